"""The conformance check's inputs (adversarial rows, garbage payloads), its compiled
pieces (each op compiled once per dtype and length) and its bit comparisons."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src.compressors import native
from jcoccl._src.compressors._base import Compressor

OPS = ("encode", "decode", "decode_sum", "decode_sum_encode")
_NAN_PATTERNS = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800000, 0x7F800000)


# ---- inputs -------------------------------------------------------------------------------


def row_length(c: Compressor) -> int:
  """Two granules, and at least 64 elements: small, and every block-wise scenario fits."""
  g = int(c.granule)
  return g * max(2, -(-64 // g))


def scenarios(n: int, block: int, dtype: jnp.dtype, rng: np.random.Generator) -> dict:
  """Finite adversarial rows (float64, representable in ``dtype``), by name."""
  fi = jnp.finfo(dtype)
  fmax, tiny = float(fi.max), float(fi.tiny)
  sub = float(fi.smallest_subnormal)
  top = np.log2(fmax) - 8  # the largest scale that leaves room for outliers

  def normal(exp: int) -> np.ndarray:
    return rng.standard_normal(n) * 2.0 ** min(exp, int(top))

  spike = normal(0)
  starts = np.arange(0, n - block + 1, block)
  spike[starts + rng.integers(0, block, len(starts))] = 2.0 ** min(14, top)
  rows = {
    "normal": normal(0),
    **{f"normal*2^{min(e, int(top))}": normal(e) for e in (-20, 20, 100)},
    "spike": spike,
    "cauchy": rng.standard_cauchy(n),
    "student_t2": rng.standard_t(2, n) * 2.0**10,
    "constant": np.full(n, -3.3),
    "zeros": np.zeros(n),
    "subnormals": sub * rng.integers(-1000, 1000, n),
    "tiny_mixed": np.where(np.arange(n) % 3 == 0, tiny, sub * np.arange(n)),
    "max_finite": np.where(np.arange(n) % 2 == 0, fmax, -fmax),
    "max_and_normal": np.where(np.arange(n) % 7 == 0, fmax, rng.standard_normal(n)),
  }
  return {k: np.clip(v, -fmax, fmax) for k, v in rows.items()}


def nonfinite_rows(n: int, block: int) -> dict:
  """Rows with NaN/Inf in their first block and finite data elsewhere."""
  base = np.linspace(-2.0, 2.0, n)
  out = {}
  for name, v in (("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)):
    r = base.copy()
    r[block // 3] = v
    out[f"{name}_in_block"] = r
  r = base.copy()
  r[:block] = np.nan
  r[min(block, n - 1)] = np.inf
  out["nan_block"] = r
  return out


def as_dtype(x: np.ndarray, dtype: jnp.dtype) -> np.ndarray:
  with np.errstate(over="ignore", invalid="ignore"):
    return np.asarray(x, np.float64).astype(np.float32).astype(dtype)


def nan_payload_row(n: int, dtype: jnp.dtype) -> np.ndarray:
  """A row of NaNs with odd sign and payload bits (signalling too), then normal values."""
  utype = {4: np.uint32, 2: np.uint16}[dtype.itemsize]
  pats = [0x7F800001, 0xFFC12345, 0x7FC00001] if dtype.itemsize == 4 else [0x7F81, 0xFFC5]
  if dtype == jnp.float16:
    pats = [0x7C01, 0xFE05]
  x = np.linspace(-1.0, 1.0, n).astype(np.float32).astype(dtype)
  v = x.view(utype)
  v[: len(pats)] = np.array(pats, utype)
  return x


@dataclasses.dataclass
class Inputs:
  """The data one dtype's checks share: rows [R, n] and garbage payloads [k, R, P]."""

  names: list[str]
  x: np.ndarray
  finite_rows: int
  garbage_names: list[str]
  garbage: np.ndarray


def inputs(c: Compressor, n: int, dtype: jnp.dtype, seed: int) -> Inputs:
  rng = np.random.default_rng(seed)
  block = min(c.granule if c.granule > 1 else 32, n)
  fin = scenarios(n, block, dtype, rng)
  bad = nonfinite_rows(n, block)
  names = list(fin) + list(bad)
  x = np.stack([as_dtype(v, dtype) for v in (*fin.values(), *bad.values())])
  rows, p = x.shape[0], c.payload_nbytes(n, dtype)
  garbage = {
    "random": rng.integers(0, 256, (rows, p), dtype=np.uint8),
    "random2": rng.integers(0, 256, (rows, p), dtype=np.uint8),
    "0x00": np.zeros((rows, p), np.uint8),
    "0xff": np.full((rows, p), 0xFF, np.uint8),
  }
  for pat in _NAN_PATTERNS:
    word = np.frombuffer(np.uint32(pat).tobytes(), np.uint8)
    garbage[f"{pat:#010x}"] = np.resize(word, rows * p).reshape(rows, p)
  return Inputs(names, x, len(fin), list(garbage), np.stack(list(garbage.values())))


# ---- compiled pieces ----------------------------------------------------------------------


def encoder(c: Compressor, impl: str) -> Callable:
  """jit of (x, key) -> (encode_rows bytes, per-row error_bound or None)."""

  def run(x, key):
    buf = c.encode_rows(x, key=key, impl=impl)
    # Row by row: error_bound flattens its argument, and a codec may treat rows apart.
    return buf, jax.vmap(c.error_bound)(x) if impl == "jnp" else None

  return jax.jit(run)


def fold(c: Compressor, buf: jax.Array, n: int, dtype: jnp.dtype) -> jax.Array:
  """The documented decode_sum: float32 decodes of each row, a left fold, one cast."""
  rows = jax.lax.optimization_barrier(c._decode_wide(buf, n, dtype))
  acc = rows[0]
  for i in range(1, rows.shape[0]):
    acc = acc + rows[i]
  return acc.astype(dtype)


def decode_ops(c: Compressor, n: int, dtype: jnp.dtype, impl: str) -> Callable:
  """(buf, key) -> dict of decode, decode_sum, decode_sum_encode (None where ``impl`` is
  native and no kernel exists), reencode (jnp encode of decode_sum) and, for jnp, fold."""

  def has(op: str) -> bool:
    return impl == "jnp" or native.available(c, op, dtype)

  def run(buf, key):
    s = c.decode_sum(buf, n, dtype, impl=impl) if has("decode_sum") else None
    se = (
      c.decode_sum_encode(buf, n, dtype, key=key, impl=impl) if has("decode_sum_encode") else None
    )
    return {
      "decode": c.decode_rows(buf, n, dtype, impl=impl) if has("decode") else None,
      "decode_sum": s,
      "decode_sum_encode": se,
      "reencode": None if s is None else c.encode_rows(s[None], key=key, impl="jnp")[0],
      "fold": fold(c, buf, n, dtype) if impl == "jnp" else None,
    }

  return run


def timed(fn: Callable, limit_s: float) -> Any:
  """``fn()`` in a daemon thread; TimeoutError if it has not returned after ``limit_s``."""
  box: dict[str, Any] = {}

  def target():
    try:
      box["out"] = jax.block_until_ready(fn())
    except BaseException as e:  # reported, not raised, by the caller
      box["err"] = e

  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(limit_s)
  if t.is_alive():
    raise TimeoutError(f"no result after {limit_s:.0f} s")
  if "err" in box:
    raise box["err"]
  return box.get("out")


# ---- comparisons --------------------------------------------------------------------------


def bits(a: Any) -> np.ndarray:
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def same_bits(a: Any, b: Any) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and bool((bits(a) == bits(b)).all())


def same_nan_as_nan(a: Any, b: Any) -> np.ndarray:
  """Elementwise: the same bits, or both NaN."""
  a, b = np.asarray(a), np.asarray(b)
  nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
  return (bits(a) == bits(b)) | nan


def short(e: BaseException) -> str:
  """The exception's type, first line and (for tracebacks in the text) last line."""
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  text = lines[0][:100] if lines else ""
  if len(lines) > 1:
    text += f" ... {lines[-1][:80]}"
  return f"{type(e).__name__}: {text}"
