"""The command line of ``python -m models.train``: its flags, and every check made before
anything is loaded or compiled.

A bad flag exits with ``error: --flag ...`` (status 2, as argparse does); a bad policy file
raises :class:`models.run_config.SetupError` naming its table and key.

Example:
  >>> args = parse_args(["--model", "qwen", "--mesh", "4,2,1", "--policy", "int8"])
  >>> recipe = load_policy(args)
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import tempfile

import jax

from jcoccl.compressors import import_codecs
from jcoccl.policy import WILDCARD
from models import calibration, data, registry
from models.directions import add_flags as add_adapt_flags
from models.directions import check_directions
from models.directions import check_flags as check_adapt_flags
from models.recipe import Recipe
from models.run_config import SetupError, checkpoint_steps, mesh_shape, policy_path, runs_dir
from models.sharding import POLICY_AXES

PROG = "python -m models.train"
DESCRIPTION = (
  "Train GPT-2 or Qwen2 on Shakespeare, 3D-parallel over jcoccl's compressed collectives."
)


def build_parser() -> argparse.ArgumentParser:
  """The command line of ``python -m models.train`` (unchecked: see :func:`check_args`)."""
  p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
  p.add_argument("--model", choices=tuple(registry.FAMILIES), default="gpt")
  p.add_argument("--size", choices=registry.SIZES, default="small")
  p.add_argument("--mesh", default="2,2,2", help="data,tensor,pipe sizes (default 2,2,2)")
  p.add_argument(
    "--policy",
    default="coccl",
    help="a TOML file, or a name under models/configs (exact, coccl, int8, "
    "zeropp, lean): per-axis compressors and the [data] training switches "
    "zero, error_feedback, nodes (models/recipe.py)",
  )
  p.add_argument(
    "--compress",
    action="append",
    default=[],
    metavar="AXIS.OP=SPEC",
    help="override one entry of --policy, e.g. data.all_reduce=int4 or "
    "data.error_feedback=false (repeatable)",
  )
  p.add_argument(
    "--codec",
    action="append",
    default=[],
    metavar="MODULE|FILE.py|PLUGIN",
    help="bring in a codec of your own before the policy is read: a module name, a Python "
    "file (path/to/log8.py) or a native plugin library (.so), looked up in the current "
    "directory first, then sys.path for modules (repeatable; docs/custom_compressors.md)",
  )
  p.add_argument(
    "--zero",
    action="store_true",
    help="ZeRO data parallelism (--policy's [data] zero = true): reduce_scatter gradients, "
    "AdamW state sharded over 'data', all_gather parameters",
  )
  p.add_argument(
    "--steps",
    type=int,
    default=300,
    help="train until this step (0: build everything, train nothing)",
  )
  p.add_argument(
    "--batch",
    type=int,
    default=16,
    help="global batch (sequences), a multiple of data size x --micro",
  )
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--micro", type=int, default=2, help="pipeline micro-batches")
  p.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="compute dtype; bfloat16: mixed precision (bf16 activations and gradients on the "
    "wire, float32 master weights and AdamW state)",
  )
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=30)
  p.add_argument("--weight-decay", type=float, default=0.1)
  p.add_argument("--clip", type=float, default=1.0, help="global gradient norm clip (> 0)")
  p.add_argument("--tokenizer", choices=data.TOKENIZERS, default="char")
  p.add_argument("--max-chars", type=int, default=None, help="use only this much text")
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--ckpt-every", type=int, default=100)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--name", default=None, help="run name (default <model>-<size>)")
  p.add_argument(
    "--out",
    default=None,
    help="output dir (default runs/<name>, or $JCOCCL_RUNS_DIR/<name> where that is set)",
  )
  p.add_argument(
    "--resume", action="store_true", help="continue from the newest checkpoint that restores"
  )
  p.add_argument(
    "--no-hlo-wire",
    action="store_true",
    help="skip measuring bytes on the wire (saves two compiles; none are reported)",
  )
  p.add_argument(
    "--no-exact-twin",
    dest="exact_twin",
    action="store_false",
    help="do not train the exact policy alongside (on the same batches, to print what "
    "compression costs in loss and speed; off anyway with --no-hlo-wire or --resume)",
  )
  p.add_argument("--no-progress", action="store_true")
  p.add_argument(
    "--direction",
    action="append",
    default=[],
    metavar="POINT=CODEC",
    help="one direction of an axis with its own codec, every message compressed (repeatable; "
    "POINT: tensor.forward, tensor.backward, pipe.forward, pipe.backward, data; CODEC: a "
    "jcoccl spec or none; docs/tuning.md)",
  )
  add_adapt_flags(p)
  calibration.add_flag(p)
  p.add_argument(
    "--sample-tokens",
    type=int,
    default=48,
    help="length of the sample printed after the final loss (0: none; more: "
    "python -m models.sample)",
  )
  return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses and checks the command line (:func:`check_args`) before anything is loaded.

  A bad flag exits with status 2 and ``error: --flag ...`` on stderr, as argparse does.
  """
  p = build_parser()
  args = p.parse_args(argv)
  try:
    check_args(args, jax.device_count())
  except ValueError as e:
    p.error(str(e))
  return args


# Flags (by dest) and their smallest accepted value.
_AT_LEAST = {
  "steps": 0,
  "batch": 1,
  "seq_len": 1,
  "micro": 1,
  "warmup": 0,
  "eval_every": 1,
  "eval_batches": 1,
  "ckpt_every": 1,
  "log_every": 1,
  "seed": 0,
  "sample_tokens": 0,
}


def directions(specs: list[str]) -> dict[str, str]:
  """``{point: codec spec}`` from ``--direction POINT=CODEC`` values, each checked
  (``models.directions.check_directions``)."""
  out = {}
  for spec in specs:
    point, eq, codec = spec.partition("=")
    try:
      if not eq:
        raise ValueError("expected POINT=CODEC, e.g. tensor.backward=hadamard(int3)")
      check_directions({point.strip(): codec.strip()})
    except ValueError as e:
      raise ValueError(f"--direction {spec!r}: {e}") from None
    out[point.strip()] = codec.strip()
  return out


def _flag(dest: str) -> str:
  return "--" + dest.replace("_", "-")


def check_args(args: argparse.Namespace, n_devices: int) -> None:
  """Checks every flag and fills the derived fields (``mesh_shape``, ``name``, ``out``,
  ``policy_path``).

  Args:
    args: the parsed command line.
    n_devices: devices available for the mesh.

  Raises:
    ValueError: the first bad flag, named as on the command line (``--batch 3 must be ...``).
  """
  for dest, low in _AT_LEAST.items():
    if getattr(args, dest) < low:
      raise ValueError(f"{_flag(dest)} must be >= {low}, got {getattr(args, dest)}")
  if args.seed >= 2**32:
    raise ValueError(f"--seed must be < 2**32, got {args.seed}")
  if args.max_chars is not None and args.max_chars < 1:
    raise ValueError(f"--max-chars must be >= 1, got {args.max_chars}")
  for dest, positive in (("lr", True), ("weight_decay", False), ("clip", True)):
    v = getattr(args, dest)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
      raise ValueError(
        f"{_flag(dest)} must be a finite number {'>' if positive else '>='} 0, got {v}"
      )
  args.mesh_shape = mesh_shape(args.mesh, n_devices)
  _check_mesh_fits(args)
  args.policy_path = policy_path(args.policy)
  try:
    args.codec = import_codecs(args.codec)
  except ValueError as e:
    raise ValueError(f"--codec: {e}") from None
  for spec in args.compress:
    try:
      Recipe.from_specs([spec], axes=POLICY_AXES)
    except ValueError as e:
      raise ValueError(f"--compress {spec!r}: {e}") from None
  args.directions = directions(args.direction)
  check_adapt_flags(args)
  # Last: what the flags ask is reported before what the output directory holds, and the
  # directory is created only for a command line that is otherwise good.
  _check_output(args)


def _check_mesh_fits(args: argparse.Namespace) -> None:
  """The mesh divides the model (layers over 'pipe', heads over 'tensor') and the batch."""
  data, tensor, pipe = args.mesh_shape
  fam = registry.get(args.model)
  cfg = fam.config(args.size, 1, args.seq_len)
  what = f"--model {args.model} --size {args.size}"
  layers = fam.layers(cfg)
  if layers % pipe:
    raise ValueError(
      f"--mesh {args.mesh}: the pipe size {pipe} must divide the {layers} layers of {what}"
    )
  if any(n % tensor for n in fam.heads(cfg)):
    raise ValueError(
      f"--mesh {args.mesh}: the tensor size {tensor} must divide the head "
      f"counts and MLP width {fam.heads(cfg)} of {what}"
    )
  if args.batch % (data * args.micro):
    raise ValueError(
      f"--batch {args.batch} must be a multiple of the data size {data} "
      f"(--mesh) x --micro {args.micro} = {data * args.micro}"
    )
  if args.zero and data == 1:
    raise ValueError(
      f"--zero shards over the data axis, which needs a size > 1 (--mesh {args.mesh})"
    )


def _check_output(args: argparse.Namespace) -> None:
  """--name and --out: a directory this process can write (created here when missing), and
  a fresh run must not land on an earlier run's checkpoints."""
  if args.name is not None and (
    not args.name.strip() or "/" in args.name or args.name in (".", "..")
  ):
    raise ValueError(f"--name must be a non-empty name without '/', got {args.name!r}")
  args.name = args.name or f"{args.model}-{args.size}"
  args.out = pathlib.Path(args.out or runs_dir() / args.name)
  _check_no_file_on_path(args.out, "--out")
  steps = checkpoint_steps(args.out)
  if args.resume and not steps:
    raise ValueError(f"--resume: no checkpoint under {args.out / 'ckpt'}")
  check_writable_dir(args.out, "--out")
  if not args.resume and steps:
    raise ValueError(
      f"--out {args.out} holds checkpoints of an earlier run (steps "
      f"{', '.join(map(str, steps))}): pass --resume to continue it, or choose "
      f"another --out or --name"
    )


def _check_no_file_on_path(path: pathlib.Path, flag: str) -> None:
  """Neither ``path`` nor the nearest of its parents that exists is a file."""
  for part in (path, *path.parents):
    if part.exists() or part.is_symlink():
      if not part.is_dir():
        where = "" if part == path else f": {part}"
        raise ValueError(f"{flag} {path}{where} is a file, not a directory")
      return


def check_writable_dir(path: pathlib.Path, flag: str) -> None:
  """Makes sure ``path`` is a directory this process can write files in, creating it (and
  its parents) when missing: an output that cannot be written is found before any work
  starts, not as a traceback at the first file written.

  Raises:
    ValueError: ``{flag} PATH: ...`` naming the path and what is wrong with it.
  """
  _check_no_file_on_path(path, flag)
  try:
    path.mkdir(parents=True, exist_ok=True)
    # A file created and removed: permissions, read-only mounts and /sys-like trees alike.
    fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=path)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    why = e.strerror or type(e).__name__
    raise ValueError(f"{flag} {path}: cannot write there ({why})") from None


def load_policy(args: argparse.Namespace) -> Recipe:
  """--policy (a recipe: the jcoccl.Policy and the training switches, models.recipe) with
  --compress overrides and --zero on top, every entry checked.

  An override of an axis that the file leaves to ``"*"`` starts from the ``"*"`` entry, so
  ``--compress data.all_reduce=int4`` changes that one op and keeps the rest.

  Raises:
    SetupError: the policy file is bad; the message names the file, table and key
      (``p.toml: [tensor] zero: ...``).
    ValueError: a bad --compress value (``parse_args`` reports those as flag errors).
  """
  path = getattr(args, "policy_path", None) or policy_path(args.policy)
  try:
    base = Recipe.from_toml(str(path), axes=POLICY_AXES)
  except (ValueError, TypeError, OSError) as e:
    raise SetupError(str(e)) from e
  table = {axis: dict(entry) for axis, entry in base.source.items()}
  for spec in args.compress:
    for axis, entries in Recipe.from_specs([spec], axes=POLICY_AXES).source.items():
      _axis_entry(table, axis).update(entries)
  if args.zero:
    _axis_entry(table, "data")["zero"] = True
  recipe = Recipe.from_dict(table, axes=POLICY_AXES)
  _check_nodes(recipe, args, path)
  return recipe


def _check_nodes(recipe: Recipe, args: argparse.Namespace, path: pathlib.Path) -> None:
  """ZeRO++'s ``[data] nodes`` needs ZeRO mode and must divide the mesh's data size."""
  nodes, data = recipe.nodes, getattr(args, "mesh_shape", (0,))[0]
  if nodes == 1 or not data:
    return
  if not recipe.zero:
    raise SetupError(
      f"{path}: [data] nodes = {nodes} splits ZeRO's data level; it needs "
      f"[data] zero = true (or --zero)"
    )
  if data % nodes:
    raise SetupError(
      f"{path}: [data] nodes = {nodes} must divide the data size {data} of --mesh {args.mesh}"
    )


def _axis_entry(table: dict, axis: str) -> dict:
  """``table[axis]``, created from the ``"*"`` entry the axis used while it was not named."""
  if axis not in table:
    table[axis] = dict(table.get(WILDCARD, {})) if axis != WILDCARD else {}
  return table[axis]


def check_corpus(args: argparse.Namespace, corpus: data.Corpus) -> None:
  """Both splits hold a --seq-len window and its next token with room to sample."""
  need = args.seq_len + 2
  for split in ("train", "val"):
    n = len(getattr(corpus, split))
    if n < need:
      raise SetupError(
        f"--seq-len {args.seq_len} needs at least {need} tokens in the {split} "
        f"split, which has {n} (--max-chars {args.max_chars}, --tokenizer "
        f"{args.tokenizer}): raise --max-chars or lower --seq-len"
      )
