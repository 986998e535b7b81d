"""The GPU verification scripts run only on a GPU machine; here their own code is exercised.

tools/gpu_collectives.py `selfcheck` runs the worker's correctness checks and the timing
loop at world size 1 on the CPU (host transport), so a broken script is caught in CI rather
than in a scarce GPU session.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_gpu_collectives_selfcheck_on_cpu(tmp_path):
  out = tmp_path / "self.json"
  r = _run("tools/gpu_collectives.py", "selfcheck", "--sizes-mib", "1", "--iters", "1",
           "--out", str(out))
  assert r.returncode == 0, r.stdout + r.stderr
  assert json.loads(out.read_text())


def test_gpu_scripts_parse_their_arguments():
  for script in ("tools/gpu_codecs.py", "tools/gpu_collectives.py"):
    r = _run(script, "--help")
    assert r.returncode == 0, r.stdout + r.stderr
  r = subprocess.run(["bash", "-n", "tools/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
