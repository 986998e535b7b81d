// Scaled sign codec ("sign1", see sign_codec.py for the wire format): the per-block and
// per-element arithmetic shared by the CPU kernels (sign_cpu.cc) and the CUDA kernels
// (sign_cuda.cu), so both compute the same bits as the jnp specification.
#pragma once

#include <float.h>
#include <stdint.h>
#include <string.h>

#include "jcoccl/codec_plugin.h"

#if defined(__CUDACC__)
#define SIGN_HD __host__ __device__ inline
#else
#define SIGN_HD inline
#endif

namespace sign1 {

constexpr int kMaxLog2Block = 12;  // blocks of 32..4096 values

SIGN_HD uint32_t Bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
SIGN_HD float FromBits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
SIGN_HD float CanonicalNaN() { return FromBits(0x7fc00000u); }
SIGN_HD bool IsNaN(float f) { return (Bits(f) & 0x7fffffffu) > 0x7f800000u; }
SIGN_HD bool IsFinite(float f) { return (Bits(f) & 0x7fffffffu) < 0x7f800000u; }

// float16 -> float32, exactly (subnormal halves become normal floats).
SIGN_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return FromBits(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return FromBits(sign);
    e = 113;  // normalise: value = m * 2^-24
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e;
    }
    return FromBits(sign | (e << 23) | ((m & 0x3ffu) << 13));
  }
  return FromBits(sign | ((e + 112) << 23) | (m << 13));
}

// float32 -> float16, round to nearest even (as jnp's astype): NaN -> 0x7e00 with the sign.
SIGN_HD uint16_t FloatToHalf(float f) {
  const uint32_t x = Bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
    if (ax <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 rounds to 0
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e, half = 1u << (shift - 1);
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t v = ax - 0x38000000u;
  return static_cast<uint16_t>(sign | ((v + 0xfffu + ((v >> 13) & 1u)) >> 13));
}

// float32 -> bfloat16, round to nearest even; NaN -> quiet NaN with the sign.
SIGN_HD uint16_t FloatToBf16(float f) {
  const uint32_t x = Bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Element i of a row of dtype `d`, as float32 (exact).
SIGN_HD float Load(int32_t d, const void* row, int64_t i) {
  if (d == JCOCCL_DTYPE_F32) return static_cast<const float*>(row)[i];
  const uint16_t h = static_cast<const uint16_t*>(row)[i];
  return d == JCOCCL_DTYPE_BF16 ? FromBits(static_cast<uint32_t>(h) << 16) : HalfToFloat(h);
}

// Stores v rounded to dtype `d` as element i of a row.
SIGN_HD void Store(int32_t d, void* row, int64_t i, float v) {
  if (d == JCOCCL_DTYPE_F32) {
    static_cast<float*>(row)[i] = v;
  } else {
    static_cast<uint16_t*>(row)[i] = d == JCOCCL_DTYPE_BF16 ? FloatToBf16(v) : FloatToHalf(v);
  }
}

// v rounded to dtype `d` and back (decode_sum_encode encodes the dtype-rounded sum).
SIGN_HD float RoundTrip(int32_t d, float v) {
  if (d == JCOCCL_DTYPE_F32) return v;
  return d == JCOCCL_DTYPE_BF16 ? FromBits(static_cast<uint32_t>(FloatToBf16(v)) << 16)
                                : HalfToFloat(FloatToHalf(v));
}

SIGN_HD int Log2(int64_t b) {
  int k = 0;
  while ((int64_t{1} << k) < b) ++k;
  return k;
}

SIGN_HD int64_t BitReverse(int64_t k, int bits) {
  int64_t r = 0;
  for (int j = 0; j < bits; ++j) r |= ((k >> j) & 1) << (bits - 1 - j);
  return r;
}

// The block's scale (sign_codec.block_scales): get(i) is value i of the block, i < B.
// The jnp tree a[i] <- a[i] + a[i + w/2] adds, at its top, the sums over the even and the
// odd bit-reversed positions; visiting the values in bit-reversed order and merging equal-
// sized partial sums like a binary counter performs exactly those additions with
// log2(B) + 1 floats of state instead of B.
template <class Get>
SIGN_HD float BlockScale(const Get& get, int64_t B) {
  const int lg = Log2(B);
  float partial[kMaxLog2Block + 1];
  bool finite = true;
  for (int64_t k = 0; k < B; ++k) {
    const float x = get(BitReverse(k, lg));
    finite = finite && IsFinite(x);
    float v = FromBits(Bits(x) & 0x7fffffffu);  // |x|: jnp.abs clears the sign bit
    int j = 0;
    while ((k >> j) & 1) {
      v = partial[j] + v;
      ++j;
    }
    partial[j] = v;
  }
  if (!finite) return CanonicalNaN();
  float s = partial[lg] / static_cast<float>(B);
  return s > FLT_MAX ? FLT_MAX : s;
}

// Decoded value i of a payload (row of n values, blocks of B).
SIGN_HD float DecodeAt(const uint8_t* payload, int64_t n, int64_t B, int64_t i) {
  float s;
  memcpy(&s, payload + n / 8 + 4 * (i / B), 4);
  if (IsNaN(s)) return CanonicalNaN();
  return (payload[i >> 3] >> (i & 7)) & 1 ? -s : s;
}

// Value i of the float32 sum of nrows payloads (row r at in + r * stride), in row order,
// NaN canonical when two or more rows were added.
SIGN_HD float SumAt(const uint8_t* const* rows, const uint8_t* in, int64_t stride, int nrows,
                    int64_t n, int64_t B, int64_t i) {
  float acc = DecodeAt(rows != nullptr ? rows[0] : in, n, B, i);
  for (int r = 1; r < nrows; ++r)
    acc = acc + DecodeAt(rows != nullptr ? rows[r] : in + r * stride, n, B, i);
  return nrows > 1 && IsNaN(acc) ? CanonicalNaN() : acc;
}

// Encodes codec block b of a row whose values get(i) gives (row-relative): its scale and its
// B / 8 sign bytes.
template <class Get>
SIGN_HD void EncodeBlock(const Get& get, int64_t n, int64_t B, int64_t b, uint8_t* out) {
  struct InBlock {
    const Get& g;
    int64_t base;
    SIGN_HD float operator()(int64_t i) const { return g(base + i); }
  };
  const float s = BlockScale(InBlock{get, b * B}, B);
  memcpy(out + n / 8 + 4 * b, &s, 4);
  for (int64_t j = b * B / 8; j < (b + 1) * B / 8; ++j) {
    uint32_t byte = 0;
    for (int t = 0; t < 8; ++t) byte |= static_cast<uint32_t>(get(8 * j + t) < 0.0f) << t;
    out[j] = static_cast<uint8_t>(byte);
  }
}

// Row value sources.
struct RowValues {  // an input row of dtype d
  int32_t d;
  const void* row;
  SIGN_HD float operator()(int64_t i) const { return Load(d, row, i); }
};
struct SumValues {  // the dtype-rounded sum of payloads
  const uint8_t* const* rows;
  const uint8_t* in;
  int64_t stride;
  int nrows;
  int64_t n, B;
  int32_t d;
  SIGN_HD float operator()(int64_t i) const {
    return RoundTrip(d, SumAt(rows, in, stride, nrows, n, B, i));
  }
};

SIGN_HD int64_t PayloadBytes(int64_t n, int64_t B) { return n / 8 + 4 * (n / B); }

}  // namespace sign1

// Records `message` as the calling thread's error (sign_cpu.cc); returns 1.
int sign1_fail(const char* message);

namespace sign1 {

// Host-side checks of every kernel: the block (params[0], a power of two in 32..4096) into
// *B, the dtype, and a row length n that is a positive multiple of the block.
inline int CheckArgs(const double* params, int32_t dtype, int64_t n, int64_t* B) {
  const double b = params[0];
  *B = b >= 32 && b <= 4096 ? static_cast<int64_t>(b) : 0;
  if (*B == 0 || static_cast<double>(*B) != b || (*B & (*B - 1)) != 0)
    return sign1_fail("sign1: block must be a power of two in 32..4096");
  if (dtype < JCOCCL_DTYPE_F32 || dtype > JCOCCL_DTYPE_F16)
    return sign1_fail("sign1: dtype must be float32 (0), bfloat16 (1) or float16 (2)");
  if (n <= 0 || n % *B != 0)
    return sign1_fail("sign1: the row length must be a positive multiple of the block");
  return 0;
}

}  // namespace sign1
