"""One process of the multi-process training tests (tests/test_train_multiprocess.py):
``python -m models.train`` with a visible, slowed-down step loop, so that a test can kill a
process in the middle of training. (test_custom_codec runs it alone, not slowed, for its
crafted calibration.)

    python -m jcoccl.launch -n 2 --devices-per-process 4 -- \\
        python tests/mp_train_worker.py SLOW_FROM SECONDS <models.train arguments>

Prints ``pid <pid>`` once and ``batch <step>`` before each training step; from step
SLOW_FROM on, each batch takes SECONDS longer (the test's time to kill a process while the
others are still training). With JCOCCL_TEST_CALIBRATION=compress or =exact, the start-up
calibration installs :func:`crafted` instead of measuring (the same table on every process,
whatever the machine's timings). With JCOCCL_TEST_ADAPT_LOG=1, every process prints what
each --adapt probe measured and the bits it chose (``adapt <json>``; models.train itself
logs the changes on process 0 only), for a test to compare between processes. With
JCOCCL_TEST_REPORT_MODULES=1 it prints, as the process exits (a signal's stop included),
``modules error_probe=<True|False>``: whether the run imported models.error_probe, which
only --adapt and the tuner need. Everything else is models.train unchanged.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jcoccl
from models import adaptive, loop, train


def log_adapt_probes() -> None:
  """Makes every process print each probe's measurements and the bits chosen."""
  update = adaptive.Adaptive.update

  def logged(self, step, measured):
    rec = update(self, step, measured)
    seen = {k: measured.get(k) for k in ("noise", "injected", "sensitivity")}
    print("adapt " + json.dumps({"step": step, **seen, "bits": self.bits}), flush=True)
    return rec

  adaptive.Adaptive.update = logged


def crafted(winner: str, mesh) -> jcoccl.CostModels:
  """A calibrated table for every axis of ``mesh`` of size > 1 under which auto's choice is
  certain: ``winner="compress"`` (a free link and codec, a slow exact op) or ``"exact"``.
  The resume tests calibrate with one and would re-measure with the other: a resumed run
  that measured again would change its choices, and so its numbers."""
  fast, slow = (1e-9, 1e15), (1.0, 1e3)
  (a, b), (xa, xb) = (fast, slow) if winner == "compress" else (slow, fast)
  model = jcoccl.CostModel(a, b, b, f"test: {winner} wins", exact_alpha_s=xa, exact_beta_Bps=xb)
  entries = tuple((ax, "all_reduce", model) for ax in mesh.axis_names if mesh.shape[ax] > 1)
  return jcoccl.CostModels(entries, f"test: {winner} wins")


def fake_calibrate(winners: list[str]):
  """A stand-in for ``jcoccl.calibrate``: its n-th call installs and returns
  ``crafted(winners[n])`` (the last one for later calls)."""
  calls: list[str] = []

  def calibrate(mesh, **_kw):
    winner = winners[min(len(calls), len(winners) - 1)]
    calls.append(winner)
    models = crafted(winner, mesh)
    jcoccl.set_cost_model(models)
    return models

  calibrate.calls = calls
  return calibrate


def main(argv: list[str]) -> None:
  slow_from, seconds, rest = int(argv[0]), float(argv[1]), argv[2:]
  batch_at = loop.batch_at

  def slowed(corpus, cfg, par, split, step, i=0):
    if split == "train":
      print(f"batch {step}", flush=True)
      if step >= slow_from:
        time.sleep(seconds)
    return batch_at(corpus, cfg, par, split, step, i)

  loop.batch_at = slowed  # the name the training loop looks up at each step
  winner = os.environ.get("JCOCCL_TEST_CALIBRATION")
  if winner:
    jcoccl.calibrate = fake_calibrate([winner])
  if os.environ.get("JCOCCL_TEST_ADAPT_LOG") == "1":
    log_adapt_probes()
  if os.environ.get("JCOCCL_TEST_REPORT_MODULES") == "1":
    atexit.register(lambda: print(f"modules error_probe={'models.error_probe' in sys.modules}"))
  print(f"pid {os.getpid()}", flush=True)
  train.main(rest)


if __name__ == "__main__":
  main(sys.argv[1:])
