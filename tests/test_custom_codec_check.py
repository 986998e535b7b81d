"""The conformance check (jcoccl.compressors.check, ``python -m jcoccl check-codec``).

Every built-in family passes it; deliberately broken codecs, written here with the public
API and registered under test-only names, fail exactly the property they break.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jcoccl import compressors as jc
from jcoccl.__main__ import main
from jcoccl._src.compressors import conformance

ALL_DTYPES = ("float32", "bfloat16", "float16")
F32 = ("float32",)
TINY = float(np.finfo(np.float32).tiny)
# (spec, dtypes): every family, all three dtypes where the time allows.
BUILTINS = [
  ("none", ALL_DTYPES),
  ("bf16", ALL_DTYPES),
  ("fp16", ALL_DTYPES),
  ("int8", ALL_DTYPES),
  ("int4", ("bfloat16",)),
  ("int2", ("float16",)),
  ("int2:asym", F32),
  ("int3", F32),
  ("int5:asym", ("bfloat16",)),
  ("int6:block=64", F32),
  ("int7", ("float16",)),
  ("int8:stochastic", ("float32", "float16")),
  ("fp8", F32),
  ("fp8:e5m2", ("bfloat16",)),
  ("eb:abs=0.001", F32),
  ("hadamard(int4)", F32),
]


@pytest.mark.parametrize("spec,dtypes", BUILTINS, ids=[s for s, _ in BUILTINS])
def test_custom_codec_check_passes_every_builtin(spec, dtypes):
  r = jc.check(jc.parse(spec), dtypes=dtypes, verbose=False)
  assert r, r.table()
  assert {row.prop for row in r.rows} == set(conformance.PROPERTIES)
  assert len(r.rows) == len(conformance.PROPERTIES) * len(dtypes)
  assert r.status("bound") == {"PASS"} and r.status("decode_in_bounds") == {"PASS"}


# ---- broken codecs: bf16 by truncation, each broken in one way ------------------------------


def _truncate(x):
  hi = (lax.bitcast_convert_type(x, jnp.uint32) >> 16).astype(jnp.uint16)
  return lax.bitcast_convert_type(hi, jnp.uint8).reshape(x.shape[0], -1)


def _widen(buf, n):
  hi = lax.bitcast_convert_type(buf.reshape(-1, n, 2), jnp.uint16)
  return lax.bitcast_convert_type(hi.astype(jnp.uint32) << 16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Trunc(jc.Compressor):
  """A correct codec: the top 16 bits of each float32 (relative error < 2**-7)."""

  granule = 1

  def row_nbytes(self, n, dtype):
    return 2 * n

  def encode_f32(self, x, key):
    return _truncate(x)

  def decode_f32(self, buf, n):
    return _widen(buf, n)

  def bound_f32(self, x):
    # Truncating a subnormal loses up to 2**-133: the absolute term is the smallest normal
    # (smaller constants would be flushed to zero by XLA:CPU).
    return jnp.abs(x) * 2.0**-7 + TINY


class FalseBound(Trunc):
  def bound_f32(self, x):
    return jnp.abs(x) * 2.0**-9 + TINY  # a quarter of the real error


class LongPayload(Trunc):
  def row_nbytes(self, n, dtype):
    return 2 * n + 1  # one byte more than encode writes

  def decode_f32(self, buf, n):
    return _widen(buf[:, : 2 * n], n)  # decodes a payload of the declared size


class ReadsPastEnd(Trunc):
  def decode_f32(self, buf, n):
    # Byte 2i+1 holds element i's high half; the last index is off by one (byte P). jnp
    # clamps the read back to byte P-1, so the values are right and only checkify sees it.
    i = jnp.arange(n)
    hi_idx = 2 * i + 1 + (i == n - 1)
    lo, hi = buf[:, 2 * i], buf[:, hi_idx]
    half = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return lax.bitcast_convert_type(half.astype(jnp.uint32) << 16, jnp.float32)


def _raise_on_all_ff(buf):
  if (np.asarray(buf) == 0xFF).all():
    raise ValueError("corrupt payload")
  return np.zeros((), np.float32)


class RaisesOnGarbage(Trunc):
  def decode_f32(self, buf, n):
    ok = jax.pure_callback(_raise_on_all_ff, jax.ShapeDtypeStruct((), jnp.float32), buf)
    return _widen(buf, n) + ok


_calls = [0]


def _noise(x):
  _calls[0] += 1
  return np.asarray(x) * np.float32(1 - (_calls[0] % 2) * 2.0**-6)


class Nondeterministic(Trunc):
  def encode_f32(self, x, key):
    return _truncate(jax.pure_callback(_noise, jax.ShapeDtypeStruct(x.shape, x.dtype), x))


BROKEN = {
  "test_custom_codec_false_bound": FalseBound,
  "test_custom_codec_long_payload": LongPayload,
  "test_custom_codec_reads_past_end": ReadsPastEnd,
  "test_custom_codec_raises": RaisesOnGarbage,
  "test_custom_codec_nondet": Nondeterministic,
  "test_custom_codec_trunc": Trunc,
}


@pytest.fixture(scope="module")
def codecs():
  out = {}
  for name, cls in BROKEN.items():
    out[cls.__name__] = jc.register(name, cls)()
  yield out
  for name in BROKEN:
    jc.unregister(name)


def _check(c, dtypes=F32):
  r = jc.check(c, dtypes=dtypes, verbose=False)
  return r, {row.prop for row in r.failures}


def test_custom_codec_correct_one_passes(codecs):
  r, failed = _check(codecs["Trunc"], ALL_DTYPES)
  assert r and not failed, r.table()
  assert r.status("native_match") == {"SKIP"}


def test_custom_codec_false_bound_fails_bound_only(codecs):
  r, failed = _check(codecs["FalseBound"])
  assert failed == {"bound"}, r.table()
  assert not r and "over the bound" in r.failures[0].detail


def test_custom_codec_wrong_payload_size_fails_payload_size(codecs):
  r, failed = _check(codecs["LongPayload"])
  assert failed == {"payload_size"}, r.table()
  assert "uint8[3, 128] != uint8[3, 129]" in r.failures[0].detail
  # Nothing decodes what the encoder wrote (one byte short): the round trips are skipped,
  # garbage of the declared size still decodes.
  assert r.status("bound") == {"SKIP"} and "writes 128 bytes" in str(r)
  assert r.status("decode_total") == {"PASS"} and r.status("decode_in_bounds") == {"PASS"}


def test_custom_codec_read_past_buffer_fails_in_bounds_only(codecs):
  r, failed = _check(codecs["ReadsPastEnd"])
  assert failed == {"decode_in_bounds"}, r.table()
  assert "out-of-bounds" in r.failures[0].detail.lower()


def test_custom_codec_raising_decoder_fails_totality(codecs):
  r, failed = _check(codecs["RaisesOnGarbage"])
  assert "decode_total" in failed, r.table()
  assert "0xff bytes" in next(x for x in r.failures if x.prop == "decode_total").detail
  assert r.status("bound") == {"PASS"} and r.status("payload_size") == {"PASS"}


def test_custom_codec_nondeterministic_encoder_fails_determinism(codecs):
  r, failed = _check(codecs["Nondeterministic"])
  assert "deterministic" in failed, r.table()
  assert r.status("payload_size") == {"PASS"} and r.status("decode_total") == {"PASS"}


def test_custom_codec_result_api():
  r = conformance.CheckResult("x", [conformance.Row("bound", "float32", "FAIL", "too big")])
  assert not r and r.failures == r.rows and r.failed("bound") and not r.failed("nonfinite")
  assert "FAIL" in str(r) and "too big" in r.table()
  with pytest.raises(TypeError, match="codec must be a jcoccl.compressors.Compressor"):
    jc.check("int8")  # type: ignore[arg-type]


# ---- command line -----------------------------------------------------------------------------


def _cli(*args, cwd=None):
  return subprocess.run(
    [sys.executable, "-m", "jcoccl", "check-codec", *args],
    capture_output=True,
    text=True,
    cwd=cwd,
    timeout=300,
  )


def test_custom_codec_cli_builtin_passes(tmp_path):
  out = tmp_path / "table.txt"
  p = _cli("int8", "--dtypes", "float32", "--out", str(out))
  assert p.returncode == 0, p.stdout + p.stderr
  assert "check int8: PASS" in p.stdout and "decode_sum_order" in p.stdout
  assert "check int8: PASS" in out.read_text()


def test_custom_codec_cli_broken_factory_fails(tmp_path):
  (tmp_path / "mycodec.py").write_text(
    textwrap.dedent(
      """
      import jax.numpy as jnp
      from jax import lax
      import jcoccl.compressors as jc

      @jc.register("cli_half_bound")
      class HalfBound(jc.Compressor):
        granule = 1
        def row_nbytes(self, n, dtype): return 2 * n
        def encode_f32(self, x, key):
          hi = (lax.bitcast_convert_type(x, jnp.uint32) >> 16).astype(jnp.uint16)
          return lax.bitcast_convert_type(hi, jnp.uint8).reshape(x.shape[0], -1)
        def decode_f32(self, buf, n):
          hi = lax.bitcast_convert_type(buf.reshape(-1, n, 2), jnp.uint16)
          return lax.bitcast_convert_type(hi.astype(jnp.uint32) << 16, jnp.float32)
        def bound_f32(self, x): return jnp.abs(x) * 2.0**-8 + 2.0**-126

      def make():
        return HalfBound()
      """
    )
  )
  p = _cli("mycodec:make", "--dtypes", "float32", cwd=tmp_path)
  assert p.returncode == 1, p.stdout + p.stderr
  assert "check cli_half_bound: FAIL" in p.stdout
  # The module registered a spec name: with --import, the spec string works too.
  p = _cli("cli_half_bound", "--import", "mycodec", "--dtypes", "float32", cwd=tmp_path)
  assert p.returncode == 1 and re.search(r"bound +float32 +64 +FAIL", p.stdout), p.stdout


@pytest.mark.parametrize(
  "args,match",
  [
    (["int9"], "neither a compressor spec nor module:factory"),
    (["no_such_module_xyz:make"], "cannot import module 'no_such_module_xyz'"),
    (["os:sep"], "not a jcoccl.compressors.Compressor"),
    (["json:dumps"], "json:dumps() raised TypeError"),
    ([], "name at least one codec"),
    (["int8", "--dtypes", "float64"], "invalid choice"),
    (["int8", "--sizes", "100"], "multiple of the granule 256"),
  ],
)
def test_custom_codec_cli_bad_arguments_exit_2(args, match, capsys):
  try:
    rc = main(["check-codec", *args])
  except SystemExit as e:  # argparse's own errors
    rc = e.code
  assert rc == 2
  assert match in capsys.readouterr().err
