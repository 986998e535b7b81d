"""Tune a compression policy to an accuracy budget with a probe and a few short runs.

  python -m models.tune --model gpt --mesh 2,2,2 --budget 1% --link 10 --out p.toml
  python -m models.tune --model qwen --budget 1% --objective bytes --out p.toml

Candidates: Hadamard-rotated ``int<b>`` on 'tensor' (all_reduce, both directions) and on
'pipe' (ppermute and all_reduce) for each ``b`` of ``--bits``, and on 'data' (the gradient
all_reduce, error feedback on) for each ``b`` of ``--data-bits``; ``--data CODEC`` keeps
'data' fixed instead. The search:

1. Probe (``models.error_probe``) after ``--probe-warm`` exact steps: each point's injected
   error per bit width, its sensitivity (gradient error / injected error) and the gradient
   noise. A candidate's *score* is its predicted gradient error over the noise, its points'
   errors added in quadrature.
2. Cost: each candidate's predicted step time of its tensor and pipe messages under the cost
   model (``--link`` Gbit/s or a ``--calibration`` file; ``--objective time``) or their bytes
   (``--objective bytes``), from the messages of one traced step. A searched 'data' point is
   scored by its error without error feedback, which feedback lowers over steps: the score
   ranks data bits too high in cost of accuracy, never too low.
3. The Pareto frontier (cheaper candidates only where their score is higher) is searched by
   bisection with short runs (``--steps`` steps, ``--seed``; the exact policy trains once
   alongside): a candidate passes when its trained weights' validation loss is within
   ``--budget`` of exact's both through its own collectives and through exact ones
   (:func:`judge`). Assuming the loss grows with the score, the cheapest passing frontier point is
   found in about log2(frontier) runs; ``--max-runs`` caps them.

``--roundings nearest,stochastic`` also measures, for each frontier point that fails, its twin
whose tensor and pipe activations round stochastically (the same bytes; unbiased, so that a
model cannot learn its rounding): the probe scores each step's error, not that.

Writes ``--out`` (the chosen policy, a models/configs TOML, with its figures as comments) and
``<out>.report.md`` / ``.report.json``: the probe, every candidate tried with its score,
predicted cost, measured loss and bytes, and the choice. Exits with status 1, writing the
report only, when no candidate tried meets the budget.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

# jax-free (as this module is at import): the devices are set up in main.
from models.directions import FAMILY
from models.tune_search import ACTIVATION_AXES as ACTIVATION_AXES
from models.tune_search import Candidate as Candidate
from models.tune_search import candidates as candidates
from models.tune_search import frontier as frontier
from models.tune_search import score as score
from models.tune_search import search as search


def message_cost(
  n: int, dtype: Any, codec: Any, objective: str, model: Any = None, ranks: int = 2
) -> float:
  """One message's cost: bytes each rank sends (payload x (ranks - 1), one-shot) or the cost
  model's seconds (the cheaper of one_shot and two_shot; exact: the lax op's)."""
  import numpy as np

  raw = n * np.dtype(dtype).itemsize
  payload = raw if codec is None else codec.payload_nbytes(n, dtype)
  if objective == "bytes":
    return float(payload * (ranks - 1))
  if codec is None:
    if model.calibrated:
      return float(model.cost("exact", raw, ranks))
    return float(model.cost("one_shot", raw, ranks, 1.0))
  return float(min(model.cost(a, raw, ranks, payload / raw) for a in ("one_shot", "two_shot")))


def axis_costs(
  messages: Sequence[tuple[str, tuple, Any]],
  bits: Mapping[str, Sequence[int]],
  objective: str,
  models: Mapping[str, Any],
  ranks: Mapping[str, int],
) -> dict[str, dict[int, float]]:
  """``{axis: {bits: cost of the step's messages on that axis}}`` for each axis of ``bits``
  ('tensor', 'pipe', 'data'): a message of point ``tensor.forward`` or ``data`` belongs to
  the axis before the dot."""
  from jcoccl import compressors as jc

  out: dict[str, dict[int, float]] = {}
  for axis, axis_bits in bits.items():
    mine = [(shape, dt) for point, shape, dt in messages if point.split(".")[0] == axis]
    out[axis] = {}
    for b in axis_bits:
      c = jc.parse(FAMILY.format(b=b))
      out[axis][b] = sum(
        message_cost(math.prod(shape), dt, c, objective, models.get(axis), ranks.get(axis, 2))
        for shape, dt in mine
      )
  return out


def policy_toml(c: Candidate, data: str | None, comments: Sequence[str]) -> str:
  """The chosen candidate as a models/configs TOML; ``data``: the fixed data codec (None
  when the candidate has data bits)."""
  b = dict(c.bits)
  t, p = c.spec("tensor"), c.spec("pipe")
  data = c.spec("data") if "data" in b else data
  head = "".join(f"# {line}\n" for line in comments)
  return (
    f'{head}[data]\nall_reduce = "{data}"\nerror_feedback = true\nmin_bytes = 0\n\n'
    f'[tensor]\nall_reduce = "{t}"\nmin_bytes = 0\n\n'
    f'[pipe]\nppermute = "{p}"\nall_reduce = "{p}"\nmin_bytes = 0\n'
  )


def search_bits(tensor_pipe: str, data: str | None) -> dict[str, list[int]]:
  """``{"tensor": [...], "pipe": [...], "data": [...]}`` from ``--bits`` and ``--data-bits``
  (no 'data' when it is None).

  Raises:
    ValueError: a bit width the Hadamard int family lacks (2 to 8), or not a list of ints.
  """
  from models.directions import parse_bits

  out = {"tensor": list(parse_bits("--bits", tensor_pipe))}
  out["pipe"] = out["tensor"]
  if data is not None:
    out["data"] = list(parse_bits("--data-bits", data))
  return out


def jc_parse(spec: str, flag: str) -> Any:
  """A compressor from ``spec``; ValueError naming ``flag`` when jcoccl does not parse it."""
  from jcoccl import compressors as jc

  try:
    return jc.parse(spec)
  except ValueError as e:
    raise ValueError(f"{flag} {spec!r}: {e}") from None


def parse_roundings(text: str) -> tuple[str, ...]:
  """``"nearest"`` or ``"nearest,stochastic"`` -> the tuple.

  Raises:
    ValueError: another value, naming --roundings and what is accepted.
  """
  got = tuple(r.strip() for r in text.split(","))
  if got not in (("nearest",), ("nearest", "stochastic")):
    raise ValueError(f"--roundings must be nearest or nearest,stochastic, got {text!r}")
  return got


def parse_budget(text: str) -> float:
  """``"1%"`` or ``"0.01"`` -> 0.01.

  Raises:
    ValueError: not a number > 0.
  """
  t = text.strip()
  v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
  if not (math.isfinite(v) and v > 0):
    raise ValueError(f"--budget must be > 0 (e.g. 1% or 0.01), got {text!r}")
  return v


def cost_models(args: argparse.Namespace, axes: Sequence[str]) -> tuple[dict[str, Any], str]:
  """Per-axis cost models of the searched ``axes`` from ``--calibration`` or ``--link``
  (none for ``--objective bytes``)."""
  import jcoccl

  if args.objective == "bytes":
    return {}, "bytes each rank sends per step"
  if args.calibration:
    models = jcoccl.read_cost_model(args.calibration)
    out = {a: models.get((a,), "all_reduce") for a in axes}
    missing = [a for a, m in out.items() if m is None]
    if missing:
      raise ValueError(f"--calibration {args.calibration} has no model for axes {missing}")
    return out, f"cost model {args.calibration}"
  # A link alone: its bandwidth, with a latency and codec throughput assumed (stated).
  m = jcoccl.CostModel(
    alpha_s=2e-5, beta_Bps=args.link * 1e9 / 8, gamma_Bps=4e9, source=f"--link {args.link}"
  )
  return dict.fromkeys(axes, m), (
    f"--link {args.link} Gbit/s (assumed: 20 us per collective step, codec 4 GB/s)"
  )


def main(argv: list[str] | None = None) -> dict:
  """``python -m models.tune``; returns the report (also written next to ``--out``)."""
  from models.run_config import use_host_devices

  use_host_devices()
  ap = argparse.ArgumentParser(prog="python -m models.tune", description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="gpt")
  ap.add_argument("--size", default="small")
  ap.add_argument("--mesh", default="2,2,2")
  ap.add_argument("--budget", default="1%", help="loss over exact's, e.g. 1%% or 0.01")
  ap.add_argument("--objective", choices=("time", "bytes"), default="time")
  ap.add_argument("--link", type=float, default=10.0, help="Gbit/s per rank (time objective)")
  ap.add_argument("--calibration", default=None, help="a jcoccl cost model JSON file")
  ap.add_argument("--bits", default="2,3,4,5,6,8")
  ap.add_argument(
    "--data-bits", default="3,4,6,8", help="bits searched on 'data' (error feedback on)"
  )
  ap.add_argument("--data", default=None, help="a fixed data codec instead (not searched)")
  ap.add_argument("--steps", type=int, default=100, help="steps of each short run")
  ap.add_argument("--seed", type=int, default=1, help="seed of the short runs")
  ap.add_argument("--probe-warm", type=int, default=50, help="exact steps before the probe")
  ap.add_argument("--max-runs", type=int, default=4)
  ap.add_argument(
    "--roundings",
    default="nearest",
    help="nearest, or nearest,stochastic: a failing point is retried with its tensor and "
    "pipe activations rounding stochastically (the same bytes)",
  )
  ap.add_argument("--train-arg", action="append", default=[], help="extra models.train flag")
  ap.add_argument("--out", required=True, help="the policy TOML to write")
  a = ap.parse_args(argv)
  try:
    roundings = parse_roundings(a.roundings)
    budget = parse_budget(a.budget)
    bits = search_bits(a.bits, None if a.data else a.data_bits)
    if a.data:
      jc_parse(a.data, "--data")
    models, cost_source = cost_models(a, list(bits))
  except ValueError as e:
    ap.error(str(e))
  if a.max_runs < 1 or a.steps < 1:
    ap.error("--max-runs and --steps must be >= 1")
  out = pathlib.Path(a.out)
  work = out.with_suffix(".runs")
  every = sorted(set().union(*bits.values()))
  probe, messages, ranks = _probe(a, every, work)
  costs = axis_costs(messages, bits, a.objective, models, ranks)
  cands = candidates(probe, costs, bits)
  base = _train_argv(a)
  exact = cached_run(base + ["--policy", "exact"], work / "exact")
  runs: list[dict] = []

  def passes(c: Candidate) -> bool:
    path = work / c.name
    path.mkdir(parents=True, exist_ok=True)
    (path / "policy.toml").write_text(policy_toml(c, a.data, []))
    s = cached_run(base + ["--policy", str(path / "policy.toml")], path / "run")
    j = judge(s, exact, budget)
    runs.append({**_cand(c), **j})
    through = j["vs_exact_collectives"]
    print(f"tune: {c.name}: val {j['val_loss']:.4f} ({j['vs_exact']:+.2%} of exact), through "
          f"exact collectives {'n/a' if through is None else f'{through:+.2%}'}, bytes "
          f"{j['bytes_ratio']:.3f} of exact: {'passes' if j['passes'] else 'fails'}",
          flush=True)  # fmt: skip
    return j["passes"]

  best, _ = search(cands, passes, a.max_runs, roundings)
  report = {
    "command": "python -m models.tune " + " ".join(argv if argv is not None else sys.argv[1:]),
    "budget": budget,
    "objective": a.objective,
    "cost_source": cost_source,
    "exact": {"val_loss": exact["val_loss_end"], "bytes": exact["wire"]["total"]["uncompressed"]},
    "probe": probe,
    "frontier": [_cand(c) for c in frontier(cands)],
    "tried": runs,
    "chosen": None if best is None else _cand(best),
  }
  out.parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(f"{out}.report.json").write_text(json.dumps(report, indent=1))
  pathlib.Path(f"{out}.report.md").write_text(report_md(report))
  print(report_md(report))
  if best is None:
    print(f"tune: no candidate tried met the budget {budget:.2%}; no policy written")
    raise SystemExit(1)
  chosen = next(r for r in runs if r["name"] == best.name)
  out.write_text(
    policy_toml(
      best,
      a.data,
      [
        f"Chosen by: {report['command']}",
        f"{a.model}-{a.size}, {a.steps} steps, seed {a.seed}: val {chosen['val_loss']:.4f}, "
        f"{chosen['vs_exact']:+.2%} of exact's {exact['val_loss_end']:.4f} "
        f"({chosen['vs_exact_collectives']:+.2%} through exact collectives); "
        f"{chosen['bytes_ratio']:.3f} of exact's bytes (one seed: check another).",
        f"Report: {out}.report.md",
      ],
    )
  )
  return report


def judge(run: Mapping[str, Any], exact: Mapping[str, Any], budget: float) -> dict[str, Any]:
  """A short run's verdict against the exact run's.

  A candidate passes only when its trained weights are within ``budget`` of exact's
  validation loss both through its own (compressed) collectives and through exact ones:
  a run whose weights co-adapted to its codec's rounding can look good through its own
  collectives alone.

  Args:
    run: the candidate run's summary.json (``val_loss_end``, ``val_loss_exact_collectives``,
      ``wire``).
    exact: the exact run's summary.json.
    budget: the allowed relative loss over exact's (0.01 for 1%).

  Returns:
    ``{"val_loss", "vs_exact", "val_loss_exact_collectives", "vs_exact_collectives",
    "bytes_ratio", "passes"}``; a run that did not measure the exact-collective loss fails.

  Example:
    >>> judge({"val_loss_end": 2.02, "val_loss_exact_collectives": 2.03, "wire": w},
    ...       {"val_loss_end": 2.0, "wire": w_exact}, 0.01)["passes"]  # doctest: +SKIP
    False
  """
  ref = exact["val_loss_end"]
  through = run.get("val_loss_exact_collectives")
  rel = run["val_loss_end"] / ref - 1
  rel_x = None if through is None else through / ref - 1
  return {
    "val_loss": run["val_loss_end"],
    "vs_exact": rel,
    "val_loss_exact_collectives": through,
    "vs_exact_collectives": rel_x,
    "bytes_ratio": run["wire"]["total"]["compressed"] / exact["wire"]["total"]["uncompressed"],
    "passes": rel <= budget and rel_x is not None and rel_x <= budget,
  }


def _cand(c: Candidate) -> dict:
  rounding = "stochastic activations" if c.stochastic else "nearest"
  return {
    "name": c.name,
    "bits": dict(c.bits),
    "rounding": rounding,
    "score": c.score,
    "cost": c.cost,
  }


def report_md(r: Mapping[str, Any]) -> str:
  """The tuner's report as markdown."""
  lines = [
    f"    {r['command']}",
    "",
    f"budget {r['budget']:.2%} of exact's validation loss ({r['exact']['val_loss']:.4f}); "
    f"objective {r['objective']} ({r['cost_source']}); gradient noise {r['probe']['noise']:.4f}",
    "",
    "| candidate (bits: t tensor, p pipe, d data; s: rounds stochastically) | score | predicted cost | val loss | vs exact "
    "| through exact collectives | bytes / exact | passes |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for t in r["tried"]:
    x = t.get("vs_exact_collectives")
    lines.append(
      f"| {t['name']} | {t['score']:.3f} | {t['cost']:.4g} | {t['val_loss']:.4f} | "
      f"{t['vs_exact']:+.2%} | {'n/a' if x is None else f'{x:+.2%}'} | {t['bytes_ratio']:.3f} "
      f"| {'yes' if t.get('passes') else 'no'} |"
    )
  ch = r["chosen"]
  lines += ["", f"frontier: {', '.join(c['name'] for c in r['frontier'])}", ""]
  lines.append(f"chosen: {ch['name']}" if ch else "chosen: none (no candidate met the budget)")
  return "\n".join(lines) + "\n"


def _train_argv(a: argparse.Namespace) -> list[str]:
  return [
    "--model", a.model, "--size", a.size, "--mesh", a.mesh, "--seed", str(a.seed),
    "--steps", str(a.steps), "--eval-every", str(a.steps), "--ckpt-every", str(a.steps),
    "--no-progress", "--no-calibrate", "--no-exact-twin", "--eval-batches", "16",
    "--sample-tokens", "0", *a.train_arg,
  ]  # fmt: skip


def cached_run(argv: list[str], out: pathlib.Path) -> dict:
  """``models.train.main(argv + --out out)``; a run whose summary.json exists with the same
  argv is read back instead (so a study can be resumed).

  Args:
    argv: models.train's flags, without --out.
    out: the run's output directory.

  Returns:
    The run's summary (summary.json's content).

  Example:
    >>> cached_run(["--steps", "50", "--policy", "exact"], pathlib.Path("runs/exact"))  # doctest: +SKIP
  """
  from models import train

  argv = [*argv, "--out", str(out)]
  done, cmd = out / "summary.json", out / "argv.json"
  if done.is_file() and cmd.is_file() and json.loads(cmd.read_text()) == argv:
    return json.loads(done.read_text())
  s = train.main(argv)
  cmd.write_text(json.dumps(argv))
  return s


def _probe(a: argparse.Namespace, bits: list[int], work: pathlib.Path) -> tuple[dict, list, dict]:
  """The probe after ``--probe-warm`` exact steps on ``--seed``'s batches, the messages of
  one traced step and the axis sizes."""
  from models import error_probe as ep
  from models import loop
  from models.directed import DirectedCollectives, DirectedParallel

  argv = ["--model", a.model, "--size", a.size, "--mesh", a.mesh, "--seed", str(a.seed)]
  argv += ["--steps", str(a.probe_warm + 1), "--out", str(work / "probe"), *a.train_arg]
  cfg, model, mesh, params, corpus = ep.warm_start(argv, a.probe_warm)
  ref = 4 if 4 in bits else bits[len(bits) // 2]
  prober = ep.Prober(model, mesh, bits=bits, reference_bits=ref, n_micro=cfg.micro, dtype=cfg.dtype)
  par = DirectedParallel(model, mesh, None, n_micro=cfg.micro, dtype=cfg.dtype)
  batch = loop.batch_at(corpus, cfg, par, "train", a.probe_warm)
  result = prober.run(params, [batch])
  ep.grads_fn(par).trace(params, *batch)
  assert isinstance(par.coll, DirectedCollectives)
  return result, par.coll.points_log, dict(par.sizes)


if __name__ == "__main__":
  main()
