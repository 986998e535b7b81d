"""Multi-process set-up: join JAX's distributed runtime from the launcher's environment.

Example:
  >>> import jcoccl.distributed
  >>> jcoccl.distributed.initialize()   # under `python -m jcoccl.launch -n 2 -- ...`: True
  False
"""

from jcoccl._src.native.distributed import environment as environment
from jcoccl._src.native.distributed import initialize as initialize
