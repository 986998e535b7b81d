"""One process of tests/test_gspmd.py's two-process run (under ``python -m jcoccl.launch -n 2
--devices-per-process 4 -- python tests/gspmd_worker.py``): the single-process checks of
tests/gspmd_cases.py on a mesh over both processes' devices. Prints ``ok <case>`` per check;
a failure raises (non-zero exit)."""

from __future__ import annotations

import os
import sys

sys.path[:0] = [
  os.path.dirname(os.path.abspath(__file__)),
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
]

import jcoccl  # noqa: E402

assert jcoccl.distributed.initialize(), "expected to run under jcoccl.launch with -n >= 2"

import gspmd_cases as G  # noqa: E402


def main() -> None:
  mesh = G.make_mesh()
  for name, case in (("mlp", G.mlp(mesh)), ("lm", G.nnx_lm(mesh))):
    # The exact codec's sums across processes are the same for both models: the MLP's run
    # checks them (the LM's layout holds the MLP's; it runs int8, in one process both).
    if name == "mlp":
      exact, got, _ = G.exact_and(case, compressor="none")
      G.check_close(exact, got)
      print(f"ok {name}-none", flush=True)
    exact, (_, grads), _ = G.exact_and(
      case, compressor="int8", algorithm="two_shot", min_bytes=0, error_feedback=True
    )
    G.check_within(exact[1], grads, G.int8_bound(case))
    print(f"ok {name}-int8", flush=True)


if __name__ == "__main__":
  main()
