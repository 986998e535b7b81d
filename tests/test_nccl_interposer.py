"""libjcoccl_nccl.so on the CPU: the interposer built against the NCCL emulation and the host
shim (cuda/nccl_interposer/test/emul_build.py), driven in-process over ctypes as NCCL's
callers drive it, and once as XLA's CUDA plugin loads it (a C++ program, in a subprocess).

Checked: every NCCL entry point of the pinned headers and of the plugin's strings is
exported and forwarded; taken-over all_reduce (one_shot, two_shot), reduce_scatter and
all_gather are bit-identical to jcoccl's fused engine (the CPU build, over jcoccl.init);
forwarded calls are the emulation's own; groups, the asynchronous error, a lost peer and
stream capture behave as NCCL's; the policy and the launcher; seeded bugs are caught."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "cuda" / "nccl_interposer" / "test"))
sys.path.insert(0, str(ROOT / "tools"))
import emul_build  # noqa: E402
import gen_nccl_api  # noqa: E402
import gpu_shim  # noqa: E402

from jcoccl._src.engine import nccl_interposer as ni  # noqa: E402

pytestmark = pytest.mark.skipif(
  gpu_shim.compiler() is None or not sys.platform.startswith("linux"),
  reason="needs a C++ compiler on Linux",
)

PLUGIN_SYMBOLS = ROOT / "cuda" / "nccl_interposer" / "test" / "plugin_symbols.txt"
F32, BF16, F16, U8 = 7, 9, 6, 1  # ncclDataType_t
SUM, MAX = 0, 2  # ncclRedOp_t
SUCCESS, INTERNAL, INVALID_ARG, INVALID_USAGE, SYSTEM, IN_PROGRESS = 0, 3, 4, 5, 2, 7
COPIES, COLLECTIVES = 2, 4  # jcoccl_shim::WorkKind bits


class UniqueId(ctypes.Structure):
  _fields_ = [("internal", ctypes.c_char * 128)]  # passed by value, as ncclUniqueId is


class Config(ctypes.Structure):
  """ncclConfig_t's leading fields (the rest left at zero, as the emulation reads blocking)."""

  _fields_ = [
    ("size", ctypes.c_size_t),
    ("magic", ctypes.c_uint),
    ("version", ctypes.c_uint),
    ("blocking", ctypes.c_int),
    ("rest", ctypes.c_char * 252),
  ]


class Nccl:
  """The interposer (and the emulation behind it) loaded into this process over ctypes."""

  def __init__(self, built: emul_build.Built, lib: Path):
    os.environ["JCOCCL_NCCL_REAL"] = str(built.emul)
    os.environ.pop("JCOCCL_NCCL_POLICY", None)
    self.emul = ctypes.CDLL(str(built.emul), mode=ctypes.RTLD_LOCAL)
    self.lib = ctypes.CDLL(str(lib), mode=ctypes.RTLD_LOCAL)
    vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name in ("ncclAllReduce", "ncclReduceScatter", "pncclAllReduce"):
      getattr(self.lib, name).argtypes = [vp, vp, sz, i32, i32, vp, vp]
    for name in ("ncclAllGather", "pncclAllGather"):
      getattr(self.lib, name).argtypes = [vp, vp, sz, i32, vp, vp]
    self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i32, UniqueId, i32]
    self.lib.ncclCommInitRankConfig.argtypes = [
      ctypes.POINTER(vp),
      i32,
      UniqueId,
      i32,
      ctypes.POINTER(Config),
    ]
    self.lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(i32)]
    self.lib.ncclCommAbort.argtypes = [vp]
    self.lib.ncclCommDestroy.argtypes = [vp]
    self.lib.jcoccl_nccl_load_policy.argtypes = [ctypes.c_char_p]
    self.emul.emul_stream.restype = vp
    self.emul.emul_findings.restype = ctypes.c_char_p
    self.emul.emul_sync.argtypes = [vp]
    self.emul.emul_copy.argtypes = [vp, vp, sz, vp]
    self.emul.emul_inject.argtypes = [ctypes.c_char_p, i32]
    self.emul.emul_set_capturing.argtypes = [vp, i32]
    self.emul.ncclAllReduce.argtypes = [vp, vp, sz, i32, i32, vp, vp]
    self.emul.ncclCommInitRank.argtypes = self.lib.ncclCommInitRank.argtypes

  def comms(self, n: int, via=None) -> list[tuple[int, int]]:
    """n ranks on devices 0..n-1: [(communicator, stream)], made through ``via``."""
    via = via or self.lib
    uid = UniqueId()
    via.ncclGetUniqueId(ctypes.byref(uid))
    out = []
    for r in range(n):
      self.emul.emul_set_device(r)
      c = ctypes.c_void_p()
      assert via.ncclCommInitRank(ctypes.byref(c), n, uid, r) == SUCCESS
      out.append((c.value, self.emul.emul_stream()))
    return out

  def policy(self, rules: list[ni.Rule] | None, path: Path | None = None) -> None:
    if rules is None:
      self.lib.jcoccl_nccl_load_policy(None)
      return
    p = ni.write_rules(rules, str(path) if path else None)
    self.lib.jcoccl_nccl_load_policy(p.encode())

  def status(self) -> dict[str, str]:
    self.lib.jcoccl_nccl_status.restype = ctypes.c_char_p
    return dict(l.partition("=")[::2] for l in self.lib.jcoccl_nccl_status().decode().splitlines())

  def counters(self) -> list[dict]:
    self.lib.jcoccl_nccl_counters.restype = ctypes.c_char_p
    return ni.parse_counters(self.lib.jcoccl_nccl_counters().decode())

  def run(self, op: str, xs: list[np.ndarray], comms, fn_lib=None, dtype=F32, red=SUM, fn=None):
    """One call per rank (issued from this thread, as NCCL allows), then waits; (codes, outs)."""
    lib = fn_lib or self.lib
    n = len(xs)
    count = xs[0].size
    if op == "all_reduce":
      outs = [np.zeros_like(x) for x in xs]
    elif op == "reduce_scatter":
      count //= n
      outs = [np.zeros(count, x.dtype) for x in xs]
    else:
      outs = [np.zeros(n * count, x.dtype) for x in xs]
    codes = []
    f = getattr(
      lib,
      fn
      or {
        "all_reduce": "ncclAllReduce",
        "reduce_scatter": "ncclReduceScatter",
        "all_gather": "ncclAllGather",
      }[op],
    )
    for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
      self.emul.emul_set_device(r)
      args = (x.ctypes.data, o.ctypes.data, count, dtype)
      codes.append(f(*args, c, s) if op == "all_gather" else f(*args, red, c, s))
    for _, s in comms:
      self.emul.emul_sync(s)
    return codes, outs


@pytest.fixture(scope="module")
def built() -> emul_build.Built:
  return emul_build.build()


@pytest.fixture(scope="module")
def nccl(built) -> Nccl:
  return Nccl(built, built.interposer)


@pytest.fixture(scope="module")
def mutant(built) -> Nccl:
  return Nccl(built, emul_build.build(mutants=True).interposer)


@pytest.fixture(autouse=True)
def _reset(request):
  yield
  for name in ("nccl", "mutant"):
    if name in request.fixturenames:
      lib = request.getfixturevalue(name)
      lib.emul.emul_set_delay(0, 0)
      lib.emul.emul_inject(b"ncclSend", 0)
      lib.emul.emul_reset_group()
      lib.policy(None)


def _rule(comp, op="all_reduce", size=0, algorithm="auto", chunks=1, min_bytes=0) -> ni.Rule:
  fields = ni.codec_fields(comp)
  return ni.Rule("t", size, op, ni.DTYPES, min_bytes, algorithm, chunks, str(comp), fields)


def _bits(a) -> np.ndarray:
  return np.asarray(a).view(np.uint8).reshape(-1)


def _names_file(tmp_path: Path, names: list[str]) -> Path:
  p = tmp_path / "names.txt"
  p.write_text("\n".join(names) + "\n")
  return p


def _plugin_names() -> list[str]:
  return [
    line.strip()
    for line in PLUGIN_SYMBOLS.read_text().splitlines()
    if line.strip() and not line.startswith("#")
  ]


def _load(built, mode: str, names: Path, lib: Path, env: dict | None = None) -> str:
  e = {**os.environ, "JCOCCL_NCCL_REAL": str(built.emul), **(env or {})}
  e.pop("JCOCCL_NCCL_POLICY", None) if not env or "JCOCCL_NCCL_POLICY" not in env else None
  if mode == "preload":
    e["LD_PRELOAD"] = str(lib)
  r = subprocess.run(
    [str(built.program), mode, str(lib), str(built.emul), str(names)],
    capture_output=True,
    text=True,
    env=e,
    timeout=120,
  )
  assert r.returncode == 0, r.stdout + r.stderr
  return r.stdout


# ---- the generated API and the exported names ---------------------------------------------------


def test_nccl_interposer_generated_api_is_up_to_date():
  try:
    inc = gen_nccl_api.include_dir()
  except SystemExit:
    pytest.skip("nvidia-nccl-cu13 is not installed")
  assert gen_nccl_api.OUT.read_text() == gen_nccl_api.generate(inc), (
    "run python tools/gen_nccl_api.py"
  )


def test_nccl_interposer_generator_reads_declarations():
  d = gen_nccl_api.declarations(
    "/* c */ ncclResult_t  ncclAllReduce(const void* s,\n void* r, size_t n);\n"
    "NCCL_EXTERN_C ncclTeam_t ncclTeamCft(ncclComm_t comm, ncclCftTeamMode_t mode = X);\n"
    "typedef ncclResult_t (*ncclFn)(int);\nconst char* pncclGetErrorString(ncclResult_t r);"
  )
  assert d == {
    "ncclAllReduce": ("ncclResult_t", "const void* s, void* r, size_t n"),
    "ncclTeamCft": ("ncclTeam_t", "ncclComm_t comm, ncclCftTeamMode_t mode"),
    "pncclGetErrorString": ("const char*", "ncclResult_t r"),
  }
  assert [gen_nccl_api.kind(t) for t in ("ncclResult_t", "const char*", "int")] == ["R", "S", "V"]


def test_nccl_interposer_exports_every_generated_and_plugin_name(nccl):
  generated = re.findall(r"JCN_(?:API|TAKEN)\((p?nccl\w+)", gen_nccl_api.OUT.read_text())
  assert len(generated) > 150
  missing = [n for n in generated + _plugin_names() if not hasattr(nccl.lib, n)]
  assert missing == []


def test_nccl_interposer_exports_the_installed_plugins_names(nccl):
  import importlib.util

  try:
    spec = importlib.util.find_spec("jax_plugins.xla_cuda13")
  except ModuleNotFoundError:
    spec = None
  if spec is None or not spec.submodule_search_locations:
    pytest.skip("jax-cuda13-pjrt is not installed (the committed list is checked above)")
  so = Path(list(spec.submodule_search_locations)[0]) / "xla_cuda_plugin.so"
  names = set(re.findall(rb"\x00(p?nccl[A-Z][A-Za-z0-9]+)\x00", so.read_bytes()))
  listed = set(_plugin_names())
  # Strings that are no symbol of libnccl.so.2 (a prefix of a message) are left out.
  exported = {n.decode() for n in names if hasattr(nccl.emul, n.decode()) or n.decode() in listed}
  assert [n for n in sorted(exported) if not hasattr(nccl.lib, n)] == []


def test_nccl_interposer_loads_as_xla_does_and_forwards(built, tmp_path):
  names = _names_file(tmp_path, _plugin_names())
  for mode in ("enable", "preload"):
    out = _load(built, mode, names, built.interposer)
    assert "missing" not in out and "elsewhere" not in out, out
    assert f"checked {len(_plugin_names())}" in out
    assert "version 99999" in out  # pncclGetVersion reached the emulation
    assert "ncclAllReduce result 0 0 maxerr 0 ranks_identical 1" in out  # forwarded
    assert "pncclAllReduce result 0 0 maxerr 0 ranks_identical 1" in out
    assert "grouped_ncclAllReduce result 0 0 maxerr 0 ranks_identical 1" in out


def test_nccl_interposer_loaded_as_xla_does_takes_over_per_policy(built, tmp_path):
  from jcoccl import compressors as jc

  rules = ni.write_rules([_rule(jc.int8(block_size=32), size=2)], str(tmp_path / "p.rules"))
  out = _load(
    built,
    "enable",
    _names_file(tmp_path, ["ncclAllReduce"]),
    built.interposer,
    {"JCOCCL_NCCL_POLICY": rules},
  )
  for fn in ("ncclAllReduce", "pncclAllReduce", "grouped_ncclAllReduce"):
    m = re.search("\n" + fn + r" result 0 0 maxerr (\S+) ranks_identical 1", out)
    assert m and 0 < float(m.group(1)) < 0.05, out  # int8: close, not exact
  assert out.count("taken_calls=3") == 2, out  # each rank: every call taken over
  assert "taken_at_group_end=2" in out  # the grouped one, on each rank


# ---- taken over: bit-identical to jcoccl's fused engine ------------------------------------------


def _fused_reference(comp, dtype, chunks, x, n):
  """jcoccl's fused engine on CPU (host transport): one_shot, two_shot, reduce_scatter,
  all_gather of x ([n * 8, 44], 8 rows per rank), per rank."""
  import jax
  import jax.numpy as jnp
  from test_fused import _program

  import jcoccl
  from jcoccl._src.engine import fused_comms

  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  xs = jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, jax.P("x")))
  jcoccl.init(mesh)
  try:
    ops = ("one_shot", "two_shot", "reduce_scatter", "all_gather")
    outs = jax.block_until_ready(_program(mesh, "x", comp, "fused", chunks, ops)(xs))
  finally:
    fused_comms.shutdown()
  return {op: np.split(np.asarray(o), n) for op, o in zip(ops, outs)}


_CASES = {
  "int8_f32": ("int8", np.float32, 1),
  "int4_asym_bf16_chunks2": ("int4a", ml_dtypes.bfloat16, 2),
  "fp8_f16": ("fp8", np.float16, 1),
  "hadamard_int4_f32_chunks2": ("hadamard", np.float32, 2),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_nccl_interposer_taken_over_is_bit_identical_to_fused_engine(nccl, case):
  from jcoccl import compressors as jc

  name, dtype, chunks = _CASES[case]
  comp = {
    "int8": jc.int8(block_size=32),
    "int4a": jc.int4(block_size=32, symmetric=False),
    "fp8": jc.fp8("e4m3", block_size=32),
    "hadamard": jc.hadamard(jc.int4(block_size=32)),
  }[name]
  n = 4
  rng = np.random.default_rng(7)
  x = rng.standard_normal((n * 8, 44)).astype(np.float32)
  x[rng.random(x.shape) < 0.01] *= 300.0
  x = x.astype(dtype)
  want = _fused_reference(comp, dtype, chunks, x, n)
  per_rank = [np.ascontiguousarray(b).reshape(-1) for b in np.split(x, n)]
  code = {np.float32: F32, ml_dtypes.bfloat16: BF16, np.float16: F16}[dtype]
  got, used = {}, set()
  for algorithm, ops in (
    ("one_shot", ("all_reduce", "reduce_scatter", "all_gather")),
    ("two_shot", ("all_reduce",)),
  ):
    nccl.policy([_rule(comp, op, size=n, algorithm=algorithm, chunks=chunks) for op in ops])
    comms = nccl.comms(n)  # a communicator keeps the policy of its first call
    used |= {c for c, _ in comms}
    if dtype == np.float16:
      ops = tuple(op for op in ops if op != "all_gather")  # float16 all_gather: forwarded
    for op in ops:
      codes, outs = nccl.run(op, per_rank, comms, dtype=code)
      assert codes == [SUCCESS] * n, (op, codes)
      got[
        "one_shot"
        if op == "all_reduce" and algorithm == "one_shot"
        else "two_shot"
        if op == "all_reduce"
        else op
      ] = outs
  for op, outs in got.items():
    if op == "all_gather" and dtype == np.float16:
      continue
    for r in range(n):
      np.testing.assert_array_equal(_bits(outs[r]), _bits(want[op][r]), err_msg=f"{op} rank {r}")
  c = [d for d in nccl.counters() if "comm" in d and int(d["comm"], 16) in used]
  assert len({d["comm"] for d in c}) == 2 * n
  assert all(
    d["taken_calls"] == 1 and d["forwarded_calls"] == 0 for d in c if d["op"] != "all_gather"
  )


# ---- forwarded ------------------------------------------------------------------------------------


def test_nccl_interposer_forwards_small_messages_bit_identical_to_the_emulation(nccl):
  from jcoccl import compressors as jc

  n = 3
  rng = np.random.default_rng(1)
  xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(n)]
  nccl.policy([_rule(jc.int8(block_size=32), min_bytes=4001)])  # 4000 bytes: under
  _, got = nccl.run("all_reduce", xs, nccl.comms(n))
  _, want = nccl.run("all_reduce", xs, nccl.comms(n, via=nccl.emul), fn_lib=nccl.emul)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), _bits(w))
  c = [d for d in nccl.counters() if d.get("size") == n]
  assert c[0]["forwarded_calls"] == 1 and c[0]["taken_calls"] == 0
  assert c[0]["forwarded_bytes"] == 4000


def test_nccl_interposer_forwards_other_ops_and_dtypes_unchanged(nccl):
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  comms = nccl.comms(2)
  before = nccl.counters()[-1]["forwarded"]["other_type"]
  xs = [np.linspace(-1, 1, 64, dtype=np.float32) * (r + 1) for r in range(2)]
  # max is forwarded: the interposer returns the emulation's very answer and bits.
  got = nccl.run("all_reduce", xs, comms, red=MAX)
  ref = nccl.comms(2, via=nccl.emul)
  assert got[0] == nccl.run("all_reduce", xs, ref, fn_lib=nccl.emul, red=MAX)[0]
  _, want = nccl.run("all_reduce", xs, ref, fn_lib=nccl.emul, red=MAX)
  np.testing.assert_array_equal(_bits(got[1][0]), _bits(want[0]))
  ys = [np.ones(64, np.int8) for _ in range(2)]
  codes, outs = nccl.run("all_gather", ys, comms, dtype=0)
  assert codes == [SUCCESS] * 2 and all((o == 1).all() for o in outs)  # int8 all_gather forwarded
  assert nccl.counters()[-1]["forwarded"]["other_type"] == before + 4


def test_nccl_interposer_takes_over_grouped_calls_at_the_group_end(nccl):
  # XLA issues every collective between ncclGroupStart and ncclGroupEnd. The group's own
  # calls (here an int8 all_gather, no rule) go to the real NCCL with its ncclGroupEnd; the
  # taken-over ones run after it, with the same bits as outside a group.
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  n = 2
  comms = nccl.comms(n)
  xs = [np.linspace(-2, 2, 256, dtype=np.float32) * (r + 1) for r in range(n)]
  _, want = nccl.run("all_reduce", xs, comms)
  outs = [np.zeros(256, np.float32) for _ in range(n)]
  bs = [np.full(8, r, np.int8) for r in range(n)]
  gathered = [np.zeros(8 * n, np.int8) for _ in range(n)]
  before = nccl.counters()[-2]["grouped"]["taken_at_group_end"]
  assert nccl.lib.ncclGroupStart() == SUCCESS
  assert nccl.lib.jcoccl_nccl_group_depth() == 1
  for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
    nccl.emul.emul_set_device(r)
    assert nccl.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 256, F32, SUM, c, s) == SUCCESS
    assert nccl.lib.ncclAllGather(bs[r].ctypes.data, gathered[r].ctypes.data, 8, 0, c, s) == 0
  assert (outs[0] == 0).all()  # nothing ran yet: NCCL starts a group's calls at its end
  assert nccl.lib.ncclGroupEnd() == SUCCESS
  for _, s in comms:
    nccl.emul.emul_sync(s)
  for r in range(n):
    np.testing.assert_array_equal(_bits(outs[r]), _bits(want[0]))
    np.testing.assert_array_equal(gathered[r], np.repeat(np.arange(n, dtype=np.int8), 8))
  assert nccl.lib.jcoccl_nccl_group_depth() == 0 and nccl.emul.emul_group_depth() == 0
  assert nccl.counters()[-2]["grouped"]["taken_at_group_end"] == before + n


def test_nccl_interposer_simulated_group_runs_none_of_its_calls(nccl):
  # ncclGroupSimulateEnd ends a group whose calls NCCL only estimates: the queued takeover
  # must not run later, and the next group must start from depth 0.
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  comms = nccl.comms(2)
  xs = [np.ones(256, np.float32) for _ in range(2)]
  outs = [np.zeros(256, np.float32) for _ in range(2)]
  assert nccl.lib.ncclGroupStart() == SUCCESS
  for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
    nccl.emul.emul_set_device(r)
    assert nccl.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 256, F32, SUM, c, s) == SUCCESS
  assert nccl.lib.pncclGroupSimulateEnd(None) == SUCCESS
  assert nccl.lib.jcoccl_nccl_group_depth() == 0 and nccl.emul.emul_group_depth() == 0
  _, got = nccl.run("all_reduce", xs, comms)  # runs alone: nothing left over from the group
  assert (outs[0] == 0).all() and (got[0] == 2).all()


def test_nccl_interposer_group_end_without_start_is_invalid_usage(nccl):
  assert nccl.lib.ncclGroupEnd() == INVALID_USAGE
  assert nccl.lib.jcoccl_nccl_group_depth() == 0
  assert nccl.lib.pncclGroupStart() == SUCCESS and nccl.lib.pncclGroupEnd() == SUCCESS
  assert nccl.lib.jcoccl_nccl_group_depth() == 0 and nccl.emul.emul_group_depth() == 0


# ---- errors, lost peers, capture ------------------------------------------------------------------


def _async(nccl, comm) -> int:
  err = ctypes.c_int(-1)
  assert nccl.lib.ncclCommGetAsyncError(comm, ctypes.byref(err)) == SUCCESS
  return err.value


def test_nccl_interposer_lost_peer_never_blocks_and_reports_as_nccl(nccl):
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32), algorithm="two_shot")])
  comms = nccl.comms(3)
  x, o = np.ones(4096, np.float32), np.zeros(4096, np.float32)
  t = time.monotonic()
  nccl.emul.emul_set_device(0)
  (c, s) = comms[0]
  assert nccl.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 4096, F32, SUM, c, s) == SUCCESS
  assert time.monotonic() - t < 2.0  # the host is not held while peers 1 and 2 never come
  assert _async(nccl, c) == SUCCESS
  assert nccl.lib.ncclCommAbort(c) == SUCCESS  # the communicator is gone: no query after it
  assert nccl.emul.emul_sync(s) == 0  # the aborted collective ends the stream's wait


def test_nccl_interposer_failed_call_is_an_async_error_and_closes_its_group(nccl):
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32), algorithm="two_shot")])
  comms = nccl.comms(2)
  assert nccl.emul.emul_inject(b"ncclSend", 1)
  x, o = np.ones(512, np.float32), np.zeros(512, np.float32)
  nccl.emul.emul_set_device(0)
  c, s = comms[0]
  assert nccl.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 512, F32, SUM, c, s) == INTERNAL
  assert nccl.emul.emul_group_depth() == 0 and nccl.lib.jcoccl_nccl_group_depth() == 0
  assert _async(nccl, c) == INTERNAL  # peers may wait for the rest: XLA polls this and aborts
  nccl.lib.ncclCommAbort(c)
  nccl.lib.ncclCommAbort(comms[1][0])


def test_nccl_interposer_delays_keep_results(nccl):
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.fp8("e5m2", block_size=32), chunks=2)])
  n = 2
  comms = nccl.comms(n)
  xs = [np.linspace(-3, 3, 1000, dtype=np.float32) * (r + 1) for r in range(n)]
  _, want = nccl.run("all_reduce", xs, comms)
  nccl.emul.emul_set_delay(COLLECTIVES, 3000)
  _, got = nccl.run("all_reduce", xs, comms)
  np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
  np.testing.assert_array_equal(_bits(got[1]), _bits(want[0]))


def test_nccl_interposer_counts_bytes_taken_and_forwarded(nccl):
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=256), op="all_gather")])
  n = 4
  comms = nccl.comms(n)
  xs = [np.ones(4096, np.float32) for _ in range(n)]
  nccl.run("all_gather", xs, comms)
  nccl.run("all_reduce", xs, comms)  # no rule: forwarded
  mine = [d for d in nccl.counters() if "comm" in d and int(d["comm"], 16) == comms[0][0]]
  ag = next(d for d in mine if d["op"] == "all_gather")
  ar = next(d for d in mine if d["op"] == "all_reduce")
  assert ag["taken_calls"] == 1 and ag["taken_bytes"] == 4096 * 4
  # int8 with 256-blocks: 4096 codes + 16 scales, to each of 3 peers (raw: 3 x 16384).
  assert ag["taken_wire"] == 3 * (4096 + 16 * 4)
  assert ar["forwarded_calls"] == 1 and ar["forwarded_wire"] == 2 * 16384 * 3 // 4


# ---- the policy -----------------------------------------------------------------------------------


def test_nccl_interposer_bad_policy_file_forwards_everything(nccl, tmp_path):
  p = tmp_path / "bad.rules"
  p.write_text("rule size=2 ops=all_reduce dtypes=float32 kind=2 bits=9 block=32\n")
  nccl.lib.jcoccl_nccl_load_policy(str(p).encode())
  st = nccl.status()
  assert st["rules"] == "0" and "bits" in st["policy_error"] and st["active"] == "0", st
  xs = [np.arange(300, dtype=np.float32) for _ in range(2)]
  _, outs = nccl.run("all_reduce", xs, nccl.comms(2))
  np.testing.assert_array_equal(outs[0], 2 * xs[0])


def _toml(tmp_path: Path, text: str) -> str:
  p = tmp_path / "p.toml"
  p.write_text(text)
  return str(p)


def test_nccl_interposer_policy_resolves_sizes_ops_and_defaults(tmp_path):
  rules = ni.resolve(
    _toml(
      tmp_path,
      '[nccl]\naxes = {data = 4}\ndtypes = ["bfloat16"]\nchunks = 2\n'
      '[data]\nall_reduce = "int8"\nreduce_scatter = "int4"\nmin_bytes = 0\n'
      'algorithm = "one_shot"\n["*"]\nall_gather = "fp8"\n',
    )
  )
  assert [(r.size, r.op, r.min_bytes, r.algorithm) for r in rules] == [
    (4, "all_reduce", 0, "one_shot"),
    (4, "reduce_scatter", 0, "one_shot"),
    (0, "all_gather", 4 * 1024 * 1024, "auto"),  # jcoccl's default min_bytes
  ]
  assert rules[0].dtypes == ("bfloat16",) and rules[0].chunks == 2
  assert rules[0].line().startswith("rule size=4 ops=all_reduce dtypes=bfloat16 min_bytes=0")
  assert "any size all_gather: fp8 (bfloat16, min_bytes 4194304" in ni.describe(rules)


@pytest.mark.parametrize(
  "text,needle",
  [
    ('[data]\nall_reduce = "int8"\n', "axes = {data = N}"),
    ('["*"]\nppermute = "int8"\n', "send/recv"),
    ('["*"]\nall_reduce = "auto:int8"\n', "cost model"),
    ("[nccl]\nsizes = {data = 2}\n", "unknown key 'sizes'"),
    ('[nccl]\ndtypes = ["float64"]\n', "'float64' is not one of"),
    ('["*"]\nall_reduce = "int9"\n', "all_reduce"),
  ],
)
def test_nccl_interposer_bad_policy_is_a_clear_error(tmp_path, text, needle):
  with pytest.raises(ValueError, match=re.escape(needle)) as e:
    ni.resolve(_toml(tmp_path, text))
  assert "p.toml" in str(e.value)


def test_nccl_interposer_launcher_preloads_or_runs_uncompressed(built, tmp_path):
  names = _names_file(tmp_path, ["ncclAllReduce"])
  env = {**os.environ, "JCOCCL_NCCL_REAL": str(built.emul)}
  cmd = [str(built.program), "preload", str(built.interposer), str(built.emul), str(names)]
  good = _toml(tmp_path, '["*"]\nall_reduce = "int8"\nmin_bytes = 0\n')
  run = [sys.executable, "-m", "jcoccl.nccl", "--library", str(built.interposer), "--report"]
  r = subprocess.run(
    [*run, "--policy", good, "--", *cmd], capture_output=True, text=True, env=env, timeout=120
  )
  assert r.returncode == 0, r.stderr
  assert "any size all_reduce: int8" in r.stderr and "taken_calls=3" in r.stdout, r.stdout
  assert "jcoccl nccl report" in r.stderr  # --report: the counters at exit
  bad = tmp_path / "bad.toml"
  bad.write_text('[data]\nall_reduce = "int8"\n')
  r = subprocess.run(
    [
      *run,
      "--policy",
      str(bad),
      "--",
      sys.executable,
      "-c",
      "import os; print(os.environ.get('LD_PRELOAD', 'none'))",
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
  )
  assert r.returncode == 0 and "running the command uncompressed" in r.stderr
  assert "libjcoccl_nccl" not in r.stdout


def test_nccl_interposer_enable_refuses_when_a_real_nccl_is_loaded(built, tmp_path):
  good = _toml(tmp_path, '["*"]\nall_reduce = "int8"\n')
  code = (
    "import ctypes, sys; from jcoccl._src.engine import nccl_interposer as ni\n"
    f"ctypes.CDLL({str(built.emul)!r})\n"
    "try:\n"
    f"  ni.enable({good!r}, library={str(built.interposer)!r}, real={str(built.emul)!r})\n"
    "except RuntimeError as e:\n  print('refused', e)\n"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert "refused a libnccl.so.2 is already loaded" in r.stdout, r.stdout + r.stderr
  with pytest.raises(RuntimeError, match="not found"):
    ni.enable(good, library=str(tmp_path / "none.so"))


# ---- seeded bugs ----------------------------------------------------------------------------------


def test_nccl_interposer_seeded_missing_fork_wait_is_caught(mutant):
  # The caller's stream writes the input (a slow copy, as an XLA kernel before the
  # collective); without the lanes' wait for that stream the encode reads the old input.
  from jcoccl import compressors as jc

  def once(mutation: int) -> list[np.ndarray]:
    ctypes.c_int.in_dll(mutant.lib, "jcn_test_mutation").value = mutation
    mutant.policy([_rule(jc.int8(block_size=32))])
    n = 2
    comms = mutant.comms(n)
    src = [np.full(1024, 3.0, np.float32) for _ in range(n)]
    xs = [np.zeros(1024, np.float32) for _ in range(n)]
    outs = [np.zeros(1024, np.float32) for _ in range(n)]
    mutant.emul.emul_set_delay(COPIES, 20000)
    for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
      mutant.emul.emul_set_device(r)
      mutant.emul.emul_copy(x.ctypes.data, src[r].ctypes.data, 4096, s)
      mutant.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 1024, F32, SUM, c, s)
    for _, s in comms:
      mutant.emul.emul_sync(s)
    mutant.emul.emul_set_delay(0, 0)
    return outs

  try:
    assert (once(0)[0] == 6.0).all()
    assert not (once(emul_build.MUTATION_IDS["no_fork_wait"])[0] == 6.0).all()
  finally:
    ctypes.c_int.in_dll(mutant.lib, "jcn_test_mutation").value = 0


def test_nccl_interposer_seeded_group_left_open_is_caught(mutant):
  from jcoccl import compressors as jc

  mutant.policy([_rule(jc.int8(block_size=32), algorithm="two_shot")])
  ctypes.c_int.in_dll(mutant.lib, "jcn_test_mutation").value = emul_build.MUTATION_IDS[
    "group_left_open"
  ]
  try:
    comms = mutant.comms(2)
    mutant.emul.emul_inject(b"ncclSend", 1)
    x, o = np.ones(512, np.float32), np.zeros(512, np.float32)
    mutant.emul.emul_set_device(0)
    c, s = comms[0]
    assert mutant.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 512, F32, SUM, c, s) == INTERNAL
    assert mutant.emul.emul_group_depth() == 1  # what the clean build's test sees as 0
  finally:
    ctypes.c_int.in_dll(mutant.lib, "jcn_test_mutation").value = 0
    mutant.emul.emul_reset_group()
    for c, _ in comms:
      mutant.lib.ncclCommAbort(c)


def test_nccl_interposer_seeded_dropped_symbol_is_caught(mutant, built, tmp_path):
  assert not hasattr(mutant.lib, "ncclSend")  # the export check above would fail
  out = _load(built, "enable", _names_file(tmp_path, _plugin_names()), mutant.lib._name)
  assert "missing ncclSend" in out or "elsewhere ncclSend" in out


def test_nccl_interposer_enable_loads_it_and_jcoccl_info_says_so(built, tmp_path):
  good = _toml(tmp_path, '[nccl]\naxes = {data = 2}\n[data]\nall_reduce = "int8"\n')
  code = (
    "from jcoccl._src.engine import nccl_interposer as ni; from jcoccl._src.observability import info\n"
    "print('before', ni.summary())\n"
    f"rules = ni.enable({good!r}, library={str(built.interposer)!r}, real={str(built.emul)!r})\n"
    "print('rules', len(rules), ni.status()['active'])\n"
    "print('after', ni.summary())\n"
    "print('counters', ni.counters())\n"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "before not loaded" in r.stdout
  assert "rules 1 1" in r.stdout  # one rule, active
  assert "after active: 1 rules from " in r.stdout and str(built.emul) in r.stdout
  assert (
    "counters [{'grouped': {'taken_at_group_end': 0}}, {'forwarded': {'no_rule': 0," in r.stdout
  )


def test_nccl_interposer_other_nccl_major_or_missing_names_forward_with_a_message(built, tmp_path):
  # A "real NCCL" 3.0.0 with two entry points: takeover is off (the ABI it was generated for
  # is NCCL 2's), and a name the library lacks fails as NCCL fails, saying which.
  src = tmp_path / "old.c"
  src.write_text(
    "int ncclGetVersion(int* v) { *v = 30000; return 0; }\n"
    'const char* ncclGetErrorString(int r) { return "fake"; }\n'
  )
  fake = tmp_path / "libnccl.so.2"
  subprocess.run([gpu_shim.compiler(), "-x", "c", "-shared", "-fPIC", str(src), "-o", str(fake)],
                 check=True)  # fmt: skip
  code = (
    "import ctypes\n"
    f"lib = ctypes.CDLL({str(built.interposer)!r})\n"
    "lib.jcoccl_nccl_status.restype = ctypes.c_char_p\n"
    "print(lib.jcoccl_nccl_status().decode())\n"
    "print('send', lib.ncclSend(None, 0, 0, 0, None, None))\n"
  )
  env = {**os.environ, "JCOCCL_NCCL_REAL": str(fake)}
  env.pop("JCOCCL_NCCL_POLICY", None)
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     timeout=60)  # fmt: skip
  assert r.returncode == 0, r.stderr
  code_h = re.search(r"JCN_NCCL_VERSION_CODE (\d+)", gen_nccl_api.OUT.read_text()).group(1)
  assert f"version=30000 (generated from {code_h})" in r.stdout and "active=0" in r.stdout
  assert "not NCCL 2.x" in r.stderr and "forwarded uncompressed" in r.stderr
  assert f"send {INVALID_USAGE}" in r.stdout
  assert "ncclSend is not in the real NCCL" in r.stderr


# ---- issue 45's risks: one test each ---------------------------------------------------------------


def _group_call(nccl, comms, xs, outs, fn="ncclAllReduce", dtype=F32, streams=None) -> list[int]:
  """One call per rank inside the current group (no sync); the codes."""
  codes = []
  for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
    nccl.emul.emul_set_device(r)
    s = streams[r] if streams else s
    f = getattr(nccl.lib, fn)
    n = x.size if fn != "ncclReduceScatter" else x.size // len(comms)
    args = (x.ctypes.data, o.ctypes.data, n, dtype)
    codes.append(f(*args, c, s) if fn == "ncclAllGather" else f(*args, SUM, c, s))
  return codes


def test_nccl_interposer_takeover_policy_is_fixed_per_communicator(nccl):
  # Risk 1: the policy a communicator decides by is the one in force at its first call; a
  # reload (one rank's process, at any time) must not make its ranks decide differently.
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  n = 2
  comms = nccl.comms(n)
  xs = [np.linspace(-1, 1, 512, dtype=np.float32) * (r + 1) for r in range(n)]
  _, want = nccl.run("all_reduce", xs, comms)
  assert not (want[0] == 3 * xs[0]).all()  # taken: compressed
  nccl.policy(None)
  _, got = nccl.run("all_reduce", xs, comms)  # the same communicator: still taken
  np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
  _, fresh = nccl.run("all_reduce", xs, nccl.comms(n))  # a new one sees no rule
  np.testing.assert_array_equal(fresh[0], xs[0] + xs[1])


def test_nccl_interposer_workspace_is_reserved_up_front_and_bounds_takeover(nccl, tmp_path):
  # Risk 1: the workspace is one reservation per communicator (JCOCCL_NCCL_WORKSPACE bytes);
  # a call that needs more is forwarded on every rank (decided from the call alone), and a
  # reservation that fails fails the call with a message instead of forwarding on one rank.
  from jcoccl import compressors as jc

  n = 2
  xs = [np.linspace(-1, 1, 8192, dtype=np.float32) * (r + 1) for r in range(n)]
  nccl.policy([_rule(jc.int8(block_size=32))])
  try:
    os.environ["JCOCCL_NCCL_WORKSPACE"] = "65536"
    comms = nccl.comms(n)
    before = nccl.counters()[-1]["forwarded"].get("workspace", 0)
    small = [x[:1024].copy() for x in xs]
    _, got = nccl.run("all_reduce", small, comms)
    assert not (got[0] == small[0] + small[1]).all()  # fits: taken
    codes, got = nccl.run("all_reduce", xs, comms)  # 32 KiB of f32 per rank: does not fit
    assert codes == [SUCCESS] * n
    np.testing.assert_array_equal(got[0], xs[0] + xs[1])
    assert nccl.counters()[-1]["forwarded"]["workspace"] == before + n
    os.environ["JCOCCL_NCCL_WORKSPACE"] = str(1 << 60)  # cannot be reserved
    codes, _ = nccl.run("all_reduce", small, nccl.comms(n))
    assert codes == [SYSTEM] * n
  finally:
    os.environ.pop("JCOCCL_NCCL_WORKSPACE", None)


def test_nccl_interposer_float16_data_movement_is_never_taken(nccl):
  # Risk 3: XLA sends S16/U16 all-gathers as ncclFloat16; coding them as floats would corrupt
  # integers (a NaN pattern turns a block into NaN). float16 all_gather is always forwarded.
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32), op="all_gather")])
  n = 2
  ints = [np.arange(r * 4096, (r + 1) * 4096, dtype=np.uint16) for r in range(n)]
  ints[0][7] = 0x7E01  # a float16 NaN bit pattern
  codes, outs = nccl.run("all_gather", [i.view(np.float16) for i in ints], nccl.comms(n), dtype=F16)
  assert codes == [SUCCESS] * n
  np.testing.assert_array_equal(outs[1].view(np.uint16), np.concatenate(ints))


def test_nccl_interposer_first_captured_call_is_taken_and_counted_as_captured(nccl):
  # Risk 4: under capture the communicator's first call is taken too (its workspace was
  # reserved up front, a captured one apart from the eager one); the counters say how many
  # of the calls taken were captured (a replay is not counted).
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  n = 2
  comms = nccl.comms(n)
  xs = [np.linspace(-1, 1, 512, dtype=np.float32) for _ in range(n)]
  for _, s in comms:
    nccl.emul.emul_set_capturing(s, 1)
  try:
    _, got = nccl.run("all_reduce", xs, comms)
  finally:
    for _, s in comms:
      nccl.emul.emul_set_capturing(s, 0)
  _, want = nccl.run("all_reduce", xs, comms)
  np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
  assert not (got[0] == 2 * xs[0]).all()  # compressed
  mine = [d for d in nccl.counters() if "comm" in d and int(d["comm"], 16) == comms[0][0]]
  assert mine[0]["taken_calls"] == 2 and mine[0]["captured_calls"] == 1


def test_nccl_interposer_group_depth_cannot_stick(nccl):
  # Risk 5: NCCL's group end may report an error and still close the group (here the real
  # library's group is already closed, so it answers ncclInvalidUsage). The library's depth
  # must follow: else every later taken call is queued forever while returning success.
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  n = 2
  comms = nccl.comms(n)
  assert nccl.lib.ncclGroupStart() == SUCCESS
  nccl.emul.emul_reset_group()  # the real NCCL closed the group
  assert nccl.lib.ncclGroupEnd() == INVALID_USAGE
  assert nccl.lib.jcoccl_nccl_group_depth() == 0
  xs = [np.ones(512, np.float32) for _ in range(n)]
  _, outs = nccl.run("all_reduce", xs, comms)
  np.testing.assert_allclose(outs[0], 2.0, rtol=0.02)  # ran, was not queued


def test_nccl_interposer_group_orders_its_streams_as_nccl(nccl):
  # Risk 8: NCCL makes every stream of a group wait for the whole group. Two taken calls of
  # one group on two streams of each rank: work queued on either stream after the group
  # must see the other stream's call's result. (Before the fix the second call's lanes
  # happened to wait on the first's, so only the copy of the second call's result on the
  # first stream read it unfinished: 0.0 instead of 4.0.)
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  n = 2
  comms = nccl.comms(n)
  side = []
  for r in range(n):
    nccl.emul.emul_set_device(r)
    side.append(nccl.emul.emul_stream())
  xs = [np.full(1024, 1.0, np.float32) for _ in range(n)]
  ys = [np.full(1024, 2.0, np.float32) for _ in range(n)]
  outs = [np.zeros(1024, np.float32) for _ in range(n)]
  outs2 = [np.zeros(1024, np.float32) for _ in range(n)]
  copies = [np.zeros(1024, np.float32) for _ in range(n)]
  copies2 = [np.zeros(1024, np.float32) for _ in range(n)]
  nccl.emul.emul_set_delay(COLLECTIVES, 20000)
  try:
    assert nccl.lib.ncclGroupStart() == SUCCESS
    assert _group_call(nccl, comms, xs, outs) == [SUCCESS] * n
    assert _group_call(nccl, comms, ys, outs2, streams=side) == [SUCCESS] * n
    assert nccl.lib.ncclGroupEnd() == SUCCESS
    for r, (_, s) in enumerate(comms):
      nccl.emul.emul_set_device(r)
      nccl.emul.emul_copy(copies[r].ctypes.data, outs[r].ctypes.data, 4096, side[r])
      nccl.emul.emul_copy(copies2[r].ctypes.data, outs2[r].ctypes.data, 4096, s)
    for (_, s), t in zip(comms, side):
      nccl.emul.emul_sync(s)
      nccl.emul.emul_sync(t)
  finally:
    nccl.emul.emul_set_delay(0, 0)
  for r in range(n):
    np.testing.assert_allclose(copies[r], 2.0, rtol=0.02)
    np.testing.assert_allclose(copies2[r], 4.0, rtol=0.02)


def test_nccl_interposer_codec_none_rule_forwards(nccl):
  # Risk 10: a hand-written rule with codec none must forward (the engine's identity path
  # would ask the transport for a plain sum, which the interposer's transport refuses).
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.none())])
  n = 2
  xs = [np.linspace(-1, 1, 512, dtype=np.float32) * (r + 1) for r in range(n)]
  codes, outs = nccl.run("all_reduce", xs, nccl.comms(n))
  assert codes == [SUCCESS] * n
  np.testing.assert_array_equal(outs[0], xs[0] + xs[1])


def _nonblocking_comms(nccl, n: int) -> list[tuple[int, int]]:
  """n ranks of a nonblocking communicator (ncclConfig_t.blocking = 0), ready for use."""
  uid = UniqueId()
  nccl.lib.ncclGetUniqueId(ctypes.byref(uid))
  cfg = Config(size=ctypes.sizeof(Config), magic=0xCAFEBEEF, version=23206, blocking=0)
  out = []
  for r in range(n):
    nccl.emul.emul_set_device(r)
    c = ctypes.c_void_p()
    code = nccl.lib.ncclCommInitRankConfig(ctypes.byref(c), n, uid, r, ctypes.byref(cfg))
    assert code in (SUCCESS, IN_PROGRESS)
    out.append((c.value, nccl.emul.emul_stream()))
  for c, _ in out:
    _poll(nccl, c)
  return out


def _poll(nccl, comm, limit_s: float = 20.0) -> int:
  """Polls ncclCommGetAsyncError as NCCL asks of a nonblocking communicator's user."""
  t = time.monotonic()
  while (state := _async(nccl, comm)) == IN_PROGRESS:
    assert time.monotonic() - t < limit_s, "still in progress"
    time.sleep(0.002)
  return state


def test_nccl_interposer_nonblocking_group_runs_after_the_communicator_is_ready(nccl):
  # Risk 2: with a nonblocking communicator the real group end answers ncclInProgress; the
  # taken calls must not be issued on the communicator until it has left that state.
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  n = 2
  comms = _nonblocking_comms(nccl, n)
  nccl.emul.emul_findings()
  xs = [np.full(512, r + 1.0, np.float32) for r in range(n)]
  outs = [np.zeros(512, np.float32) for _ in range(n)]
  bs = [np.full(8, r, np.int8) for r in range(n)]
  gathered = [np.zeros(8 * n, np.int8) for _ in range(n)]
  assert nccl.lib.ncclGroupStart() == SUCCESS
  assert _group_call(nccl, comms, xs, outs) == [SUCCESS] * n
  assert _group_call(nccl, comms, bs, gathered, fn="ncclAllGather", dtype=0) == [SUCCESS] * n
  assert nccl.lib.ncclGroupEnd() == IN_PROGRESS
  assert [_poll(nccl, c) for c, _ in comms] == [SUCCESS] * n
  for _, s in comms:
    nccl.emul.emul_sync(s)
  assert nccl.emul.emul_findings().decode() == ""
  np.testing.assert_allclose(outs[0], 3.0, rtol=0.02)
  np.testing.assert_array_equal(gathered[1], np.repeat(np.arange(n, dtype=np.int8), 8))
  for c, _ in comms:
    nccl.lib.ncclCommDestroy(c)


def test_nccl_interposer_abort_from_another_thread_ends_a_waiting_call(nccl):
  # Risk 7: a taken call waits for its nonblocking communicator to leave ncclInProgress;
  # ncclCommAbort from another thread must end that wait before the communicator is freed
  # (a later ncclCommGetAsyncError on it is a use after free, which the emulation counts).
  import threading

  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  comms = _nonblocking_comms(nccl, 2)
  c, s = comms[0]
  misuse = nccl.emul.emul_misuse()
  old = nccl.emul.emul_set_nonblocking_delay_ms(800)
  x, o = np.ones(512, np.float32), np.zeros(512, np.float32)
  codes = []

  def call() -> None:
    nccl.emul.emul_set_device(0)
    codes.append(nccl.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, 512, F32, SUM, c, s))

  try:
    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.1)
    assert nccl.lib.ncclCommAbort(c) == SUCCESS
    t.join(10)
    assert not t.is_alive() and codes and codes[0] != SUCCESS
  finally:
    nccl.emul.emul_set_nonblocking_delay_ms(old)
  time.sleep(0.8)  # the emulation's own in-progress work on the communicator ends
  assert nccl.emul.emul_misuse() == misuse
  nccl.emul.emul_findings()


def test_nccl_interposer_real_nccls_own_calls_never_reenter(built, tmp_path):
  # Risk 11: preloaded, the library is what the real NCCL's own calls to its public names
  # bind to (a library's calls to its exported functions go through the PLT). Here the "real
  # NCCL"'s ncclBroadcast calls its own ncclAllGather: the interposer must not see it.
  src = tmp_path / "fake.c"
  src.write_text(
    "#include <stddef.h>\n"
    "int ncclGetVersion(int* v) { *v = 99999; return 0; }\n"
    'const char* ncclGetErrorString(int r) { return "fake"; }\n'
    "int ncclAllGather(const void* s, void* r, size_t n, int t, void* c, void* st) { return 0; }\n"
    "int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, void* c, void* st) {\n"
    "  return ncclAllGather(s, r, n, t, c, st) + 40;\n}\n"
  )
  fake = tmp_path / "libfake.so"
  subprocess.run([gpu_shim.compiler(), "-x", "c", "-shared", "-fPIC", str(src), "-o", str(fake)],
                 check=True)  # fmt: skip
  code = (
    "import ctypes\n"
    f"lib = ctypes.CDLL({str(built.interposer)!r})\n"
    "lib.jcoccl_nccl_counters.restype = ctypes.c_char_p\n"
    "print('bcast', lib.ncclBroadcast(None, None, ctypes.c_size_t(8), 0, 0, None, None))\n"
    "print(lib.jcoccl_nccl_counters().decode())\n"
  )
  env = {**os.environ, "JCOCCL_NCCL_REAL": str(fake), "LD_PRELOAD": str(built.interposer)}
  env.pop("JCOCCL_NCCL_POLICY", None)
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     timeout=60)  # fmt: skip
  assert r.returncode == 0, r.stderr
  assert "bcast 40" in r.stdout  # reached the fake's own ncclAllGather
  assert "other_type=0" in r.stdout, r.stdout  # which the interposer never saw


_REAL_PROBE = r"""
// Loads the interposer as the plugin does, then jcoccl's own NCCL transport's table.
#include <dlfcn.h>
#include <cstdio>
#include <string>
#include "transport/nccl.h"
int main(int argc, char** argv) {
  if (argc != 3 || dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) return 2;
  std::string err;
  const jcoccl::transport::NcclApi* api = jcoccl::transport::Nccl(&err);
  void* real = dlopen(argv[2], RTLD_NOW | RTLD_NOLOAD);
  if (api == nullptr || real == nullptr) return std::printf("error %s\n", err.c_str()), 3;
  const bool ok = reinterpret_cast<void*>(api->AllReduce) == dlsym(real, "ncclAllReduce") &&
                  reinterpret_cast<void*>(api->GroupEnd) == dlsym(real, "ncclGroupEnd");
  std::printf("%s\n", ok ? "real" : "interposer");
  return 0;
}
"""


def test_nccl_interposer_jcoccls_own_transport_reaches_the_real_nccl(built, tmp_path):
  # Risk 6: jcoccl's transport opens "libnccl.so.2" by name, which is the interposer once it
  # is loaded; its exact float32 sums must still reach the real NCCL.
  import hashlib

  inc = [gpu_shim.SHIM_DIR, ROOT / "cuda" / "emul", ROOT / "cuda", gpu_shim.PUBLIC_INCLUDE]
  inputs = [ROOT / "cuda" / "transport" / n for n in ("nccl.cc", "nccl.h", "transport.h")]
  flags = [f for f in emul_build.FLAGS if f != "-O1"] + ["-O0"]  # a loader check: build fast
  h = hashlib.sha256((_REAL_PROBE + " ".join(flags)).encode())
  for f in [*inputs, *sorted(gpu_shim.SHIM_DIR.glob("*")), *sorted((ROOT / "cuda/emul").glob("*"))]:
    h.update(f.read_bytes())
  prog = emul_build.OUT / f"transport_probe-{h.hexdigest()[:16]}"
  if not prog.exists():  # built once per source state, as emul_build caches its products
    src = tmp_path / "probe.cc"
    src.write_text(_REAL_PROBE)
    emul_build.OUT.mkdir(parents=True, exist_ok=True)
    tmp = emul_build.OUT / f"{prog.name}.{os.getpid()}.tmp"  # renamed: workers may race
    r = subprocess.run(
      [gpu_shim.compiler(), *flags, *[f"-I{i}" for i in inc], str(src),
       str(inputs[0]), "-ldl", "-o", str(tmp)],
      capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    tmp.replace(prog)
  env = {**os.environ, "JCOCCL_NCCL_REAL": str(built.emul)}
  env.pop("JCOCCL_NCCL_POLICY", None)
  out = subprocess.run([str(prog), str(built.interposer), str(built.emul)], capture_output=True,
                       text=True, env=env, timeout=60)  # fmt: skip
  assert out.stdout.strip() == "real", out.stdout + out.stderr


def test_nccl_interposer_unaligned_buffers_never_reach_vector_loads(nccl):
  # Risk 9: NCCL takes any element-aligned buffer; the codec kernels load 16 bytes at a
  # time, so buffers that are not 16-byte aligned are staged through the workspace.
  from jcoccl import compressors as jc

  nccl.policy([_rule(jc.int8(block_size=32))])
  n = 2
  comms = nccl.comms(n)
  base = [np.linspace(-1, 1, 1025, dtype=np.float32) * (r + 1) for r in range(n)]
  aligned = [b[:1024].copy() for b in base]
  _, want = nccl.run("all_reduce", aligned, comms)
  nccl.emul.emul_findings()
  shifted = [np.zeros(1025, np.float32) for _ in range(n)]
  outs = [np.zeros(1025, np.float32) for _ in range(n)]
  for r, ((c, s), x, o) in enumerate(zip(comms, shifted, outs)):
    x[1:] = aligned[r]
    nccl.emul.emul_set_device(r)
    code = nccl.lib.ncclAllReduce(x.ctypes.data + 4, o.ctypes.data + 4, 1024, F32, SUM, c, s)
    assert code == SUCCESS
  for _, s in comms:
    nccl.emul.emul_sync(s)
  assert nccl.emul.emul_findings().decode() == ""
  np.testing.assert_array_equal(_bits(outs[0][1:]), _bits(want[0]))


def test_nccl_interposer_captured_call_replays_compressed_and_counts_once(nccl):
  # Risk 4 with the shim's real graph capture: a taken call recorded into a graph (its
  # lanes forked off the capturing stream and joined back, so the capture ends cleanly) runs
  # the compressed collective at each replay, on new inputs; the counters count the capture.
  from jcoccl import compressors as jc

  L = nccl.emul
  vp = ctypes.c_void_p
  L.emul_begin_capture.argtypes = [vp]
  L.emul_end_capture.argtypes = [vp, ctypes.POINTER(vp)]
  L.emul_graph_launch.argtypes = [vp, vp]
  nccl.policy([_rule(jc.int8(block_size=32))])
  n, count = 2, 1024
  comms = nccl.comms(n)
  xs = [np.zeros(count, np.float32) for _ in range(n)]
  outs = [np.zeros(count, np.float32) for _ in range(n)]
  execs = []
  for r, ((c, s), x, o) in enumerate(zip(comms, xs, outs)):
    L.emul_set_device(r)
    assert L.emul_begin_capture(s) == 0
    assert nccl.lib.ncclAllReduce(x.ctypes.data, o.ctypes.data, count, F32, SUM, c, s) == 0
    g = ctypes.c_void_p()
    assert L.emul_end_capture(s, ctypes.byref(g)) == 0  # no lane left unjoined
    execs.append(g.value)
  ref = [np.linspace(-1, 1, count, dtype=np.float32) * (r + 1) for r in range(n)]
  _, want = nccl.run("all_reduce", ref, nccl.comms(n))  # eager, on a fresh communicator
  for replay in (1, 2):
    for r, (_, s) in enumerate(comms):
      xs[r][:] = ref[r]
      outs[r][:] = 0
      L.emul_set_device(r)
      assert L.emul_graph_launch(execs[r], s) == 0
    for _, s in comms:
      L.emul_sync(s)
    np.testing.assert_array_equal(_bits(outs[1]), _bits(want[0]), err_msg=f"replay {replay}")
  assert not (want[0] == ref[0] + ref[1]).all()  # compressed
  mine = [d for d in nccl.counters() if "comm" in d and int(d["comm"], 16) == comms[0][0]]
  assert mine[0]["taken_calls"] == 1 and mine[0]["captured_calls"] == 1
