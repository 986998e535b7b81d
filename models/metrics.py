"""What a training run reports: the bytes on the wire per step (measured on the compiled
step), the JSONL records of metrics.jsonl, the loss plot and the end-of-run lines.

Only process 0 writes (:func:`lead`); every process computes the same numbers.

Example:
  >>> records = start_metrics(out / "metrics.jsonl", resumed_at=None)
  >>> plot(records, out / "loss.png")
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jcoccl
from models.checkpoint import State
from models.parallel import Parallel3D
from models.run_config import SetupError
from models.sharding import POLICY_AXES, crosses_processes


def lead() -> bool:
  """Whether this is process 0, the one that writes metrics, the plot and the summary."""
  return jax.process_index() == 0


def say(text: str) -> None:
  """Prints on process 0 only (every process computes the same numbers)."""
  if lead():
    print(text, flush=True)


NO_WIRE = {"source": None, "note": "bytes on the wire not measured (--no-hlo-wire)"}
WIRE_SOURCE = (
  "measured: jcoccl.wire_bytes(..., mesh=mesh) on the compiled train step; "
  "uncompressed = the same step compiled with the exact policy (no compression)"
)
# XLA:CPU runs bfloat16 collectives in float32; NCCL sends them as bfloat16, so a bfloat16
# run counts the program as jax lowered it (for float32 both counts are the same).
WIRE_SOURCE_LOWERED = (
  "measured: jcoccl.wire_bytes(..., mesh=mesh, program='lowered') on the train step as "
  "lowered (bfloat16 collectives at bfloat16 width, as NCCL sends them; XLA:CPU's compiled "
  "program widens them to float32); uncompressed = the same step with the exact policy"
)


def wire_report(
  par: Parallel3D,
  exact: Parallel3D,
  tx: optax.GradientTransformation,
  traced: jax.stages.Traced,
  state: State,
  x,
  clip: float | None,
  ref_traced: jax.stages.Traced | None = None,
) -> dict:
  """Bytes each device sends per train step, by mesh axis, read from the compiled HLO.

  ``traced`` is the train step as traced for the run (``step.trace(...)``): its executable,
  the one the run executes, is read, not compiled again. The uncompressed reference is the
  run itself when ``exact is par``; otherwise the same step compiled with ``exact`` (the
  same model and mesh under the exact policy: about 3 s on CPU for the default run; none
  when ``ref_traced``, that step as the exact twin traced and compiled it, is given), so
  both columns count what XLA actually sends, including the algorithms jcoccl picks
  (one_shot = all_gather of payloads, two_shot = all_to_all + all_gather).

  Returns:
    {"source", "by_axis": {axes: {"compressed", "uncompressed", "crosses_processes"}},
    "total": {...}, "across_processes": {...}, "inside_process": {...}, "by_op": {op: bytes},
    "reference_by_op": {op: bytes}}; axes are mesh axis names joined by commas, "?" for
    groups that match no mesh axes. "across_processes" sums the axes whose device groups
    span several processes (the bytes that go over the network between hosts; "?" counts
    there whenever there are several processes), "inside_process" the others.
  """
  program = "compiled" if par.dtype == jnp.float32 else "lowered"
  got = jcoccl.wire_bytes(traced, mesh=par.mesh, program=program)
  ref = got
  if exact is not par and ref_traced is not None:
    ref = jcoccl.wire_bytes(ref_traced, mesh=exact.mesh, program=program)
  elif exact is not par:  # traced and compiled only: the state's arrays are not consumed
    ref_step = exact.train_step(tx, state.params, clip_norm=clip)
    args = (state.params, state.opt_state, None, x, x)
    ref = jcoccl.wire_bytes(ref_step, *args, mesh=exact.mesh, program=program)
  axes = sorted(set(got["by_axis"]) | set(ref["by_axis"]), key=_axis_order)
  by_axis = {
    a: {
      "compressed": got["by_axis"].get(a, 0.0),
      "uncompressed": ref["by_axis"].get(a, 0.0),
      "crosses_processes": _crosses(par.mesh, a),
    }
    for a in axes
  }
  return {
    "source": WIRE_SOURCE if program == "compiled" else WIRE_SOURCE_LOWERED,
    "by_axis": by_axis,
    "total": {"compressed": got["total"], "uncompressed": ref["total"]},
    **_process_split(by_axis),
    "by_op": got["by_op"],
    "reference_by_op": ref["by_op"],
  }


def _crosses(mesh: jax.sharding.Mesh, key: str) -> bool:
  if key == "?":
    return jax.process_count() > 1
  return crosses_processes(mesh, tuple(key.split(",")))


def _process_split(by_axis: dict) -> dict:
  """Bytes of the axes that cross processes and of those that stay inside one."""
  out = {}
  for name, crossing in (("across_processes", True), ("inside_process", False)):
    rows = [r for r in by_axis.values() if r["crosses_processes"] == crossing]
    out[name] = {k: float(sum(r[k] for r in rows)) for k in ("compressed", "uncompressed")}
  return out


def _axis_order(key: str) -> tuple:
  names = key.split(",")
  order = POLICY_AXES
  return (len(names), [order.index(n) if n in order else 99 for n in names])


def plot(records: list[dict], path: pathlib.Path) -> None:
  """loss.png: the train loss of the logged steps and the validation losses, by step (and
  the exact twin's train loss, when it ran)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tr = [(r["step"], r["loss"]) for r in records if "loss" in r]
  va = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
  ex = [(r["step"], r["exact_loss"]) for r in records if "exact_loss" in r]
  fig, ax = plt.subplots(figsize=(6, 4))
  if tr:
    ax.plot(*zip(*tr), label="train")
  if va:
    ax.plot(*zip(*va), "o-", label="validation")
  if ex:
    ax.plot(*zip(*ex), "--", alpha=0.7, label="train, exact twin")
  ax.set_xlabel("step")
  ax.set_ylabel("cross entropy (nats/token)")
  if tr or va or ex:
    ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def read_records(path: pathlib.Path) -> list[dict]:
  """The records of metrics.jsonl.

  A torn last line (a run killed while writing it) is dropped with a note; any other line
  that is not a record is an error.

  Raises:
    SetupError: a line before the last is not a JSON object with an integer "step".
  """
  if not path.exists():
    return []
  lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
  numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
  records = []
  for k, (lineno, line) in enumerate(numbered):
    rec = _record(line)
    if rec is not None:
      records.append(rec)
    elif k == len(numbered) - 1:
      print(
        f"--resume: dropping the torn last line {lineno} of {path}: {line[:60]!r}", file=sys.stderr
      )
    else:
      raise SetupError(f"{path}: line {lineno} is not a metrics record: {line[:80]!r}")
  return records


def _record(line: str) -> dict | None:
  try:
    rec = json.loads(line)
  except ValueError:
    return None
  ok = isinstance(rec, dict) and type(rec.get("step")) is int
  return rec if ok else None


def start_metrics(path: pathlib.Path, resumed_at: int | None) -> list[dict]:
  """Process 0: the records kept from before ``resumed_at`` (none for a fresh run), written
  back to ``path``. Other processes keep no records."""
  if not lead():
    return []
  records = [] if resumed_at is None else [r for r in read_records(path) if r["step"] <= resumed_at]
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return records


def print_wire(wire: dict) -> None:
  """The by-axis table of :func:`wire_report` (or why there is none)."""
  if not wire.get("source"):
    print(wire.get("note", "bytes on the wire not measured"))
    return
  print(f"bytes on the wire per step per device, by mesh axis ({wire['source']}):")
  rows = [
    (a, r, " (across processes)" if r.get("crosses_processes") else "")
    for a, r in wire["by_axis"].items()
  ] + [("total", wire["total"], "")]
  if "across_processes" in wire and jax.process_count() > 1:
    rows += [
      ("across", wire["across_processes"], " (between processes: the network)"),
      ("inside", wire["inside_process"], " (inside each process)"),
    ]
  for axis, row, note in rows:
    ratio = row["compressed"] / row["uncompressed"] if row["uncompressed"] else float("nan")
    print(
      f"  {axis:12s} compressed {row['compressed'] / 1e3:10.1f} kB   uncompressed "
      f"{row['uncompressed'] / 1e3:10.1f} kB   ratio {ratio:.3f}{note}"
    )


def _num(v: float | None) -> str:
  return "n/a" if v is None else f"{v:.4f}"


def _print_exact_collectives(summary: dict, val: float | None) -> None:
  """The final weights' validation loss through exact collectives, beside the loss through
  the run's own (a model trained compressed and served uncompressed gets the first)."""
  ex = summary.get("val_loss_exact_collectives")
  if ex is None or val is None or ex == val:
    return
  print(
    f"val loss of the trained weights through exact collectives: {ex:.4f} "
    f"({(ex / val - 1) * 100:+.2f}% against its own collectives' {val:.4f})"
  )


def _print_twin(summary: dict, val: float | None) -> None:
  """The exact twin's lines: what compression cost in loss and speed in this run."""
  twin = summary.get("exact_twin")
  if not twin:
    return
  ev, tps, etps = twin["val_loss_end"], summary["tokens_per_s"], twin["tokens_per_s"]
  print(
    f"exact twin (same initial weights and batches, exact policy): loss -> "
    f"{_num(twin['loss_end'])}" + (f" (val {ev:.4f})" if ev is not None else "")
  )
  cost = []
  if ev is not None and val is not None:
    cost.append(f"{val - ev:+.4f} val loss ({(val / ev - 1) * 100:+.2f}%, one seed)")
  if tps and etps:
    cost.append(f"{tps:,.0f} tokens/s vs {etps:,.0f} exact on this machine")
  if cost:
    print("  what compression cost in this run: " + "; ".join(cost))


# The x86 vector extensions XLA:CPU may compile for, widest first.
VECTOR_ISAS = ("avx512f", "avx2", "avx", "sse4_2")


def machine() -> dict[str, str]:
  """The CPU this process's XLA:CPU programs are compiled for (summary.json "machine"):
  its model name, its widest vector extension (``+fma`` where it has FMA) and XLA_FLAGS.

  XLA:CPU targets the CPU it runs on, and the code around the codecs (rotations, scales,
  error feedback) rounds differently with other vector instructions: a compressed run's
  losses are bitwise the same on one machine and can differ between CPUs (README, "Set up").
  """
  try:
    text = pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    text = ""
  info: dict[str, str] = {}
  for line in text.splitlines():
    key, _, value = line.partition(":")
    info.setdefault(key.strip(), value.strip())
  flags = set(info.get("flags", "").split())
  isa = next((i for i in VECTOR_ISAS if i in flags), platform.machine())
  return {
    "cpu": info.get("model name") or platform.processor() or platform.machine(),
    "vector_isa": isa + ("+fma" if "fma" in flags else ""),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


# Model sizes whose end-of-run sample is gibberish after the default number of steps.
SMALL_SIZES = ("tiny", "small")


def print_summary(cfg: Any, summary: dict, start_step: int, sampling: tuple[float, int]) -> None:
  """The end-of-run lines: the loss over the steps run, throughput, the sample (drawn at
  ``sampling`` = (temperature, seed)), the wire table and where the outputs are."""
  steps, tps, val = summary["steps"], summary["tokens_per_s"], summary["val_loss_end"]
  if steps == start_step:
    print(f"\nno steps run: at step {steps}, --steps {cfg.steps}")
  else:
    print(
      f"\nloss {_num(summary['loss_start'])} -> {_num(summary['loss_end'])}"
      + (f" (val {val:.4f})" if val is not None else "")
      + f" over steps {start_step}.."
      f"{steps}, "
      + (f"{tps:,.0f} tokens/s (steady state)" if tps else "no steady-state steps timed")
    )
    _print_exact_collectives(summary, val)
    _print_twin(summary, val)
    if summary["sample"] is not None:
      temperature, seed = sampling
      print(
        f"sample ({cfg.sample_tokens} tokens, temperature {temperature}, seed "
        f"{seed}; more: python -m models.sample --out {cfg.out}):\n  "
        + summary["sample"].replace("\n", "\n  ")
      )
      if cfg.size in SMALL_SIZES:
        print(
          f"  (expected of a {cfg.model}-{cfg.size} after {steps} steps: the plays' layout "
          "and some short words, otherwise gibberish; the sample shows that the trained "
          "weights load and generate, not that they write sense)"
        )
  print_wire(summary["wire"])
  if "machine" in summary and jax.default_backend() == "cpu":
    m = summary["machine"]
    print(
      f"compiled for {m['cpu']} ({m['vector_isa']}): XLA:CPU targets this CPU, so a compressed "
      "run's losses repeat bitwise here and may differ on a CPU with other vector "
      "instructions"
    )
  print(f"outputs in {cfg.out}/ (metrics.jsonl, loss.png, summary.json, config.json, ckpt/)")
