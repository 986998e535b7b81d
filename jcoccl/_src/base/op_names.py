"""The collectives jcoccl has, by name, and the dual of each: the one table every other
list of ops is read from (the primitives' registry, the backends' registry, a policy's
op names). No imports, so that any module may read it.

Example:
  >>> OPS[0], DUALS["all_gather"]
  ('all_reduce', 'reduce_scatter')
"""

# The dual (transpose) of each collective: the op that carries cotangents back.
DUALS = {
  "all_reduce": "all_reduce",
  "all_gather": "reduce_scatter",
  "reduce_scatter": "all_gather",
  "all_to_all": "all_to_all",
  "ppermute": "ppermute",
}
OPS = tuple(DUALS)
