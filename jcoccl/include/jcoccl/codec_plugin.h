/* jcoccl codec plugins: the C ABI between jcoccl and a compressor's native kernels.
 *
 * A plugin is a shared library that exports one symbol, JCOCCL_PLUGIN_ENTRY_SYMBOL
 * ("jcoccl_codec_plugin_v1"), a function returning a pointer to a constant
 * jcoccl_codec_plugin. jcoccl.compressors.load_plugin(path) opens the library with
 * dlopen(RTLD_NOW | RTLD_LOCAL) inside jcoccl's native modules, checks the ABI version and
 * the jcoccl version it was built against (major.minor must match), and from then on the
 * codec custom calls (backend="xla") and the fused engine (backend="fused") call its
 * kernels for every compressor of the codec's jnp family.
 *
 * The kernels must compute exactly the bytes of the codec's jnp specification (its
 * jcoccl.compressors.Compressor subclass): the same payload for the same input, and the
 * same decoded values, bit for bit. Build them without floating-point contraction
 * (-ffp-contract=off; nvcc --fmad=false). XLA:CPU runs its threads with flush-to-zero and
 * denormals-are-zero, and the CPU kernels run on those threads, so they see the same
 * subnormal behaviour as the jnp code there.
 *
 * Rows. A row is n elements of one dtype (JCOCCL_DTYPE_*), n a positive multiple of the
 * codec's granule; its payload is exactly payload_bytes(params, n, dtype) bytes, in a layout
 * the plugin owns. Several rows are contiguous: row r starts at element r * n, payload r at
 * byte r * payload_bytes. Reductions (decode_sum) decode every row to float32 and add them
 * in row order (a float32 left fold: ((r0 + r1) + r2) + ...), replace any NaN of a sum of
 * two or more rows by the canonical NaN 0x7fc00000, then cast once to the dtype (round to
 * nearest even). decode_sum_encode encodes that cast result.
 *
 * Parameters. A codec has up to JCOCCL_PLUGIN_MAX_PARAMS numeric parameters, named by
 * param_names: jcoccl passes the values of the jnp class's dataclass fields of those names,
 * converted to double, in that order (booleans as 0/1). Every function receives them as
 * `params` (an array of JCOCCL_PLUGIN_MAX_PARAMS doubles; unused entries are 0).
 *
 * Errors. Every function returns 0 on success and nonzero on failure; last_error() then
 * returns a message for the calling thread (kept until that thread's next call into the
 * plugin). jcoccl raises it as a Python exception. A function must never abort the process.
 *
 * Threads. XLA runs each device's program on its own thread: every function may be called
 * from several threads at once and must not keep mutable global state.
 *
 * Example (C):
 *   static const jcoccl_codec_plugin kPlugin = {JCOCCL_PLUGIN_ABI_VERSION,
 *                                               sizeof(jcoccl_codec_plugin),
 *                                               JCOCCL_VERSION_STRING, "sign1", 1, {"block"},
 *                                               ...};
 *   JCOCCL_PLUGIN_EXPORT const jcoccl_codec_plugin* jcoccl_codec_plugin_v1(void) {
 *     return &kPlugin;
 *   }
 */
#ifndef JCOCCL_CODEC_PLUGIN_H_
#define JCOCCL_CODEC_PLUGIN_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The layout and meaning of jcoccl_codec_plugin; bumped on any incompatible change. */
#define JCOCCL_PLUGIN_ABI_VERSION 1

/* The jcoccl release this header belongs to. A plugin records it in jcoccl_version, and
 * jcoccl loads only plugins built for its own major.minor. */
#define JCOCCL_VERSION_MAJOR 0
#define JCOCCL_VERSION_MINOR 1
#define JCOCCL_VERSION_PATCH 0
#define JCOCCL_VERSION_STRING "0.1.0"

/* At most this many numeric parameters per codec. */
#define JCOCCL_PLUGIN_MAX_PARAMS 8

/* The name of the exported entry function (its type: jcoccl_codec_plugin_entry_fn). */
#define JCOCCL_PLUGIN_ENTRY_SYMBOL "jcoccl_codec_plugin_v1"

/* Element types of rows (the values of jcoccl's DType codes). */
#define JCOCCL_DTYPE_F32 0
#define JCOCCL_DTYPE_BF16 1
#define JCOCCL_DTYPE_F16 2

#if defined(_WIN32)
#define JCOCCL_PLUGIN_EXPORT __declspec(dllexport)
#else
#define JCOCCL_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- shape functions (host) --------------------------------------------------------------
 * Return 0 and write the result, or nonzero (last_error says why). */

/* 0 if `params` are valid for this codec (e.g. a block size in range), else nonzero. */
typedef int (*jcoccl_validate_fn)(const double* params);
/* Row lengths are multiples of *granule (>= 1). */
typedef int (*jcoccl_granule_fn)(const double* params, int64_t* granule);
/* *bytes = payload bytes of one row of n elements of `dtype` (n a multiple of the granule). */
typedef int (*jcoccl_payload_bytes_fn)(const double* params, int64_t n, int32_t dtype,
                                       int64_t* bytes);

/* ---- CPU kernels (synchronous, host memory, the calling thread only) ---------------------- */

/* x: rows x n elements of dtype -> out: rows payloads. */
typedef int (*jcoccl_cpu_encode_fn)(const double* params, int32_t dtype, const void* x,
                                    int64_t rows, int64_t n, uint8_t* out);
/* in: rows payloads -> out: rows x n elements of dtype. */
typedef int (*jcoccl_cpu_decode_fn)(const double* params, int32_t dtype, const uint8_t* in,
                                    int64_t rows, int64_t n, void* out);
/* rows[0..nrows): payloads at any addresses -> out: n elements of dtype, their sum (see
 * "Reductions" above). nrows >= 1. */
typedef int (*jcoccl_cpu_decode_sum_fn)(const double* params, int32_t dtype,
                                        const uint8_t* const* rows, int32_t nrows, int64_t n,
                                        void* out);
/* As decode_sum, then encode the dtype-rounded sum: out is one payload. */
typedef int (*jcoccl_cpu_decode_sum_encode_fn)(const double* params, int32_t dtype,
                                               const uint8_t* const* rows, int32_t nrows, int64_t n,
                                               uint8_t* out);

/* ---- CUDA kernels (host functions that enqueue work on `stream`, a cudaStream_t) --------
 * Pointers are device memory. Return 0 once the work is enqueued (a launch error is a
 * failure); the work must stay on `stream`, which jcoccl orders against its other streams.
 * Batched reductions: `outs` independent sums; sum o reads the nrows payloads at
 * in + (o * nrows + r) * row_stride (row_stride >= payload bytes) and writes output row o
 * (n elements, or one payload). */
typedef int (*jcoccl_cuda_encode_fn)(const double* params, int32_t dtype, const void* x,
                                     int64_t rows, int64_t n, uint8_t* out, void* stream);
typedef int (*jcoccl_cuda_decode_fn)(const double* params, int32_t dtype, const uint8_t* in,
                                     int64_t rows, int64_t n, void* out, void* stream);
typedef int (*jcoccl_cuda_decode_sum_fn)(const double* params, int32_t dtype, const uint8_t* in,
                                         int32_t nrows, int64_t row_stride, int64_t outs, int64_t n,
                                         void* out, void* stream);
typedef int (*jcoccl_cuda_decode_sum_encode_fn)(const double* params, int32_t dtype,
                                                const uint8_t* in, int32_t nrows,
                                                int64_t row_stride, int64_t outs, int64_t n,
                                                uint8_t* out, void* stream);

/* The message of the calling thread's last failed call (never NULL; "" if none). */
typedef const char* (*jcoccl_last_error_fn)(void);

/* What a plugin library describes. Returned by the entry function; must stay valid (and
 * constant) while the library is loaded. */
typedef struct jcoccl_codec_plugin {
  /* JCOCCL_PLUGIN_ABI_VERSION of the header the plugin was built with. jcoccl reads no other
   * field when it differs from its own. */
  uint32_t abi_version;
  /* sizeof(jcoccl_codec_plugin) as the plugin saw it (a second layout check). */
  uint32_t struct_size;
  /* JCOCCL_VERSION_STRING of the header the plugin was built with, "MAJOR.MINOR.PATCH". */
  const char* jcoccl_version;
  /* The spec name of the codec's jnp family (e.g. "sign1"): the executable specification
   * these kernels implement. */
  const char* name;
  /* Number of parameters (0..JCOCCL_PLUGIN_MAX_PARAMS) and their names: dataclass fields of
   * the jnp class, passed in this order as doubles. */
  int32_t num_params;
  const char* param_names[JCOCCL_PLUGIN_MAX_PARAMS];

  /* Shape functions (required). */
  jcoccl_validate_fn validate;
  jcoccl_granule_fn granule;
  jcoccl_payload_bytes_fn payload_bytes;

  /* CPU kernels (required). */
  jcoccl_cpu_encode_fn cpu_encode;
  jcoccl_cpu_decode_fn cpu_decode;
  jcoccl_cpu_decode_sum_fn cpu_decode_sum;
  jcoccl_cpu_decode_sum_encode_fn cpu_decode_sum_encode;

  /* CUDA kernels: all four, or all NULL (the codec then runs its jnp code on GPUs). */
  jcoccl_cuda_encode_fn cuda_encode;
  jcoccl_cuda_decode_fn cuda_decode;
  jcoccl_cuda_decode_sum_fn cuda_decode_sum;
  jcoccl_cuda_decode_sum_encode_fn cuda_decode_sum_encode;

  /* Error message of the calling thread (required). */
  jcoccl_last_error_fn last_error;
} jcoccl_codec_plugin;

/* The type of the exported entry function JCOCCL_PLUGIN_ENTRY_SYMBOL. */
typedef const jcoccl_codec_plugin* (*jcoccl_codec_plugin_entry_fn)(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

/* ---- helpers: element conversions every plugin needs ----------------------------------------
 * Bit for bit jnp's astype on XLA:CPU: float16/bfloat16 -> float32 exactly (subnormal halves
 * become normal floats); float32 -> float16/bfloat16 rounded to nearest even, overflow to
 * +-Inf, subnormal results kept. NaNs keep their sign and come out quiet: float16 <-> float32
 * keep the payload's top bits, float32 -> bfloat16 gives 0x7fc0, bfloat16 -> float32 keeps
 * every bit. Integer arithmetic only, so flush-to-zero modes do not touch them. Callable
 * from C, C++ and CUDA device code. tests/test_plugin.py checks every float16 and bfloat16
 * value, the float32 ties around each and NaN payloads against jnp. */

#if defined(__CUDACC__)
#define JCOCCL_PLUGIN_INLINE static __host__ __device__ inline
#else
#define JCOCCL_PLUGIN_INLINE static inline
#endif

/* The bits of a float32, and the float32 of given bits. */
JCOCCL_PLUGIN_INLINE uint32_t jcoccl_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
JCOCCL_PLUGIN_INLINE float jcoccl_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* The canonical NaN 0x7fc00000 (what sums of two or more rows write for any NaN). */
JCOCCL_PLUGIN_INLINE float jcoccl_canonical_nan(void) { return jcoccl_f32_from_bits(0x7fc00000u); }
/* NaN / finite tests on the bits: right under -ffast-math and flush-to-zero too. */
JCOCCL_PLUGIN_INLINE int jcoccl_is_nan(float f) {
  return (jcoccl_f32_bits(f) & 0x7fffffffu) > 0x7f800000u;
}
JCOCCL_PLUGIN_INLINE int jcoccl_is_finite(float f) {
  return (jcoccl_f32_bits(f) & 0x7fffffffu) < 0x7f800000u;
}

/* float16 bits -> float32, exactly. */
JCOCCL_PLUGIN_INLINE float jcoccl_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) /* Inf, or NaN made quiet */
    return jcoccl_f32_from_bits(sign | 0x7f800000u | (m != 0 ? 0x400000u : 0u) | (m << 13));
  if (e == 0) {
    if (m == 0) return jcoccl_f32_from_bits(sign);
    e = 113; /* normalise: the value is m * 2^-24 */
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e;
    }
    return jcoccl_f32_from_bits(sign | (e << 23) | ((m & 0x3ffu) << 13));
  }
  return jcoccl_f32_from_bits(sign | ((e + 112) << 23) | (m << 13));
}

/* float32 -> float16 bits, round to nearest even; NaN -> quiet NaN, payload's top bits. */
JCOCCL_PLUGIN_INLINE uint16_t jcoccl_f32_to_f16(float f) {
  const uint32_t x = jcoccl_f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to Inf */
  if (ax < 0x38800000u) {                                   /* under 2^-14: subnormal or 0 */
    uint32_t e, m, shift, half, q, rem;
    if (ax <= 0x33000000u) return (uint16_t)sign; /* <= 2^-25 rounds to 0 */
    e = ax >> 23;
    m = (ax & 0x7fffffu) | 0x800000u;
    shift = 126 - e;
    half = 1u << (shift - 1);
    q = m >> shift;
    rem = m & ((1u << shift) - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return (uint16_t)(sign | q);
  }
  {
    const uint32_t v = ax - 0x38000000u;
    return (uint16_t)(sign | ((v + 0xfffu + ((v >> 13) & 1u)) >> 13));
  }
}

/* bfloat16 bits -> float32, exactly. */
JCOCCL_PLUGIN_INLINE float jcoccl_bf16_to_f32(uint16_t h) {
  return jcoccl_f32_from_bits((uint32_t)h << 16);
}

/* float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7fc0 with the sign. */
JCOCCL_PLUGIN_INLINE uint16_t jcoccl_f32_to_bf16(float f) {
  const uint32_t x = jcoccl_f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((x >> 16) & 0x8000u) | 0x7fc0u);
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Bytes of one element of a JCOCCL_DTYPE_*. */
JCOCCL_PLUGIN_INLINE int64_t jcoccl_dtype_bytes(int32_t dtype) {
  return dtype == JCOCCL_DTYPE_F32 ? 4 : 2;
}

/* Element i of a row of `dtype`, as float32 (exact). */
JCOCCL_PLUGIN_INLINE float jcoccl_load(int32_t dtype, const void* row, int64_t i) {
  if (dtype == JCOCCL_DTYPE_F32) return ((const float*)row)[i];
  if (dtype == JCOCCL_DTYPE_BF16) return jcoccl_bf16_to_f32(((const uint16_t*)row)[i]);
  return jcoccl_f16_to_f32(((const uint16_t*)row)[i]);
}

/* Stores v, rounded to `dtype`, as element i of a row. */
JCOCCL_PLUGIN_INLINE void jcoccl_store(int32_t dtype, void* row, int64_t i, float v) {
  if (dtype == JCOCCL_DTYPE_F32) {
    ((float*)row)[i] = v;
  } else {
    ((uint16_t*)row)[i] = dtype == JCOCCL_DTYPE_BF16 ? jcoccl_f32_to_bf16(v) : jcoccl_f32_to_f16(v);
  }
}

/* v rounded to `dtype` and back (decode_sum_encode encodes the dtype-rounded sum). */
JCOCCL_PLUGIN_INLINE float jcoccl_round_to(int32_t dtype, float v) {
  if (dtype == JCOCCL_DTYPE_F32) return v;
  if (dtype == JCOCCL_DTYPE_BF16) return jcoccl_bf16_to_f32(jcoccl_f32_to_bf16(v));
  return jcoccl_f16_to_f32(jcoccl_f32_to_f16(v));
}

#endif /* JCOCCL_CODEC_PLUGIN_H_ */
