"""The conformance properties, one function per table row (or pair of rows), each on
the :class:`Ctx` of one dtype and row length."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jcoccl._src.compressors import native
from jcoccl._src.compressors._base import Compressor
from jcoccl._src.compressors.conformance_inputs import (
  OPS,
  Inputs,
  bits,
  decode_ops,
  encoder,
  nan_payload_row,
  same_bits,
  same_nan_as_nan,
  short,
  timed,
)
from jcoccl._src.compressors.conformance_result import Row

# ---- properties ---------------------------------------------------------------------------


class Skip(Exception):
  """A property cannot run because another one already failed (the message says which)."""


class SizeMismatch(Skip):
  """encode_rows wrote a payload of another size than payload_nbytes: nothing decodes it."""


@dataclasses.dataclass
class Ctx:
  """Everything one dtype's checks share: codec, sizes, inputs, compiled functions (each
  compiled once and reused by every property)."""

  c: Compressor
  n: int
  dtype: jnp.dtype
  key: jax.Array
  inp: Inputs
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
      self.enc[impl] = encoder(self.c, impl)
    buf, bound = self.enc[impl](jnp.asarray(x), self.key)
    want = self.c.payload_nbytes(self.n, self.dtype)
    if buf.shape[-1] != want:
      raise SizeMismatch(
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
    except SizeMismatch:
      return out
    return valid + out

  def decode(self, buf: np.ndarray, impl: str = "jnp") -> tuple[dict, str | None]:
    """The decode ops on ``buf`` and, for jnp, checkify's index error (or None)."""
    run = decode_ops(self.c, self.n, self.dtype, impl)
    args = (jnp.asarray(buf), self.key)
    if impl == "jnp" and self.no_checkify is None:
      if impl not in self.dec:
        self.dec[impl] = jax.jit(checkify.checkify(run, errors=checkify.index_checks))
      try:
        err, out = self.dec[impl](*args)
        return host(out), err.get()
      except Exception as e:
        jax.jit(run)(*args)  # raises when the codec itself fails
        self.no_checkify = short(e)  # else checkify cannot transform this decoder
        self.dec.pop(impl)
    if impl not in self.dec:
      self.dec[impl] = jax.jit(run)
    return host(self.dec[impl](*args)), None

  def decode_or_skip(
    self, buf: np.ndarray, name: str, impl: str = "jnp"
  ) -> tuple[dict, str | None]:
    """:meth:`decode`, with a failure turned into a skip (decode_total reports it)."""
    try:
      return self.decode(buf, impl)
    except Exception as e:
      raise Skip(f"{impl} decode of {name} bytes raised (see decode_total)") from e


def host(out: dict) -> dict:
  return {k: None if v is None else np.asarray(v) for k, v in out.items()}


def check_bound(ctx: Ctx) -> tuple[Row, Row]:
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
  return bound_row(ctx, err, bound, ok, finite, xh64), nonfinite_row(ctx, finite, xh64)


def bound_row(ctx, err, bound, ok, finite, xh64) -> Row:
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
    return lossless_row(ctx)
  sel = finite & np.isfinite(bound) & (bound > 0)
  ratio = float(np.max(err[sel] / bound[sel])) if sel.any() else 0.0
  promised = int((np.isfinite(bound) & finite).sum())
  return Row(
    "bound", d, "PASS",
    f"max err/bound {ratio:.4f} ({promised}/{int(finite.sum())} finite elements bounded, "
    f"{len(ctx.inp.names)} input rows)",
  )  # fmt: skip


def lossless_row(ctx: Ctx) -> Row:
  """Lossless: every row, and NaNs with any sign and payload, come back bit for bit."""
  d, x = ctx.dtype.name, ctx.inp.x
  nan_rows = np.repeat(nan_payload_row(ctx.n, ctx.dtype)[None], x.shape[0], 0)
  for what, rows in (("the input rows", x), ("NaN payload bits", nan_rows)):
    back = ctx.decode_or_skip(ctx.encode(rows)[0], "valid")[0]["decode"]
    if not same_bits(back, rows):
      return Row("bound", d, "FAIL", f"lossless codec: {what} do not round-trip bit for bit")
  return Row("bound", d, "PASS", "lossless: bit-exact round trip, NaN payloads kept")


def nonfinite_row(ctx: Ctx, finite: np.ndarray, xh64: np.ndarray) -> Row:
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
  bad = [e for m in lengths for e in size_errors(c, m, dtype, key)]
  if bad:
    return Row("payload_size", dtype.name, "FAIL", "; ".join(bad[:2]))
  detail = f"row lengths {','.join(map(str, lengths))}: encode_rows, encode, decode_sum_encode"
  return Row("payload_size", dtype.name, "PASS", detail)


def size_errors(c: Compressor, n: int, dtype: jnp.dtype, key: jax.Array) -> list[str]:
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


def check_total(ctx: Ctx) -> Row:
  """Every garbage payload decodes (jnp, native) to the right shapes within the time limit."""
  d, n, rows = ctx.dtype, ctx.n, ctx.inp.x.shape[0]
  # (decode_sum_encode writes an encoder's payload: its size is payload_size's business.)
  want = {"decode": ((rows, n), d), "decode_sum": ((n,), d)}
  t0 = time.perf_counter()
  bufs = ctx.payloads()
  for impl in ctx.impls:
    for name, buf in bufs:
      try:
        out = timed(lambda b=buf, i=impl: ctx.decode(b, i)[0], ctx.limit_s)
      except Exception as e:
        return Row("decode_total", d.name, "FAIL", f"{impl}, {name} bytes: {short(e)}")
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


def check_in_bounds(ctx: Ctx) -> Row:
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


def check_native(ctx: Ctx) -> Row:
  """Bitwise native == jnp for every op with a native kernel."""
  d = ctx.dtype.name
  ops = [op for op in OPS if ctx.has_native(op)]
  if not ops:
    return Row("native_match", d, "SKIP", f"no native kernel on {jax.default_backend()}")
  x = ctx.inp.x
  try:
    if "encode" in ops:
      a, b = ctx.encode(x, "jnp")[0], ctx.encode(x, "native")[0]
      if not same_bits(a, b):
        return Row("native_match", d, "FAIL", f"encode: {ndiff(a, b)} differ")
    for name, buf in ctx.payloads():
      want = ctx.decode_or_skip(buf, name)[0]
      got = ctx.decode_or_skip(buf, name, "native")[0]
      for op in OPS[1:]:
        if got[op] is not None and not same_bits(got[op], want[op]):
          return Row(
            "native_match", d, "FAIL", f"{op} of {name} bytes: {ndiff(got[op], want[op])} differ"
          )
  except Exception as e:
    return Row("native_match", d, "FAIL", f"native raised {short(e)}")
  return Row("native_match", d, "PASS", f"{'+'.join(ops)} bit-exact")


def ndiff(a: np.ndarray, b: np.ndarray) -> str:
  if a.shape != b.shape or a.dtype != b.dtype:
    return f"shape/dtype {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
  return f"{int((bits(a) != bits(b)).sum())} elements"


def check_deterministic(ctx: Ctx) -> Row:
  """Two runs of each compiled op on the same input give the same bits."""
  d = ctx.dtype.name
  x, bufs = ctx.inp.x, ctx.payloads()
  for impl in ctx.impls:
    encodes = bufs[0][0] == "valid" and (impl == "jnp" or ctx.has_native("encode"))
    if encodes and not same_bits(ctx.encode(x, impl)[0], ctx.encode(x, impl)[0]):
      return Row("deterministic", d, "FAIL", f"{impl} encode: two runs give different bytes")
    for name, buf in bufs[:3]:
      one, two = ctx.decode_or_skip(buf, name, impl)[0], ctx.decode_or_skip(buf, name, impl)[0]
      for op in OPS[1:]:
        if one[op] is not None and not same_bits(one[op], two[op]):
          return Row("deterministic", d, "FAIL", f"{impl} {op}: two runs differ")
  return Row("deterministic", d, "PASS", f"every op twice, {'+'.join(ctx.impls)}")


def check_sum_order(ctx: Ctx) -> Row:
  """decode_sum == documented left fold; decode_sum_encode == encode(decode_sum)."""
  d = ctx.dtype.name
  bufs = ctx.payloads()
  for name, buf in bufs:
    want = ctx.decode_or_skip(buf, name)[0]["fold"]
    for impl in ctx.impls:
      out = ctx.decode_or_skip(buf, name, impl)[0]
      s, se = out["decode_sum"], out["decode_sum_encode"]
      if s is not None:
        same = same_nan_as_nan(s, want)
        if not same.all():
          msg = f"{impl} decode_sum of {name} bytes: {int((~same).sum())} elements differ"
          return Row("decode_sum_order", d, "FAIL", msg + " from the row-order fold")
      if se is not None and s is not None and not same_bits(se, out["reencode"]):
        msg = f"{impl} decode_sum_encode of {name} bytes != encode(decode_sum)"
        return Row("decode_sum_order", d, "FAIL", msg)
  return Row("decode_sum_order", d, "PASS", f"{len(bufs)} payloads, {'+'.join(ctx.impls)}")
