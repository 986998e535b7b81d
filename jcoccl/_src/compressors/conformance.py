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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jcoccl._src.compressors import native
from jcoccl._src.compressors._base import Compressor

PROPERTIES = (
  "bound",
  "nonfinite",
  "payload_size",
  "decode_total",
  "decode_in_bounds",
  "native_match",
  "deterministic",
  "decode_sum_order",
)
OPS = ("encode", "decode", "decode_sum", "decode_sum_encode")
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
_NAN_PATTERNS = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800000, 0x7F800000)


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the table: a property checked for one dtype.

  Attributes:
    prop: the property (one of ``PROPERTIES``).
    dtype: the input dtype's name, or "-" for checks without one.
    status: "PASS", "FAIL" or "SKIP".
    detail: a short measurement or reason (e.g. "max err/bound 0.502").
    n: the row length the property ran at.
  """

  prop: str
  dtype: str
  status: str
  detail: str
  n: int = 0


@dataclasses.dataclass
class CheckResult:
  """What :func:`check` found: falsy when any property fails.

  Attributes:
    codec: the codec's spec string (or repr).
    rows: every :class:`Row`, in table order.
    seconds: wall time of the whole check.

  Example:
    >>> r = CheckResult("int8", [Row("bound", "float32", "FAIL", "2 violations")])
    >>> bool(r), r.failed("bound")
    (False, True)
  """

  codec: str
  rows: list[Row] = dataclasses.field(default_factory=list)
  seconds: float = 0.0

  @property
  def failures(self) -> list[Row]:
    """The rows whose status is FAIL."""
    return [r for r in self.rows if r.status == "FAIL"]

  def __bool__(self) -> bool:
    return not self.failures

  def status(self, prop: str) -> set[str]:
    """The statuses ``prop`` got over the dtypes, e.g. ``{"PASS", "SKIP"}``."""
    return {r.status for r in self.rows if r.prop == prop}

  def failed(self, prop: str) -> bool:
    """True if ``prop`` failed for at least one dtype."""
    return "FAIL" in self.status(prop)

  def table(self) -> str:
    """The rows as an aligned text table, headed by the codec and a verdict."""
    verdict = "PASS" if self else f"FAIL ({len(self.failures)} failing rows)"
    head = f"check {self.codec}: {verdict} in {self.seconds:.1f} s"
    w = max([len(p) for p in PROPERTIES] + [len(r.prop) for r in self.rows])
    lines = [head, f"  {'property':<{w}}  {'dtype':<8}  {'n':>5}  status  detail"]
    lines += [
      f"  {r.prop:<{w}}  {r.dtype:<8}  {r.n:>5}  {r.status:<6}  {r.detail}" for r in self.rows
    ]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


# ---- inputs -------------------------------------------------------------------------------


def row_length(c: Compressor) -> int:
  """Two granules, and at least 64 elements: small, and every block-wise scenario fits."""
  g = int(c.granule)
  return g * max(2, -(-64 // g))


def _scenarios(n: int, block: int, dtype: jnp.dtype, rng: np.random.Generator) -> dict:
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


def _nonfinite_rows(n: int, block: int) -> dict:
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


def _as_dtype(x: np.ndarray, dtype: jnp.dtype) -> np.ndarray:
  with np.errstate(over="ignore", invalid="ignore"):
    return np.asarray(x, np.float64).astype(np.float32).astype(dtype)


def _nan_payload_row(n: int, dtype: jnp.dtype) -> np.ndarray:
  """A row of NaNs with odd sign and payload bits (signalling too), then normal values."""
  bits = {4: np.uint32, 2: np.uint16}[dtype.itemsize]
  pats = [0x7F800001, 0xFFC12345, 0x7FC00001] if dtype.itemsize == 4 else [0x7F81, 0xFFC5]
  if dtype == jnp.float16:
    pats = [0x7C01, 0xFE05]
  x = np.linspace(-1.0, 1.0, n).astype(np.float32).astype(dtype)
  v = x.view(bits)
  v[: len(pats)] = np.array(pats, bits)
  return x


@dataclasses.dataclass
class _Inputs:
  """The data one dtype's checks share: rows [R, n] and garbage payloads [k, R, P]."""

  names: list[str]
  x: np.ndarray
  finite_rows: int
  garbage_names: list[str]
  garbage: np.ndarray


def _inputs(c: Compressor, n: int, dtype: jnp.dtype, seed: int) -> _Inputs:
  rng = np.random.default_rng(seed)
  block = min(c.granule if c.granule > 1 else 32, n)
  fin = _scenarios(n, block, dtype, rng)
  bad = _nonfinite_rows(n, block)
  names = list(fin) + list(bad)
  x = np.stack([_as_dtype(v, dtype) for v in (*fin.values(), *bad.values())])
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
  return _Inputs(names, x, len(fin), list(garbage), np.stack(list(garbage.values())))


# ---- compiled pieces ----------------------------------------------------------------------


def _encoder(c: Compressor, impl: str) -> Callable:
  """jit of (x, key) -> (encode_rows bytes, per-row error_bound or None)."""

  def run(x, key):
    buf = c.encode_rows(x, key=key, impl=impl)
    # Row by row: error_bound flattens its argument, and a codec may treat rows apart.
    return buf, jax.vmap(c.error_bound)(x) if impl == "jnp" else None

  return jax.jit(run)


def _fold(c: Compressor, buf: jax.Array, n: int, dtype: jnp.dtype) -> jax.Array:
  """The documented decode_sum: float32 decodes of each row, a left fold, one cast."""
  rows = jax.lax.optimization_barrier(c._decode_wide(buf, n, dtype))
  acc = rows[0]
  for i in range(1, rows.shape[0]):
    acc = acc + rows[i]
  return acc.astype(dtype)


def _decode_ops(c: Compressor, n: int, dtype: jnp.dtype, impl: str) -> Callable:
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
      "fold": _fold(c, buf, n, dtype) if impl == "jnp" else None,
    }

  return run


def _timed(fn: Callable, limit_s: float) -> Any:
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


def _bits(a: Any) -> np.ndarray:
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _same_bits(a: Any, b: Any) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and bool((_bits(a) == _bits(b)).all())


def _same_nan_as_nan(a: Any, b: Any) -> np.ndarray:
  """Elementwise: the same bits, or both NaN."""
  a, b = np.asarray(a), np.asarray(b)
  nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
  return (_bits(a) == _bits(b)) | nan


def _short(e: BaseException) -> str:
  """The exception's type, first line and (for tracebacks in the text) last line."""
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  text = lines[0][:100] if lines else ""
  if len(lines) > 1:
    text += f" ... {lines[-1][:80]}"
  return f"{type(e).__name__}: {text}"


# ---- properties ---------------------------------------------------------------------------


class _Skip(Exception):
  """A property cannot run because another one already failed (the message says which)."""


class _SizeMismatch(_Skip):
  """encode_rows wrote a payload of another size than payload_nbytes: nothing decodes it."""


@dataclasses.dataclass
class _Ctx:
  """Everything one dtype's checks share: codec, sizes, inputs, compiled functions (each
  compiled once and reused by every property)."""

  c: Compressor
  n: int
  dtype: jnp.dtype
  key: jax.Array
  inp: _Inputs
  limit_s: float
  enc: dict[str, Callable] = dataclasses.field(default_factory=dict)
  dec: dict[str, Callable] = dataclasses.field(default_factory=dict)
  no_checkify: str | None = None  # why the jnp decoders run without index checks

  @property
  def impls(self) -> list[str]:
    return ["jnp"] + (["native"] if any(self.has_native(op) for op in OPS) else [])

  def has_native(self, op: str) -> bool:
    try:
      return native.available(self.c, op, self.dtype)
    except Exception:
      return False

  def encode(self, x: np.ndarray, impl: str = "jnp") -> tuple[np.ndarray, np.ndarray | None]:
    """(payload bytes, error bound or None for native) of rows ``x``."""
    if impl not in self.enc:
      self.enc[impl] = _encoder(self.c, impl)
    buf, bound = self.enc[impl](jnp.asarray(x), self.key)
    want = self.c.payload_nbytes(self.n, self.dtype)
    if buf.shape[-1] != want:
      raise _SizeMismatch(
        f"no round trip: encode_rows writes {buf.shape[-1]} bytes per row, payload_nbytes "
        f"says {want} (see payload_size)"
      )
    return np.asarray(buf), None if bound is None else np.asarray(bound)

  def payloads(self) -> list[tuple[str, np.ndarray]]:
    """(name, bytes) of the garbage payloads and, when the encoder's sizes are right, of
    valid ones: all rows, and the finite rows alone (repeated to the same row count, so
    nothing recompiles; their sums are not all NaN)."""
    x, k = self.inp.x, self.inp.finite_rows
    out = list(zip(self.inp.garbage_names, self.inp.garbage))
    try:
      valid = [
        ("valid", self.encode(x)[0]),
        ("valid finite", self.encode(x[np.arange(len(x)) % k])[0]),
      ]
    except _SizeMismatch:
      return out
    return valid + out

  def decode(self, buf: np.ndarray, impl: str = "jnp") -> tuple[dict, str | None]:
    """The decode ops on ``buf`` and, for jnp, checkify's index error (or None)."""
    run = _decode_ops(self.c, self.n, self.dtype, impl)
    args = (jnp.asarray(buf), self.key)
    if impl == "jnp" and self.no_checkify is None:
      if impl not in self.dec:
        self.dec[impl] = jax.jit(checkify.checkify(run, errors=checkify.index_checks))
      try:
        err, out = self.dec[impl](*args)
        return _host(out), err.get()
      except Exception as e:
        jax.jit(run)(*args)  # raises when the codec itself fails
        self.no_checkify = _short(e)  # else checkify cannot transform this decoder
        self.dec.pop(impl)
    if impl not in self.dec:
      self.dec[impl] = jax.jit(run)
    return _host(self.dec[impl](*args)), None

  def decode_or_skip(
    self, buf: np.ndarray, name: str, impl: str = "jnp"
  ) -> tuple[dict, str | None]:
    """:meth:`decode`, with a failure turned into a skip (decode_total reports it)."""
    try:
      return self.decode(buf, impl)
    except Exception as e:
      raise _Skip(f"{impl} decode of {name} bytes raised (see decode_total)") from e


def _host(out: dict) -> dict:
  return {k: None if v is None else np.asarray(v) for k, v in out.items()}


def _check_bound(ctx: _Ctx) -> tuple[Row, Row]:
  """Rows for 'bound' and 'nonfinite' from one encode/decode/bound of every input row."""
  x = ctx.inp.x
  buf, b = ctx.encode(x)
  assert b is not None  # the jnp encoder computes the bound too
  xh64 = ctx.decode_or_skip(buf, "valid")[0]["decode"].astype(np.float64)
  x64, bound = x.astype(np.float64), b.astype(np.float64)
  finite = np.isfinite(x64)
  with np.errstate(invalid="ignore"):
    err = np.abs(x64 - xh64)
    ok = (err <= bound) | np.isposinf(bound) | ~finite
  return _bound_row(ctx, err, bound, ok, finite, xh64), _nonfinite_row(ctx, finite, xh64)


def _bound_row(ctx, err, bound, ok, finite, xh64) -> Row:
  d = ctx.dtype.name
  if not ok.all():
    r, i = np.argwhere(~ok)[0]
    return Row(
      "bound", d, "FAIL",
      f"{int((~ok).sum())} elements over the bound; first in {ctx.inp.names[r]!r}: "
      f"x={ctx.inp.x[r, i].astype(np.float64):.6g} x_hat={xh64[r, i]:.6g} "
      f"err={err[r, i]:.3g} bound={bound[r, i]:.3g}",
    )  # fmt: skip
  if ctx.c.lossless:
    return _lossless_row(ctx)
  sel = finite & np.isfinite(bound) & (bound > 0)
  ratio = float(np.max(err[sel] / bound[sel])) if sel.any() else 0.0
  promised = int((np.isfinite(bound) & finite).sum())
  return Row(
    "bound", d, "PASS",
    f"max err/bound {ratio:.4f} ({promised}/{int(finite.sum())} finite elements bounded, "
    f"{len(ctx.inp.names)} input rows)",
  )  # fmt: skip


def _lossless_row(ctx: _Ctx) -> Row:
  """Lossless: every row, and NaNs with any sign and payload, come back bit for bit."""
  d, x = ctx.dtype.name, ctx.inp.x
  nan_rows = np.repeat(_nan_payload_row(ctx.n, ctx.dtype)[None], x.shape[0], 0)
  for what, rows in (("the input rows", x), ("NaN payload bits", nan_rows)):
    back = ctx.decode_or_skip(ctx.encode(rows)[0], "valid")[0]["decode"]
    if not _same_bits(back, rows):
      return Row("bound", d, "FAIL", f"lossless codec: {what} do not round-trip bit for bit")
  return Row("bound", d, "PASS", "lossless: bit-exact round trip, NaN payloads kept")


def _nonfinite_row(ctx: _Ctx, finite: np.ndarray, xh64: np.ndarray) -> Row:
  d = ctx.dtype.name
  leaked = ~finite & np.isfinite(xh64)
  if leaked.any():
    r, i = np.argwhere(leaked)[0]
    return Row(
      "nonfinite", d, "FAIL",
      f"{int(leaked.sum())} NaN/Inf inputs decode finite; first in {ctx.inp.names[r]!r}: "
      f"x={ctx.inp.x[r, i]} x_hat={xh64[r, i]:.6g}",
    )  # fmt: skip
  return Row("nonfinite", d, "PASS", f"{int((~finite).sum())} NaN/Inf inputs stay non-finite")


def check_payload_size(c: Compressor, dtype: jnp.dtype, key: jax.Array, n: int = 0) -> Row:
  """``encode_rows`` / ``encode`` output sizes against ``payload_nbytes`` (traced only).

  Args:
    c: the codec.
    dtype: the input dtype.
    key: PRNG key (stochastic codecs).
    n: a row length to check besides 1, 2, 3 and 5 times the base length.

  Returns:
    The table row of property "payload_size".

  Example:
    >>> check_payload_size(jc.int8(), jnp.dtype("float32"), jax.random.key(0)).status
    'PASS'
  """
  g = int(c.granule)
  lengths = sorted({g * k * -(-64 // g) for k in (1, 2, 3, 5)} | ({n} if n else set()))
  bad = [e for m in lengths for e in _size_errors(c, m, dtype, key)]
  if bad:
    return Row("payload_size", dtype.name, "FAIL", "; ".join(bad[:2]))
  detail = f"row lengths {','.join(map(str, lengths))}: encode_rows, encode, decode_sum_encode"
  return Row("payload_size", dtype.name, "PASS", detail)


def _size_errors(c: Compressor, n: int, dtype: jnp.dtype, key: jax.Array) -> list[str]:
  """What disagrees with ``payload_nbytes`` at row length ``n`` (shapes traced, not run)."""
  want, u8 = c.payload_nbytes(n, dtype), jnp.dtype(jnp.uint8)
  rows = jax.ShapeDtypeStruct((3, n), dtype)
  bufs = jax.ShapeDtypeStruct((3, want), u8)
  m = max(n - 1, 1)  # encode() pads it to the granule
  flat = jax.ShapeDtypeStruct((m,), dtype)
  got = {
    "encode_rows": jax.eval_shape(lambda x: c.encode_rows(x, key=key, impl="jnp"), rows),
    "decode_sum_encode": jax.eval_shape(
      lambda b: c.decode_sum_encode(b, n, dtype, key=key, impl="jnp"), bufs
    ),
    "encode": jax.eval_shape(lambda x: c.encode(x, key=key, impl="jnp").data, flat),
  }
  shapes = {
    "encode_rows": (3, want),
    "decode_sum_encode": (want,),
    "encode": (c.payload_nbytes(m, dtype),),
  }
  return [
    f"{op} n={n}: {a.dtype}{list(a.shape)} != uint8{list(shapes[op])}"
    for op, a in got.items()
    if a.shape != shapes[op] or a.dtype != u8
  ]


def _check_total(ctx: _Ctx) -> Row:
  """Every garbage payload decodes (jnp, native) to the right shapes within the time limit."""
  d, n, rows = ctx.dtype, ctx.n, ctx.inp.x.shape[0]
  # (decode_sum_encode writes an encoder's payload: its size is payload_size's business.)
  want = {"decode": ((rows, n), d), "decode_sum": ((n,), d)}
  t0 = time.perf_counter()
  bufs = ctx.payloads()
  for impl in ctx.impls:
    for name, buf in bufs:
      try:
        out = _timed(lambda b=buf, i=impl: ctx.decode(b, i)[0], ctx.limit_s)
      except Exception as e:
        return Row("decode_total", d.name, "FAIL", f"{impl}, {name} bytes: {_short(e)}")
      for op, (shape, dt) in want.items():
        o = out[op]
        if o is not None and (o.shape != shape or o.dtype != dt):
          return Row(
            "decode_total", d.name, "FAIL",
            f"{impl} {op} of {name} bytes: {o.dtype}{list(o.shape)}, want {dt}{list(shape)}",
          )  # fmt: skip
  secs = time.perf_counter() - t0
  return Row(
    "decode_total", d.name, "PASS", f"{len(bufs)} payloads, {'+'.join(ctx.impls)}, {secs:.1f} s"
  )


def _check_in_bounds(ctx: _Ctx) -> Row:
  """jnp decoders under checkify's index checks: a read outside the buffer is an error."""
  d = ctx.dtype.name
  bufs = ctx.payloads()
  for name, buf in bufs:
    msg = ctx.decode_or_skip(buf, name)[1]
    if msg is not None:
      return Row("decode_in_bounds", d, "FAIL", f"{name} bytes: {msg.splitlines()[0][:120]}")
  if ctx.no_checkify is not None:
    return Row("decode_in_bounds", d, "SKIP", f"checkify: {ctx.no_checkify}")
  return Row("decode_in_bounds", d, "PASS", f"{len(bufs)} payloads, 3 jnp decode ops")


def _check_native(ctx: _Ctx) -> Row:
  """Bitwise native == jnp for every op with a native kernel."""
  d = ctx.dtype.name
  ops = [op for op in OPS if ctx.has_native(op)]
  if not ops:
    return Row("native_match", d, "SKIP", f"no native kernel on {jax.default_backend()}")
  x = ctx.inp.x
  try:
    if "encode" in ops:
      a, b = ctx.encode(x, "jnp")[0], ctx.encode(x, "native")[0]
      if not _same_bits(a, b):
        return Row("native_match", d, "FAIL", f"encode: {_ndiff(a, b)} differ")
    for name, buf in ctx.payloads():
      want = ctx.decode_or_skip(buf, name)[0]
      got = ctx.decode_or_skip(buf, name, "native")[0]
      for op in OPS[1:]:
        if got[op] is not None and not _same_bits(got[op], want[op]):
          return Row(
            "native_match", d, "FAIL", f"{op} of {name} bytes: {_ndiff(got[op], want[op])} differ"
          )
  except Exception as e:
    return Row("native_match", d, "FAIL", f"native raised {_short(e)}")
  return Row("native_match", d, "PASS", f"{'+'.join(ops)} bit-exact")


def _ndiff(a: np.ndarray, b: np.ndarray) -> str:
  if a.shape != b.shape or a.dtype != b.dtype:
    return f"shape/dtype {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
  return f"{int((_bits(a) != _bits(b)).sum())} elements"


def _check_deterministic(ctx: _Ctx) -> Row:
  """Two runs of each compiled op on the same input give the same bits."""
  d = ctx.dtype.name
  x, bufs = ctx.inp.x, ctx.payloads()
  for impl in ctx.impls:
    encodes = bufs[0][0] == "valid" and (impl == "jnp" or ctx.has_native("encode"))
    if encodes and not _same_bits(ctx.encode(x, impl)[0], ctx.encode(x, impl)[0]):
      return Row("deterministic", d, "FAIL", f"{impl} encode: two runs give different bytes")
    for name, buf in bufs[:3]:
      one, two = ctx.decode_or_skip(buf, name, impl)[0], ctx.decode_or_skip(buf, name, impl)[0]
      for op in OPS[1:]:
        if one[op] is not None and not _same_bits(one[op], two[op]):
          return Row("deterministic", d, "FAIL", f"{impl} {op}: two runs differ")
  return Row("deterministic", d, "PASS", f"every op twice, {'+'.join(ctx.impls)}")


def _check_sum_order(ctx: _Ctx) -> Row:
  """decode_sum == documented left fold; decode_sum_encode == encode(decode_sum)."""
  d = ctx.dtype.name
  bufs = ctx.payloads()
  for name, buf in bufs:
    want = ctx.decode_or_skip(buf, name)[0]["fold"]
    for impl in ctx.impls:
      out = ctx.decode_or_skip(buf, name, impl)[0]
      s, se = out["decode_sum"], out["decode_sum_encode"]
      if s is not None:
        same = _same_nan_as_nan(s, want)
        if not same.all():
          msg = f"{impl} decode_sum of {name} bytes: {int((~same).sum())} elements differ"
          return Row("decode_sum_order", d, "FAIL", msg + " from the row-order fold")
      if se is not None and s is not None and not _same_bits(se, out["reencode"]):
        msg = f"{impl} decode_sum_encode of {name} bytes != encode(decode_sum)"
        return Row("decode_sum_order", d, "FAIL", msg)
  return Row("decode_sum_order", d, "PASS", f"{len(bufs)} payloads, {'+'.join(ctx.impls)}")


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
  ctx = _Ctx(c, n, d, key, _inputs(c, n, d, seed), limit_s)
  rows = [_guard("payload_size", d, lambda: check_payload_size(c, d, key, n))]
  rows.append(_guard("decode_total", d, lambda: _check_total(ctx)))
  rows += _guard_pair(("bound", "nonfinite"), d, lambda: _check_bound(ctx))
  checks: dict[str, Callable[[_Ctx], Row]] = {
    "decode_in_bounds": _check_in_bounds,
    "native_match": _check_native,
    "deterministic": _check_deterministic,
    "decode_sum_order": _check_sum_order,
  }
  for prop, fn in checks.items():
    rows.append(_guard(prop, d, functools.partial(fn, ctx)))
  return rows


def _guard(prop: str, d: jnp.dtype, fn: Callable[[], Row]) -> Row:
  """``fn()``, or a FAIL row naming the exception it raised (SKIP: no valid payload)."""
  try:
    return fn()
  except _Skip as e:
    return Row(prop, d.name, "SKIP", str(e))
  except Exception as e:
    return Row(prop, d.name, "FAIL", f"raised {_short(e)}")


def _guard_pair(props: tuple[str, str], d: jnp.dtype, fn: Callable) -> tuple[Row, Row]:
  try:
    return fn()
  except _Skip as e:
    return tuple(Row(p, d.name, "SKIP", str(e)) for p in props)  # type: ignore[return-value]
  except Exception as e:
    return tuple(Row(p, d.name, "FAIL", f"raised {_short(e)}") for p in props)  # type: ignore[return-value]
