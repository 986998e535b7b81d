"""The strict NCCL emulation (cuda/emul/nccl_emul.h) on its own, in-process over ctypes: the
library the interposer's tests load as the real NCCL (built once by
cuda/nccl_interposer/test/emul_build.py).

Checked: the ranks must agree on each collective and each send/recv pair, and a
disagreement fails every rank involved with a finding that names both calls; every datatype
and reduction against numpy/ml_dtypes references computed with NCCL's order and rounding;
errors inside groups; nonblocking communicators and ncclCommSplit; abort from another thread
and use after destroy/abort."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "cuda" / "nccl_interposer" / "test"))
sys.path.insert(0, str(ROOT / "tools"))
import emul_build  # noqa: E402
import gpu_shim  # noqa: E402

pytestmark = pytest.mark.skipif(
  gpu_shim.compiler() is None or not sys.platform.startswith("linux"),
  reason="needs a C++ compiler on Linux",
)

SUCCESS, SYSTEM, INTERNAL, INVALID_ARG, INVALID_USAGE, IN_PROGRESS = 0, 2, 3, 4, 5, 7
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
NOCOLOR = -1
# ncclDataType_t -> numpy dtype
DTYPES = {
  0: np.int8,
  1: np.uint8,
  2: np.int32,
  3: np.uint32,
  4: np.int64,
  5: np.uint64,
  6: np.float16,
  7: np.float32,
  8: np.float64,
  9: ml_dtypes.bfloat16,
  10: ml_dtypes.float8_e4m3fn,
  11: ml_dtypes.float8_e5m2,
}
F32, F16, U8 = 7, 6, 1


class UniqueId(ctypes.Structure):
  _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):
  """ncclConfig_t (NCCL 2.32), set as NCCL_CONFIG_INITIALIZER sets it."""

  _fields_ = [
    ("size", ctypes.c_size_t),
    ("magic", ctypes.c_uint),
    ("version", ctypes.c_uint),
    ("blocking", ctypes.c_int),
    ("cgaClusterSize", ctypes.c_int),
    ("minCTAs", ctypes.c_int),
    ("maxCTAs", ctypes.c_int),
    ("netName", ctypes.c_char_p),
    ("splitShare", ctypes.c_int),
    ("trafficClass", ctypes.c_int),
    ("commName", ctypes.c_char_p),
    *[
      (n, ctypes.c_int)
      for n in [
        "collnetEnable",
        "CTAPolicy",
        "shrinkShare",
        "nvlsCTAs",
        "nChannelsPerNetPeer",
        "nvlinkCentricSched",
        "graphUsageMode",
        "numRmaCtx",
        "maxP2pPeers",
        "graphStreamOrdering",
        "launchOrderImplicit",
        "numRmaSig",
        "rmaEagerInit",
        "hostCftMode",
        "nvlsHostMode",
      ]
    ],
  ]

  @classmethod
  def make(cls, blocking: int) -> Config:
    c = cls()
    undef = -(2**31)
    for name, typ in cls._fields_[3:]:
      if typ is ctypes.c_int:
        setattr(c, name, undef)
    c.size, c.magic, c.version, c.blocking = ctypes.sizeof(cls), 0xCAFEBEEF, 23206, blocking
    return c


class Emul:
  """The emulation library loaded into this process."""

  def __init__(self, path: Path):
    self.lib = lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name in ("ncclAllReduce", "ncclReduceScatter"):
      getattr(lib, name).argtypes = [vp, vp, sz, i32, i32, vp, vp]
    lib.ncclReduce.argtypes = [vp, vp, sz, i32, i32, i32, vp, vp]
    lib.ncclBroadcast.argtypes = [vp, vp, sz, i32, i32, vp, vp]
    for name in ("ncclAllGather", "ncclAlltoAll"):
      getattr(lib, name).argtypes = [vp, vp, sz, i32, vp, vp]
    for name in ("ncclSend", "ncclRecv"):
      getattr(lib, name).argtypes = [vp, sz, i32, i32, vp, vp]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i32, UniqueId, i32]
    lib.ncclCommInitRankConfig.argtypes = [
      ctypes.POINTER(vp),
      i32,
      UniqueId,
      i32,
      ctypes.POINTER(Config),
    ]
    lib.ncclCommSplit.argtypes = [vp, i32, i32, ctypes.POINTER(vp), ctypes.POINTER(Config)]
    lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(i32)]
    lib.ncclCommAbort.argtypes = [vp]
    lib.ncclCommDestroy.argtypes = [vp]
    lib.ncclCommCount.argtypes = [vp, ctypes.POINTER(i32)]
    lib.ncclCommUserRank.argtypes = [vp, ctypes.POINTER(i32)]
    lib.ncclRedOpCreatePreMulSum.argtypes = [ctypes.POINTER(i32), vp, i32, i32, vp]
    lib.ncclRedOpDestroy.argtypes = [i32, vp]
    lib.emul_stream.restype = vp
    lib.emul_sync.argtypes = [vp]
    lib.emul_findings.restype = ctypes.c_char_p
    self.streams: dict[int, int] = {}

  def stream(self, device: int) -> int:
    """One stream per device, reused by every test."""
    if device not in self.streams:
      self.lib.emul_set_device(device)
      self.streams[device] = self.lib.emul_stream()
    return self.streams[device]

  def comms(self, n: int, blocking: int = 1) -> list[tuple[int, int]]:
    """n ranks on devices 0..n-1 (inside one group): [(communicator, stream)]."""
    uid = UniqueId()
    self.lib.ncclGetUniqueId(ctypes.byref(uid))
    cfg = Config.make(blocking)
    out = []
    assert self.lib.ncclGroupStart() == SUCCESS
    for r in range(n):
      self.lib.emul_set_device(r)
      c = ctypes.c_void_p()
      assert self.lib.ncclCommInitRankConfig(ctypes.byref(c), n, uid, r, ctypes.byref(cfg)) == 0
      out.append((c.value, self.stream(r)))
    assert self.lib.ncclGroupEnd() == (SUCCESS if blocking else IN_PROGRESS)
    if not blocking:
      for c, _ in out:
        self.ready(c)
    return out

  def async_error(self, comm: int) -> int:
    err = ctypes.c_int(-1)
    assert self.lib.ncclCommGetAsyncError(comm, ctypes.byref(err)) == SUCCESS
    return err.value

  def ready(self, comm: int, limit: float = 10.0) -> None:
    """Polls ncclCommGetAsyncError until the communicator leaves ncclInProgress."""
    t = time.monotonic()
    while self.async_error(comm) == IN_PROGRESS:
      assert time.monotonic() - t < limit, "still in progress"
      time.sleep(0.002)

  def sync(self, comms) -> None:
    for _, s in comms:
      self.lib.emul_sync(s)

  def findings(self) -> str:
    return self.lib.emul_findings().decode()


@pytest.fixture(scope="module")
def emul() -> Emul:
  e = Emul(emul_build.build().emul)
  old = e.lib.emul_set_timeout_ms(5000)  # a missed peer fails in 5 s, not 60
  e.findings()
  yield e
  e.lib.emul_set_timeout_ms(old)


@pytest.fixture(autouse=True)
def _clean(emul):
  yield
  emul.lib.emul_reset_group()
  emul.findings()


# ---- rank agreement ---------------------------------------------------------------------------


def _all_reduce(emul, comms, counts, dtypes=None, reds=None):
  """One all-reduce per rank with per-rank count/dtype/reduction; returns the results."""
  outs = []
  for r, (c, s) in enumerate(comms):
    emul.lib.emul_set_device(r)
    t = (dtypes or [F32] * len(comms))[r]
    x = np.ones(counts[r], DTYPES[t])
    o = np.zeros(counts[r], DTYPES[t])
    red = (reds or [SUM] * len(comms))[r]
    assert emul.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, counts[r], t, red, c, s) == 0
    outs.append((x, o))
  emul.sync(comms)
  return [o for _, o in outs]


@pytest.mark.parametrize(
  "counts,dtypes,reds,needle",
  [
    ([64, 32], None, None, "count 32"),
    ([64, 64], [F32, F16], None, "ncclFloat16"),
    ([64, 64], None, [SUM, MAX], "ncclMax"),
  ],
  ids=["count", "dtype", "reduction"],
)
def test_nccl_emul_ranks_that_disagree_fail_and_name_both_calls(emul, counts, dtypes, reds, needle):
  comms = emul.comms(2)
  outs = _all_reduce(emul, comms, counts, dtypes, reds)
  assert [emul.async_error(c) for c, _ in comms] == [INVALID_USAGE] * 2
  found = emul.findings()
  assert "ranks disagree on collective #0" in found and needle in found
  assert "rank 0 called ncclAllReduce(count 64" in found and "rank 1 called" in found
  assert all((o == 0).all() for o in outs)  # no result is written


def test_nccl_emul_send_and_recv_must_agree(emul):
  comms = emul.comms(2)
  x, y = np.ones(16, np.float32), np.zeros(16, np.float32)
  emul.lib.emul_set_device(0)
  assert emul.lib.ncclSend(x.ctypes.data, 16, F32, 1, *comms[0]) == SUCCESS
  emul.lib.emul_set_device(1)
  assert emul.lib.ncclRecv(y.ctypes.data, 8, F32, 0, *comms[1]) == SUCCESS
  emul.sync(comms)
  assert [emul.async_error(c) for c, _ in comms] == [INVALID_USAGE] * 2
  found = emul.findings()
  assert "ncclRecv(count 8, ncclFloat32, peer 0)" in found
  assert "ncclSend(count 16, ncclFloat32, peer 1)" in found
  assert (y == 0).all()


# ---- datatypes and reductions -----------------------------------------------------------------


def _reference(xs: list[np.ndarray], red: int, dt) -> np.ndarray:
  """NCCL's result: fold in rank order, rounding to the datatype after every step."""
  n = len(xs)
  if np.issubdtype(dt, np.integer):
    acc = xs[0].astype(np.int64 if np.dtype(dt).kind == "i" else np.uint64)
    with np.errstate(over="ignore"):
      for x in xs[1:]:
        x = x.astype(acc.dtype)
        acc = {
          SUM: acc + x,
          AVG: acc + x,
          PROD: acc * x,
          MAX: np.maximum(acc, x),
          MIN: np.minimum(acc, x),
        }[red]
        acc = acc.astype(dt).astype(acc.dtype)  # wraps as the datatype does
    if red == AVG:
      v = acc.astype(dt).astype(object)
      return np.array([int(a) // n if a >= 0 else -(-int(a) // n) for a in v], dt)  # toward 0
    return acc.astype(dt)
  f = [x.astype(np.float64) for x in xs]

  def rnd(v):
    with np.errstate(over="ignore"):  # fp16 products overflow to inf, as in NCCL
      return v.astype(dt).astype(np.float64)

  if red == AVG:
    s = float(rnd(np.array(1.0 / n)))
    f = [rnd(v * s) for v in f]
  acc = f[0]
  for x in f[1:]:
    acc = {
      SUM: lambda: rnd(acc + x),
      AVG: lambda: rnd(acc + x),
      PROD: lambda: rnd(acc * x),
      MAX: lambda: np.fmax(acc, x),
      MIN: lambda: np.fmin(acc, x),
    }[red]()
  return acc.astype(dt)


def _inputs(t: int, n: int, count: int) -> list[np.ndarray]:
  rng = np.random.default_rng(t)
  dt = DTYPES[t]
  if np.issubdtype(dt, np.integer):
    info = np.iinfo(dt)
    return [rng.integers(info.min, info.max, count, dtype=dt, endpoint=True) for _ in range(n)]
  # Ranges whose sums and products stay finite (ml_dtypes' fp8 overflow differs from CUDA's).
  scale = {10: 4.0, 11: 4.0}.get(t, 100.0)
  return [(rng.standard_normal(count) * scale).astype(dt) for _ in range(n)]


def test_nccl_emul_every_dtype_and_reduction_as_nccl(emul):
  n, count = 3, 64
  comms = emul.comms(n)
  for t, dt in DTYPES.items():
    for red in (SUM, PROD, MAX, MIN, AVG):
      xs = _inputs(t, n, count)
      outs = [np.zeros(count, dt) for _ in range(n)]
      for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
        emul.lib.emul_set_device(r)
        assert emul.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, count, t, red, c, s) == 0
      emul.sync(comms)
      want = _reference(xs, red, dt)
      for o in outs:
        np.testing.assert_array_equal(
          o.view(np.uint8), want.view(np.uint8), err_msg=f"dtype {t} red {red}"
        )
  assert [emul.async_error(c) for c, _ in comms] == [SUCCESS] * n
  assert emul.findings() == ""


def test_nccl_emul_fp16_sum_rounds_every_step(emul):
  # 2048 + 1 + 1 in fp16: each step rounds to 2048 (ulp 2 there, ties to even); a float32
  # sum rounded once would give 2050.
  comms = emul.comms(3)
  xs = [np.array([2048.0], np.float16), np.ones(1, np.float16), np.ones(1, np.float16)]
  outs = [np.zeros(1, np.float16) for _ in range(3)]
  for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
    emul.lib.emul_set_device(r)
    assert emul.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 1, F16, SUM, c, s) == 0
  emul.sync(comms)
  assert [float(o[0]) for o in outs] == [2048.0] * 3


def test_nccl_emul_premulsum_and_the_other_collectives(emul):
  n, count = 2, 8
  comms = emul.comms(n)
  scalars = [np.array([0.5], np.float32), np.array([4.0], np.float32)]
  ops = []
  for r, (c, _) in enumerate(comms):
    op = ctypes.c_int()
    residence = r  # rank 0's scalar is read at run time (device), rank 1's now (host)
    assert (
      emul.lib.ncclRedOpCreatePreMulSum(ctypes.byref(op), scalars[r].ctypes.data, F32, residence, c)
      == SUCCESS
    )
    ops.append(op.value)
  assert ops == [5, 5]
  scalars[0][0], scalars[1][0] = 2.0, 8.0  # read at run time (device) / at creation (host)
  xs = [np.arange(count, dtype=np.float32) + r for r in range(n)]
  got = {k: [np.zeros(count * (n if k in ("ag", "a2a") else 1), np.float32) for _ in range(n)]
         for k in ("pms", "ag", "a2a", "bc", "red")}  # fmt: skip
  got["rs"] = [np.zeros(count // n, np.float32) for _ in range(n)]
  a2a_in = [np.arange(count * n, dtype=np.float32) + 100 * r for r in range(n)]
  inplace = [x.copy() for x in xs]
  for r, ((c, s), x) in enumerate(zip(comms, xs)):
    emul.lib.emul_set_device(r)
    L = emul.lib
    assert L.ncclAllReduce(x.ctypes.data, got["pms"][r].ctypes.data, count, F32, ops[r], c, s) == 0
    assert L.ncclAllGather(x.ctypes.data, got["ag"][r].ctypes.data, count, F32, c, s) == 0
    assert L.ncclAlltoAll(a2a_in[r].ctypes.data, got["a2a"][r].ctypes.data, count, F32, c, s) == 0
    assert L.ncclBroadcast(x.ctypes.data, got["bc"][r].ctypes.data, count, F32, 1, c, s) == 0
    assert L.ncclReduce(x.ctypes.data, got["red"][r].ctypes.data, count, F32, MAX, 0, c, s) == 0
    assert (
      L.ncclReduceScatter(x.ctypes.data, got["rs"][r].ctypes.data, count // n, F32, SUM, c, s) == 0
    )
    p = inplace[r].ctypes.data
    assert L.ncclAllReduce(p, p, count, F32, SUM, c, s) == 0  # in place
  emul.sync(comms)
  for r in range(n):
    np.testing.assert_array_equal(got["pms"][r], xs[0] * 2.0 + xs[1] * 4.0)
    np.testing.assert_array_equal(got["ag"][r], np.concatenate(xs))
    np.testing.assert_array_equal(
      got["a2a"][r], np.concatenate([a[r * count : (r + 1) * count] for a in a2a_in])
    )
    np.testing.assert_array_equal(got["bc"][r], xs[1])
    np.testing.assert_array_equal(inplace[r], xs[0] + xs[1])
    np.testing.assert_array_equal(
      got["rs"][r], (xs[0] + xs[1])[r * count // n : (r + 1) * count // n]
    )
  np.testing.assert_array_equal(got["red"][0], np.maximum(xs[0], xs[1]))
  assert (got["red"][1] == 0).all()  # only the root receives
  for r, (c, _) in enumerate(comms):
    assert emul.lib.ncclRedOpDestroy(ops[r], c) == SUCCESS
    assert emul.lib.ncclRedOpDestroy(ops[r], c) == INVALID_ARG
  emul.lib.emul_set_device(0)
  x = xs[0]
  assert emul.lib.ncclAllReduce(x.ctypes.data, x.ctypes.data, count, F32, ops[0], *comms[0]) == 4
  assert emul.lib.ncclAllReduce(x.ctypes.data, x.ctypes.data, count, 12, SUM, *comms[0]) == 4
  assert emul.findings().count("invalid argument") == 2


# ---- groups -----------------------------------------------------------------------------------


def test_nccl_emul_error_inside_a_group_is_returned_by_its_end_and_closes_it(emul):
  comms = emul.comms(2)
  x, o = np.ones(4, np.float32), np.zeros(4, np.float32)
  c, s = comms[0]
  emul.lib.emul_set_device(0)
  assert emul.lib.ncclGroupStart() == SUCCESS and emul.lib.ncclGroupStart() == SUCCESS
  assert emul.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 4, F32, SUM, c, s) == SUCCESS
  assert emul.lib.ncclSend(x.ctypes.data, 4, F32, 7, c, s) == INVALID_ARG  # no rank 7
  assert emul.lib.ncclGroupEnd() == SUCCESS  # inner end
  assert emul.lib.emul_group_depth() == 1
  assert emul.lib.ncclGroupEnd() == INVALID_ARG  # the outermost end returns the error
  assert emul.lib.emul_group_depth() == 0
  emul.lib.emul_sync(s)
  assert (o == 0).all() and emul.async_error(c) == SUCCESS  # the group's calls were dropped
  # The next group starts clean.
  outs = _all_reduce(emul, comms, [4, 4])
  assert all((v == 2).all() for v in outs)


def test_nccl_emul_group_mixing_blocking_and_nonblocking_is_invalid_usage_and_closed(emul):
  blocking, nonblocking = emul.comms(1), emul.comms(1, blocking=0)
  x, o = np.ones(4, np.float32), np.zeros(4, np.float32)
  emul.lib.emul_set_device(0)
  assert emul.lib.ncclGroupStart() == SUCCESS
  for c, s in (blocking[0], nonblocking[0]):
    assert emul.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 4, F32, SUM, c, s) == SUCCESS
  assert emul.lib.ncclGroupEnd() == INVALID_USAGE
  assert emul.lib.emul_group_depth() == 0
  assert "mixes blocking and nonblocking" in emul.findings()
  assert emul.async_error(nonblocking[0][0]) == SUCCESS


# ---- nonblocking communicators and split ------------------------------------------------------


def test_nccl_emul_nonblocking_init_and_calls_are_in_progress_until_done(emul):
  n = 2
  uid = UniqueId()
  emul.lib.ncclGetUniqueId(ctypes.byref(uid))
  cfg = Config.make(0)
  comms = []
  for r in range(n):
    emul.lib.emul_set_device(r)
    c = ctypes.c_void_p()
    assert emul.lib.ncclCommInitRankConfig(ctypes.byref(c), n, uid, r, ctypes.byref(cfg)) == 7
    comms.append((c.value, emul.stream(r)))
  assert emul.async_error(comms[0][0]) == IN_PROGRESS
  count = ctypes.c_int()
  assert emul.lib.ncclCommCount(comms[0][0], ctypes.byref(count)) == INVALID_ARG  # in progress
  x, o = np.ones(4, np.float32), np.zeros(4, np.float32)
  emul.lib.emul_set_device(0)
  assert emul.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 4, F32, SUM, *comms[0]) == 4
  assert "still in progress" in emul.findings()
  for c, _ in comms:
    emul.ready(c)
  outs = [np.zeros(4, np.float32) for _ in range(n)]
  for r, (c, s) in enumerate(comms):
    emul.lib.emul_set_device(r)
    assert emul.lib.ncclAllReduce(x.ctypes.data, outs[r].ctypes.data, 4, F32, SUM, c, s) == 7
  assert emul.async_error(comms[0][0]) == IN_PROGRESS
  for c, _ in comms:
    emul.ready(c)
  emul.sync(comms)
  assert all((v == 2).all() for v in outs) and emul.findings() == ""


@pytest.mark.parametrize("blocking", [1, 0], ids=["blocking", "nonblocking"])
def test_nccl_emul_split_inside_a_group_as_xla_does(emul, blocking):
  n = 4
  parents = emul.comms(n, blocking=blocking)
  cfg = Config.make(blocking)
  kids = [ctypes.c_void_p() for _ in range(n)]
  assert emul.lib.ncclGroupStart() == SUCCESS
  for r, (c, _) in enumerate(parents):
    emul.lib.emul_set_device(r)
    color = NOCOLOR if r == 3 else r % 2  # {0, 2}, {1}, and rank 3 in none
    assert emul.lib.ncclCommSplit(c, color, -r, ctypes.byref(kids[r]), ctypes.byref(cfg)) == 0
  assert emul.lib.ncclGroupEnd() == (SUCCESS if blocking else IN_PROGRESS)
  assert kids[3].value is None
  for k in kids[:3]:
    emul.ready(k.value)
  ranks, sizes = [], []
  for k in kids[:3]:
    v = ctypes.c_int()
    assert emul.lib.ncclCommUserRank(k, ctypes.byref(v)) == SUCCESS
    ranks.append(v.value)
    assert emul.lib.ncclCommCount(k, ctypes.byref(v)) == SUCCESS
    sizes.append(v.value)
  assert ranks == [1, 0, 0] and sizes == [2, 1, 2]  # key -r: rank 2 comes first in {0, 2}
  comms = [(kids[0].value, parents[0][1]), (kids[2].value, parents[2][1])]
  xs = [np.full(4, 1.0, np.float32), np.full(4, 10.0, np.float32)]
  outs = [np.zeros(8, np.float32) for _ in range(2)]
  for (c, s), x, o, dev in zip(comms, xs, outs, (0, 2)):
    emul.lib.emul_set_device(dev)
    assert emul.lib.ncclAllGather(x.ctypes.data, o.ctypes.data, 4, F32, c, s) in (0, 7)
  for c, _ in comms:
    emul.ready(c)
  emul.sync(comms)
  for o in outs:
    np.testing.assert_array_equal(o, np.concatenate([xs[1], xs[0]]))  # new rank order


# ---- abort and use after free -----------------------------------------------------------------


def test_nccl_emul_abort_from_another_thread_ends_a_waiting_call(emul):
  (c0, _), (c1, _) = emul.comms(2)
  kid = ctypes.c_void_p()
  result = []
  emul.lib.emul_set_device(0)
  # Rank 0's blocking split waits for rank 1, which never comes.
  t = threading.Thread(
    target=lambda: result.append(emul.lib.ncclCommSplit(c0, 0, 0, ctypes.byref(kid), None))
  )
  t.start()
  time.sleep(0.1)
  assert result == []  # still waiting
  assert emul.lib.ncclCommAbort(c0) == SUCCESS
  t.join(timeout=2)
  assert result == [SYSTEM]
  before = emul.lib.emul_misuse()
  err = ctypes.c_int()
  assert emul.lib.ncclCommGetAsyncError(c0, ctypes.byref(err)) == INVALID_ARG
  assert emul.lib.ncclCommDestroy(c1) == SUCCESS
  assert emul.lib.ncclCommDestroy(c1) == INVALID_ARG
  assert emul.lib.emul_misuse() == before + 2
  found = emul.findings()
  assert "ncclCommGetAsyncError on a communicator after its ncclCommAbort" in found
  assert "ncclCommDestroy on a communicator after its ncclCommDestroy" in found


# ---- graph capture and vector alignment in the host shim --------------------------------------


def _capture_setup(emul):
  L = emul.lib
  vp = ctypes.c_void_p
  L.emul_event.restype = vp
  L.emul_record.argtypes = [vp, vp]
  L.emul_wait.argtypes = [vp, vp]
  L.emul_begin_capture.argtypes = [vp]
  L.emul_end_capture.argtypes = [vp, ctypes.POINTER(vp)]
  L.emul_graph_launch.argtypes = [vp, vp]
  L.emul_copy.argtypes = [vp, vp, ctypes.c_size_t, vp]
  return L


def test_nccl_emul_captured_collective_runs_at_each_replay_not_at_capture(emul):
  L = _capture_setup(emul)
  n, count = 2, 16
  comms = emul.comms(n)
  src = [np.full(count, r + 1.0, np.float32) for r in range(n)]
  x = [np.zeros(count, np.float32) for _ in range(n)]
  o = [np.zeros(count, np.float32) for _ in range(n)]
  execs = []
  for r, (c, s) in enumerate(comms):
    L.emul_set_device(r)
    assert L.emul_begin_capture(s) == 0
    assert L.emul_copy(x[r].ctypes.data, src[r].ctypes.data, count * 4, s) == 0
    assert L.ncclAllReduce(x[r].ctypes.data, o[r].ctypes.data, count, F32, SUM, c, s) == 0
    g = ctypes.c_void_p()
    assert L.emul_end_capture(s, ctypes.byref(g)) == 0
    execs.append(g.value)
  emul.sync(comms)
  assert all((v == 0).all() for v in x + o)  # recorded, not run
  for replay in (1, 2):
    for r, (_, s) in enumerate(comms):
      src[r][:] = replay * (r + 1)
      L.emul_set_device(r)
      assert L.emul_graph_launch(execs[r], s) == 0
    emul.sync(comms)
    assert all((v == 3 * replay).all() for v in o)
  assert [emul.async_error(c) for c, _ in comms] == [SUCCESS] * n


def test_nccl_emul_capture_with_an_unjoined_side_stream_fails(emul):
  L = _capture_setup(emul)
  L.emul_set_device(0)
  origin, side = emul.stream(0), L.emul_stream()
  a, b = np.ones(4, np.float32), np.zeros(4, np.float32)
  for join in (False, True):
    fork, back = L.emul_event(), L.emul_event()
    assert L.emul_begin_capture(origin) == 0
    assert L.emul_record(fork, origin) == 0 and L.emul_wait(side, fork) == 0  # fork
    assert L.emul_copy(b.ctypes.data, a.ctypes.data, 16, side) == 0
    if join:
      assert L.emul_record(back, side) == 0 and L.emul_wait(origin, back) == 0
    g = ctypes.c_void_p()
    assert L.emul_end_capture(origin, ctypes.byref(g)) == (0 if join else 904)
    assert "never joined back" in emul.findings() or join
  L.emul_sync(origin)
  L.emul_sync(side)
  assert (b == 0).all()  # captured work never ran eagerly
  assert L.emul_graph_launch(g.value, origin) == 0
  L.emul_sync(origin)
  assert (b == 1).all()  # the origin's end waited for the joined side stream


@pytest.mark.parametrize("kind,align", [(0, 16), (1, 8), (2, 16)], ids=["float4", "uint2", "store"])
def test_nccl_emul_shim_faults_misaligned_vector_access(emul, kind, align):
  emul.lib.emul_vector_access.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_char_p),
  ]
  buf = np.zeros(64, np.uint8)
  base = buf.ctypes.data + (-buf.ctypes.data) % 16
  why = ctypes.c_char_p()
  assert emul.lib.emul_vector_access(kind, base, ctypes.byref(why)) == 0
  assert emul.lib.emul_vector_access(kind, base + align // 2, ctypes.byref(why)) == 716
  assert b"misaligned address" in why.value and f"{align}-byte".encode() in why.value


# ---- XLA's call patterns (cuda/nccl_interposer/test/xla_patterns.cc) ----------------------------


def _patterns(built, lib: Path, n: int, blocking: int, out: Path, policy: str | None = None):
  """Runs the driver; {pattern: {device: (input bytes, output bytes)}}, checking every call
  succeeded and the emulation found nothing."""
  import os
  import subprocess

  out.mkdir(parents=True, exist_ok=True)
  env = {**os.environ, "JCOCCL_NCCL_REAL": str(built.emul)}
  env.pop("JCOCCL_NCCL_POLICY", None)
  if policy:
    env["JCOCCL_NCCL_POLICY"] = policy
  r = subprocess.run(
    [str(built.patterns), str(lib), str(n), str(blocking), str(out)],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
  )
  assert r.returncode == 0 and r.stdout.endswith("done\n"), r.stdout + r.stderr
  lines = r.stdout.splitlines()
  assert not [line for line in lines if line.startswith("finding")], r.stdout
  results = [line for line in lines if " result " in line]
  assert len(results) == n * 21 and all(line.endswith(" result 0") for line in results), r.stdout
  got: dict[str, dict[int, tuple[bytes, bytes]]] = {}
  for f in sorted(out.glob("*.out")):
    name, dev = f.name[: -len(".out")].rsplit(".d", 1)
    got.setdefault(name, {})[int(dev)] = (f.with_suffix(".in").read_bytes(), f.read_bytes())
  return got


def _f32(b: bytes) -> np.ndarray:
  return np.frombuffer(b, np.float32)


@pytest.fixture(scope="module")
def patterns_ref(tmp_path_factory):
  """The driver on the emulation alone, 4 ranks, blocking."""
  built = emul_build.build()
  return built, _patterns(built, built.emul, 4, 1, tmp_path_factory.mktemp("ref"))


def test_nccl_emul_xla_patterns_without_the_interposer_are_nccl_semantics(patterns_ref):
  _, got = patterns_ref
  n = 4
  rank = {d: n - 1 - d for d in range(n)}  # the clique communicator reverses the order
  by_rank = lambda name: [got[name][d] for d in sorted(range(n), key=rank.get)]
  ins = [_f32(i) for i, _ in by_rank("all_reduce_f32_x2")]
  acc = ins[0].copy()
  for x in ins[1:]:
    acc = acc + x  # float32, in rank order
  for _, o in by_rank("all_reduce_f32_x2"):
    np.testing.assert_array_equal(_f32(o), acc)
  gathered = b"".join(i for i, _ in by_rank("all_gather_s16"))
  assert all(o == gathered for _, o in by_rank("all_gather_s16"))  # NaN patterns kept
  a2a = [np.frombuffer(i, np.uint16).reshape(n, 64) for i, _ in by_rank("all_to_all_u16")]
  for r, (_, o) in enumerate(by_rank("all_to_all_u16")):
    np.testing.assert_array_equal(np.frombuffer(o, np.uint16).reshape(n, 64), [a[r] for a in a2a])
  perm = by_rank("collective_permute_s16")
  for r in range(n):
    assert perm[r][1] == perm[(r - 1) % n][0]
  pair = by_rank("collective_permute_f32_pair")
  assert pair[1][1] == pair[0][0] and set(pair[2][1]) == {0xEE}  # rank 2 took no part
  assert by_rank("send_recv_f32")[n - 1][1] == by_rank("send_recv_f32")[0][0]
  assert all(o == by_rank("broadcast_f32")[0][0] for _, o in by_rank("broadcast_f32"))
  pairs = got["pair_all_reduce_f32"]
  np.testing.assert_array_equal(_f32(pairs[2][1]), _f32(pairs[2][0]) + _f32(pairs[3][0]))


@pytest.mark.parametrize("blocking", [1, 0], ids=["blocking", "nonblocking"])
def test_nccl_emul_xla_patterns_through_the_interposer(patterns_ref, tmp_path, blocking):
  # Forwarded calls (no policy: all of them) are bit-identical to the emulation alone; with an
  # int8 one_shot all-reduce rule the float32 sums are taken, within the codec's bound, and
  # everything else (bf16/prod/integer reductions, S16 all-gathers sent as float16, ...) is
  # still bit-identical.
  from jcoccl import compressors as jc
  from jcoccl._src.engine import nccl_interposer as ni

  built, ref = patterns_ref
  got = _patterns(built, built.interposer, 4, blocking, tmp_path / "fwd")
  assert got == ref
  comp = jc.int8(block_size=32)
  rules = [
    ni.Rule("t", 0, "all_reduce", ("float32",), 0, "one_shot", 1, str(comp), ni.codec_fields(comp)),
    # float16 included: XLA's S16 all-gathers come as float16 and must still be forwarded.
    ni.Rule("t", 0, "all_gather", ni.DTYPES, 0, "auto", 1, str(comp), ni.codec_fields(comp)),
  ]  # fmt: skip
  policy = ni.write_rules(rules, str(tmp_path / "policy.rules"))
  got = _patterns(built, built.interposer, 4, blocking, tmp_path / "taken", policy)
  # Taken: the float32 sums, as (first, end) element ranges of one call each.
  taken = {
    "all_reduce_f32_x2": [(0, 1000), (1000, 1300)],
    "all_reduce_c64_sum": [(0, 256)],
    "pair_all_reduce_f32": [(0, 1000)],
    "all_reduce_f32_bf16": [(0, 400)],  # its bfloat16 half is forwarded
  }
  for name in ref:
    if name not in taken and name != "all_gather_f32":
      assert got[name] == ref[name], name
  # The float32 all-gather is taken: each block within the bound of its rank's input.
  by_rank = [_f32(ref["all_gather_f32"][d][0]) for d in (3, 2, 1, 0)]
  for d in range(4):
    o = _f32(got["all_gather_f32"][d][1]).reshape(4, -1)
    for r, x in enumerate(by_rank):
      assert (np.abs(o[r] - x) <= np.asarray(comp.error_bound(x))).all()
  for name, calls in taken.items():
    groups = [[0, 1], [2, 3]] if name == "pair_all_reduce_f32" else [[0, 1, 2, 3]]
    for g in groups:
      outs = [got[name][d][1] for d in g]
      assert all(o == outs[0] for o in outs), name  # every rank alike
      for a, b in calls:
        xs = [_f32(ref[name][d][0])[a:b] for d in g]
        exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
        bound = sum(np.asarray(comp.error_bound(x), np.float64) for x in xs)
        bound += 1e-6 * np.sum(np.abs(np.stack(xs)), axis=0)  # float32 summation
        assert (np.abs(_f32(outs[0])[a:b] - exact) <= bound).all(), name
      rest = 4 * calls[-1][1]
      assert outs[0][rest:] == ref[name][g[0]][1][rest:], name
  assert got["all_reduce_f32_x2"] != ref["all_reduce_f32_x2"]  # it was compressed


@pytest.mark.parametrize("n,alone_blocking", [(2, 0), (3, 1)])
def test_nccl_emul_xla_patterns_on_fewer_ranks_forward_bit_identical(
  patterns_ref, tmp_path, n, alone_blocking
):
  # 3 ranks: one rank in no pair (NCCL_SPLIT_NOCOLOR). The emulation alone in one mode vs
  # through the interposer with no policy in the other: the same bits (each mode, each way).
  built, _ = patterns_ref
  alone = _patterns(built, built.emul, n, alone_blocking, tmp_path / "alone")
  assert _patterns(built, built.interposer, n, 1 - alone_blocking, tmp_path / "via") == alone


# ---- seeded bugs that only the strict emulation catches -----------------------------------------


class _DropIn:
  """A mutant libjcoccl_nccl.so (emul_build MUTATIONS behind jcn_test_mutation) in front of an
  NCCL emulation, both loaded into this process. Also run by hand against cdd5d83's lenient
  emulation (see the test below), so it uses only the controls both emulations export."""

  def __init__(self, emul: Path, interposer: Path):
    import os

    old = os.environ.get("JCOCCL_NCCL_REAL")
    os.environ["JCOCCL_NCCL_REAL"] = str(emul)  # read once, when the library loads
    try:
      self.emul = ctypes.CDLL(str(emul), mode=ctypes.RTLD_LOCAL)
      self.lib = lib = ctypes.CDLL(str(interposer), mode=ctypes.RTLD_LOCAL)
    finally:
      os.environ.pop("JCOCCL_NCCL_REAL") if old is None else os.environ.update(JCOCCL_NCCL_REAL=old)
    vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lib.ncclAllReduce.argtypes = [vp, vp, sz, i32, i32, vp, vp]
    lib.ncclAllGather.argtypes = [vp, vp, sz, i32, vp, vp]
    lib.ncclCommInitRankConfig.argtypes = [
      ctypes.POINTER(vp), i32, UniqueId, i32, ctypes.POINTER(Config)
    ]  # fmt: skip
    lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(i32)]
    lib.ncclCommAbort.argtypes = [vp]
    lib.jcoccl_nccl_load_policy.argtypes = [ctypes.c_char_p]
    e = self.emul
    e.emul_stream.restype = vp
    e.emul_sync.argtypes = [vp]
    e.emul_findings.restype = ctypes.c_char_p
    e.emul_begin_capture.argtypes = [vp]
    e.emul_end_capture.argtypes = [vp, ctypes.POINTER(vp)]
    e.emul_graph_launch.argtypes = [vp, vp]
    self.streams = {d: self._stream(d) for d in range(2)}

  def _stream(self, device: int) -> int:
    self.emul.emul_set_device(device)
    return self.emul.emul_stream()

  def mutation(self, bug: str | None) -> None:
    ctypes.c_int.in_dll(self.lib, "jcn_test_mutation").value = emul_build.MUTATION_IDS.get(bug, 0)

  def policy(self, op: str | None, path: Path, algorithm: str = "auto") -> None:
    """One int8 rule for `op` (every dtype), or none."""
    from jcoccl import compressors as jc
    from jcoccl._src.engine import nccl_interposer as ni

    if op is None:
      self.lib.jcoccl_nccl_load_policy(None)
      return
    comp = jc.int8(block_size=32)
    rule = ni.Rule("t", 0, op, ni.DTYPES, 0, algorithm, 1, str(comp), ni.codec_fields(comp))
    self.lib.jcoccl_nccl_load_policy(ni.write_rules([rule], str(path)).encode())

  def state(self, comm: int) -> int:
    err = ctypes.c_int(-1)
    self.lib.ncclCommGetAsyncError(comm, ctypes.byref(err))
    return err.value

  def comms(self, blocking: int = 1) -> list[tuple[int, int]]:
    """Two ranks (devices 0 and 1), made in one group, ready for use."""
    uid = UniqueId()
    self.lib.ncclGetUniqueId(ctypes.byref(uid))
    cfg = Config.make(blocking)
    out = []
    self.lib.ncclGroupStart()
    for r in range(2):
      self.emul.emul_set_device(r)
      c = ctypes.c_void_p()
      self.lib.ncclCommInitRankConfig(ctypes.byref(c), 2, uid, r, ctypes.byref(cfg))
      out.append((c.value, self.streams[r]))
    self.lib.ncclGroupEnd()
    self.ready(out)
    return out

  def ready(self, comms) -> None:
    t = time.monotonic()
    while any(self.state(c) == IN_PROGRESS for c, _ in comms):
      assert time.monotonic() - t < 10, "still in progress"
      time.sleep(0.002)


# The seeded bugs (emul_build.MUTATIONS) and what the strict emulation shows of each. The same
# scenarios run against cdd5d83's lenient emulation and host shim (the mutant interposer built
# against that shim; the controls it lacked exported as it had them: ncclCommInitRankConfig
# as ncclCommInitRank, a capture as the stream's `capturing` flag) looked right every time:
#   bug                          strict emulation                              lenient
#   count_padded_on_one_rank     ranks disagree on collective #0 (count 1024   missed
#                                vs 1025): ncclInvalidUsage on both, finding
#   in_progress_comm_used        ncclAllGather on a communicator still in      missed
#                                progress: ncclInvalidArgument, finding
#   host_wait_for_previous_call  the capture is invalidated (901); the call    missed
#                                fails with ncclInternalError
#   unaligned_input_not_staged   misaligned float4 load (the GPU faults):      missed
#                                finding
#   in_progress_taken_as_done    the two_shot all-gather on a communicator     missed
#                                still in progress: ncclInvalidArgument
# Two more were dropped: one rank forwarding what the other takes over, and a taken float16
# all-gather; the lenient emulation shows both as wrong results.
SEEDED = {
  "count_padded_on_one_rank": "the ranks disagree on collective #0",
  "in_progress_comm_used": "still in progress",
  "host_wait_for_previous_call": "the capture failed (901)",
  "unaligned_input_not_staged": "misaligned address: float4 load",
  "in_progress_taken_as_done": "still in progress",
}


def _seeded_run(h: _DropIn, bug: str, tmp: Path) -> list[str]:
  """The scenario that shows `bug` (run with the mutation on or off): 2 ranks, one float32
  all-reduce each, taken over by an int8 rule (forwarded for count_padded_on_one_rank).
  Returns what went wrong, as the emulation and the results tell; [] when all looks right."""
  taken = bug != "count_padded_on_one_rank"
  # two_shot: an all-to-all, then an all-gather, on the communicator
  algorithm = "two_shot" if bug == "in_progress_taken_as_done" else "auto"
  h.policy("all_reduce" if taken else None, tmp / f"{bug}.rules", algorithm)
  # A nonblocking communicator stays in progress this long after its init and each group end:
  # a call issued on it meanwhile (at once, in the seeded bugs) is refused, whatever the load.
  delay = h.emul.emul_set_nonblocking_delay_ms(100)
  comms = []
  try:
    comms = h.comms(blocking=0 if bug.startswith("in_progress") else 1)
    return _seeded_calls(h, bug, comms, taken)
  finally:
    h.emul.emul_set_nonblocking_delay_ms(delay)
    for c, _ in comms:
      h.lib.ncclCommAbort(c)


def _seeded_calls(h: _DropIn, bug: str, comms, taken: bool) -> list[str]:
  from jcoccl import compressors as jc

  n, count = 2, 1024
  shift = 1 if bug == "unaligned_input_not_staged" else 0  # buffers 4 bytes past alignment
  xs = [np.linspace(-1, 1, count + 16, dtype=np.float32) * (r + 1) for r in range(n)]
  outs = [np.zeros(count + 16, np.float32) for _ in range(n)]  # slack past the call's end
  capture = bug == "host_wait_for_previous_call"
  grouped = bug == "in_progress_comm_used"
  problems, codes = [], []
  if grouped:
    h.lib.ncclGroupStart()
  for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
    h.emul.emul_set_device(r)
    if capture:
      h.emul.emul_begin_capture(s)
    px, po = x.ctypes.data + 4 * shift, o.ctypes.data + 4 * shift
    codes.append(h.lib.ncclAllReduce(px, po, count, F32, SUM, c, s))
    if capture:
      g = ctypes.c_void_p()
      if (e := h.emul.emul_end_capture(s, ctypes.byref(g))) != 0:
        problems.append(f"rank {r}: the capture failed ({e})")
      elif h.emul.emul_graph_launch(g, s) != 0:
        problems.append(f"rank {r}: the graph launch failed")
  if grouped:  # a forwarded call too: the real group end then answers ncclInProgress
    bs = [np.full(8, r, np.int8) for r in range(n)]
    gathered = [np.zeros(8 * n, np.int8) for _ in range(n)]
    for r, ((c, s), b, o) in enumerate(zip(comms, bs, gathered)):
      h.emul.emul_set_device(r)
      codes.append(h.lib.ncclAllGather(b.ctypes.data, o.ctypes.data, 8, 0, c, s))
    codes.append(h.lib.ncclGroupEnd())
  h.ready(comms)
  for _, s in comms:
    h.emul.emul_sync(s)
  if grouped:
    problems += [f"rank {r}: the int8 all-gather is wrong" for r, o in enumerate(gathered)
                 if not np.array_equal(o, np.concatenate(bs))]  # fmt: skip
  problems += [f"call {i} returned {c}" for i, c in enumerate(codes) if c not in (0, IN_PROGRESS)]
  problems += [f"rank {r}: asynchronous error {e}" for r, (c, _) in enumerate(comms)
               if (e := h.state(c)) != SUCCESS]  # fmt: skip
  problems += [f"finding: {f}" for f in h.emul.emul_findings().decode().splitlines()]
  part = slice(shift, shift + count)
  exact = xs[0][part] + xs[1][part]  # float32: both emulations add in rank order
  got = [o[part] for o in outs]
  if not taken:
    problems += [
      f"rank {r}: not the sum" for r, g in enumerate(got) if not np.array_equal(g, exact)
    ]
  else:
    bound = sum(np.asarray(jc.int8(block_size=32).error_bound(x[part])) for x in xs)
    problems += [f"rank {r}: out of the codec's bound" for r, g in enumerate(got)
                 if not (np.abs(g - exact) <= 1.0001 * bound).all()]  # fmt: skip
    problems += ["the ranks' results differ"] * (not np.array_equal(got[0], got[1]))
  return problems


@pytest.fixture(scope="module")
def drop_in() -> _DropIn:
  built = emul_build.build()
  h = _DropIn(built.emul, emul_build.build(mutants=True).interposer)
  # A peer that never comes fails in 5 s, not 60 (no run waits for one: a rank's call may
  # wait for its peer's while the host still issues rank 0's, 100 ms per nonblocking step).
  old = h.emul.emul_set_timeout_ms(5000)
  yield h
  h.emul.emul_set_timeout_ms(old)
  h.mutation(None)


@pytest.mark.parametrize("bug", SEEDED)
def test_nccl_emul_catches_seeded_bugs_the_lenient_emulation_missed(drop_in, tmp_path, bug):
  # The scenario passes with the mutation off and fails with it on, as the table above says.
  drop_in.mutation(None)
  assert _seeded_run(drop_in, bug, tmp_path) == []
  drop_in.mutation(bug)
  try:
    problems = _seeded_run(drop_in, bug, tmp_path)
  finally:
    drop_in.mutation(None)
  assert any(SEEDED[bug] in p for p in problems), problems
