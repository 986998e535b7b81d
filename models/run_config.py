"""A training run's configuration, shared by ``models.train`` and ``models.sample``.

:class:`RunConfig` is the checked command line of ``python -m models.train`` as a frozen
object (what the training loop reads); ``config.json`` in the run directory records the
part of it that rebuilds the model and its data (:data:`CONFIG_FLAGS`), which
``models.sample`` reads back. The helpers here are the ones both scripts need: the model of
a run (:func:`build_model`), its checkpoint steps, the ``--mesh`` and ``--policy`` values,
and :func:`use_host_devices`, which both entry points call first.

Example:
  >>> cfg = RunConfig.from_args(models.cli.parse_args(["--size", "tiny"]))
  >>> model = build_model(cfg, vocab=65)
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import pathlib
from typing import Any

from flax import nnx

from models import registry
from models.directions import DEFAULT_BITS, DIRECTED

CONFIGS = pathlib.Path(__file__).parent / "configs"
HOST_DEVICES = 8
# Where runs go without --out: runs/<name>, or $JCOCCL_RUNS_DIR/<name> (the tests set it to a
# temporary directory, so that they never read or write a working tree's runs/).
RUNS_ENV = "JCOCCL_RUNS_DIR"


def runs_dir() -> pathlib.Path:
  """The directory that holds runs by name: ``$JCOCCL_RUNS_DIR`` when set, else ``runs``
  (relative to the current directory)."""
  return pathlib.Path(os.environ.get(RUNS_ENV) or "runs")


def use_host_devices() -> None:
  """Fakes :data:`HOST_DEVICES` CPU devices when there is no accelerator and XLA_FLAGS is
  unset. XLA reads the flag when jax's backend starts, so call this before anything asks jax
  for its devices."""
  if "XLA_FLAGS" in os.environ or glob.glob("/dev/nvidia[0-9]*"):
    return
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={HOST_DEVICES}"


class SetupError(ValueError):
  """A bad run configuration found before training starts: the policy file, a corpus too short
  for --seq-len, checkpoints that do not restore. ``python -m models.train`` reports it as
  ``error: ...`` with exit status 2, like a bad flag."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The flags of ``python -m models.train`` after :func:`models.cli.check_args` (same names,
  ``--seq-len`` as ``seq_len``), with the derived ``mesh_shape``, ``policy_path`` and the
  defaults of ``name`` and ``out`` filled in."""

  model: str
  size: str
  mesh: str
  mesh_shape: tuple[int, int, int]
  policy: str
  policy_path: pathlib.Path | None
  compress: tuple[str, ...]
  codec: tuple[str, ...]
  zero: bool
  steps: int
  batch: int
  seq_len: int
  micro: int
  lr: float
  warmup: int
  weight_decay: float
  clip: float
  tokenizer: str
  max_chars: int | None
  eval_every: int
  eval_batches: int
  ckpt_every: int
  log_every: int
  seed: int
  name: str
  out: pathlib.Path
  resume: bool
  no_hlo_wire: bool
  no_progress: bool
  sample_tokens: int
  calibrate: bool = True  # models.calibration: jcoccl.calibrate on the mesh at start
  recalibrate: bool = False  # with resume: measure again instead of reusing the saved one
  exact_twin: bool = True  # train the exact policy alongside (models.loop.Job.twin)
  dtype: str = "float32"  # the compute dtype (models.parallel.Parallel3D)
  # --direction and --adapt* (models.directions; docs/tuning.md): points with their own
  # codecs, and the adaptive controller's settings (adapt None: no controller).
  direction: tuple[str, ...] = ()
  adapt: float | None = None
  adapt_every: int = 25
  adapt_bits: str = ",".join(map(str, DEFAULT_BITS))
  adapt_max_programs: int = 4
  adapt_points: str = ",".join(DIRECTED)
  adapt_rounding: str = "nearest"

  @classmethod
  def from_args(cls, args: Any) -> RunConfig:
    """The config of a checked command line (an ``argparse.Namespace``, or any object with
    these attributes); list values become tuples."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    for key in ("compress", "codec", "direction"):
      values[key] = tuple(values[key])
    values["mesh_shape"] = tuple(values["mesh_shape"])
    return cls(**values)


# The flags recorded in config.json: what rebuilds the model and its data (models.sample).
CONFIG_FLAGS = (
  "model",
  "size",
  "tokenizer",
  "max_chars",
  "seq_len",
  "mesh",
  "policy",
  "compress",
  "codec",
  "zero",
  "steps",
  "batch",
  "micro",
  "dtype",
  "lr",
  "seed",
)


def write_config(cfg: RunConfig) -> None:
  """``out/config.json``: the run's flags that name its model, vocabulary and training."""
  rec: dict[str, Any] = {k: getattr(cfg, k) for k in CONFIG_FLAGS}
  for key in ("compress", "codec"):
    rec[key] = list(rec[key])
  rec["policy_path"] = str(cfg.policy_path) if cfg.policy_path else None
  (cfg.out / "config.json").write_text(json.dumps(rec, indent=1))


def build_model(cfg: Any, vocab: int) -> nnx.Module:
  """A freshly initialised model of ``cfg.model`` / ``cfg.size`` (positions covering
  ``cfg.seq_len``), its weights drawn with ``cfg.seed``."""
  fam = registry.get(cfg.model)
  return fam.build(cfg.size, vocab=vocab, seq_len=cfg.seq_len, seed=cfg.seed)


def checkpoint_steps(out: pathlib.Path) -> list[int]:
  """The steps of the checkpoint directories under ``out/ckpt`` (restorable or not)."""
  ckpt = out / "ckpt"
  if not ckpt.is_dir():
    return []
  return sorted(int(d.name) for d in ckpt.iterdir() if d.is_dir() and d.name.isdigit())


def mesh_shape(text: str, n_devices: int) -> tuple[int, int, int]:
  """``--mesh data,tensor,pipe`` as three sizes that fit on ``n_devices``.

  Raises:
    ValueError: not three positive integers, or more devices than there are.
  """
  try:
    shape = tuple(int(v) for v in text.split(","))
  except ValueError:
    shape = ()
  if len(shape) != 3 or min(shape) < 1:
    raise ValueError(f"--mesh must be three positive integers data,tensor,pipe, got {text!r}")
  if math.prod(shape) > n_devices:
    raise ValueError(f"--mesh {text} needs {math.prod(shape)} devices; {n_devices} are available")
  return shape[0], shape[1], shape[2]


def policy_path(name: str) -> pathlib.Path:
  """--policy: a TOML file, or the name of one under models/configs."""
  path = pathlib.Path(name)
  if not path.suffix and (CONFIGS / f"{name}.toml").exists():
    path = CONFIGS / f"{name}.toml"
  if not path.is_file():
    names = sorted(p.stem for p in CONFIGS.glob("*.toml"))
    raise ValueError(f"--policy must be a TOML file or one of {names}, got {name!r}")
  return path
