"""jcoccl across processes on JAX's own runtime, started by ``python -m jcoccl.launch``:
every op against lax on 2 and 4 processes, a process killed mid-run, the launcher's exit
status, and its network namespace (a rate-limited loopback, removed afterwards)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from mp_util import kill_when_ready

from jcoccl import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_worker.py")


def _launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "jcoccl.launch", *args]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# Two processes of one device each run as four do (one rank per process on the 'proc' axis);
# two processes are covered by (2, 2), where the ops span both axes.
@pytest.mark.parametrize("procs,devices", [(4, 1), (2, 2)])
def test_ops_across_processes_match_lax(procs, devices):
  r = _launch(
    "-n", str(procs), "--devices-per-process", str(devices), "--", sys.executable, WORKER, "ops"
  )
  assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
  for rank in range(procs):
    oks = re.findall(rf"^\[{rank}\] ok (.*)$", r.stdout, re.M)
    # 2 compressors x (2 all_reduce algorithms + 4 ops), and fused init refused
    assert len(oks) == 13, (rank, oks)
    assert f"[{rank}] done" in r.stdout


def test_process_env(monkeypatch):
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_foo=1")
  env = launch.process_env(2, 4, 1234, 3, "rate=1gbit")
  assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
  assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("4", "2")
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=3"
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # the user's wins
  assert launch.process_env(0, 4, 1234, 3, "")["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


def test_launcher_exit_status_is_the_failed_process():
  code = (
    "import os, sys, time; rank = int(os.environ['JAX_PROCESS_ID']); "
    "print('rank', rank, os.environ['JAX_NUM_PROCESSES'], flush=True); "
    "sys.exit(3) if rank == 1 else time.sleep(60)"
  )
  t0 = time.monotonic()
  r = _launch("-n", "3", "--kill-after", "1", "--", sys.executable, "-c", code)
  assert r.returncode == 3, r.stdout + r.stderr
  assert time.monotonic() - t0 < 30  # the sleepers were stopped, not waited for
  assert {"[0] rank 0 3", "[1] rank 1 3", "[2] rank 2 3"} <= set(r.stdout.splitlines())
  assert "process 1 exited with status 3" in r.stderr


@pytest.mark.parametrize(
  "argv,message",
  [
    (["-n", "0", "--", "true"], "--processes must be >= 1"),
    (["-n", "2"], "give the program after --"),
    (["-n", "2", "--link-rate", "fast", "--", "true"], "--link-rate must be a positive rate"),
    (["-n", "2", "--link-delay", "soon", "--", "true"], "--link-delay must be a time"),
  ],
)
def test_launcher_rejects_bad_arguments(argv, message, capsys):
  # In this process: the arguments are refused before anything starts, by the main() that
  # `python -m jcoccl.launch` exits with (its exit status runs through in the tests above).
  with pytest.raises(SystemExit) as e:
    launch.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and message in err, err


@pytest.mark.slow
def test_killed_process_stops_the_others():
  """kill -9 of one process: the others fail with an error, well within 60 s, by themselves
  (the launcher would wait 120 s before terminating them)."""
  cmd = [
    sys.executable,
    "-m",
    "jcoccl.launch",
    "-n",
    "3",
    "--kill-after",
    "120",
    "--",
    sys.executable,
    WORKER,
    "loop",
  ]
  took, out, rc = kill_when_ready(
    cmd, ROOT, r"\[(\d)\] process \d/3 pid (\d+)", r"\[(\d)\] step 4$", {0, 1, 2}, 1
  )
  assert rc != 0
  assert took < 60, f"others took {took:.0f} s to stop"
  for rank in (0, 2):  # each survivor says why it stopped
    assert re.search(rf"^\[{rank}\] .*(Gloo|heartbeat|another task died)", out, re.M), out[-3000:]


needs_netns = pytest.mark.skipif(
  os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
  reason="link shaping needs root and iproute2 (ip, tc)",
)

# Process 0 sends 4 MiB to process 1 over 127.0.0.1 and prints the time it took.
_TRANSFER = r"""
import os, socket, time
rank, port = int(os.environ["JAX_PROCESS_ID"]), int(os.environ["JAX_COORDINATOR_ADDRESS"].split(":")[1]) + 1
n = 4 << 20
if rank == 1:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port)); s.listen(1); c, _ = s.accept(); got = 0
    while got < n:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    c.sendall(b"k"); print("received", got, flush=True)
else:
    for _ in range(200):
        try: c = socket.create_connection(("127.0.0.1", port)); break
        except OSError: time.sleep(0.05)
    t0 = time.perf_counter(); c.sendall(b"x" * n); c.recv(1); dt = time.perf_counter() - t0
    print(f"seconds {dt:.4f}", flush=True)
"""


@needs_netns
def test_link_rate_limits_a_transfer_and_the_namespace_goes_away():
  before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  r = _launch("-n", "2", "--link-rate", "100mbit", "--", sys.executable, "-c", _TRANSFER)
  assert r.returncode == 0, r.stdout + r.stderr
  assert f"[1] received {4 << 20}" in r.stdout
  seconds = float(re.search(r"\[0\] seconds ([\d.]+)", r.stdout).group(1))
  # 4 MiB at 100 Mbit/s cannot take less than 0.336 s; the token bucket may hand out its
  # burst (512 KiB) at once, so at least (4 MiB - 512 KiB) * 8 / 1e8 = 0.29 s. Unshaped
  # loopback moves it in a few milliseconds.
  assert seconds >= ((4 << 20) - (512 << 10)) * 8 / 1e8, seconds
  after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  assert after == before


@needs_netns
def test_namespace_removed_on_interrupt():
  with launch.LinkNamespace(rate="1gbit") as ns:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns.name in listed
    qdisc = subprocess.run(
      ns.wrap(["tc", "qdisc", "show", "dev", "lo"]), capture_output=True, text=True
    ).stdout
    assert "tbf" in qdisc and "1Gbit" in qdisc
  assert (
    ns.name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  )
  # Ctrl-C of the launcher: its namespace goes too.
  p = subprocess.Popen(
    [sys.executable, "-m", "jcoccl.launch", "-n", "1", "--link-rate", "1gbit", "--", "sleep", "60"],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    for _ in range(200):
      names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
      if f"jcoccl-{p.pid}-" in names:
        break
      time.sleep(0.05)
    else:
      raise AssertionError("the launcher made no namespace")
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 130
  finally:
    if p.poll() is None:
      p.kill()
  names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  assert f"jcoccl-{p.pid}-" not in names


def test_bench_collectives_across_processes():
  import json

  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "jcoccl.bench",
      "collectives",
      "--processes",
      "2",
      "--sizes",
      "64KiB",
      "--ops",
      "all_reduce,ppermute",
      "--compressors",
      "int8",
      "--algorithms",
      "two_shot",
      "--iters",
      "1",
      "--json",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
  text = "\n".join(
    line[4:]
    for line in r.stdout.splitlines()
    if line.startswith("[0] ") and not line.startswith("[0] [Gloo]")
  )
  rows = json.loads(text[text.index("[") :])
  assert [(row["op"], row["compressor"]) for row in rows] == [
    ("all_reduce", "lax"),
    ("all_reduce", "int8"),
    ("ppermute", "lax"),
    ("ppermute", "int8"),
  ]
  for row in rows:
    assert row["processes"] == 2 and row["ranks"] == 2 and row["speedup"] > 0
  assert rows[0]["max_abs_err"] == 0 and 0 < rows[1]["wire_ratio"] < 0.3
  assert not any(line.startswith("[1]") and '"op"' in line for line in r.stdout.splitlines())


@needs_netns
def test_calibrate_compresses_the_slow_cross_process_axis(tmp_path):
  """2 processes x 2 devices on a 200 Mbit/s link: the 'proc' axis crosses the link, where
  int8 sends a quarter of the bytes (predicted several times faster than lax.psum at
  16 MiB); 'local' stays inside each process. Decisions, not timings, are asserted."""
  import json

  out = tmp_path / "model.json"
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "jcoccl.bench",
      "calibrate",
      "--processes",
      "2",
      "--devices-per-process",
      "2",
      "--link-rate",
      "200mbit",
      # Past the 200 Mbit/s link's burst at 2 MiB already; larger sizes only add seconds.
      "--sizes",
      "64KiB,512KiB,2MiB",
      "--other-codec",
      "hadamard(int4)",
      "--out",
      str(out),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
  text = "\n".join(
    line[4:]
    for line in r.stdout.splitlines()
    if line.startswith("[0] ") and not line.startswith("[0] [Gloo]")
  )
  report = json.loads(text[text.index("{") :])
  assert report["mesh"] == {"proc": 2, "local": 2}
  assert report["choices"]["proc"]["16MiB"] == "one_shot", report
  import jcoccl

  models = jcoccl.read_cost_model(str(out))
  assert [(a, op) for a, op, _ in models.entries] == [
    ("proc", "all_reduce"),
    ("local", "all_reduce"),
  ]
  assert all(m.calibrated for _, _, m in models.entries)
  assert [spec for spec, _ in models.codecs] == ["hadamard(int4)"]
  assert list(report["codecs"]) == ["hadamard(int4)"]
