"""The arguments every compressed collective shares: compressors resolved (spec strings,
None for the exact path, the backward one), the dtypes lossy codecs take, ``chunks`` and
``tiled`` checked, and a compressor's payload ratio.

Example:
  >>> is_float(jnp.bfloat16), is_float(jnp.int32)
  (True, False)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src.base.axes import canonical_axes
from jcoccl._src.compressors import layout
from jcoccl._src.compressors.arith import FLOAT_DTYPES


def resolve_compressor(compressor: Any, argname: str = "compressor") -> Any:
  """A Compressor from a Compressor, spec string or None; None for the exact path.

  ``none()`` and None both mean "exact": the op calls the lax collective itself.
  """
  if compressor is None:
    return None
  if isinstance(compressor, str) and compressor.strip().startswith("auto:"):
    rest = compressor.strip()[len("auto:") :]
    raise ValueError(
      f"{argname}={compressor!r}: 'auto:' lets all_reduce's algorithm='auto' run the exact "
      f"op where that is predicted faster; it applies to jcoccl.all_reduce's compressor "
      f"(and a policy's all_reduce entry) only. Here write {rest!r} (error feedback: "
      f"{rest!r} with algorithm='auto_exact')"
    )
  if isinstance(compressor, str):
    from jcoccl import compressors as _c

    try:
      compressor = _c.parse(compressor)
    except ValueError as e:
      raise ValueError(f"{argname}: {e}") from None
  if not hasattr(compressor, "encode_rows") or not hasattr(compressor, "granule"):
    raise TypeError(
      f"{argname} must be a jcoccl Compressor, a spec string (e.g. 'int8') or None, "
      f"got {compressor!r}"
    )
  from jcoccl._src.compressors import registry

  try:
    registry.family_of(compressor)  # the ops carry it as its spec string
  except TypeError as e:
    raise TypeError(f"{argname}: {e}") from None
  if getattr(compressor, "kind", None) == "none":
    return None
  return compressor


def stochastic_codec(spec: Any) -> Any:
  """The first codec that ``spec`` names which rounds stochastically, or None.

  Args:
    spec: what a compressor argument takes: None, a Compressor, a spec string, an
      ``"auto:<spec>"`` string, or per-level pairs and dicts of these. A spec that does not
      parse gives None here: the op's own check names it.

  Returns:
    That Compressor, or None.

  Example:
    >>> str(stochastic_codec(("int8", "auto:int4:stochastic"))), stochastic_codec("int8")
    ('int4:stochastic', None)
  """
  if isinstance(spec, (tuple, list)):
    return next(filter(None, map(stochastic_codec, spec)), None)
  if isinstance(spec, dict):
    return stochastic_codec(list(spec.values()))
  if isinstance(spec, str) and spec.strip().startswith("auto:"):
    spec = spec.strip()[len("auto:") :]
  try:
    c = resolve_compressor(spec)
  except (ValueError, TypeError):
    return None
  return c if getattr(c, "stochastic", False) else None


def check_dtype(dtype: Any, compressor: Any, argname: str = "compressor") -> None:
  """Raises TypeError when a lossy ``compressor`` is given a non-floating ``dtype``."""
  if compressor is None or compressor.lossless:
    return
  if not is_float(dtype):
    raise TypeError(
      f"{argname} {compressor} is lossy and accepts float32, bfloat16 or float16 inputs; "
      f"got dtype {jnp.dtype(dtype).name} (pass compressor=None for this leaf)"
    )


def is_float(dtype: Any) -> bool:
  """float32, bfloat16 or float16: the dtypes lossy compressors take."""
  return jnp.dtype(dtype) in FLOAT_DTYPES


def is_lone_array(x: Any) -> bool:
  """True when ``x`` is one array rather than a container of them."""
  return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


SAME = "same"  # grad_compressor default: reuse the forward compressor


def resolve_grad_compressor(grad_compressor: Any, forward: Any) -> Any:
  """``grad_compressor`` resolved; the default ("same") is the forward compressor."""
  if isinstance(grad_compressor, str) and grad_compressor == SAME:
    return forward
  return resolve_compressor(grad_compressor, "grad_compressor")


def grad_for(x: jax.Array, grad_compressor: Any) -> Any:
  """The backward compressor for leaf ``x`` (dtype-checked; threshold applied in bwd)."""
  if grad_compressor is None or grad_compressor.lossless:
    return grad_compressor
  if not is_float(x.dtype):
    return None  # integer leaves have no cotangent to compress
  return grad_compressor


def canonical_args(
  axis_name: Any, compressor: Any, grad_compressor: Any, chunks: Any, tiled: Any = False
) -> tuple[tuple[str, ...], Any, Any]:
  """The arguments every compressed collective shares, checked and canonicalised.

  Args:
    axis_name: mesh axis name or tuple of names.
    compressor: Compressor, spec string or None.
    grad_compressor: the backward compressor (``SAME`` = ``compressor``).
    chunks: positive int.
    tiled: a bool, or 0/1 (ops without ``tiled`` pass the default).

  Returns:
    (axes tuple, forward compressor or None, backward compressor or None).

  Example:
    >>> canonical_args("data", "int8", SAME, 1)  # doctest: +SKIP
  """
  axes = canonical_axes(axis_name, empty=True)
  comp = resolve_compressor(compressor)
  gcomp = resolve_grad_compressor(grad_compressor, comp)
  check_chunks(chunks)
  # lax takes any truth value; 0 and 1 (and numpy's bools) are ones people write.
  if not (isinstance(tiled, (bool, int, np.bool_, np.integer)) and tiled in (0, 1)):
    raise TypeError(f"tiled must be a bool (or 0/1, as lax takes them), got {tiled!r}")
  return axes, comp, gcomp


def check_chunks(chunks: Any) -> int:
  """Checks that ``chunks`` is a positive int (its upper limit depends on the message:
  see :func:`jcoccl._src.compressors.layout.slices`)."""
  if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
    raise ValueError(f"chunks must be a positive int, got {chunks!r}")
  return chunks


def compression_ratio(compressor: Any, n: int, dtype: Any) -> float:
  """payload_nbytes / raw bytes for a row of ``n`` elements (granule-padded)."""
  n = layout.padded_len(n, compressor.granule)
  return compressor.payload_nbytes(n, dtype) / (n * jnp.dtype(dtype).itemsize)
