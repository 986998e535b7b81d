"""Native (C++ on CPU, CUDA on GPU) implementations of the codec row operations.

The jnp code in this package is the specification; these custom calls compute the same
bytes (cuda/WIRE_FORMAT.md). Each function here mirrors a row method of ``Compressor``.

Interface (used by ``Compressor`` when ``impl`` is "native" or "auto"):
  available(c, op, dtype) -> bool
  encode_rows(c, x2d) -> uint8[rows, c.payload_nbytes(n, dtype)]
  decode_rows(c, buf, n, dtype) -> dtype[rows, n]
  decode_sum(c, buf, n, dtype) -> dtype[n]
  decode_sum_encode(c, buf, n, dtype) -> uint8[c.payload_nbytes(n, dtype)]

The codec reaches C++ as one dictionary attribute, ``codec``: its descriptor, whose fields
and wire types C++ defines (cuda/codecs/descriptor.h) and exports as ``CODEC_FIELDS``
(:func:`schema`). :func:`codec_attrs` is the one place that builds it from a compressor;
it checks its fields against that schema. Outside XLA (C interfaces, files) the same
descriptor travels as text, :func:`codec_text`. Every
call works under jit, vmap (leading batch dimensions are folded into rows) and
``jax.shard_map(..., check_vma=True)`` (outputs carry the inputs' varying axes).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jcoccl._src import _compat
from jcoccl._src.compressors import registry
from jcoccl._src.native import _ffi

_NATIVE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# jax's lowering platform names -> the native module that has kernels for them.
_NATIVE_PLATFORMS = {"cpu": "cpu", "cuda": "cuda"}
_OPS = ("encode", "decode", "decode_sum", "decode_sum_encode")
_TARGETS = {
  "encode": "jcoccl_encode_rows",
  "decode": "jcoccl_decode_rows",
  "decode_sum": "jcoccl_decode_sum",
  "decode_sum_encode": "jcoccl_decode_sum_encode",
}


def _platform() -> str | None:
  """The native platform ("cpu" or "cuda") whose kernels the program uses, or None.

  Inside a jcoccl collective's lowering (where the codecs of every collective run) it is
  the platform the program is lowered for: a program lowered for CPU on a GPU machine uses
  the CPU kernels, and one lowered for several platforms at once runs the jnp
  specification. A codec method called directly in a user's function is traced before
  the lowering platform is known: it uses the default backend's kernels.
  """
  lowering = _compat.lowering_platforms()
  if lowering is not None:
    if len(lowering) != 1:
      return None
    return _NATIVE_PLATFORMS.get(lowering[0])
  backend = jax.default_backend()
  if backend == "cpu":
    return "cpu"
  if backend in ("gpu", "cuda"):
    try:
      if not jax.devices("gpu"):
        return None
    except RuntimeError:
      return None
    return "cuda"
  return None


def _kinds() -> dict[str, int]:
  return _ffi.codes("CODEC_KINDS")


def dtype_code(dtype: Any) -> int:
  """The engine's code of a row element type (float32, bfloat16 or float16)."""
  return _ffi.codes("DTYPES")[jnp.dtype(dtype).name]


def _fp8_code(fmt: Any) -> int:
  f = str(fmt).lower()
  for name, code in _ffi.codes("FP8_FORMATS").items():
    if name in f:
      return code
  raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")


def _fields(c: Any) -> dict[str, Any] | None:
  """The kernel fields of ``c`` from its family (:mod:`.registry`), or None without a kernel."""
  fam = registry.family_of(c)
  own = fam.native(c) if fam.native is not None else None
  if own is None:
    return None
  if not fam.wraps:
    # A plugin family's hook names its kind ("plugin") itself.
    kind = own.get("kind", fam.kind)
    return {**own, "kind": kind} if kind in _kinds() else None
  # The kernels wrap a plain codec once (rotation or spike reserving): no wrapper inside a
  # wrapper, whose flat fields would not say which is outside, and none around a plugin
  # (its kernels know nothing of the wrapping).
  if registry.family_of(c.inner).wraps:
    return None
  inner = _fields(c.inner)
  if inner is None or set(own) & set(inner) or inner["kind"] == "plugin":
    return None
  return {**inner, **own}


def codec_attrs(c: Any) -> dict[str, np.generic | np.ndarray]:
  """The codec descriptor of compressor ``c``: every field of C++'s schema, typed by it.

  The one place that turns a compressor into the fields of cuda/codecs/descriptor.h; a
  field added there is added here, and :func:`typed` fails until both sides agree.

  Args:
    c: a ``Compressor`` whose family has native kernels (none, cast, int, fp8,
      error_bounded, hadamard around one of those, spike around int, fp8 or
      error_bounded, or a loaded plugin's codec).

  Returns:
    A dict of numpy scalars (and the float64[8] ``params`` array), one per schema field.

  Raises:
    ValueError: if ``c`` has no native kernel.

  Example:
    >>> codec_attrs(jc.int4(block_size=64))["bits"]
    np.int32(4)
  """
  f = _fields(c)
  if f is None:
    raise ValueError(no_kernel_reason(c))
  return _descriptor(f)


def no_kernel_reason(c: Any) -> str | None:
  """Why compressor ``c`` has no native kernel, or None when it has one.

  Example:
    >>> no_kernel_reason(jc.int8()) is None
    True
  """
  if _supported(c):
    return None
  kinds = ", ".join(k for k in _kinds() if k != "plugin")
  return (
    f"compressor {c} has no native kernel (native: {kinds} with round-to-nearest and "
    "power-of-two blocks of 32 to 4096, one hadamard around one of those, spike around int, "
    "fp8 or error_bounded, and codecs whose native plugin is loaded with "
    "jcoccl.compressors.load_plugin)"
  )


def _descriptor(f: dict[str, Any]) -> dict[str, np.generic | np.ndarray]:
  """The descriptor of a codec's kernel fields (:func:`_fields`): one value per field."""
  return typed(
    {
      "kind": _kinds()[f["kind"]],
      "bits": f.get("bits", 8),
      "block": f.get("block", 1),
      "symmetric": int(bool(f.get("symmetric", True))),
      "fp8": _fp8_code(f.get("fp8", "e4m3")),
      "cast_dtype": dtype_code(f.get("cast_dtype", "bfloat16")),
      "abs_error": float(f.get("abs_error", 0.0)),
      "hadamard": f.get("hadamard", 0),
      "spike": f.get("spike", 0),
      "plugin": f.get("plugin", -1),
      "params": tuple(float(v) for v in f.get("params", ())),
    }
  )


def identity_attrs() -> dict[str, np.generic | np.ndarray]:
  """The descriptor of the identity codec (kind none), e.g. for the fused engine's
  uncompressed ops.

  Example:
    >>> int(identity_attrs()["kind"]) == _ffi.codes("CODEC_KINDS")["none"]
    True
  """
  return _descriptor({"kind": "none"})


def schema() -> dict[str, str]:
  """Field name -> wire type ("int32", "float32", "float64[8]") of the codec descriptor,
  in C++'s order, as the native module exports it (``CODEC_FIELDS``): Python keeps no copy.

  Example:
    >>> schema()["abs_error"]
    'float32'
  """
  return {str(k): str(v) for k, v in importlib.import_module("jcoccl._cpu").CODEC_FIELDS.items()}


def max_plugin_params() -> int:
  """How many parameters a plugin codec may have: the length of the descriptor's ``params``
  field (JCOCCL_PLUGIN_MAX_PARAMS in C++).

  Example:
    >>> max_plugin_params()
    8
  """
  m = re.fullmatch(r"float64\[(\d+)\]", schema()["params"])
  if m is None:
    raise ValueError(f"C++'s params field is {schema()['params']!r}, not float64[N]")
  return int(m.group(1))


def typed(values: dict[str, Any], fields: dict[str, str] | None = None) -> dict[str, Any]:
  """``values`` (field -> Python value) checked against the schema and converted to its
  wire types, in the schema's order.

  Args:
    values: one value per field: an integer for int32 fields, a number for float32, a
      sequence of at most N numbers for float64[N] (zero-padded).
    fields: the schema (default: :func:`schema`).

  Returns:
    The descriptor: numpy int32 / float32 scalars and float64[N] arrays.

  Raises:
    ValueError: a field is missing or unknown on one side, or its wire type is unknown here.
    TypeError: a value does not fit its field's wire type.

  Example:
    >>> typed({"bits": 4}, {"bits": "int32"})
    {'bits': np.int32(4)}
  """
  fields = schema() if fields is None else fields
  missing, extra = sorted(set(fields) - set(values)), sorted(set(values) - set(fields))
  if missing or extra:
    raise ValueError(
      "the codec descriptor's fields differ between C++ (cuda/codecs/descriptor.h, "
      f"CODEC_FIELDS) and Python's builder (compressors/native.py codec_attrs): "
      f"missing in Python: {missing}, unknown to C++: {extra}; C++'s fields: {fields}"
    )
  return {name: _wire_value(name, wire, values[name]) for name, wire in fields.items()}


def _wire_value(name: str, wire: str, v: Any) -> Any:
  if wire == "int32":
    if isinstance(v, (bool, float, np.floating)) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"codec field {name!r} is int32 in C++'s schema; Python gave {v!r}")
    return np.int32(v)
  if wire == "float32":
    if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, bool):
      raise TypeError(f"codec field {name!r} is float32 in C++'s schema; Python gave {v!r}")
    return np.float32(v)
  m = re.fullmatch(r"float64\[(\d+)\]", wire)
  if m is None:
    raise ValueError(f"codec field {name!r}: C++'s wire type {wire!r} is unknown to Python")
  if not isinstance(v, (tuple, list, np.ndarray)):
    raise TypeError(f"codec field {name!r} is {wire} in C++'s schema; Python gave {v!r}")
  out = np.zeros((int(m.group(1)),), np.float64)
  if len(v) > out.size:
    raise ValueError(f"a plugin codec has at most {out.size} params, got {len(v)}")
  out[: len(v)] = [float(x) for x in v]
  return out


def codec_text(attrs: dict[str, Any]) -> str:
  """The text form of codec descriptor ``attrs`` (:func:`codec_attrs`): ``name=value`` pairs
  separated by spaces, every field in C++'s order. The C interfaces and files that carry a
  codec outside XLA read it with one decoder (cuda/codecs/descriptor.h ``SpecFromText``):
  the host shim, ``jcoccl_codec_time`` (tools/gpu_codecs.py) and the NCCL interposer's rules.

  Every value reads back exactly: float32 fields are written as the shortest decimal that
  is the same float32, ``params`` as the shortest float64 decimals (trailing zeros left out:
  C++ zero-pads).

  Args:
    attrs: a descriptor (``codec_attrs(c)``, ``identity_attrs()``).

  Returns:
    The text, e.g. ``"kind=2 bits=4 block=64 ... plugin=-1 params="``.

  Example:
    >>> codec_text(codec_attrs(jc.int4(block_size=64))).split()[:3]
    ['kind=2', 'bits=4', 'block=64']
  """
  fields = schema()
  out = []
  for name, v in typed(dict(attrs), fields).items():
    wire = fields[name]
    if wire == "int32":
      text = str(int(v))
    elif wire == "float32":
      text = str(np.float32(v))
    else:
      vals = [float(x) for x in v]
      while vals and vals[-1] == 0.0 and not np.signbit(vals[-1]):
        vals.pop()
      text = ",".join(repr(x) for x in vals)
    out.append(f"{name}={text}")
  return " ".join(out)


class _HashableArray(np.ndarray):
  """A float64 array that hashes and compares by value: ``jax.ffi.ffi_call`` hashes its
  dictionary-valued attributes (a plain ndarray is unhashable)."""

  def __hash__(self) -> int:  # type: ignore[override]
    return hash((self.shape, self.tobytes()))

  def __eq__(self, other: object) -> bool:
    return (
      isinstance(other, np.ndarray) and self.shape == other.shape and np.array_equal(self, other)
    )


def ffi_codec(c: Any) -> dict[str, Any]:
  """The descriptor of ``c`` (None: the identity codec) as the value of the FFI dictionary
  attribute ``codec`` (or ``outer``): :func:`codec_attrs`, hashable.

  Example:
    >>> jax.ffi.ffi_call("jcoccl_encode_rows", out_type)(x, codec=ffi_codec(jc.int8()))  # doctest: +SKIP
  """
  attrs = identity_attrs() if c is None else codec_attrs(c)
  return {k: v.view(_HashableArray) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}


def _supported(c: Any) -> bool:
  try:
    return _fields(c) is not None
  except TypeError:
    return False


def available(c: Any, op: str, dtype: Any) -> bool:
  """True if a native kernel implements ``op`` for compressor ``c`` on the default backend.

  Args:
    c: a ``Compressor``.
    op: one of "encode", "decode", "decode_sum", "decode_sum_encode".
    dtype: the row dtype.

  Returns:
    True when ``c`` rounds to nearest, ``dtype`` is float32/bfloat16/float16 and the native
    module of the default backend ("cpu" or "cuda") registered the target.

  Example:
    >>> available(jc.int8(), "encode", jnp.float32)  # on a CPU machine with jcoccl._cpu
    True
  """
  if op not in _OPS:
    raise ValueError(f"op must be one of {_OPS}, got {op!r}")
  try:
    if jnp.dtype(dtype) not in _NATIVE_DTYPES:
      return False
  except TypeError:
    return False
  if not _supported(c):
    return False
  platform = _platform()
  return platform is not None and _ffi.has_target(_TARGETS[op], platform)


def _result(x: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
  del x
  return jax.ShapeDtypeStruct(shape, dtype)


def _vary_like(out: jax.Array, x: jax.Array, invariant_over: tuple = ()) -> jax.Array:
  """Gives ``out`` the varying manual axes of ``x`` (ffi_call outputs carry none), except
  ``invariant_over``: axes over which the caller knows every rank computes the same value."""
  vma = _compat.varying_axes(x) - set(invariant_over)
  missing = tuple(sorted(vma - _compat.varying_axes(out)))
  if not missing:
    return out
  return jax.lax.pcast(out, missing, to="varying")


def _call(
  op: str,
  c: Any,
  arg: jax.Array,
  shape: tuple[int, ...],
  out_dtype: Any,
  invariant_over: tuple = (),
  **extra: np.generic,
) -> jax.Array:
  platform = _platform()
  if platform is None or not _ffi.has_target(_TARGETS[op], platform):
    where = _compat.lowering_platforms() or (jax.default_backend(),)
    raise ValueError(f"no native kernel for op {op!r} on platform {'/'.join(where)!r}")
  fn = jax.ffi.ffi_call(_TARGETS[op], _result(arg, shape, out_dtype), vmap_method="broadcast_all")
  return _vary_like(fn(arg, codec=ffi_codec(c), **extra), arg, invariant_over)


def encode_rows(c: Any, x2d: jax.Array) -> jax.Array:
  """Native ``c.encode_rows``: ``x2d[rows, n]`` -> ``uint8[rows, payload_nbytes(n)]``.

  Example:
    >>> encode_rows(jc.int8(), jnp.ones((2, 256))).shape
    (2, 260)
  """
  rows, n = x2d.shape
  p = c.payload_nbytes(n, x2d.dtype)
  return _call("encode", c, x2d, (rows, p), jnp.uint8)


def decode_rows(
  c: Any, buf: jax.Array, n: int, dtype: Any, invariant_over: tuple = ()
) -> jax.Array:
  """Native ``c.decode_rows``: ``uint8[rows, P]`` -> ``dtype[rows, n]``.

  ``invariant_over``: mesh axes over which every rank decodes the same bytes (so the result
  is the same everywhere): the result is typed device-invariant over them.

  Example:
    >>> c = jc.int8(); decode_rows(c, encode_rows(c, jnp.ones((2, 256))), 256, jnp.float32)[0, 0]
    Array(1., dtype=float32)
  """
  return _call("decode", c, buf, (buf.shape[0], int(n)), jnp.dtype(dtype), invariant_over)


def decode_sum(c: Any, buf: jax.Array, n: int, dtype: Any, invariant_over: tuple = ()) -> jax.Array:
  """Native ``c.decode_sum``: float32 left fold of the decoded rows, cast once to ``dtype[n]``
  (``invariant_over`` as for :func:`decode_rows`).

  Example:
    >>> c = jc.int8(); decode_sum(c, encode_rows(c, jnp.ones((3, 256))), 256, jnp.float32)[0]
    Array(3., dtype=float32)
  """
  return _call("decode_sum", c, buf, (int(n),), jnp.dtype(dtype), invariant_over)


def decode_sum_encode(c: Any, buf: jax.Array, n: int, dtype: Any) -> jax.Array:
  """Native ``c.decode_sum_encode``: ``encode(decode_sum(buf))`` as ``uint8[P]``.

  Example:
    >>> c = jc.int8(); decode_sum_encode(c, encode_rows(c, jnp.ones((3, 256))), 256, jnp.float32).shape
    (260,)
  """
  d = jnp.dtype(dtype)
  p = c.payload_nbytes(n, d)
  return _call(
    "decode_sum_encode", c, buf, (p,), jnp.uint8, dtype=np.int32(dtype_code(d)), n=np.int64(n)
  )
