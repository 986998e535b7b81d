// CPU codecs (cuda/WIRE_FORMAT.md) and their XLA FFI handlers.
//
// Single-threaded per call: XLA:CPU already runs each device's program on its own thread.
// The handlers call no kernels of their own, so they declare no command-buffer traits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "codecs/codec.h"
#include "codecs/ffi_attrs.h"
#include "codecs/format.h"
#include "cpu/registry.h"
#include "xla/ffi/api/ffi.h"

namespace jcoccl::codecs {
namespace {

void ToF32(DType d, const void* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = LoadElem(d, x, i);
}

void FromF32(DType d, const float* x, int64_t n, void* y) {
  for (int64_t i = 0; i < n; ++i) StoreElem(d, y, i, x[i]);
}

// Unnormalised fast Walsh-Hadamard transform of every run of h elements, then * scale.
void Hadamard(float* x, int64_t n, int h) {
  const float scale = HadamardScale(h);
  for (int64_t base = 0; base < n; base += h) {
    float* v = x + base;
    for (int len = 1; len < h; len <<= 1) {
      for (int run = 0; run < h; run += 2 * len) {
        for (int j = run; j < run + len; ++j) {
          const float a = v[j], b = v[j + len];
          v[j] = a + b;
          v[j + len] = a - b;
        }
      }
    }
    for (int j = 0; j < h; ++j) v[j] = v[j] * scale;
  }
}

void EncodeIntBlock(const CodecSpec& s, const float* x, int64_t b, const Layout& l,
                    uint8_t* out) {
  const int64_t B = s.block;
  const float* xb = x + b * B;
  bool finite = true;
  float amax = 0.0f, lo = HostDazFlush(xb[0]), hi = xb[0];
  for (int64_t j = 0; j < B; ++j) {
    finite &= IsFinite(xb[j]);
    amax = std::max(amax, std::fabs(xb[j]));
    lo = MinZ(lo, HostDazFlush(xb[j]));
    hi = std::max(hi, xb[j]);
  }
  const float R = IntR(s.bits, s.symmetric);
  float sc, mn = 0.0f;
  if (s.symmetric) {
    sc = finite ? amax * R : BitsFloat(0x7fc00000u);
  } else {
    sc = finite ? (hi - lo) * R : BitsFloat(0x7fc00000u);
    mn = finite ? lo : BitsFloat(0x7fc00000u);
  }
  const int bits = s.bits;
  const int per_byte = 8 / bits;
  uint8_t* codes = out + b * B * bits / 8;
  for (int64_t k = 0; k < B / per_byte; ++k) {
    uint32_t byte = 0;
    for (int t = 0; t < per_byte; ++t) {
      const float v = xb[k * per_byte + t];
      const uint32_t u = s.symmetric ? IntCodeSym(v, sc, bits) : IntCodeAsym(v, mn, sc, bits);
      byte |= u << (t * bits);
    }
    codes[k] = static_cast<uint8_t>(byte);
  }
  std::memcpy(out + l.scales + 4 * b, &sc, 4);
  if (!s.symmetric) std::memcpy(out + l.mins + 4 * b, &mn, 4);
}

void EncodeFp8Block(const CodecSpec& s, const float* x, int64_t b, const Layout& l,
                    uint8_t* out) {
  const int64_t B = s.block;
  const float* xb = x + b * B;
  const Fp8Params p = Fp8Of(s.fp8);
  bool finite = true;
  float amax = 0.0f;
  for (int64_t j = 0; j < B; ++j) {
    finite &= IsFinite(xb[j]);
    amax = std::max(amax, std::fabs(xb[j]));
  }
  const float sc = finite ? amax * p.r : BitsFloat(0x7fc00000u);
  uint8_t* codes = out + b * B;
  for (int64_t j = 0; j < B; ++j) {
    codes[j] = sc > 0.0f ? F32ToFp8(ClampF(xb[j] / sc, -p.fmax, p.fmax), p) : 0;
  }
  std::memcpy(out + l.scales + 4 * b, &sc, 4);
}

void EncodeEbBlock(const CodecSpec& s, const float* x, int64_t b, const Layout& l,
                   uint8_t* out) {
  const int64_t B = s.block;
  const float* xb = x + b * B;
  const float step = 2.0f * s.abs_error;
  uint32_t* words = reinterpret_cast<uint32_t*>(out + l.scales) + b * B;
  bool ok = true;
  uint32_t zmax = 0;
  for (int64_t j = 0; j < B; ++j) {
    const float q = EbQuant(xb[j], step);
    const bool good = EbElementOk(xb[j], q, step, s.abs_error);
    ok &= good;
    if (good) zmax = std::max(zmax, ZigZag(static_cast<int32_t>(q)));
  }
  std::memset(words, 0, 4 * B);
  if (!ok) {
    out[b] = kRawWidth;
    std::memcpy(words, xb, 4 * B);
    return;
  }
  const int w = BitLength(zmax);
  out[b] = static_cast<uint8_t>(w);
  if (w == 0) return;
  for (int64_t j = 0; j < B; ++j) {
    const uint64_t z = ZigZag(static_cast<int32_t>(EbQuant(xb[j], step)));
    const int64_t bit = j * w;
    const int64_t k = bit >> 5;
    const int off = static_cast<int>(bit & 31);
    const uint64_t v = z << off;
    words[k] |= static_cast<uint32_t>(v);
    if (off + w > 32) words[k + 1] |= static_cast<uint32_t>(v >> 32);
  }
}

// Encodes a float32 row; `d` is the row's dtype (the `none` payload is stored in it).
void EncodeF32(const CodecSpec& s, DType d, const float* x, int64_t n, uint8_t* out) {
  const Layout l = RowLayout(s, n, d);
  const int64_t nb = s.block > 0 ? n / s.block : 0;
  switch (s.kind) {
    case Kind::kNone: FromF32(d, x, n, out); return;
    case Kind::kCast: FromF32(s.cast_dtype, x, n, out); return;
    case Kind::kInt:
      for (int64_t b = 0; b < nb; ++b) EncodeIntBlock(s, x, b, l, out);
      return;
    case Kind::kFp8:
      for (int64_t b = 0; b < nb; ++b) EncodeFp8Block(s, x, b, l, out);
      return;
    case Kind::kErrorBounded:
      std::memset(out, 0, l.scales);
      for (int64_t b = 0; b < nb; ++b) EncodeEbBlock(s, x, b, l, out);
      return;
  }
}

// Decodes a row to float32, inverse rotation included.
void DecodeF32(const CodecSpec& s, DType d, const uint8_t* in, int64_t n, float* y) {
  if (s.kind == Kind::kNone && s.hadamard == 0) {
    ToF32(d, in, n, y);
  } else if (s.kind == Kind::kCast) {
    ToF32(s.cast_dtype, in, n, y);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = DecodeElem(s, d, in, n, i);
  }
  if (s.hadamard > 0) Hadamard(y, n, s.hadamard);
}

}  // namespace

void EncodeRowCpu(const CodecSpec& s, DType d, const void* x, int64_t n, uint8_t* out) {
  if (s.kind == Kind::kNone && s.hadamard == 0) {
    std::memcpy(out, x, n * DTypeBytes(d));
    return;
  }
  std::vector<float> tmp(n);
  ToF32(d, x, n, tmp.data());
  if (s.hadamard > 0) Hadamard(tmp.data(), n, s.hadamard);
  EncodeF32(s, d, tmp.data(), n, out);
}

void DecodeRowCpu(const CodecSpec& s, DType d, const uint8_t* in, int64_t n, void* out) {
  if (s.kind == Kind::kNone && s.hadamard == 0) {
    std::memcpy(out, in, n * DTypeBytes(d));
    return;
  }
  std::vector<float> tmp(n);
  DecodeF32(s, d, in, n, tmp.data());
  FromF32(d, tmp.data(), n, out);
}

namespace {
void SumF32(const CodecSpec& s, DType d, const uint8_t* const* rows, int nrows, int64_t n,
            float* acc) {
  std::vector<float> tmp(n);
  DecodeF32(s, d, rows[0], n, acc);
  for (int r = 1; r < nrows; ++r) {
    DecodeF32(s, d, rows[r], n, tmp.data());
    for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + tmp[i];
  }
}
}  // namespace

void DecodeSumCpu(const CodecSpec& s, DType d, const uint8_t* const* rows, int nrows,
                  int64_t n, void* out) {
  std::vector<float> acc(n);
  SumF32(s, d, rows, nrows, n, acc.data());
  FromF32(d, acc.data(), n, out);
}

void DecodeSumEncodeCpu(const CodecSpec& s, DType d, const uint8_t* const* rows, int nrows,
                        int64_t n, uint8_t* out) {
  std::vector<float> acc(n);
  SumF32(s, d, rows, nrows, n, acc.data());
  for (int64_t i = 0; i < n; ++i) acc[i] = RoundTrip(d, acc[i]);
  if (s.kind == Kind::kNone && s.hadamard == 0) {
    FromF32(d, acc.data(), n, out);
    return;
  }
  if (s.hadamard > 0) Hadamard(acc.data(), n, s.hadamard);
  EncodeF32(s, d, acc.data(), n, out);
}

}  // namespace jcoccl::codecs

// ---- XLA FFI handlers ----------------------------------------------------------------------
namespace ffi = xla::ffi;
namespace jc = jcoccl::codecs;

namespace {

int64_t LastDim(const ffi::AnyBuffer& b) {
  auto dims = b.dimensions();
  return dims.size() == 0 ? 1 : dims.back();
}

ffi::Error BadArg(const std::string& what) {
  return ffi::Error::InvalidArgument("jcoccl codec: " + what);
}

ffi::Error CheckRow(const jc::CodecSpec& s, int64_t n) {
  if (n <= 0 || n % jc::Granule(s) != 0) {
    return BadArg("row length " + std::to_string(n) + " is not a positive multiple of the granule " +
                  std::to_string(jc::Granule(s)));
  }
  return ffi::Error::Success();
}

// x: [..., n] -> out: uint8[..., P].
ffi::Error EncodeRowsImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  jc::DType d;
  if (!jc::DTypeFromFfi(x.element_type(), &d)) return BadArg("x must be float32, bfloat16 or float16");
  const int64_t n = LastDim(x);
  if (auto e = CheckRow(*spec, n); e.failure()) return e;
  const int64_t rows = static_cast<int64_t>(x.element_count()) / n;
  const int64_t p = jc::PayloadBytes(*spec, n, d);
  if (out->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(out->element_count()) != rows * p) {
    return BadArg("output must be uint8[rows, " + std::to_string(p) + "]");
  }
  const auto* xp = static_cast<const uint8_t*>(x.untyped_data());
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  for (int64_t r = 0; r < rows; ++r) {
    jc::EncodeRowCpu(*spec, d, xp + r * n * jc::DTypeBytes(d), n, op + r * p);
  }
  return ffi::Error::Success();
}

// buf: uint8[..., P] -> out: dtype[..., n].
ffi::Error DecodeRowsImpl(ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  jc::DType d;
  if (!jc::DTypeFromFfi(out->element_type(), &d)) return BadArg("output must be float32, bfloat16 or float16");
  const int64_t n = LastDim(*out);
  if (auto e = CheckRow(*spec, n); e.failure()) return e;
  const int64_t rows = static_cast<int64_t>(out->element_count()) / n;
  const int64_t p = jc::PayloadBytes(*spec, n, d);
  if (buf.element_type() != ffi::DataType::U8 || LastDim(buf) != p ||
      static_cast<int64_t>(buf.element_count()) != rows * p) {
    return BadArg("payload must be uint8[rows, " + std::to_string(p) + "]");
  }
  const auto* bp = static_cast<const uint8_t*>(buf.untyped_data());
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  for (int64_t r = 0; r < rows; ++r) {
    jc::DecodeRowCpu(*spec, d, bp + r * p, n, op + r * n * jc::DTypeBytes(d));
  }
  return ffi::Error::Success();
}

// Shapes of a reduction: buf uint8[batch..., nrows, P], n elements per row.
struct SumShape {
  int64_t batch = 0, nrows = 0, p = 0;
};

ffi::Error SumShapeOf(const jc::CodecSpec& s, jc::DType d, const ffi::AnyBuffer& buf, int64_t n,
                      SumShape* sh) {
  if (auto e = CheckRow(s, n); e.failure()) return e;
  auto dims = buf.dimensions();
  sh->p = jc::PayloadBytes(s, n, d);
  if (buf.element_type() != ffi::DataType::U8 || dims.size() < 2 || dims.back() != sh->p ||
      dims[dims.size() - 2] < 1) {
    return BadArg("payload must be uint8[..., nrows >= 1, " + std::to_string(sh->p) + "]");
  }
  sh->nrows = dims[dims.size() - 2];
  sh->batch = static_cast<int64_t>(buf.element_count()) / (sh->nrows * sh->p);
  return ffi::Error::Success();
}

ffi::Error DecodeSumImpl(ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  jc::DType d;
  if (!jc::DTypeFromFfi(out->element_type(), &d)) return BadArg("output must be float32, bfloat16 or float16");
  const int64_t n = LastDim(*out);
  SumShape sh;
  if (auto e = SumShapeOf(*spec, d, buf, n, &sh); e.failure()) return e;
  if (static_cast<int64_t>(out->element_count()) != sh.batch * n) return BadArg("output must be dtype[..., n]");
  const auto* bp = static_cast<const uint8_t*>(buf.untyped_data());
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  std::vector<const uint8_t*> rows(sh.nrows);
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t r = 0; r < sh.nrows; ++r) rows[r] = bp + (b * sh.nrows + r) * sh.p;
    jc::DecodeSumCpu(*spec, d, rows.data(), static_cast<int>(sh.nrows), n,
                     op + b * n * jc::DTypeBytes(d));
  }
  return ffi::Error::Success();
}

ffi::Error DecodeSumEncodeImpl(ffi::AnyBuffer buf, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Dictionary attrs) {
  auto spec = jc::SpecFromAttrs(attrs);
  if (spec.has_error()) return spec.error();
  auto dt = attrs.get<int32_t>("dtype");
  auto n = attrs.get<int64_t>("n");
  if (dt.has_error()) return dt.error();
  if (n.has_error()) return n.error();
  if (*dt < 0 || *dt > 2) return BadArg("dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  const jc::DType d = static_cast<jc::DType>(*dt);
  SumShape sh;
  if (auto e = SumShapeOf(*spec, d, buf, *n, &sh); e.failure()) return e;
  if (out->element_type() != ffi::DataType::U8 ||
      static_cast<int64_t>(out->element_count()) != sh.batch * sh.p) {
    return BadArg("output must be uint8[..., " + std::to_string(sh.p) + "]");
  }
  const auto* bp = static_cast<const uint8_t*>(buf.untyped_data());
  auto* op = static_cast<uint8_t*>(out->untyped_data());
  std::vector<const uint8_t*> rows(sh.nrows);
  for (int64_t b = 0; b < sh.batch; ++b) {
    for (int64_t r = 0; r < sh.nrows; ++r) rows[r] = bp + (b * sh.nrows + r) * sh.p;
    jc::DecodeSumEncodeCpu(*spec, d, rows.data(), static_cast<int>(sh.nrows), *n, op + b * sh.p);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclEncodeRows, EncodeRowsImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclDecodeRows, DecodeRowsImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclDecodeSum, DecodeSumImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclDecodeSumEncode, DecodeSumEncodeImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attrs());
JCOCCL_CPU_REGISTER("jcoccl_encode_rows", JcocclEncodeRows);
JCOCCL_CPU_REGISTER("jcoccl_decode_rows", JcocclDecodeRows);
JCOCCL_CPU_REGISTER("jcoccl_decode_sum", JcocclDecodeSum);
JCOCCL_CPU_REGISTER("jcoccl_decode_sum_encode", JcocclDecodeSumEncode);
