"""Codec methods called outside a trace run as one compiled program.

Called eagerly, a jnp codec would dispatch each of its dozens of small ops on its own, and
JAX compiles every op for every new shape and dtype: about 50 ms each on a CPU, so an
``encode`` of a new shape cost seconds. :func:`one_program` wraps a method so that an eager
call compiles the whole method once per (codec, shapes, dtypes, static arguments), cached by
``jax.jit``; under a trace (jit, vmap, grad, shard_map) the method runs as written.

Example:
  >>> class C(Compressor):
  ...   @one_program
  ...   def encode(self, x, *, key=None, impl="auto"): ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jcoccl._src import _compat


def _is_array(leaf: Any) -> bool:
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _program(method: Callable[..., Any], c: Any, treedef: Any, static: tuple, *arrays: Any) -> Any:
  fixed = {i: value for i, _, value in static}
  rest = iter(arrays)
  leaves = [fixed[i] if i in fixed else next(rest) for i in range(len(static) + len(arrays))]
  args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
  return method(c, *args, **kwargs)


def one_program[F: Callable[..., Any]](method: F) -> F:
  """Wraps a codec method: eager calls compile it whole (see the module docstring).

  Array arguments (also inside pytrees such as a Payload) are the program's inputs; every
  other leaf (row lengths, dtypes, "impl") is static, keyed with its type so that ``3`` and
  ``3.0`` never share a program. A codec or argument that cannot be hashed runs as written.

  Args:
    method: a method of a hashable codec; its results must be arrays or pytrees of them.

  Returns:
    The wrapped method.
  """

  @functools.wraps(method)
  def run(self: Any, *args: Any, **kwargs: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    if _compat.is_traced(*leaves):
      return method(self, *args, **kwargs)
    static = tuple((i, type(v), v) for i, v in enumerate(leaves) if not _is_array(v))
    try:
      hash((self, static))
    except TypeError:
      return method(self, *args, **kwargs)
    arrays = [v for v in leaves if _is_array(v)]
    return _program(method, self, treedef, static, *arrays)

  return run  # type: ignore[return-value]
