"""Checkpoints of a training run: orbax checkpoints under ``<out>/ckpt``, saved by every
process together, and the resume that skips damaged ones.

``restore`` takes the newest checkpoint that restores onto the current state's shapes and
shardings; damaged newer ones are named, skipped and moved to ``<out>/ckpt-skipped/``.

Example:
  >>> mngr = checkpointer(out)
  >>> save(mngr, State(params, opt_state, ef, step=100))
  >>> state = restore(mngr, state, out)
  >>> saved_calibration(mngr, state.step)   # the cost model the run trained under
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import sys
from typing import Any

import jax
import numpy as np

from models.run_config import SetupError


@dataclasses.dataclass
class State:
  """What a checkpoint holds: the parameters, the optimizer state, the error-feedback
  residuals (None without error feedback) and the number of steps taken."""

  params: Any
  opt_state: Any
  ef: Any
  step: int = 0

  def tree(self) -> dict:
    # The step is a global array replicated over the parameters' mesh: across processes,
    # orbax saves only global arrays.
    mesh = jax.tree.leaves(self.params)[0].sharding.mesh
    step = jax.make_array_from_callback(
      (), jax.NamedSharding(mesh, jax.P()), lambda _: np.asarray(self.step, np.int32)
    )
    return {"params": self.params, "opt_state": self.opt_state, "ef": self.ef, "step": step}


# A replicated array whose per-replica slice is smaller than this is written whole by one
# replica. orbax otherwise splits every replicated array across its replicas, compiling a
# slice program per array and replica at a process's first save: 80 programs and about 2 s
# of compiling for the tiny model on a 2x2x2 CPU mesh, to write slices of a few KiB.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _write_small_arrays_whole() -> None:
  """Registers orbax's jax.Array handler with MIN_REPLICA_SLICE_BYTES (once per process)."""
  import orbax.checkpoint as ocp

  current = ocp.type_handlers.get_type_handler(jax.Array)
  if getattr(current, "_min_slice_bytes_for_replica_parallel", None) == MIN_REPLICA_SLICE_BYTES:
    return
  # orbax builds its default handler with this store. An orbax without the store or the
  # option keeps its default handler: slower first saves, the same checkpoints.
  try:
    from orbax.checkpoint._src.metadata import array_metadata_store

    handler = ocp.type_handlers.ArrayHandler(
      min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
      array_metadata_store=array_metadata_store.Store(),
    )
  except (ImportError, TypeError):
    return
  # orbax logs a WARNING for every override; this one is deliberate, so it is not shown.
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
  finally:
    absl.setLevel(level)


def checkpointer(out: pathlib.Path) -> Any:
  """An orbax CheckpointManager over ``out/ckpt`` keeping the newest two steps."""
  import orbax.checkpoint as ocp

  _write_small_arrays_whole()
  return ocp.CheckpointManager(
    (out / "ckpt").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  )


def save(
  mngr: Any, state: State, calibration: dict | None = None, adaptive: dict | None = None
) -> None:
  """Saves ``state`` at its step and waits until it is on disk (every process together).

  ``calibration`` (the run's record, ``models.calibration.start``) goes into the step's
  metadata: ``--resume`` reinstalls the cost model the saved state was trained under; so
  does ``adaptive`` (``models.adaptive.Adaptive.state_dict``): its bits and history."""
  import orbax.checkpoint as ocp

  meta = {} if calibration is None else {"calibration": calibration}
  if adaptive is not None:
    meta["adaptive"] = adaptive
  meta = meta or None
  mngr.save(state.step, args=ocp.args.StandardSave(state.tree()), force=True, custom_metadata=meta)
  mngr.wait_until_finished()


def saved_calibration(mngr: Any, step: int, key: str = "calibration") -> dict | None:
  """The calibration record (or another ``key`` of the metadata) saved with the checkpoint
  of ``step`` (None: none saved)."""
  try:
    meta = mngr.metadata(step).custom_metadata or {}
  except (OSError, ValueError, KeyError, AttributeError):
    return None
  rec = meta.get(key)
  return rec if isinstance(rec, dict) else None


def saved_adaptive(mngr: Any, step: int) -> dict | None:
  """The adaptive controller's state saved with the checkpoint of ``step`` (None: none)."""
  return saved_calibration(mngr, step, "adaptive")


def restore(mngr: Any, state: State, out: pathlib.Path) -> State:
  """The newest checkpoint that restores onto ``state``'s shapes and shardings.

  A checkpoint that does not restore (truncated or corrupt files, another model's shapes) is
  skipped with a message naming its step and the reason, and moved to ``out/ckpt-skipped/``
  (kept for inspection) so that the resumed run can save that step again.

  Raises:
    SetupError: no checkpoint restores; the message lists each step and its reason.
  """
  import orbax.checkpoint as ocp

  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state.tree())
  skipped = []
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      t = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
      if int(t["step"]) != step:
        raise ValueError(f"it holds step {int(t['step'])}")
    except Exception as e:
      skipped.append((step, _reason(e)))
      print(f"--resume: skipping the checkpoint at step {step}: {skipped[-1][1]}", file=sys.stderr)
      continue
    _set_aside(mngr, [s for s, _ in skipped], out)
    return State(t["params"], t["opt_state"], t["ef"], step)
  why = "; ".join(f"step {s}: {r}" for s, r in skipped) or "there are none"
  raise SetupError(f"--resume: no checkpoint under {mngr.directory} restores ({why})")


def _reason(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  text = f"{type(e).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= 300 else text[:297] + "..."


def _set_aside(mngr: Any, steps: list[int], out: pathlib.Path) -> None:
  """Moves the checkpoints of ``steps`` to ``out/ckpt-skipped/<step>``."""
  for step in steps:
    dest = out / "ckpt-skipped" / str(step)
    n = 0
    while dest.exists():
      n += 1
      dest = out / "ckpt-skipped" / f"{step}.{n}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(pathlib.Path(str(mngr.directory)) / str(step)), dest)
    print(f"--resume: moved the checkpoint of step {step} to {dest}", file=sys.stderr)
  if steps:
    mngr.reload()
