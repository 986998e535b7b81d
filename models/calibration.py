"""Calibration of a training run: measured at the start, saved with the run, reused on resume.

``python -m models.train`` measures each mesh axis and the policy's codecs first
(``jcoccl.calibrate``, a few seconds). The cost model it installs decides how each
all_reduce is sent (one_shot, two_shot, ...); an ``"auto:<spec>"`` policy entry also lets it
run the exact op where compression would cost time. A codec the policy names plainly is
always used. :func:`verdict` then prints, per mesh axis, what the calibration predicts for
the run's own messages (the exact op against the best compressed algorithm) and what
``"auto:<spec>"`` would do with them.

The record of what was done (:func:`start`: the measured table, or why there is none) goes
to ``<out>/calibration.json`` and into each checkpoint. ``--resume`` installs the record of
the checkpoint it continues from instead of measuring again, so the resumed run makes the
choices the run made before (a new measurement could pick other algorithms and change the
numbers); ``--recalibrate`` measures again, ``--no-calibrate`` runs without a cost model.
Under ``jax.distributed`` every process installs process 0's record.

Example:
  >>> p = argparse.ArgumentParser(); add_flag(p)          # doctest: +SKIP
  >>> rec = start(mesh, "measure", print, codecs)         # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

import jcoccl
from jcoccl.policy import AUTO_PREFIX

# Per device; a process sends its devices' messages together, so 4 MiB each outlasts a
# link's burst allowance (see jcoccl._src.observability.calibrate.DEFAULT_SIZES) for 4 devices a process.
SIZES = (64 << 10, 1 << 20, 4 << 20)
# jcoccl.error_feedback charges a compressed all_reduce its residual's decode (the op
# returns the residual of the payload it encoded: one codec pass more than the plain op).
EF_CODEC_PASSES = 1


def add_flag(p: argparse.ArgumentParser) -> None:
  """Adds ``--no-calibrate`` (``args.calibrate``, default True) and ``--recalibrate``."""
  p.add_argument(
    "--no-calibrate",
    dest="calibrate",
    action="store_false",
    help="skip measuring the mesh's links and codecs at start (auto then chooses by the "
    "platform's default cost model; a resumed run drops its saved calibration)",
  )
  p.add_argument(
    "--recalibrate",
    action="store_true",
    help="with --resume: measure again instead of reusing the calibration saved with the "
    "run (the resumed run may then choose other algorithms than the run it continues)",
  )


def auto_codecs(policy: jcoccl.Policy, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """``{axis: compressor}`` of the policy's all_reduce on each mesh axis of size > 1: the
  codecs whose throughput the calibration measures (auto weighs each axis by its own)."""
  out = {}
  for a in mesh.axis_names:
    c = policy.compressor(a, "all_reduce")
    if mesh.shape[a] > 1 and c is not None and not isinstance(c, tuple):
      out[a] = c
  return out


def mode(calibrate: bool, resume: bool, recalibrate: bool) -> str:
  """What :func:`start` does: "off" (--no-calibrate), "measure" (a new run), "reuse"
  (--resume) or "remeasure" (--resume --recalibrate)."""
  if not calibrate:
    return "off"
  if resume:
    return "remeasure" if recalibrate else "reuse"
  return "measure"


def start(
  mesh: jax.sharding.Mesh,
  how: str,
  say: Callable[[str], None],
  codecs: Mapping[str, Any] | None = None,
  saved: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Installs the run's cost model: measured, reused from ``saved``, given, or none.

  Args:
    mesh: the training mesh (every process calls this with the same one).
    how: :func:`mode`'s answer.
    say: prints a line (process 0's output).
    codecs: ``{axis: compressor}`` the run's all_reduce uses (:func:`auto_codecs`): their
      throughput is measured too.
    saved: with ``how="reuse"``, the record saved with the checkpoint the run resumes
      from (:func:`share` it first); None: there is none (a run from before records were
      kept), so the mesh is measured.

  Returns:
    The record for the run's files: ``{"calibrated": bool, "why", "cost_model"}`` (the
    table in use, as ``jcoccl.save_cost_model`` writes it; absent when none is), plus
    ``"seconds"`` when measured (``models.train`` adds ``"reused_from_step"`` on resume).
  """
  if how == "reuse" and saved is not None:
    rec = dict(saved)
    _install(rec.get("cost_model"))
    if rec.get("calibrated"):
      what = "its calibration"
    elif rec.get("cost_model"):
      what = f"its cost model ({rec.get('why')})"
    else:
      what = f"no cost model, as it started ({rec.get('why')})"
    say(
      f"resumed with {what}, saved with the checkpoint: the same choices as before "
      "(--recalibrate measures again)"
    )
    return rec
  if how == "reuse":
    say("--resume: no calibration was saved with the checkpoint; measuring the mesh again")
  given = jcoccl.get_config().cost_model
  # A table given from outside is used as it is, and recorded so that a resume reuses it.
  table = None if given is None else jcoccl.CostModels.of(given).to_json()
  if how == "off":
    rec: dict[str, Any] = {"calibrated": False, "why": "--no-calibrate"}
    return rec if table is None else {**rec, "cost_model": table}
  if table is not None:
    why = "cost model given (JCOCCL_COST_MODEL or jcoccl.set_cost_model)"
    return {"calibrated": False, "why": why, "cost_model": table}
  if all(mesh.shape[a] < 2 for a in mesh.axis_names):
    return {"calibrated": False, "why": "no mesh axis of size > 1"}
  t0 = time.perf_counter()
  codecs = dict(codecs or {})
  models = jcoccl.calibrate(mesh, sizes=SIZES, iters=3, codecs=list(codecs.values()))
  took = time.perf_counter() - t0
  names = ", ".join(sorted({str(c) for c in codecs.values()})) or "int8"
  again = " (--recalibrate: the choices may differ from the run's so far)"
  say(
    f"calibrated the mesh's links and codecs ({names}) in {took:.1f} s"
    + (again if how == "remeasure" else "")
  )
  return {
    "calibrated": True,
    "why": "measured again on resume (--recalibrate)"
    if how == "remeasure"
    else "measured at start",
    "seconds": round(took, 2),
    "cost_model": models.to_json(),
  }


def _install(table: Mapping[str, Any] | None) -> None:
  """Makes the JSON ``table`` (or no cost model) the process default."""
  if table is None:
    jcoccl.set_cost_model(None)
    return
  jcoccl.set_cost_model(load_table(table))


def load_table(table: Mapping[str, Any]) -> Any:
  """The cost model that a saved JSON ``table`` (a record's ``cost_model``) describes.

  Args:
    table: ``CostModels.to_json()``'s output, as calibration.json and checkpoints keep it.

  Returns:
    The ``CostModels`` object, read by ``jcoccl.read_cost_model`` (which takes a file).

  Example:
    >>> models = load_table(record["cost_model"])  # doctest: +SKIP
  """
  fd, path = tempfile.mkstemp(suffix=".json", prefix="jcoccl-cost-model-")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(table, f)
    return jcoccl.read_cost_model(path)
  finally:
    os.unlink(path)


def share(record: Mapping[str, Any] | None) -> dict[str, Any] | None:
  """Process 0's ``record`` on every process (each may have read another file, or none):
  the processes of a run must install the same cost model to trace the same programs."""
  if jax.process_count() == 1:
    return None if record is None else dict(record)
  from jax.experimental import multihost_utils

  mine = np.frombuffer(json.dumps(record).encode(), np.uint8)
  n = int(multihost_utils.broadcast_one_to_all(np.asarray(mine.size, np.int32)))
  buf = np.zeros(n, np.uint8)
  if jax.process_index() == 0:
    buf[:] = mine
  got = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
  return json.loads(got.tobytes().decode())


def compressed_all_reduces(rows: Sequence[Any]) -> list[tuple[str, tuple, str, Any]]:
  """``(axis, shape, dtype, compressor)`` of each leaf that a program's jcoccl all_reduce
  calls name a compressor for (one mesh axis, one codec), in program order.

  Args:
    rows: ``jcoccl.explain(traced)``'s records: the program's own equations say what each
      call named (``"auto:<spec>"`` where auto chose; the spec is what is read back here).

  Returns:
    One tuple per leaf; calls over several axes and per-level pairs are left out, as the
    cost model has one entry per (axis, op, codec).
  """
  found = []
  for r in rows:
    named = r.named.removeprefix(AUTO_PREFIX)
    if r.kind != "jcoccl" or r.op != "all_reduce" or named == "none" or named.startswith("("):
      continue
    if len(r.axes) == 1:
      dtype = jax.numpy.dtype(r.dtype)
      found.append((r.axes[0], tuple(r.shape), dtype, jcoccl.compressors.parse(named)))
  return found


def verdict(
  record: Mapping[str, Any],
  rows: Sequence[Any],
  policy: jcoccl.Policy,
  mesh: jax.sharding.Mesh,
  ef_axes: tuple[str, ...] = (),
) -> dict[str, Any]:
  """What the run's cost model predicts for its compressed all_reduce messages, per axis.

  Args:
    record: :func:`start`'s record (its ``cost_model``).
    rows: ``jcoccl.explain(traced)``'s records of the traced train step (its jcoccl
      all_reduce calls are read by :func:`compressed_all_reduces`).
    policy: the run's policy (which entries are ``"auto:<spec>"``).
    mesh: the mesh.
    ef_axes: axes whose all_reduce keeps an error-feedback residual (two codec passes more).

  Returns:
    ``{axis: {"codec", "messages", "bytes": [min, max], "exact_s", "compressed_s",
    "auto_exact_keeps": messages "auto:<spec>" would send with the exact op, "opted_in",
    "source"}}`` for axes with a calibrated model; {} without one.
  """
  table = record.get("cost_model")
  if not table:
    return {}
  models = load_table(table)
  out: dict[str, Any] = {}
  for axis, shape, dtype, comp in compressed_all_reduces(rows):
    if axis not in mesh.shape:
      continue
    model = models.get((axis,), "all_reduce", comp)
    if model is None or not model.calibrated:
      continue
    n, nbytes = mesh.shape[axis], int(np.prod(shape)) * np.dtype(dtype).itemsize
    ratio = comp.payload_nbytes(int(np.prod(shape)), dtype) / nbytes
    extra = EF_CODEC_PASSES * nbytes / model.gamma_Bps if axis in ef_axes else 0.0
    algos = ("one_shot",) if n <= 2 else ("one_shot", "two_shot")
    t_comp = min(model.cost(a, nbytes, n, ratio) for a in algos) + extra
    picks = jcoccl.cost_model_choices(models, mesh, {axis: str(comp)}, sizes=[nbytes])
    keeps = next(iter(picks.get(axis, {}).values()), "") == "exact"
    row = out.setdefault(
      axis,
      {
        "codec": str(comp),
        "messages": 0,
        "bytes": [nbytes, nbytes],
        "exact_s": 0.0,
        "compressed_s": 0.0,
        "auto_exact_keeps": 0,
        "opted_in": policy.options(axis, "all_reduce").get("algorithm") == "auto_exact",
        "error_feedback": axis in ef_axes,
        "source": model.source,
      },
    )
    row["messages"] += 1
    row["bytes"] = [min(row["bytes"][0], nbytes), max(row["bytes"][1], nbytes)]
    row["exact_s"] += model.cost("exact", nbytes, n)
    row["compressed_s"] += t_comp
    row["auto_exact_keeps"] += int(keeps)
  return {a: out[a] for a in mesh.axis_names if a in out}


def verdict_lines(v: Mapping[str, Any], record: Mapping[str, Any]) -> list[str]:
  """:func:`verdict` as the lines the run prints: per axis, what the run does with its
  arrays and why, and what to write to change it."""
  if not v:
    why = record.get("why") or "no calibrated cost model"
    return [f"no calibrated cost model ({why}): auto compresses with the codecs as named"]
  lines = [
    "calibration's prediction for this step's compressed all_reduce arrays (times summed; "
    "error feedback's codec passes counted), and what the run does with them: "
    "'auto:<spec>' compresses an array where that is predicted 1.25x faster than the exact "
    "op, a plain <spec> always compresses:"
  ]
  for axis, r in v.items():
    ef = " with error feedback" if r["error_feedback"] else ""
    lo, hi = r["bytes"]
    size = _kib(lo) if lo == hi else f"{_kib(lo)}..{_kib(hi)}"
    spec = f"auto:{r['codec']}" if r["opted_in"] else r["codec"]
    lines.append(
      f"  {axis:6s} all_reduce {spec}{ef}, {r['messages']} arrays of {size}: {_did(r)}: "
      f"{_faster(r)} (exact {_ms(r['exact_s'])} vs compressed {_ms(r['compressed_s'])})"
    )
  plain = [a for a, r in v.items() if not r["opted_in"]]
  slower = [a for a in plain if v[a]["auto_exact_keeps"]]
  if slower:
    lines.append(
      f"  this run compresses on {', '.join(slower)} although the exact op is predicted "
      "faster for some or all of the arrays there, because the policy names the codec "
      "(inside one process the link is memory; across a slow link compression pays). To let "
      "auto decide, write all_reduce = 'auto:<spec>' in the policy, e.g. --compress "
      f"{slower[0]}.all_reduce=auto:{v[slower[0]]['codec']}"
    )
  return lines


def _did(r: Mapping[str, Any]) -> str:
  """What the run does with an axis's arrays (:func:`verdict`'s row ``r``)."""
  keeps, n = r["auto_exact_keeps"], r["messages"]
  if not r["opted_in"]:
    would = f"all {n}" if keeps == n else f"{keeps} of {n}"
    kept = f"; 'auto:{r['codec']}' would keep the exact op for {would}" if keeps else ""
    return f"compressed all {n}, as the policy names the codec{kept}"
  if keeps == n:
    return f"kept the exact op for all {n}"
  if keeps == 0:
    return f"compressed all {n}"
  return f"kept the exact op for {keeps} of {n}, compressed {n - keeps}"


def _faster(r: Mapping[str, Any]) -> str:
  """Which of the exact op and compression the calibration predicted faster, and by how much
  (all of the axis's arrays together)."""
  exact, comp = r["exact_s"], r["compressed_s"]
  if exact <= comp:
    return f"calibration predicted the exact op {_times(comp, exact)} faster"
  return f"calibration predicted compression {_times(exact, comp)} faster"


def _times(slow: float, fast: float) -> str:
  ratio = slow / max(fast, 1e-12)
  return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x" if ratio < 1000 else "over 1000x"


def _kib(b: int) -> str:
  return f"{b / 1024:.0f} KiB" if b >= 10240 else f"{b / 1024:.1f} KiB"


def _ms(s: float) -> str:
  return f"{s * 1e3:.2f} ms"
