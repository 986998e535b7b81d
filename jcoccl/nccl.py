"""jcoccl.nccl: compress the collectives XLA issues through NCCL, with no change to the code.

``python -m jcoccl.nccl --policy p.toml -- python train.py`` runs a program with
libjcoccl_nccl.so in front of the real NCCL; :func:`enable` does the same from inside a
program (after ``import jax``, before the GPU backend starts). See docs/nccl.md.

Example:
  >>> import jax, jcoccl.nccl
  >>> jcoccl.nccl.enable("p.toml")   # doctest: +SKIP
"""

import sys

from jcoccl._src.engine.nccl_interposer import Rule as Rule
from jcoccl._src.engine.nccl_interposer import counters as counters
from jcoccl._src.engine.nccl_interposer import describe as describe
from jcoccl._src.engine.nccl_interposer import enable as enable
from jcoccl._src.engine.nccl_interposer import library_path as library_path
from jcoccl._src.engine.nccl_interposer import main as _main
from jcoccl._src.engine.nccl_interposer import real_nccl_path as real_nccl_path
from jcoccl._src.engine.nccl_interposer import resolve as resolve
from jcoccl._src.engine.nccl_interposer import status as status

if __name__ == "__main__":
  sys.exit(_main())
