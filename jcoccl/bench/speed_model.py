"""The speed model behind ``python -m jcoccl.bench predict``: links and nodes
(:class:`Topology`), a codec's measured kernels (:class:`Codec`), and the seconds of NCCL's
exact op and of jcoccl's compressed one. The constants and formulas are stated in
:mod:`jcoccl.bench.predict`'s docstring (the command's help).

Example:
  >>> passes("two_shot", 8)
  (1.125, 2.0)
"""

from __future__ import annotations

import dataclasses
import math

from jcoccl._src.base.cost_model import CostModel

NODE_GPUS = 8
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
ROOFLINE = 0.8  # the "at 80% of copy" column: kernels at this fraction of copy bandwidth


@dataclasses.dataclass(frozen=True)
class Link:
  """One level of the network, per GPU.

  Attributes:
    name: the --links name. beta_Bps: usable bytes per second per GPU.
    alpha_s: seconds per collective step. source: where the numbers come from.
  """

  name: str
  beta_Bps: float
  alpha_s: float
  source: str


NVLINK = Link("nvlink", 450e9, 2e-6, "NCCL all_reduce busbw 8x H100/H200, published ~370-480 GB/s")
LINKS: dict[str, Link] = {
  "nvlink": NVLINK,
  "ib400": Link("ib400", 0.9 * 50e9, 5e-6, "400 Gb/s InfiniBand per GPU, 90% usable"),
  "eth100": Link("eth100", 0.9 * 12.5e9, 10e-6, "100 Gb/s Ethernet per GPU, 90% usable"),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  """N GPUs in nodes of :data:`NODE_GPUS` on NVLink, ``net`` between nodes.

  Example:
    >>> t = Topology(32, LINKS["ib400"])
    >>> t.nodes, t.ring_Bps / 1e9
    (4, 360.0)
    >>> round(t.alpha_s * 1e6, 3)  # 28 NVLink hops at 2 us, 4 network hops at 5 us
    2.375
  """

  gpus: int
  net: Link
  nics: int = NODE_GPUS  # network links per node (one per GPU: the rated case)

  @property
  def nodes(self) -> int:
    return max(1, math.ceil(self.gpus / NODE_GPUS))

  @property
  def local(self) -> int:
    """GPUs per node that take part."""
    return min(self.gpus, NODE_GPUS)

  @property
  def alpha_s(self) -> float:
    """Seconds per step of a collective over all N GPUs: of a ring's N hops, one per node
    crosses the network and the others are NVLink, so the hops' mean."""
    m, n = self.nodes, self.gpus
    return ((n - m) * NVLINK.alpha_s + m * self.net.alpha_s) / n if m > 1 else NVLINK.alpha_s

  @property
  def ring_Bps(self) -> float:
    """A rank's bus bandwidth in NCCL's rings: one ring per NIC, NVLink and network hops
    pipelined, so the slower of NVLink and the node's NICs together bounds it."""
    if self.nodes == 1:
      return NVLINK.beta_Bps
    return min(NVLINK.beta_Bps, self.nics * self.net.beta_Bps)

  @property
  def net_Bps(self) -> float:
    """A GPU's share of its node's network links."""
    return self.nics / self.local * self.net.beta_Bps

  def ring_s(self, bus_bytes: float, steps: int) -> float:
    """Seconds of a ring collective that moves ``bus_bytes`` per rank in ``steps``."""
    return steps * self.alpha_s + bus_bytes / self.ring_Bps

  def p2p_s(self, nbytes: float) -> float:
    """Seconds of a point-to-point all_to_all of ``nbytes`` per GPU: the NVLink and the
    network shares go at once, the slower bounds it."""
    n = self.gpus
    inside = (self.local - 1) / n * nbytes / NVLINK.beta_Bps
    across = (n - self.local) / n * nbytes / self.net_Bps if self.nodes > 1 else 0.0
    return (n - 1) * self.alpha_s + max(inside, across)


@dataclasses.dataclass(frozen=True)
class Codec:
  """A codec's measured kernels.

  Attributes:
    spec: the codec as the results name it (e.g. "int8").
    ratio: payload bytes / float32 input bytes (r).
    rates: (kernel, input MiB) -> input float32 bytes per second, median over files.
    copy_Bps: the device copy bandwidth measured with it (bytes read + written).
  """

  spec: str
  ratio: float
  rates: tuple[tuple[tuple[str, float], float], ...]
  copy_Bps: float

  def rate(self, kernel: str, nbytes: float) -> tuple[float, str]:
    """(input bytes per second, note) of ``kernel`` at the measured size nearest
    ``nbytes``; a kernel not measured gets its stand-in and a note saying so."""
    have = dict(self.rates)
    stand_in = {"decode_sum": "decode"}  # decode_sum_encode: see codec_s
    k, note = kernel, ""
    if not any(kk == kernel for kk, _ in have):
      k = stand_in.get(kernel, kernel)
      note = f"{kernel} not measured: {k} stands in"
    sizes = [mib for kk, mib in have if kk == k]
    if not sizes:
      raise ValueError(f"--results: {self.spec} has no {k} timing")
    mib = min(sizes, key=lambda m: abs(math.log(m * 2**20 / nbytes)))
    return have[(k, mib)], note


def passes(op: str, n: int) -> tuple[float, float]:
  """(encode, decode) passes over the message of ``op`` ("one_shot", "two_shot", or a
  non-all_reduce op) on ``n`` ranks; the decodes of one_shot and two_shot's first are
  decode_sums. Their sum is :mod:`jcoccl._src.base.cost_model`'s codec coefficient.

  Example:
    >>> passes("two_shot", 8)
    (1.125, 2.0)
  """
  table = {
    "one_shot": (1.0, float(n)),
    "two_shot": (1.0 + 1.0 / n, 2.0),
    "reduce_scatter": (1.0, 1.0),
    "all_gather": (1.0 / n, 1.0),
    "all_to_all": (1.0, 1.0),
  }
  if op not in table:
    raise ValueError(f"no codec passes for {op!r}")
  return table[op]


def codec_s(codec: Codec, op: str, nbytes: float, n: int, notes: set[str]) -> float:
  """Seconds of codec work of ``op`` on a message of ``nbytes`` over ``n`` ranks, from the
  measured kernels (decode_sum and decode_sum_encode where measured)."""
  enc, dec = passes(op, n)
  g_enc, _ = codec.rate("encode", nbytes)
  g_dec, _ = codec.rate("decode", nbytes)
  if op == "two_shot" and any(k == "decode_sum_encode" for (k, _), _ in codec.rates):
    g_dse, _ = codec.rate("decode_sum_encode", nbytes)  # decodes S, encodes S/n
    return nbytes / g_enc + nbytes / g_dse + nbytes / g_dec
  if op in ("one_shot", "two_shot", "reduce_scatter"):
    g_sum, note = codec.rate("decode_sum", nbytes)
    if note:
      notes.add(note)
    first = n if op == "one_shot" else 1.0  # the decode_sum passes
    return nbytes * (enc / g_enc + first / g_sum + (dec - first) / g_dec)
  return nbytes * (enc / g_enc + dec / g_dec)


def _gamma(codec: Codec, op: str, nbytes: float, n: int, notes: set[str]) -> float:
  """The single gamma that gives cost_model's codec term (sum of passes x S / gamma) the
  measured kernels' time."""
  return sum(passes(op, n)) * nbytes / codec_s(codec, op, nbytes, n, notes)


def exact_s(op: str, nbytes: float, topo: Topology) -> float:
  """Seconds of NCCL's float32 ``op`` of ``nbytes`` per GPU (all_gather: its output)."""
  n = topo.gpus
  if op == "all_reduce":
    m = CostModel(
      topo.alpha_s,
      topo.ring_Bps,
      1e18,
      exact_alpha_s=steps(op, n) * topo.alpha_s,
      exact_beta_Bps=topo.ring_Bps,
    )
    return m.cost("exact", int(nbytes), n)
  if op in ("reduce_scatter", "all_gather"):
    return topo.ring_s((n - 1) / n * nbytes, n - 1)
  if op == "all_to_all":
    return topo.p2p_s(nbytes)
  raise ValueError(f"--ops: unknown op {op!r}; known: {', '.join(OPS)}")


def jcoccl_s(
  op: str, nbytes: float, topo: Topology, codec: Codec, notes: set[str], roofline: bool = False
) -> tuple[str, float]:
  """(algorithm, seconds) of jcoccl's compressed ``op``: for all_reduce the least
  predicted time among its algorithms. ``roofline``: every kernel at :data:`ROOFLINE` of
  the copy bandwidth instead of as measured."""
  if roofline:
    g = ROOFLINE * codec.copy_Bps / (1 + codec.ratio)
    rates = tuple(((k, 1.0), g) for k in ("encode", "decode"))
    codec = dataclasses.replace(codec, rates=rates)
    notes = set()
  n, r, s = topo.gpus, codec.ratio, float(nbytes)
  if op == "all_reduce":
    return min(_all_reduce(s, topo, codec, notes), key=lambda c: c[1])
  link = {
    "reduce_scatter": lambda: topo.p2p_s(r * s),
    "all_gather": lambda: topo.ring_s((n - 1) / n * r * s, n - 1),
    "all_to_all": lambda: topo.p2p_s(r * s),
  }
  return "compressed", link[op]() + codec_s(codec, op, s, n, notes)


def _all_reduce(s: float, topo: Topology, codec: Codec, notes: set[str]) -> list[tuple[str, float]]:
  """(algorithm, seconds) of each all_reduce candidate, by cost_model's formulas."""
  n, r, a = topo.gpus, codec.ratio, topo.alpha_s
  wire_two = 2 * (n - 1) / n * r * s
  link_two = topo.p2p_s((n - 1) / n * r * s) + topo.ring_s((n - 1) / n * r * s, 0)
  link_two -= (n - 1) * a  # the steps are cost_model's alpha term
  out = [
    ("one_shot", _cost("one_shot", s, n, r, a, topo.ring_Bps, codec, notes)),
    ("two_shot", _cost("two_shot", s, n, r, a, wire_two / link_two, codec, notes)),
  ]
  if topo.nodes > 1:
    g, m = topo.local, topo.nodes
    inner = _cost("two_shot", s, g, r, NVLINK.alpha_s, NVLINK.beta_Bps, codec, notes)
    outer = _cost("one_shot", s / g, m, r, topo.net.alpha_s, topo.net_Bps, codec, notes)
    out.append(("hierarchical", inner + outer))
  return out


def _cost(
  algo: str, s: float, n: int, r: float, alpha: float, beta: float, codec: Codec, notes: set
) -> float:
  model = CostModel(alpha, beta, _gamma(codec, algo, s, n, notes))
  return model.cost(algo, int(s), n, r)


def steps(op: str, n: int) -> int:
  """Latency steps of NCCL's ``op`` on ``n`` ranks: all_reduce takes the fewer of a ring's
  2(n-1) and a tree's 2 log2(n) (NCCL picks between them); the other ops ring, n-1."""
  if op == "all_reduce":
    return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
  return n - 1
