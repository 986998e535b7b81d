"""One process of the multi-process training tests (tests/test_train_multiprocess.py):
``python -m models.train`` with a visible, slowed-down step loop, so that a test can kill a
process in the middle of training.

    python -m jcoccl.launch -n 2 --devices-per-process 4 -- \\
        python tests/mp_train_worker.py SLOW_FROM SECONDS <models.train arguments>

Prints ``pid <pid>`` once and ``batch <step>`` before each training step; from step
SLOW_FROM on, each batch takes SECONDS longer (the test's time to kill a process while the
others are still training). Everything else is models.train unchanged.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import loop, train


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
  print(f"pid {os.getpid()}", flush=True)
  train.main(rest)


if __name__ == "__main__":
  main(sys.argv[1:])
