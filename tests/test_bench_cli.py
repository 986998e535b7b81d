"""Command lines of ``python -m jcoccl.bench`` and ``jcoccl``: one size syntax for every
benchmark subcommand (units, invalid sizes refused with an argparse error naming --sizes),
``--version``."""

import json
import os
import subprocess
import sys

import pytest

import jcoccl
from jcoccl.bench import __main__ as bench_main
from jcoccl.bench import _harness as H

SUBCOMMANDS = ["codecs", "collectives"]


@pytest.mark.parametrize(
  "text,want",
  [
    ("512", 512),
    ("512B", 512),
    ("512b", 512),
    ("1KiB", 1024),
    ("64KiB", 65536),
    ("4MiB", 4 << 20),
    ("4mib", 4 << 20),
    ("4 MiB", 4 << 20),
    ("1GiB", 1 << 30),
    ("1TiB", 1 << 40),
    ("1KB", 1000),
    ("1MB", 10**6),
    ("2GB", 2 * 10**9),
    ("1.5KiB", 1536),
    ("0.5KiB", 512),
    ("1.1MB", 1_100_000),
    ("1", 1),
  ],
)
def test_parse_size_units(text, want):
  assert H.parse_size(text) == want


@pytest.mark.parametrize(
  "text,match",
  [
    ("0", "at least 1 byte"),
    ("0B", "at least 1 byte"),
    ("0MiB", "at least 1 byte"),
    ("0.0KiB", "at least 1 byte"),
    ("-1", "at least 1 byte"),
    ("-4MiB", "at least 1 byte"),
    ("1.5", "whole number of bytes"),
    ("0.3KiB", "whole number of bytes"),
    ("4K", "ambiguous unit 'K'"),
    ("4M", "ambiguous unit 'M'"),
    ("1g", "ambiguous unit 'G'"),
    ("4XB", "unknown unit"),
    ("4 bytes", "unknown unit"),
    ("abc", "not a size"),
    ("", "not a size"),
    ("1e6", "not a size"),
    ("1,000", "not a size"),
    ("MiB", "not a size"),
    ("nan", "not a size"),
    ("inf", "not a size"),
  ],
)
def test_parse_size_rejects(text, match):
  with pytest.raises(ValueError, match=match):
    H.parse_size(text)


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
@pytest.mark.parametrize("sizes", ["0", "-1", "1MiB,0", "4M", "256K,1M", "x", "", ",", "1,,2"])
def test_bad_sizes_are_argparse_errors(capsys, cmd, sizes):
  with pytest.raises(SystemExit) as e:
    bench_main.main([cmd, f"--sizes={sizes}"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "error: argument --sizes:" in err and "Traceback" not in err


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
@pytest.mark.parametrize("iters", ["0", "-2", "x"])
def test_bad_iters_are_argparse_errors(capsys, cmd, iters):
  with pytest.raises(SystemExit) as e:
    bench_main.main([cmd, f"--iters={iters}"])
  assert e.value.code == 2 and "argument --iters" in capsys.readouterr().err


def test_collectives_size_under_one_element_per_rank(capsys):
  with pytest.raises(SystemExit) as e:
    bench_main.main(["collectives", "--sizes", "31B", "--ops", "all_reduce"])
  assert e.value.code == 2
  assert "--sizes: 31 B is under one float32 element per rank" in capsys.readouterr().err


def test_both_subcommands_take_sizes_in_bytes_with_units(capsys):
  """The same --sizes text means the same bytes in both subcommands."""
  assert (
    bench_main.main(
      [
        "codecs",
        "--sizes",
        "4KiB,1024",
        "--compressors",
        "int8",
        "--impl",
        "jnp",
        "--iters",
        "1",
        "--json",
      ]
    )
    == 0
  )
  rows = json.loads(capsys.readouterr().out)
  # int8's granule is 256 float32 values (1 KiB): both sizes are whole granules.
  assert [r["bytes"] for r in rows] == [4096, 1024]
  assert (
    bench_main.main(
      [
        "collectives",
        "--sizes",
        "4KiB,1024",
        "--ops",
        "all_gather",
        "--compressors",
        "int8",
        "--iters",
        "1",
        "--json",
      ]
    )
    == 0
  )
  rows = json.loads(capsys.readouterr().out)
  assert sorted({r["bytes"] for r in rows}) == [1024, 4096]


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
  "argv",
  [
    [sys.executable, "-m", "jcoccl", "--version"],
    [os.path.join(os.path.dirname(sys.executable), "jcoccl"), "--version"],
  ],
  ids=["python -m jcoccl", "jcoccl script"],
)
def test_version(argv):
  if not os.path.exists(argv[0]):
    pytest.skip(f"{argv[0]} is not installed")
  r = _run(*argv)
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == f"jcoccl {jcoccl.__version__}"


def test_version_falls_back_without_metadata(monkeypatch):
  import importlib.metadata as md

  from jcoccl._src.observability import info

  def missing(name):
    raise md.PackageNotFoundError(name)

  monkeypatch.setattr(md, "version", missing)
  assert info.version() == jcoccl.__version__
  assert info.info()["jcoccl"] == jcoccl.__version__


def test_bench_cli_end_to_end_exit_code():
  r = _run(sys.executable, "-m", "jcoccl.bench", "codecs", "--sizes", "0")
  assert r.returncode == 2
  assert "error: argument --sizes: '0': a size must be at least 1 byte" in r.stderr
  assert "Traceback" not in r.stderr


_LOG8 = '''"""An 8-bit log quantizer: a user's codec in a file of its own."""
import jax.numpy as jnp
import numpy as np
from jcoccl import compressors as jc


@jc.register("log8_bench")
class Log8(jc.Compressor):
  granule = 1

  def row_nbytes(self, n, dtype):
    return n

  def encode_f32(self, x, key):
    e = jnp.clip(jnp.round(2 * jnp.log2(jnp.abs(x) + np.float32(1e-30))) + 64, 0, 127)
    return e.astype(jnp.uint8) | jnp.where(x < 0, jnp.uint8(128), jnp.uint8(0))

  def decode_f32(self, buf, n):
    v = jnp.exp2(((buf & 127).astype(jnp.float32) - 64) / 2)
    return jnp.where(buf >= 128, -v, v)

  def bound_f32(self, x):
    return jnp.full_like(x, jnp.inf)
'''


def test_bench_subcommands_import_a_codec_file(tmp_path, monkeypatch, capsys):
  """--codec path/to/file.py brings a user's codec into bench codecs and collectives (a
  relative path from the current directory); a missing file is a --codec error."""
  from jcoccl import compressors as jc

  (tmp_path / "codecs").mkdir()
  (tmp_path / "codecs" / "log8_bench.py").write_text(_LOG8)
  monkeypatch.chdir(tmp_path)
  common = ["--codec", "codecs/log8_bench.py", "--compressors", "log8_bench", "--iters", "1"]
  try:
    assert bench_main.main(["codecs", *common, "--sizes", "4KiB", "--impl", "jnp", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["compressor"], r["bytes"], r["ratio"]) for r in rows] == [("log8_bench", 4096, 4.0)]
    argv = ["collectives", *common, "--sizes", "4KiB", "--ops", "all_gather", "--json"]
    assert bench_main.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["compressor"] for r in rows} == {"lax", "log8_bench"}, rows
  finally:
    jc.unregister("log8_bench")
  with pytest.raises(SystemExit):
    bench_main.main(["calibrate", "--codec", "codecs/nothing.py"])
  assert "--codec: no codec module file at 'codecs/nothing.py'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# bench predict: speed-ups from a crafted results file (no compile, no GPU).

_G = 500e9  # input float32 bytes per second of every crafted kernel
_R = 0.25  # payload / input bytes of the crafted codec


def _results(path, ops=("encode", "decode"), mib=64.0):
  """A results file as tools/gpu_codecs.py writes it: one codec whose kernels all run at
  _G input bytes per second, r = _R, and a copy row."""
  ms = mib * 2**20 / _G * 1e3
  moved = mib * 2**20 * (1 + _R)
  rows = [{"codec": "copy", "mib": mib, "op": "copy(cupy, CUDA events)", "gbs": 4000.0}]
  rows += [
    {"codec": "q8", "mib": mib, "op": op, "ms": ms, "gbs": moved / (ms * 1e-3) / 1e9} for op in ops
  ]
  path.write_text(json.dumps({"device": "crafted", "bench": rows}))
  return str(path)


def test_predict_prints_the_table(tmp_path, capsys):
  res = _results(tmp_path / "r.json")
  out = tmp_path / "p.json"
  argv = ["predict", "--results", res, "--gpus", "8,32", "--links", "ib400,eth100"]
  assert bench_main.main([*argv, "--sizes", "64MiB", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "q8: r = 0.2500" in text and "decode_sum not measured: decode stands in" in text
  lines = [ln.split() for ln in text.splitlines() if not ln.startswith("#")]
  # 4 ops at 8 GPUs (one node) + 4 ops x 2 links at 32 GPUs
  assert len(lines) == 12 and {ln[1] for ln in lines} == {"nvlink", "ib400", "eth100"}
  rows = json.loads(out.read_text())["rows"]
  assert [float(ln[-2]) for ln in lines] == [round(r["speedup"], 2) for r in rows]
  assert {r["algorithm"] for r in rows if r["op"] == "all_reduce"} <= {
    "one_shot",
    "two_shot",
    "hierarchical",
  }


def test_predict_matches_a_hand_computation(tmp_path):
  """8 GPUs on NVLink and 16 GPUs (2 nodes) on 400 Gb/s IB, worked out by hand."""
  from jcoccl.bench import predict as P
  from jcoccl.bench import speed_model as SM

  codec = P.load_results([_results(tmp_path / "r.json")])["q8"]
  s, notes = 64 * 2**20, set()
  nvl, ib = 450e9, 45e9
  one = SM.Topology(8, SM.LINKS["ib400"])  # one node: the network is unused
  # all_gather: NCCL 7 steps + 7/8 S; jcoccl the same of r S, encode S/8, decode S.
  want = 7 * 2e-6 + 7 / 8 * _R * s / nvl + (1 / 8 + 1) * s / _G
  assert SM.jcoccl_s("all_gather", s, one, codec, notes) == ("compressed", pytest.approx(want))
  assert SM.exact_s("all_gather", s, one) == pytest.approx(7 * 2e-6 + 7 / 8 * s / nvl)
  # 16 GPUs: NCCL's all_reduce at min(450, 8 x 45) = 360 GB/s, a tree's 8 steps at the
  # hops' mean latency (14 NVLink at 2 us, 2 IB at 5 us).
  two = SM.Topology(16, SM.LINKS["ib400"])
  alpha = (14 * 2e-6 + 2 * 5e-6) / 16
  assert SM.exact_s("all_reduce", s, two) == pytest.approx(8 * alpha + 2 * 15 / 16 * s / 360e9)
  # hierarchical: two_shot in the node, then one_shot of S/8 between the 2 nodes.
  inner = 14 * 2e-6 + 2 * 7 / 8 * _R * s / nvl + (3 + 1 / 8) * s / _G
  outer = 5e-6 + _R * s / 8 / ib + 3 * (s / 8) / _G
  got = dict(SM._all_reduce(s, two, codec, notes))
  assert got["hierarchical"] == pytest.approx(inner + outer)
  # 2 NICs per node: NCCL's rings at 2 x 45 GB/s; a GPU's share of the network is 2/8.
  shared = SM.Topology(16, SM.LINKS["ib400"], nics=2)
  assert SM.exact_s("all_reduce", s, shared) == pytest.approx(8 * alpha + 2 * 15 / 16 * s / 90e9)
  outer = 5e-6 + _R * s / 8 / (ib / 4) + 3 * (s / 8) / _G
  assert dict(SM._all_reduce(s, shared, codec, notes))["hierarchical"] == pytest.approx(
    inner + outer
  )


def test_predict_composes_cost_model(tmp_path):
  """The codec passes sum to cost_model's codec terms, and on one node reduce_scatter +
  all_gather is cost_model's two_shot."""
  from jcoccl._src.base.cost_model import CostModel
  from jcoccl.bench import predict as P
  from jcoccl.bench import speed_model as SM

  s = 1 << 26
  for algo in ("one_shot", "two_shot"):
    for n in (2, 8, 32):
      codec_only = CostModel(1e-30, 1e30, 1.0).cost(algo, s, n, _R)
      assert codec_only == pytest.approx(sum(SM.passes(algo, n)) * s)
  codec = P.load_results([_results(tmp_path / "r.json")])["q8"]
  node, notes = SM.Topology(8, SM.LINKS["eth100"]), set()
  rs = SM.jcoccl_s("reduce_scatter", s, node, codec, notes)[1]
  ag = SM.jcoccl_s("all_gather", s, node, codec, notes)[1]
  assert rs + ag == pytest.approx(CostModel(2e-6, 450e9, _G).cost("two_shot", s, 8, _R))


@pytest.mark.parametrize(
  "argv,match",
  [
    (["--results", "nowhere.json"], "--results: cannot read 'nowhere.json'"),
    (["--results", "bad.json"], "--results: 'bad.json' is not valid JSON"),
    (["--results", "empty.json"], "--results: no codec timings in 'empty.json'"),
    (["--results", "r.json", "--links", "ib400,token"], "--links: unknown link 'token'"),
    (["--results", "r.json", "--compressors", "int4"], "--compressors: 'int4' is not measured"),
    (["--results", "r.json", "--gpus", "12"], "--gpus: 12 is not 2-8 GPUs"),
    (["--results", "r.json", "--nics-per-node", "9"], "--nics-per-node: must be 1-8"),
  ],
)
def test_predict_bad_input_names_the_flag(tmp_path, monkeypatch, capsys, argv, match):
  monkeypatch.chdir(tmp_path)
  _results(tmp_path / "r.json")
  (tmp_path / "bad.json").write_text('{"bench": [')
  (tmp_path / "empty.json").write_text('{"bench": []}')
  with pytest.raises(SystemExit) as e:
    bench_main.main(["predict", *argv])
  err = capsys.readouterr().err
  assert e.value.code == 2 and match in err and "Traceback" not in err, err


def test_predict_uses_measured_decode_sum(tmp_path, capsys):
  """decode_sum rows, where the results have them, time the decode_sum passes (no stand-in)."""
  from jcoccl.bench import predict as P
  from jcoccl.bench import speed_model as SM

  path = tmp_path / "r.json"
  _results(path, ops=("encode", "decode", "decode_sum"))
  data = json.loads(path.read_text())
  for r in data["bench"]:
    if r["op"] == "decode_sum":
      r["ms"] *= 2  # half the rate of the other kernels
  path.write_text(json.dumps(data))
  codec, notes, s = P.load_results([str(path)])["q8"], set(), 1 << 26
  assert SM.codec_s(codec, "one_shot", s, 8, notes) == pytest.approx(s / _G + 8 * s / (_G / 2))
  assert notes == set()
  assert bench_main.main(["predict", "--results", str(path), "--gpus", "8"]) == 0
  assert "not measured" not in capsys.readouterr().out


def test_predict_prefers_kernels_timed_with_cuda_events(tmp_path):
  """A "<kernel> [events]" row (the kernel alone) replaces the wall-clock row of the same
  codec, kernel and size; the payload ratio still comes from the wall-clock rows."""
  from jcoccl.bench import predict as P

  path = tmp_path / "r.json"
  _results(path)
  data = json.loads(path.read_text())
  wall = {r["op"]: r for r in data["bench"] if r["codec"] == "q8"}
  for op in ("decode", "decode_sum"):  # events: twice the wall-clock rate
    row = {**wall["decode"], "op": f"{op} [events]", "ms": wall["decode"]["ms"] / 2}
    data["bench"].append({**row, "gbs": 1.0})  # its gbs counts other bytes: not the ratio
  path.write_text(json.dumps(data))
  codec, s = P.load_results([str(path)])["q8"], 1 << 26
  assert codec.rate("decode", s)[0] == pytest.approx(2 * _G)
  assert codec.rate("decode_sum", s)[0] == pytest.approx(2 * _G)
  assert codec.rate("encode", s)[0] == pytest.approx(_G)
  assert codec.ratio == pytest.approx(_R)
