"""``python -m jcoccl.bench predict``: speed-ups at 8, 32 and 256 GPUs from measured codecs.

Predicts how much faster jcoccl's compressed all_reduce, reduce_scatter, all_gather and
all_to_all would be than NCCL's exact (float32) op, from the codec throughputs one GPU
measured (the JSON that ``tools/gpu_codecs.py`` writes, e.g. ``codec_bench_r1.json`` in
benchmarks/results/2026-12-04-h200/run4-df9e660/logs.tgz) and a model of the links. No
GPU and nothing compiled: the all_reduce algorithms are timed with the alpha-beta-gamma
formulas of :mod:`jcoccl._src.base.cost_model` (``CostModel.cost``), the other ops and the
two-level network composed from the same terms.

Model constants (all stated in the output's header, and in
benchmarks/results/2026-12-05-predict/README.md):
  nvlink: 450 GB/s per GPU, alpha 2 us per step. NCCL's published all_reduce bus bandwidth
    on 8x H100/H200 (NVLink 4, NVSwitch) is about 370-480 GB/s for large messages
    (nccl-tests, NVIDIA's DGX H100/H200 figures); 450 is inside that range. The exact op
    and jcoccl's payload transfers (NCCL all_to_all / all_gather) both get it.
  ib400: 400 Gb/s InfiniBand per GPU (one NDR NIC per GPU, rail-optimised) = 50 GB/s
    line rate, 90% of it usable (45 GB/s, NCCL's usual efficiency on NDR), alpha 5 us.
  eth100: 100 Gb/s Ethernet per GPU = 12.5 GB/s, 90% usable (11.25 GB/s), alpha 10 us.
  The alphas are order-of-magnitude choices. A step over all N GPUs costs the mean of a
  ring's hops (N - m on NVLink, m on the network, m nodes). The JSON output gives NCCL's
  latency share (nccl_alpha_ms); it matters at 64 MiB on 256 GPUs (reduce_scatter and
  all_gather: 255 ring steps), little at 1 GiB.
  Nodes of 8 GPUs on NVLink. Up to 8 GPUs is one node (the network is unused).
  ``--nics-per-node K`` (default 8) gives a node K such links, shared by its GPUs.

Beyond one node (N = 8 m GPUs, m nodes, K = 8 NICs per node unless --nics-per-node):
  NCCL's ring ops (all_reduce, reduce_scatter, all_gather) run one ring per NIC and
  pipeline its NVLink and network hops, so a rank's bus bandwidth is
  min(nvlink, K x NIC); a GPU's own share of the network is K/8 of a NIC. T = steps alpha + bus bytes / that
  (all_reduce: cost_model's exact formula over N ranks, with the latency of the fewer of
  a ring's 2(N-1) and a tree's 2 log2 N steps, as NCCL picks; reduce_scatter and
  all_gather: N-1 steps). A point-to-point all_to_all of X bytes per GPU sends (8-1)/N X
  over NVLink and (N-8)/N X over its share: T = (N-1) alpha + max of the two.
  jcoccl's all_reduce takes the least time among hierarchical (cost_model two_shot inside
  the node over NVLink + cost_model one_shot of the 1/8 shard across nodes over each GPU's
  NIC, as ``all_reduce_auto._hierarchical_cost`` composes them), flat two_shot (its
  all_to_all point to point, its all_gather a ring) and flat one_shot (a ring
  all_gather), each with the bandwidth those patterns give. reduce_scatter sends its
  payloads with an all_to_all (each GPU's unreduced piece crosses the network, where
  NCCL's ring sends one partial sum per node boundary), all_gather with a ring, all_to_all
  point to point.

Codec time: the measured throughput of each kernel, input float32 bytes per second
(``mib`` / ``ms`` of the results' rows), at the measured size nearest the message (in
log scale), median over the files given. Passes per op (in message bytes S, n ranks):
one_shot encode 1, decode n; two_shot encode 1 + 1/n, decode 2; reduce_scatter encode 1,
decode 1; all_gather encode 1/n, decode 1; all_to_all encode 1, decode 1 (their sums are
cost_model's codec terms). decode_sum and decode_sum_encode run at their measured rate
where the file has them; otherwise decode's rate per decoded element stands in (and for
decode_sum_encode, decode's then encode's), which the table's notes say. A kernel timed
with CUDA events (op ``"<kernel> [events]"``: the kernel alone, jcoccl_codec_time) is used
in place of the wall-clock row of the same codec, kernel and size. Nothing of the codec
overlaps the link (jcoccl's engine runs them one after another).

Example:
  tar xzf benchmarks/results/2026-12-04-h200/run4-df9e660/logs.tgz -C /tmp/run4
  python -m jcoccl.bench predict --results /tmp/run4/codec_bench_r{1,2,3}.json
  python -m jcoccl.bench predict --results r.json --links ib400 --gpus 32 \\
      --compressors int8,int4 --sizes 64MiB --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from jcoccl.bench import _harness as H
from jcoccl.bench.speed_model import (
  LINKS,
  NODE_GPUS,
  OPS,
  ROOFLINE,
  Codec,
  Topology,
  exact_s,
  jcoccl_s,
  steps,
)

NAME = "predict"
HELP = "predict compressed vs NCCL speed-ups at 8-256 GPUs from measured codec throughputs"
KERNELS = ("encode", "decode", "decode_sum", "decode_sum_encode")
DEFAULT_SIZES = (64 << 20, 1 << 30)
DEFAULT_GPUS = (8, 32, 256)


# ---------------------------------------------------------------------------------------
# Results files.


def load_results(paths: Sequence[str]) -> dict[str, Codec]:
  """The codecs measured in the GPU script's JSON files ``paths`` (``{"bench": [rows]}``,
  rows with codec, mib, op, ms and gbs = bytes read + written / s); rates are medians over
  the files.

  Raises:
    ValueError: a file is missing, not JSON, or holds no codec timings (names --results).
  """
  rates: dict[tuple[str, str, float], list[float]] = {}
  timed: dict[tuple[str, str, float], list[float]] = {}  # rows timed with CUDA events
  ratios: dict[str, list[float]] = {}
  copies: list[float] = []
  for path in paths:
    rows = _rows(path)
    copies += [float(r["gbs"]) * 1e9 for r in rows if r.get("codec") == "copy" and "gbs" in r]
    for i, r in enumerate(rows):
      kernel, events = _kernel_of(r.get("op"))
      if r.get("codec") == "copy" or kernel not in KERNELS:
        continue
      try:
        mib, ms, gbs = float(r["mib"]), float(r["ms"]), float(r["gbs"])
        spec = str(r["codec"])
      except (KeyError, TypeError, ValueError):
        raise ValueError(
          f"--results: {path!r} bench[{i}] needs codec, mib, op, ms and gbs, got {r!r}"
        ) from None
      if not (mib > 0 and ms > 0 and gbs > 0):
        raise ValueError(f"--results: {path!r} bench[{i}] has a non-positive value: {r!r}")
      inp = mib * 2**20
      (timed if events else rates).setdefault((spec, kernel, mib), []).append(inp / (ms * 1e-3))
      if kernel in ("encode", "decode") and not events:  # moved = input + payload
        ratios.setdefault(spec, []).append(gbs * 1e9 * ms * 1e-3 / inp - 1)
  rates.update(timed)
  if not rates:
    raise ValueError(
      f"--results: no codec timings in {', '.join(map(repr, paths))} (expected the GPU "
      "script's JSON: {'bench': [{codec, mib, op, ms, gbs}, ...]})"
    )
  if not copies:
    raise ValueError("--results: no copy bandwidth row (codec 'copy') in the files")
  out = {}
  for spec in sorted({k[0] for k in rates}):
    if spec not in ratios:
      raise ValueError(f"--results: {spec} has no encode or decode row to size its payload")
    mine = tuple(
      ((op, mib), statistics.median(v)) for (c, op, mib), v in sorted(rates.items()) if c == spec
    )
    out[spec] = Codec(spec, statistics.median(ratios[spec]), mine, max(copies))
  return out


def _kernel_of(op: Any) -> tuple[Any, bool]:
  """(kernel, timed with CUDA events) of a results row's ``op``: ``"decode [events]"`` is
  ``("decode", True)``."""
  if isinstance(op, str) and op.endswith(" [events]"):
    return op.removesuffix(" [events]"), True
  return op, False


def _rows(path: str) -> list[dict[str, Any]]:
  try:
    with open(path) as f:
      data = json.load(f)
  except OSError as e:
    raise ValueError(f"--results: cannot read {path!r}: {e.strerror or e}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"--results: {path!r} is not valid JSON: {e}") from None
  rows = data.get("bench") if isinstance(data, dict) else data
  if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
    raise ValueError(f"--results: {path!r} must hold {{'bench': [row objects]}} or a list of rows")
  return rows


# ---------------------------------------------------------------------------------------
# Command line.


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
  """Registers the ``predict`` subcommand."""
  p = subparsers.add_parser(
    NAME, help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--results",
    nargs="+",
    required=True,
    metavar="FILE",
    help="JSON written by tools/gpu_codecs.py (codec_bench*.json); several: medians",
  )
  p.add_argument(
    "--links",
    type=lambda t: H.parse_list(t, what="--links"),
    default=list(LINKS),
    help=f"between-node links, comma-separated, of {', '.join(LINKS)} (default: all)",
  )
  p.add_argument(
    "--gpus",
    type=lambda t: H.parse_list(t, H.positive_int, "--gpus"),
    default=list(DEFAULT_GPUS),
    help="GPU counts (default 8,32,256; over 8: nodes of 8)",
  )
  p.add_argument(
    "--compressors",
    type=lambda t: H.parse_list(t, what="--compressors"),
    default=None,
    help="codecs as the results name them, e.g. int8,int4,fp8 (default: all measured)",
  )
  p.add_argument(
    "--ops",
    type=lambda t: H.parse_list(t, what="--ops"),
    default=list(OPS),
    help=f"of {', '.join(OPS)} (default: all)",
  )
  p.add_argument(
    "--sizes",
    type=H.size_list,
    default=list(DEFAULT_SIZES),
    help="message bytes per GPU (default 64MiB,1GiB); " + H.SIZE_HELP,
  )
  p.add_argument(
    "--nics-per-node",
    type=H.positive_int,
    default=NODE_GPUS,
    help=f"network links per node of {NODE_GPUS} GPUs (default {NODE_GPUS}: one per GPU, "
    "as the links are rated); fewer: the GPUs of a node share them",
  )
  p.add_argument("--json", default=None, metavar="OUT", help="also write the rows to OUT")
  return p


def predict(
  codecs: dict[str, Codec],
  links: Sequence[str],
  gpus: Sequence[int],
  ops: Sequence[str],
  sizes: Sequence[int],
  nics: int = NODE_GPUS,
) -> tuple[list[dict[str, Any]], list[str]]:
  """The table's rows and notes: one row per (GPUs, link, op, size, codec).

  Up to 8 GPUs is one NVLink node (one row, link "nvlink"); more are nodes of 8 joined by
  each network link of ``links``.
  """
  bad = [name for name in links if name not in LINKS]
  if bad:
    raise ValueError(f"--links: unknown link {bad[0]!r}; known: {', '.join(LINKS)}")
  bad = [op for op in ops if op not in OPS]
  if bad:
    raise ValueError(f"--ops: unknown op {bad[0]!r}; known: {', '.join(OPS)}")
  bad_n = [n for n in gpus if n < 2 or (n > NODE_GPUS and n % NODE_GPUS)]
  if bad_n:
    raise ValueError(
      f"--gpus: {bad_n[0]} is not 2-{NODE_GPUS} GPUs (one node) or whole nodes of {NODE_GPUS}"
    )
  rows, notes = [], set()
  for n in gpus:
    nets = ["nvlink"] if n <= NODE_GPUS else [x for x in links if x != "nvlink"]
    if n > NODE_GPUS and not nets:
      notes.add(f"{n} GPUs need a network link (--links ib400 or eth100): skipped")
    for net in nets:
      topo = Topology(n, LINKS[net], nics)
      for op in ops:
        for size in sizes:
          for codec in codecs.values():
            rows.append(_row(op, size, topo, codec, notes))
  return rows, sorted(notes)


def _row(op: str, size: int, topo: Topology, codec: Codec, notes: set[str]) -> dict[str, Any]:
  t_exact = exact_s(op, size, topo)
  algo, t = jcoccl_s(op, size, topo, codec, notes)
  _, t_roof = jcoccl_s(op, size, topo, codec, notes, roofline=True)
  return {
    "gpus": topo.gpus,
    "link": topo.net.name if topo.nodes > 1 else "nvlink",
    "op": op,
    "bytes": size,
    "codec": codec.spec,
    "algorithm": algo,
    "nccl_ms": t_exact * 1e3,
    "nccl_alpha_ms": steps(op, topo.gpus) * topo.alpha_s * 1e3,
    "jcoccl_ms": t * 1e3,
    "speedup": t_exact / t,
    "speedup_roofline": t_exact / t_roof,
  }


COLUMNS = (
  "gpus",
  "link",
  "op",
  "bytes",
  "codec",
  "algorithm",
  "nccl_ms",
  "jcoccl_ms",
  "speedup",
  "speedup_roofline",
)
HEADERS = {"speedup": "x (measured)", "speedup_roofline": f"x ({ROOFLINE:.0%} copy)"}


def _select(codecs: dict[str, Codec], names: Sequence[str] | None) -> dict[str, Codec]:
  if names is None:
    return codecs
  missing = [c for c in names if c not in codecs]
  if missing:
    raise ValueError(
      f"--compressors: {missing[0]!r} is not measured in --results; measured: {', '.join(codecs)}"
    )
  return {c: codecs[c] for c in names}


def run(args: argparse.Namespace) -> int:
  """Runs ``predict``; returns the exit code."""
  codecs = _select(load_results(args.results), args.compressors)
  if not 1 <= args.nics_per_node <= NODE_GPUS:
    raise ValueError(f"--nics-per-node: must be 1-{NODE_GPUS}, got {args.nics_per_node}")
  rows, notes = predict(codecs, args.links, args.gpus, args.ops, args.sizes, args.nics_per_node)
  print("# jcoccl predict: NCCL float32 time / jcoccl compressed time (alpha-beta-gamma)")
  for link in LINKS.values():
    print(
      f"# {link.name}: {link.beta_Bps / 1e9:g} GB/s per GPU, alpha {link.alpha_s * 1e6:g} us"
      f" ({link.source})"
    )
  k = args.nics_per_node
  print(
    f"# nodes of {NODE_GPUS} GPUs on nvlink, {k} link(s) per node; NCCL's ring busbw across "
    f"nodes: min(nvlink, {k} x link); a GPU's network share: {k}/{NODE_GPUS} of a link"
  )
  print(f"# results: {' '.join(args.results)}")
  for c in codecs.values():
    rates = ", ".join(f"{k}@{mib:g}MiB {g / 1e9:.0f}" for (k, mib), g in c.rates)
    print(f"# {c.spec}: r = {c.ratio:.4f}; input GB/s: {rates}")
  print(f"# copy bandwidth {max(c.copy_Bps for c in codecs.values()) / 1e9:.0f} GB/s")
  for note in notes:
    print(f"# note: {note}")
  formats = {"nccl_ms": ".3f", "jcoccl_ms": ".3f", "speedup": ".2f", "speedup_roofline": ".2f"}
  H.print_table(rows, COLUMNS, headers=HEADERS, formats=formats)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"notes": notes, "rows": rows}, f, indent=1)
      f.write("\n")
  return 0
