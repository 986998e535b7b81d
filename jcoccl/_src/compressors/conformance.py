"""Conformance check: the properties every codec must have, run on any Compressor.

``check(codec)`` exercises a codec only through its public methods (``encode_rows``,
``decode_rows``, ``decode_sum``, ``decode_sum_encode``, ``payload_nbytes``, ``error_bound``,
``encode``/``decode``), with ``impl="jnp"`` and, where a kernel exists, ``impl="native"``;
built-in codecs, registered user codecs and native plugins are checked alike.

Properties (one table row per property, dtype and row length):

  =================  ==========================================================================
  bound              ``|x - decode(encode(x))| <= error_bound(x)`` on adversarial finite data
                     (spikes, heavy tails, constant and zero blocks, subnormals, +-max finite,
                     several scales) and on the finite blocks of rows with NaN/Inf; lossless
                     codecs round-trip bit for bit (NaN payloads included)
  nonfinite          NaN/Inf inputs decode to NaN/Inf (never to a finite value)
  payload_size       ``encode_rows``, ``encode`` and ``decode_sum_encode`` produce
                     ``payload_nbytes`` bytes per row, at several row lengths
  decode_total       valid payloads and any bytes (random, 0x00, 0xff, NaN patterns) decode
                     without error, to the right shape and dtype, within ``time_limit_s``
                     (jnp and native)
  decode_in_bounds   the jnp decoders never index outside their buffer (``checkify``'s index
                     checks: jnp would otherwise clamp such reads silently)
  native_match       native == jnp bit for bit for every op with a kernel (SKIP without one)
  deterministic      encoding or decoding the same input twice gives the same bits
  decode_sum_order   ``decode_sum`` is the float32 left fold of the decoded rows in row order,
                     cast once (NaN compared as NaN); ``decode_sum_encode`` is
                     ``encode(decode_sum)`` bit for bit
  =================  ==========================================================================

A property that cannot run because another failed (no round trip when the encoder writes the
wrong size; nothing to compare when a decoder raises) is SKIP, naming the failing one. Native
decoders run on the same garbage in decode_total; a read outside a buffer in native code
shows only under a sanitizer (``tools/asan_fuzz.sh``). Stochastic codecs run with
``jax.random.key(seed)``: the bound is their stochastic bound, determinism is for that key.

Example:
  >>> import jcoccl.compressors as jc
  >>> r = jc.check(jc.int8(), dtypes=("float32",), verbose=False)
  >>> bool(r), r.failures
  (True, [])
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jcoccl._src.compressors._base import Compressor
from jcoccl._src.compressors.conformance_inputs import OPS as OPS
from jcoccl._src.compressors.conformance_inputs import inputs, row_length, short
from jcoccl._src.compressors.conformance_props import (
  Ctx,
  Skip,
  check_bound,
  check_deterministic,
  check_in_bounds,
  check_native,
  check_payload_size,
  check_sum_order,
  check_total,
)
from jcoccl._src.compressors.conformance_result import PROPERTIES as PROPERTIES
from jcoccl._src.compressors.conformance_result import CheckResult as CheckResult
from jcoccl._src.compressors.conformance_result import Row as Row

# One codec of every built-in family (the set `python -m jcoccl check-codec --all-builtins`
# checks).
BUILTINS = (
  "none",
  "bf16",
  "fp16",
  "int8",
  "int4",
  "int2",
  "int7",
  "int6",
  "int5",
  "int3",
  "int8:asym",
  "int5:asym",
  "int2:asym",
  "int8:stochastic",
  "fp8",
  "fp8:e5m2",
  "eb:abs=0.001",
  "hadamard(int4)",
  "spike(int4)",
)


# ---- driver -------------------------------------------------------------------------------


def check(
  codec: Compressor,
  *,
  dtypes: Sequence[Any] = ("float32", "bfloat16", "float16"),
  seed: int = 0,
  sizes: Sequence[int] | None = None,
  time_limit_s: float = 60.0,
  verbose: bool = True,
) -> CheckResult:
  """Runs every conformance property on ``codec`` and prints the table.

  Args:
    codec: a Compressor (built-in, registered user codec or native plugin).
    dtypes: input dtypes to check (float32, bfloat16, float16).
    seed: seeds the random inputs and, for stochastic codecs, the rounding key.
    sizes: row lengths to run at (multiples of the granule); default one, two granules
      and at least 64 elements. Each size reruns every property (and compiles again).
    time_limit_s: the longest one decode of garbage bytes may take (compilation included).
    verbose: print the table.

  Returns:
    A :class:`CheckResult`: falsy when any property fails; ``.failures``, ``.rows``,
    ``.table()``.

  Example:
    >>> r = check(jc.int4(), dtypes=("float32",), verbose=False)
    >>> r.status("bound")
    {'PASS'}
  """
  if not isinstance(codec, Compressor):
    raise TypeError(
      f"codec must be a jcoccl.compressors.Compressor, got {type(codec).__name__}; "
      "build one with a factory (jc.int8()) or jc.parse('int8')"
    )
  t0 = time.perf_counter()
  result = CheckResult(str(codec))
  lengths = [row_length(codec)] if sizes is None else [codec._check_n(n, "sizes") for n in sizes]
  key = jax.random.key(seed)
  for dt in dtypes:
    d = codec._check_dtype(dt)
    for n in lengths:
      result.rows += [
        dataclasses.replace(r, n=n) for r in _check_dtype(codec, d, n, key, seed, time_limit_s)
      ]
  result.rows.sort(key=lambda r: PROPERTIES.index(r.prop))
  result.seconds = time.perf_counter() - t0
  if verbose:
    print(result.table(), flush=True)
  return result


def _check_dtype(c, d, n, key, seed, limit_s) -> list[Row]:
  ctx = Ctx(c, n, d, key, inputs(c, n, d, seed), limit_s)
  rows = [_guard("payload_size", d, lambda: check_payload_size(c, d, key, n))]
  rows.append(_guard("decode_total", d, lambda: check_total(ctx)))
  rows += _guard_pair(("bound", "nonfinite"), d, lambda: check_bound(ctx))
  checks: dict[str, Callable[[Ctx], Row]] = {
    "decode_in_bounds": check_in_bounds,
    "native_match": check_native,
    "deterministic": check_deterministic,
    "decode_sum_order": check_sum_order,
  }
  for prop, fn in checks.items():
    rows.append(_guard(prop, d, functools.partial(fn, ctx)))
  return rows


def _guard(prop: str, d: jnp.dtype, fn: Callable[[], Row]) -> Row:
  """``fn()``, or a FAIL row naming the exception it raised (SKIP: no valid payload)."""
  try:
    return fn()
  except Skip as e:
    return Row(prop, d.name, "SKIP", str(e))
  except Exception as e:
    return Row(prop, d.name, "FAIL", f"raised {short(e)}")


def _guard_pair(props: tuple[str, str], d: jnp.dtype, fn: Callable) -> tuple[Row, Row]:
  try:
    return fn()
  except Skip as e:
    return tuple(Row(p, d.name, "SKIP", str(e)) for p in props)  # type: ignore[return-value]
  except Exception as e:
    return tuple(Row(p, d.name, "FAIL", f"raised {short(e)}") for p in props)  # type: ignore[return-value]
