// Per-element arithmetic of the wire formats (cuda/WIRE_FORMAT.md), shared by the CPU
// code and the CUDA kernels. Host conversions reproduce XLA:CPU's (x86) results bit for
// bit, NaN payloads included; device conversions use the instructions XLA:GPU emits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "codecs/codec.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace jcoccl::codecs {

JCOCCL_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

JCOCCL_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// `v + 0.0` in round-to-nearest: a zero of either sign becomes +0 (and, where the thread
// treats subnormals as zero (XLA:CPU sets MXCSR.DAZ), a subnormal too: the comparison sees
// zero). The asymmetric int codec stores its block minimum and maximum through this, so the
// sign of a zero extreme does not depend on how a min/max reduction breaks ties.
JCOCCL_HD float PlusZero(float v) { return v == 0.0f ? 0.0f : v; }

JCOCCL_HD bool IsFinite(float x) { return (FloatBits(x) & 0x7f800000u) != 0x7f800000u; }

// The canonical NaN every decoder writes for a NaN that its arithmetic produced.
constexpr uint32_t kCanonicalNaN = 0x7fc00000u;

// v, or the canonical NaN if v is a NaN. IEEE 754 leaves the sign and payload of an
// arithmetic NaN open (x86 makes 0xffc00000 from 0 * inf and keeps an operand's payload,
// CUDA makes 0x7fffffff): the wire format fixes them here.
JCOCCL_HD float CanonNaN(float v) { return v != v ? BitsFloat(kCanonicalNaN) : v; }

// round-half-to-even in the current (nearest) rounding mode.
JCOCCL_HD float RoundEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

// min with -0 < +0 (IEEE 754-2019 minimum on finite values).
JCOCCL_HD float MinZ(float a, float b) {
  return (a < b || (a == b && (FloatBits(a) >> 31) != 0)) ? a : b;
}

JCOCCL_HD float ClampF(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// ---- bfloat16 / float16 <-> float32 ------------------------------------------------------
JCOCCL_HD float BF16ToF32(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

JCOCCL_HD uint16_t F32ToBF16(float f) {
  const uint32_t u = FloatBits(f);
  // NaN: sign kept, canonical payload (the device instruction's NaN differs: written out).
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) & 0x8000u) | 0x7fc0u;
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

JCOCCL_HD float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  // Inf/NaN: sign and payload kept, NaNs quieted (written out for the device too).
  if (e == 0x1f) return BitsFloat(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  if (e != 0) return BitsFloat(sign | ((e + 112u) << 23) | (m << 13));
  // Subnormal (or zero): m * 2^-24 is exact in float32.
  const float v = static_cast<float>(m) * 5.9604644775390625e-08f;
  return sign ? -v : v;
#endif
}

JCOCCL_HD uint16_t F32ToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  // NaN: sign and the payload's top bits kept, quieted (written out for the device too).
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((a >> 13) & 0x3ffu);
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65536: Inf
  if (a >= 0x38800000u) {                       // normal half
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return sign | static_cast<uint16_t>((r >> 13) - (112u << 10));
  }
  if (a < 0x33000000u) return sign;  // < 2^-25: rounds to zero (ties to even: 0)
  // Subnormal half: round(|f| * 2^24) to even, computed in integers.
  const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift =
      126u - e;  // value = m * 2^(e-150); units of 2^-24 -> shift right by (126-e)
  const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  const uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  return sign | static_cast<uint16_t>(r);
#endif
}

// Element i of a row of dtype d, as float32 (exact).
JCOCCL_HD float LoadElem(DType d, const void* p, int64_t i) {
  switch (d) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return BF16ToF32(static_cast<const uint16_t*>(p)[i]);
    default:
      return F16ToF32(static_cast<const uint16_t*>(p)[i]);
  }
}

// Stores v rounded to dtype d (round-to-nearest-even).
JCOCCL_HD void StoreElem(DType d, void* p, int64_t i, float v) {
  switch (d) {
    case DType::kF32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = F32ToBF16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = F32ToF16(v);
      break;
  }
}

// float32 -> dtype d -> float32.
JCOCCL_HD float RoundTrip(DType d, float v) {
  switch (d) {
    case DType::kF32:
      return v;
    case DType::kBF16:
      return BF16ToF32(F32ToBF16(v));
    default:
      return F16ToF32(F32ToF16(v));
  }
}

// ---- fp8 -------------------------------------------------------------------------------
struct Fp8Params {
  int mbits, bias;
  float fmax, r;  // largest finite value and float32(1 / fmax)
  float sub_mul;  // 2^(bias - 1 + mbits): |y| in units of the smallest subnormal
};

JCOCCL_HD Fp8Params Fp8Of(Fp8Format f) {
  if (f == Fp8Format::kE4M3) return {3, 7, 448.0f, 1.0f / 448.0f, 512.0f};
  return {2, 15, 57344.0f, 1.0f / 57344.0f, 65536.0f};
}

// y finite with |y| <= fmax, rounded to nearest even fp8 (subnormals included).
JCOCCL_HD uint8_t F32ToFp8(float y, const Fp8Params& p) {
  const uint32_t u = FloatBits(y);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  const int e = static_cast<int>(a >> 23) - 127;
  if (e >= 1 - p.bias) {
    const int shift = 23 - p.mbits;
    const uint32_t r = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
    return static_cast<uint8_t>(sign | (r - (static_cast<uint32_t>(127 - p.bias) << p.mbits)));
  }
  // Subnormal fp8: an exact power-of-two multiply, then round half to even.
  const float q = RoundEven(BitsFloat(a) * p.sub_mul);
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(q));
}

JCOCCL_HD float Fp8ToF32(uint8_t c, const Fp8Params& p) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const int ebits = 7 - p.mbits;
  const uint32_t e = (c >> p.mbits) & ((1u << ebits) - 1u), m = c & ((1u << p.mbits) - 1u);
  if (p.mbits == 3 && e == 15 && m == 7) return BitsFloat(sign | 0x7fc00000u);
  if (p.mbits == 2 && e == 31) return BitsFloat(sign | 0x7f800000u | (m ? 0x400000u : 0u));
  if (e == 0) {
    const float v = static_cast<float>(m) / p.sub_mul;  // exact: power-of-two divisor
    return sign ? -v : v;
  }
  return BitsFloat(sign | ((e - p.bias + 127u) << 23) | (m << (23 - p.mbits)));
}

// ---- int ----------------------------------------------------------------------------------
JCOCCL_HD int IntQmax(int bits) { return (1 << (bits - 1)) - 1; }

// float32(1 / qmax) (symmetric) or float32(1 / (2^b - 1)) (asymmetric).
JCOCCL_HD float IntR(int bits, bool symmetric) {
  const int levels = symmetric ? (1 << (bits - 1)) - 1 : (1 << bits) - 1;
  return 1.0f / static_cast<float>(levels);
}

JCOCCL_HD uint32_t IntCodeSym(float x, float s, int bits) {
  const float qmax = static_cast<float>(IntQmax(bits));
  const float q = s > 0.0f ? ClampF(RoundEven(x / s), -qmax, qmax) : 0.0f;
  return static_cast<uint32_t>(static_cast<int>(q) + (1 << (bits - 1)));
}

JCOCCL_HD uint32_t IntCodeAsym(float x, float lo, float s, int bits) {
  const float L = static_cast<float>((1 << bits) - 1);
  const float q = s > 0.0f ? ClampF(RoundEven((x - lo) / s), 0.0f, L) : 0.0f;
  return static_cast<uint32_t>(q);
}

JCOCCL_HD float IntDecodeSym(uint32_t u, float s, int bits) {
  return static_cast<float>(static_cast<int>(u) - (1 << (bits - 1))) * s;
}

JCOCCL_HD float IntDecodeAsym(uint32_t u, float lo, float s) {
  const float p = static_cast<float>(u) * s;
  return lo + p;
}

// b-bit code of element i from the packed codes (a little-endian bit stream). A code that
// straddles two bytes ends inside its group of 8 codes (b whole bytes), so the second byte
// read is always part of the payload.
JCOCCL_HD uint32_t UnpackCode(const uint8_t* codes, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int off = static_cast<int>(bit & 7);
  uint32_t w = codes[bit >> 3];
  if (off + bits > 8) w |= static_cast<uint32_t>(codes[(bit >> 3) + 1]) << 8;
  return (w >> off) & ((1u << bits) - 1u);
}

// ---- error_bounded -------------------------------------------------------------------------
constexpr uint8_t kRawWidth = 255;
constexpr int kMaxWidth = 31;  // widths 32..254 are invalid: the block decodes to NaN

JCOCCL_HD uint32_t ZigZag(int32_t q) {
  return q >= 0 ? static_cast<uint32_t>(q) << 1 : (static_cast<uint32_t>(-(q + 1)) << 1) | 1u;
}

JCOCCL_HD int32_t UnZigZag(uint32_t z) {
  return static_cast<int32_t>(z >> 1) ^ -static_cast<int32_t>(z & 1u);
}

JCOCCL_HD int BitLength(uint32_t z) {
#if defined(__CUDA_ARCH__)
  return 32 - __clz(z);
#else
  return z == 0 ? 0 : 32 - __builtin_clz(z);
#endif
}

// q = round(x / step) as float32; the block stays quantized only if every element passes
// EbElementOk.
JCOCCL_HD float EbQuant(float x, float step) { return RoundEven(x / step); }

JCOCCL_HD bool EbElementOk(float x, float q, float step, float abs_error) {
  if (!IsFinite(x) || !(fabsf(q) < 1073741824.0f)) return false;
  const float xh = q * step;
  return fabsf(x - xh) <= abs_error;
}

// w-bit field j of a block's words (LSB first across words), w in 1..kMaxWidth (the caller
// checks: a wider field would read past the block's words).
JCOCCL_HD uint32_t EbField(const uint32_t* words, int64_t j, int w) {
  const int64_t bit = j * w;
  const int64_t k = bit >> 5;
  const int off = static_cast<int>(bit & 31);
  uint64_t v = words[k] >> off;
  if (off + w > 32) v |= static_cast<uint64_t>(words[k + 1]) << (32 - off);
  return static_cast<uint32_t>(v) & ((1u << w) - 1u);
}

JCOCCL_HD float EbDecode(const uint32_t* block_words, int64_t j, int w, float step) {
  if (w == kRawWidth) return BitsFloat(block_words[j]);
  if (w > kMaxWidth) return BitsFloat(kCanonicalNaN);  // invalid width byte (untrusted payload)
  if (w == 0) return 0.0f * step;
  return static_cast<float>(UnZigZag(EbField(block_words, j, w))) * step;
}

// ---- Hadamard ------------------------------------------------------------------------------
// The normalised transform of H = 2^k values is computed as pre-scale by 2^-k (exact unless
// the result is below the normal range), the unnormalised butterflies, then times
// float32(sqrt(H)). Every butterfly output is then at most max |x| in size, and only the
// last multiply can overflow, where the true result itself is near float32's top
// (cuda/WIRE_FORMAT.md).
JCOCCL_HD float HadamardPre(int h) {
  int k = 0;
  while ((1 << k) < h) ++k;
  return BitsFloat(static_cast<uint32_t>(127 - k) << 23);
}
inline float HadamardPost(int h) { return static_cast<float>(std::sqrt(static_cast<double>(h))); }

// ---- spike reserving ----------------------------------------------------------------------
// The reserving order of element j of a block as one uint64, largest first: |x|'s bits
// (finite values; the integer order of the bits is the order of the magnitudes, subnormals
// included), below them every NaN/Inf, then the lower index first among equals. Every key
// is distinct and nonzero.
JCOCCL_HD uint64_t SpikeKey(float v, int64_t j) {
  const uint32_t a = FloatBits(v) & 0x7fffffffu;
  const uint64_t score = a < 0x7f800000u ? a + 1u : 0u;
  return (score << 32) | (0xffffffffu - static_cast<uint32_t>(j));
}
// The in-block index of a key, and whether its element is finite (reserved).
JCOCCL_HD uint32_t SpikeIndex(uint64_t key) { return 0xffffffffu - static_cast<uint32_t>(key); }
JCOCCL_HD bool SpikeUsed(uint64_t key) { return (key >> 32) != 0; }

// ---- one element of a decoded row (float32, before the cast to the row dtype) -------------
// Everything DecodeElem needs that depends only on the codec and the row: built once per row
// (or kernel), so decoding an element costs no layout arithmetic and no division. `d` is the
// row dtype (used by `none`); under hadamard the payload holds float32, and the caller applies
// the inverse rotation afterwards.
struct ElemDecoder {
  Kind kind;
  DType pd;         // none: payload dtype; cast: cast dtype
  int bits;         // int
  bool symmetric;   // int
  int block_shift;  // log2(block)
  int64_t scales, mins;
  float step;  // error_bounded
  Fp8Params fp8;

  JCOCCL_HD float operator()(const uint8_t* row, int64_t i) const {
    switch (kind) {
      case Kind::kNone:
      case Kind::kCast:
        return LoadElem(pd, row, i);
      case Kind::kInt: {
        const int64_t b = i >> block_shift;
        const float sc = reinterpret_cast<const float*>(row + scales)[b];
        const uint32_t u = UnpackCode(row, i, bits);
        if (symmetric) return CanonNaN(IntDecodeSym(u, sc, bits));
        return CanonNaN(IntDecodeAsym(u, reinterpret_cast<const float*>(row + mins)[b], sc));
      }
      case Kind::kFp8: {
        const float sc = reinterpret_cast<const float*>(row + scales)[i >> block_shift];
        return CanonNaN(Fp8ToF32(row[i], fp8) * sc);
      }
      default: {
        const int64_t b = i >> block_shift;
        const uint32_t* words =
            reinterpret_cast<const uint32_t*>(row + scales) + (b << block_shift);
        return EbDecode(words, i - (b << block_shift), row[b], step);
      }
    }
  }
};

JCOCCL_HD ElemDecoder MakeElemDecoder(const CodecSpec& s, DType d, int64_t n) {
  if (s.hadamard > 0) d = DType::kF32;
  const Layout l = RowLayout(s, n, d);
  int shift = 0;
  while ((int64_t{1} << shift) < s.block) ++shift;
  return ElemDecoder{s.kind,      s.kind == Kind::kCast ? s.cast_dtype : d,
                     s.bits,      s.symmetric,
                     shift,       l.scales,
                     l.mins,      2.0f * s.abs_error,
                     Fp8Of(s.fp8)};
}

// One element, building the decoder on the spot (prefer MakeElemDecoder once per row).
JCOCCL_HD float DecodeElem(const CodecSpec& s, DType d, const uint8_t* row, int64_t n, int64_t i) {
  return MakeElemDecoder(s, d, n)(row, i);
}

}  // namespace jcoccl::codecs
