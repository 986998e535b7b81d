// Scaled sign codec ("sign1", see sign_codec.py for the wire format): the per-block and
// per-element arithmetic shared by the CPU kernels (sign_cpu.cc) and the CUDA kernels
// (sign_cuda.cu), so both compute the same bits as the jnp specification.
#pragma once

#include <float.h>
#include <stdint.h>
#include <string.h>

#include "jcoccl/codec_plugin.h"  // also the element helpers: jcoccl_load, jcoccl_store, ...

#if defined(__CUDACC__)
#define SIGN_HD __host__ __device__ inline
#else
#define SIGN_HD inline
#endif

namespace sign1 {

constexpr int kMaxLog2Block = 12;  // blocks of 32..4096 values

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
    finite = finite && jcoccl_is_finite(x);
    // |x|: jnp.abs clears the sign bit
    float v = jcoccl_f32_from_bits(jcoccl_f32_bits(x) & 0x7fffffffu);
    int j = 0;
    while ((k >> j) & 1) {
      v = partial[j] + v;
      ++j;
    }
    partial[j] = v;
  }
  if (!finite) return jcoccl_canonical_nan();
  float s = partial[lg] / static_cast<float>(B);
  return s > FLT_MAX ? FLT_MAX : s;
}

// Decoded value i of a payload (row of n values, blocks of B).
SIGN_HD float DecodeAt(const uint8_t* payload, int64_t n, int64_t B, int64_t i) {
  float s;
  memcpy(&s, payload + n / 8 + 4 * (i / B), 4);
  if (jcoccl_is_nan(s)) return jcoccl_canonical_nan();
  return (payload[i >> 3] >> (i & 7)) & 1 ? -s : s;
}

// Value i of the float32 sum of nrows payloads (row r at in + r * stride), in row order,
// NaN canonical when two or more rows were added.
SIGN_HD float SumAt(const uint8_t* const* rows, const uint8_t* in, int64_t stride, int nrows,
                    int64_t n, int64_t B, int64_t i) {
  float acc = DecodeAt(rows != nullptr ? rows[0] : in, n, B, i);
  for (int r = 1; r < nrows; ++r)
    acc = acc + DecodeAt(rows != nullptr ? rows[r] : in + r * stride, n, B, i);
  return nrows > 1 && jcoccl_is_nan(acc) ? jcoccl_canonical_nan() : acc;
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
  SIGN_HD float operator()(int64_t i) const { return jcoccl_load(d, row, i); }
};
struct SumValues {  // the dtype-rounded sum of payloads
  const uint8_t* const* rows;
  const uint8_t* in;
  int64_t stride;
  int nrows;
  int64_t n, B;
  int32_t d;
  SIGN_HD float operator()(int64_t i) const {
    return jcoccl_round_to(d, SumAt(rows, in, stride, nrows, n, B, i));
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
