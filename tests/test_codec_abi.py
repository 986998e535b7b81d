"""The codec descriptor's ABI: Python's builder (compressors/native.py ``codec_attrs``)
against the schema the native modules export from C++'s field table
(cuda/codecs/descriptor.h: ``CODEC_FIELDS``), field by field; descriptors round-trip
Python -> C++ -> Python for every built-in family and a plugin; a field missing, extra or
mistyped on either side fails with a message that names it."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jcoccl import compressors as jc
from jcoccl._src.compressors import native
from jcoccl._src.engine import fused_ffi
from jcoccl._src.native import _ffi

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(_ffi.native_module("cpu") is None, reason="jcoccl._cpu missing")
WIRE_DTYPES = {"int32": np.int32, "float32": np.float32, "float64[8]": np.float64}

BUILT_IN = [
  jc.none(),
  jc.cast(jnp.bfloat16),
  jc.cast(jnp.float16),
  jc.int8(block_size=64),
  jc.int4(block_size=128, symmetric=False),
  jc.fp8("e5m2", block_size=32),
  jc.error_bounded(0.01, block_size=256),
  jc.hadamard(jc.int4(block_size=128), size=256),
  jc.spike(jc.int8(block_size=64), k=2),
]


def _modules():
  mods = [_ffi.require_module("cpu")]
  if _ffi.native_module("cuda") is not None:
    mods.append(_ffi.require_module("cuda"))
  return mods


@pytest.fixture(scope="module")
def sign_plugin_codec():
  """The example scaled-sign plugin, loaded (built once into build/plugin_test)."""
  import test_plugin

  sys.path.insert(0, str(test_plugin.EXAMPLE))
  import sign_codec

  jc.load_plugin(test_plugin._sign_library(), spec=sign_codec.SignCompressor)
  return sign_codec.SignCompressor(block=32)


def _plain(d: dict) -> dict:
  """A descriptor as plain Python values, for comparison."""
  return {
    k: [float(x) for x in v]
    if isinstance(v, (np.ndarray, list))
    else v.item()
    if isinstance(v, np.generic)
    else v
    for k, v in d.items()
  }


def test_schema_is_the_same_in_every_native_module():
  fields = native.schema()
  assert list(fields)[:2] == ["kind", "bits"] and fields["params"] == "float64[8]"
  for mod in _modules():
    assert {str(k): str(v) for k, v in mod.CODEC_FIELDS.items()} == fields, mod.__name__


@pytest.mark.parametrize("c", BUILT_IN, ids=str)
def test_builder_agrees_with_cpp_and_round_trips(c):
  fields = native.schema()
  d = native.codec_attrs(c)
  assert list(d) == list(fields)  # every field, in C++'s order
  for name, wire in fields.items():
    assert np.asarray(d[name]).dtype == WIRE_DTYPES[wire], name
  for mod in _modules():
    assert _plain(mod.codec_descriptor(d)) == _plain(d), mod.__name__


def test_plugin_descriptor_round_trips(sign_plugin_codec):
  d = native.codec_attrs(sign_plugin_codec)
  assert int(d["kind"]) == _ffi.codes("CODEC_KINDS")["plugin"] and int(d["plugin"]) >= 0
  assert _plain(_ffi.require_module("cpu").codec_descriptor(d)) == _plain(d)


@pytest.mark.parametrize(
  "drift, message",
  [
    (lambda f: {k: v for k, v in f.items() if k != "spike"}, r"unknown to C\+\+: \['spike'\]"),
    (lambda f: {**f, "scale": "float32"}, r"missing in Python: \['scale'\]"),
    (lambda f: {**f, "abs_error": "int32"}, "'abs_error' is int32 in C\\+\\+'s schema"),
    (lambda f: {**f, "bits": "float16"}, "wire type 'float16' is unknown to Python"),
  ],
  ids=["python_extra", "python_missing", "mistyped", "unknown_type"],
)
def test_python_side_drift_is_caught(monkeypatch, drift, message):
  cpp = native.schema()
  monkeypatch.setattr(native, "schema", lambda: drift(cpp))
  with pytest.raises((ValueError, TypeError), match=message):
    native.codec_attrs(jc.int8())


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda d: d.pop("block"), r"field 'block' \(int32\) is missing"),
    (lambda d: d.update(scale=np.float32(1)), "unknown codec field 'scale'"),
    (lambda d: d.update(bits=np.float32(8)), r"field 'bits' \(int32\) is not an int32"),
    (lambda d: d.update(params=np.zeros(9)), r"field 'params' \(float64\[8\]\) holds 9 values"),
  ],
  ids=["missing", "extra", "mistyped", "too_long"],
)
def test_cpp_side_drift_is_caught(change, message):
  d = dict(native.codec_attrs(jc.int8()))
  change(d)
  with pytest.raises(ValueError, match=message):
    _ffi.require_module("cpu").codec_descriptor(d)


def test_handler_names_a_bad_descriptor_field():
  """The FFI decoder (one function for every handler) says what is wrong, as the
  nanobind one does."""
  x = jnp.ones((2, 64), jnp.float32)
  jc.int8(block_size=64).encode_rows(x, impl="native")  # registers the targets
  call = jax.ffi.ffi_call("jcoccl_encode_rows", jax.ShapeDtypeStruct((2, 68), jnp.uint8))
  good = native.ffi_codec(jc.int8(block_size=64))
  for codec, message in (
    ({k: v for k, v in good.items() if k != "hadamard"}, r"field 'hadamard' \(int32\) is missing"),
    ({**good, "extra": np.int32(0)}, "unknown codec field 'extra'"),
    ({**good, "bits": np.float32(8)}, r"field 'bits' \(int32\) has another type"),
  ):
    with pytest.raises(Exception, match=message):
      jax.block_until_ready(call(x, codec=codec))
  with pytest.raises(Exception, match="attribute 'codec' .* is missing"):
    jax.block_until_ready(call(x, **good))


def test_workspace_sizing_takes_the_call_descriptors():
  """The dry run sizes with the descriptors the call carries (None: no outer codec)."""
  code = fused_ffi.op_code("all_reduce", "hierarchical", jc.int8(), jnp.float32)
  codec = fused_ffi.codec_attr(jc.int8(block_size=64))
  int8 = fused_ffi.workspace_bytes(code, 1, 256, 4, 2, codec, codec, jnp.float32)
  exact = fused_ffi.codec_attr(None)
  assert 0 < int8 < fused_ffi.workspace_bytes(code, 1, 256, 4, 2, exact, exact, jnp.float32)
  with pytest.raises(ValueError, match="outer: unknown codec field 'o_kind'"):
    fused_ffi.workspace_bytes(code, 1, 256, 4, 2, codec, {"o_kind": 0}, jnp.float32)


def test_text_form_decodes_as_the_dict_form():
  """The C interfaces' text form (native.codec_text, read by SpecFromText) carries the same
  descriptor as the FFI dictionary, for every built-in family."""
  for mod in _modules():
    for c in BUILT_IN:
      d = native.codec_attrs(c)
      got = mod.codec_descriptor_from_text(native.codec_text(d))
      assert _plain(got) == _plain(mod.codec_descriptor(d)), (mod.__name__, str(c))


def test_text_form_reads_floats_back_exactly():
  """float32 and float64 fields cross as text bit for bit (params checked by no built-in
  kind: a plugin's travel the same way)."""
  d = dict(native.codec_attrs(jc.error_bounded(0.01, block_size=64)))
  d["params"] = np.array([0.1, -0.0, 1e-300, 3.5, 0, 0, 0, 0], np.float64)
  text = native.codec_text(d)
  assert " abs_error=0.01 " in text and text.endswith(" params=0.1,-0.0,1e-300,3.5")
  got = _ffi.require_module("cpu").codec_descriptor_from_text(text)
  assert np.float32(got["abs_error"]).view(np.uint32) == d["abs_error"].view(np.uint32)
  assert np.array_equal(np.asarray(got["params"]).view(np.uint64), d["params"].view(np.uint64))


@pytest.mark.parametrize(
  "text, message",
  [
    ("kind=2 bits=x", r"field 'bits' \(int32\) cannot be 'x'"),
    ("kind=2 scale=1", "unknown codec field 'scale'; the fields are kind"),
    ("kind=2 bits", "expected name=value, got 'bits'"),
    ("kind=0 params=" + ",".join(["1"] * 9), r"field 'params' \(float64\[8\]\) cannot be"),
    ("kind=2 bits=9 block=32", "bits"),  # decoded, then refused by Validate
  ],
  ids=["mistyped", "unknown", "no_value", "too_long", "invalid"],
)
def test_text_form_names_what_is_wrong(text, message):
  with pytest.raises(ValueError, match=message):
    _ffi.require_module("cpu").codec_descriptor_from_text(text)
