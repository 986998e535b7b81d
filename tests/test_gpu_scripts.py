"""The GPU verification scripts, exercised on the CPU: every subcommand runs here at world
size 1 through the same code paths as on the GPU except the device (host transport instead
of NCCL, the C++ CPU codecs instead of the CUDA ones), so a broken script is caught in CI
rather than in a scarce GPU session."""

import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def _run(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
  base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run(
    [sys.executable, *args],
    cwd=ROOT,
    env={**base, **(env or {})},
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def test_gpu_scripts_parse_their_arguments():
  for script in (
    "tools/gpu_codecs.py",
    "tools/gpu_collectives.py",
    "tools/gpu_build.py",
    "tools/gpu_shim.py",
    "tools/gpu_ptx.py",
    "tools/gpu_plugin.py",
    "tools/cuda_ext.py",
    "tools/cuda_ext_check.py",
    "tools/xla_comm_probe.py",
  ):
    r = _run(script, "--help")
    assert r.returncode == 0, r.stdout + r.stderr
  r = subprocess.run(["bash", "-n", "tools/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu_runs_every_step(tmp_path):
  # The whole script in its CPU mode: build plan, import, codec check, single (fused vs xla
  # through shard_map: the Explicit-mesh defect made every row a mismatch), launch + worker
  # at world 1, timings, report; the output directory ends as the device tool needs it.
  out = tmp_path / "out"
  r = subprocess.run(
    ["bash", "tools/gpu_check.sh", "--cpu", str(out)],
    cwd=ROOT,
    env={
      **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
      "PYTHON": sys.executable,
      "JCOCCL_GPU_QUICK": "1",
    },
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
  assert sorted(os.listdir(out)) == ["logs.tgz", "summary.json", "summary.txt"]
  for name in (
    "build", "import", "codecs", "plugin", "single", "world1", "codec_bench", "bench1",
    "cuda_ext", "report",
  ):  # fmt: skip
    assert f"=== VERDICT [{name}] PASS" in r.stdout, name
  summary = json.loads((out / "summary.json").read_text())
  single = summary["single.json"]
  assert single["complete"] and single["mismatches"] == 0
  assert all(row["bit_identical"] for row in single["results"])
  assert any(row.get("fused_calls") for row in single["results"])  # the fused path ran
  assert summary["codecs.json"]["mismatches"] == [] and summary["codecs.json"]["cases"]
  assert summary["plugin.json"]["mismatches"] == [] and summary["plugin.json"]["cases"]
  world1 = summary["world1.json"]
  assert world1["complete"] and world1["mismatches"] == 0 and world1["checks"] > 0
  assert summary["bench1.json"]["bench"] and summary["codec_bench.json"]["bench"]
  cuda_ext = summary["cuda_ext.json"]  # the CUDA host code under the shim and emulated NCCL
  assert cuda_ext["ok"] and cuda_ext["mutations_caught"]
  assert all(cuda_ext["mutations_caught"].values())
  with tarfile.open(out / "logs.tgz") as t:
    names = t.getnames()
  assert "single.log" in names and "codecs.json" in names


def test_codec_reference_takes_inputs_as_arguments():
  # The reference once closed over x: XLA folded its conversions at compile time on the
  # host, and on CPU 18 cases (subnormal runs) then differed from the same spec at run time.
  import gpu_codecs
  import jax
  import jax.numpy as jnp

  from jcoccl import compressors as jc

  for c in (jc.int8(block_size=32), jc.int8(block_size=64, symmetric=False)):
    for dtype in (jnp.float32, jnp.bfloat16):
      assert gpu_codecs.check_case(jax, jnp, c, dtype) == ([], []), (c, dtype)


class _Stop(BaseException):  # not caught by the scripts' per-case error handling
  pass


def test_codec_results_are_written_case_by_case(tmp_path, monkeypatch):
  import gpu_codecs
  import jax
  import jax.numpy as jnp

  from jcoccl import compressors as jc

  calls = []

  def fake_case(jax_, jnp_, c, dtype):
    calls.append(c)
    if len(calls) == 3:
      raise _Stop  # the step's time limit strikes here
    return [], []

  monkeypatch.setattr(gpu_codecs, "check_case", fake_case)
  path = tmp_path / "codecs.json"
  res = gpu_codecs.Results(str(path), mismatches=None)
  with pytest.raises(_Stop):
    gpu_codecs.check(jax, jnp, jc, res)
  assert len(json.loads(path.read_text())["cases"]) == 2


def test_single_results_are_written_case_by_case(tmp_path, monkeypatch):
  import gpu_collectives
  import numpy as np

  n = []

  def equal_until_stopped(a, b):
    n.append(1)
    if len(n) == 8:
      raise _Stop
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))

  monkeypatch.setattr(gpu_collectives, "_bits_equal", equal_until_stopped)
  out = tmp_path / "single.json"
  with pytest.raises(_Stop):
    gpu_collectives.main(
      ["single", "--platform", "cpu", "--compressors", "^int8$", "--out", str(out)]
    )
  got = json.loads(out.read_text())
  assert not got["complete"] and len(got["results"]) == 7
  import jcoccl

  jcoccl.shutdown()


def _fake_nvcc(d: Path) -> Path:
  p = d / "nvcc"
  p.write_text("#!/bin/sh\nexit 0\n")
  p.chmod(p.stat().st_mode | stat.S_IXUSR)
  return p


def test_gpu_build_finds_nvcc_off_path(tmp_path):
  import gpu_build

  nvcc = _fake_nvcc(tmp_path)
  assert gpu_build.find_nvcc({"CUDACXX": str(nvcc), "PATH": ""}) == str(nvcc)
  assert gpu_build.find_nvcc({"PATH": str(tmp_path)}) == str(nvcc)
  cfg, build = gpu_build.cmake_cmds("py", str(nvcc), tmp_path / "b")
  assert f"-DCMAKE_CUDA_COMPILER={nvcc}" in cfg and "-DJCOCCL_CUDA=ON" in cfg
  assert build[:2] == ["cmake", "--build"]
  r = _run("tools/gpu_build.py", "--dry-run", env={"CUDACXX": str(nvcc)})
  assert r.returncode == 0 and f"nvcc: {nvcc}" in r.stdout, r.stdout + r.stderr
  assert "--no-build-isolation --no-deps -e" in r.stdout and "cmake -S" in r.stdout


def test_report_gives_median_and_spread_over_rounds(tmp_path):
  """Timings repeated in rounds (bench2_r1.json, ...) are summarised per figure."""
  import gpu_collectives

  def launch(us: float, nccl_us: float) -> dict:
    rows = [
      dict(
        op="all_reduce",
        bytes=64,
        compressor=c,
        time_us=t,
        speedup_vs_nccl=nccl_us / t,
        algbw_GBps=1.0,
        busbw_GBps=1.0,
      )
      for c, t in (("nccl", nccl_us), ("int8", us))
    ]
    return {
      "kind": "launch",
      "world": 2,
      "refused": False,
      "returncodes": ["0", "0"],
      "mismatches": 0,
      "bench": rows,
    }

  for r, (us, nccl_us) in enumerate([(10.0, 40.0), (30.0, 45.0), (20.0, 50.0)], 1):
    (tmp_path / f"bench2_r{r}.json").write_text(json.dumps(launch(us, nccl_us)))
  for r, gbs in enumerate([300.0, 100.0], 1):
    row = {"codec": "int8", "mib": 256, "op": "encode", "gbs": gbs, "ms": 1.0}
    (tmp_path / f"codec_bench_r{r}.json").write_text(json.dumps({"bench": [row], "cases": []}))
  assert gpu_collectives.main(["report", "--dir", str(tmp_path)]) == 0
  spread = json.loads((tmp_path / "summary.json").read_text())["spread"]
  t = spread["collectives"]["world 2 all_reduce 64 int8"]["time_us"]
  assert (t["median"], t["min"], t["max"], t["rounds"]) == (20.0, 10.0, 30.0, 3)
  s = spread["collectives"]["world 2 all_reduce 64 int8"]["speedup_vs_nccl"]
  assert (s["median"], s["min"], s["max"]) == (2.5, 1.5, 4.0)
  g = spread["codecs_gbs"]["256 MiB int8 encode"]
  assert (g["median"], g["min"], g["max"], g["rounds"]) == (200.0, 100.0, 300.0, 2)
  assert "# medians over rounds" in (tmp_path / "summary.txt").read_text()
