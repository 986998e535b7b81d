// Codec API shared by the FFI handlers and the fused collective engine.
//
// A codec turns a row of n elements (float32, bfloat16 or float16; n a multiple of
// Granule(spec)) into exactly PayloadBytes(spec, n, dtype) bytes, as fixed bit for bit by
// cuda/WIRE_FORMAT.md. The CPU functions are single-threaded and synchronous; the CUDA
// functions (codecs/codec_cuda.h) are asynchronous launches on a stream.
//
// Example (CPU):
//   CodecSpec spec = CodecSpec::Int(8, 256, /*symmetric=*/true);
//   std::vector<uint8_t> buf(PayloadBytes(spec, n, DType::kF32));
//   EncodeRowCpu(spec, DType::kF32, x, n, buf.data());
//   DecodeRowCpu(spec, DType::kF32, buf.data(), n, y);
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "jcoccl/codec_plugin.h"

#if defined(__CUDACC__)
#define JCOCCL_HD __host__ __device__ __forceinline__
#else
#define JCOCCL_HD inline
#endif

namespace jcoccl::codecs {

// Element types of rows. Values are the wire encoding (descriptor field cast_dtype, fused dtype).
enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Codec families. Values are the descriptor field "kind". A Hadamard rotation is not
// a kind: it is CodecSpec::hadamard > 0 around any of these (the "inner" codec) except
// kPlugin, a codec whose kernels come from a loaded plugin library
// (jcoccl/include/jcoccl/codec_plugin.h).
enum class Kind : int32_t {
  kNone = 0,
  kCast = 1,
  kInt = 2,
  kFp8 = 3,
  kErrorBounded = 5,
  kPlugin = 6
};

constexpr int kMaxPluginParams = JCOCCL_PLUGIN_MAX_PARAMS;

// fp8 formats. Values are the descriptor field "fp8" (codecs/descriptor.h).
enum class Fp8Format : int32_t { kE4M3 = 0, kE5M2 = 1 };

// A codec, flat: `kind` with its parameters, optionally wrapped by a Hadamard rotation of
// `hadamard` elements (0 = no rotation) or by spike reserving of `spike` values per block
// (0 = none; never both). hadamard(inner=int4 B=128, size=256) is
// {kind=kInt, bits=4, block=128, symmetric=true, hadamard=256}; spike(int4 B=128, k=2) is
// {kind=kInt, bits=4, block=128, symmetric=true, spike=2}.
struct CodecSpec {
  Kind kind = Kind::kNone;
  int32_t bits = 8;                      // kInt: 2 to 8
  int32_t block = 1;                     // kInt, kFp8, kErrorBounded: B (power of two, 32..4096)
  bool symmetric = true;                 // kInt
  Fp8Format fp8 = Fp8Format::kE4M3;      // kFp8
  DType cast_dtype = DType::kBF16;       // kCast: kBF16 or kF16
  float abs_error = 0.0f;                // kErrorBounded
  int32_t hadamard = 0;                  // 0, or H (power of two, 2..4096)
  int32_t spike = 0;                     // 0, or k reserved values per block (1..block-1)
  int32_t plugin = -1;                   // kPlugin: the id load_plugin gave the library
  double params[kMaxPluginParams] = {};  // kPlugin: the codec's parameters, in its order

  static CodecSpec None() { return CodecSpec{}; }
  static CodecSpec Cast(DType to) {
    CodecSpec s;
    s.kind = Kind::kCast;
    s.cast_dtype = to;
    return s;
  }
  static CodecSpec Int(int32_t bits, int32_t block, bool symmetric) {
    CodecSpec s;
    s.kind = Kind::kInt;
    s.bits = bits;
    s.block = block;
    s.symmetric = symmetric;
    return s;
  }
  static CodecSpec Fp8(Fp8Format f, int32_t block) {
    CodecSpec s;
    s.kind = Kind::kFp8;
    s.fp8 = f;
    s.block = block;
    return s;
  }
  static CodecSpec ErrorBounded(float abs_error, int32_t block) {
    CodecSpec s;
    s.kind = Kind::kErrorBounded;
    s.abs_error = abs_error;
    s.block = block;
    return s;
  }
  CodecSpec WithHadamard(int32_t h) const {
    CodecSpec s = *this;
    s.hadamard = h;
    return s;
  }
  CodecSpec WithSpike(int32_t k) const {
    CodecSpec s = *this;
    s.spike = k;
    return s;
  }
};

// Spike reserving: the index that marks a slot holding no value (WIRE_FORMAT.md "spike").
constexpr uint16_t kSpikeUnused = 0xFFFF;

namespace detail {
JCOCCL_HD bool IsPow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }
}  // namespace detail

// ---- plugins (host only) ----------------------------------------------------------------
// The plugin libraries loaded into this native module, by the id Python assigned them
// (jcoccl._cpu and jcoccl._cuda are separate shared objects: each has its own table).
// Written by the loader while XLA threads may read: atomics.
constexpr int kMaxPlugins = 64;

inline std::atomic<const jcoccl_codec_plugin*>* PluginTable() {
  static std::atomic<const jcoccl_codec_plugin*> table[kMaxPlugins];
  return table;
}

// The plugin of a kPlugin spec, or nullptr when its id is not loaded here.
inline const jcoccl_codec_plugin* PluginOf(const CodecSpec& s) {
  if (s.kind != Kind::kPlugin || s.plugin < 0 || s.plugin >= kMaxPlugins) return nullptr;
  return PluginTable()[s.plugin].load(std::memory_order_acquire);
}

// The plugin's message for its last failure on this thread (never null).
inline const char* PluginError(const jcoccl_codec_plugin* p) {
  const char* m = p != nullptr && p->last_error != nullptr ? p->last_error() : nullptr;
  return m != nullptr && m[0] != '\0' ? m : "plugin kernel failed (it gave no message)";
}

// The library path of each loaded plugin (written before its table entry is published).
inline std::string* PluginPaths() {
  static std::string paths[kMaxPlugins];
  return paths;
}

inline const char* DTypeName(DType d) {
  return d == DType::kF32 ? "float32" : d == DType::kBF16 ? "bfloat16" : "float16";
}

// For a plugin spec, the start of an error message that names the plugin, its library and
// the sizes (n, dtype, the plugin's payload bytes per row); "" for a built-in codec.
inline std::string PluginContext(const CodecSpec& s, DType d, int64_t n) {
  if (s.kind != Kind::kPlugin) return {};
  const jcoccl_codec_plugin* p = PluginOf(s);
  if (p == nullptr) return "jcoccl plugin id " + std::to_string(s.plugin) + " (not loaded): ";
  int64_t bytes = -1;
  const bool ok = p->payload_bytes(s.params, n, static_cast<int32_t>(d), &bytes) == 0;
  return "jcoccl plugin '" + std::string(p->name) + "' (" + PluginPaths()[s.plugin] +
         "), rows of n=" + std::to_string(n) + " " + DTypeName(d) +
         " (its payload_bytes: " + (ok ? std::to_string(bytes) + " bytes per row" : "refused") +
         "): ";
}

// Validity of a kPlugin spec: loaded, parameters accepted, a granule >= 1.
inline const char* ValidatePlugin(const CodecSpec& s) {
  if (s.hadamard != 0) return "a plugin codec takes no hadamard rotation";
  if (s.spike != 0) return "a plugin codec takes no spike reserving";
  const jcoccl_codec_plugin* p = PluginOf(s);
  if (p == nullptr)
    return "plugin id is not loaded in this native module; call "
           "jcoccl.compressors.load_plugin(path) first";
  if (p->validate(s.params) != 0) return PluginError(p);
  int64_t g = 0;
  if (p->granule(s.params, &g) != 0) return PluginError(p);
  if (g < 1) return "the plugin's granule must be >= 1";
  return nullptr;
}

// Returns nullptr if `spec` is valid, else a static message naming the bad field.
inline const char* Validate(const CodecSpec& s) {
  switch (s.kind) {
    case Kind::kNone:
      break;
    case Kind::kCast:
      if (s.cast_dtype != DType::kBF16 && s.cast_dtype != DType::kF16)
        return "cast_dtype must be bfloat16 (1) or float16 (2)";
      break;
    case Kind::kInt:
      if (s.bits < 2 || s.bits > 8) return "bits must be 2 to 8";
      [[fallthrough]];
    case Kind::kFp8:
      if (s.kind == Kind::kFp8 && s.fp8 != Fp8Format::kE4M3 && s.fp8 != Fp8Format::kE5M2)
        return "fp8 must be e4m3 (0) or e5m2 (1)";
      [[fallthrough]];
    case Kind::kErrorBounded:
      if (!detail::IsPow2(s.block) || s.block < 32 || s.block > 4096)
        return "block must be a power of two in [32, 4096]";
      if (s.kind == Kind::kErrorBounded && !(s.abs_error > 0.0f && s.abs_error < 3.0e38f))
        return "abs_error must be a positive finite float32";
      break;
    case Kind::kPlugin:
      return ValidatePlugin(s);
    default:
      return "kind must be none (0), cast (1), int (2), fp8 (3), error_bounded (5) or plugin (6)";
  }
  if (s.hadamard != 0 && (!detail::IsPow2(s.hadamard) || s.hadamard < 2 || s.hadamard > 4096))
    return "hadamard must be 0 or a power of two in [2, 4096]";
  if (s.spike != 0) {
    if (s.kind != Kind::kInt && s.kind != Kind::kFp8 && s.kind != Kind::kErrorBounded)
      return "spike needs an int, fp8 or error_bounded inner codec";
    if (s.hadamard != 0) return "spike and hadamard do not combine in one native codec";
    if (s.spike < 1 || s.spike >= s.block) return "spike must be 0 or in [1, block - 1]";
  }
  return nullptr;
}

JCOCCL_HD int64_t DTypeBytes(DType d) { return d == DType::kF32 ? 4 : 2; }

// Granule of the inner codec alone (1 for none/cast, the plugin's, else the block size).
JCOCCL_HD int64_t InnerGranule(const CodecSpec& s) {
  if (s.kind == Kind::kPlugin) {
    int64_t g = 1;
#if !defined(__CUDA_ARCH__)  // plugins are host code; no device kernel sees a plugin spec
    const jcoccl_codec_plugin* p = PluginOf(s);
    if (p == nullptr || p->granule(s.params, &g) != 0 || g < 1) g = 1;
#endif
    return g;
  }
  return (s.kind == Kind::kNone || s.kind == Kind::kCast) ? 1 : s.block;
}

// Row lengths must be multiples of this: lcm(H, inner granule); both are powers of two.
JCOCCL_HD int64_t Granule(const CodecSpec& s) {
  int64_t g = InnerGranule(s);
  return s.hadamard > g ? s.hadamard : g;
}

// Byte offsets of the sections of a payload (see WIRE_FORMAT.md).
struct Layout {
  int64_t codes = 0;   // int: codes; fp8: codes; error_bounded: widths (padded)
  int64_t scales = 0;  // int/fp8: f32 scales; error_bounded: uint32 words
  int64_t mins = 0;    // int asymmetric: f32 mins
  int64_t spike = 0;   // spike: f32 values [nb, k], uint16 indices [nb, k], zero padding
  int64_t total = 0;
};

// Layout of a row of n elements of dtype `d` (the inner codec sees float32 under hadamard).
JCOCCL_HD Layout RowLayout(const CodecSpec& s, int64_t n, DType d) {
  Layout l;
  if (s.hadamard > 0) d = DType::kF32;
  const int64_t nb = s.block > 0 ? n / s.block : 0;
  switch (s.kind) {
    case Kind::kNone:
      l.total = n * DTypeBytes(d);
      break;
    case Kind::kCast:
      l.total = n * DTypeBytes(s.cast_dtype);
      break;
    case Kind::kInt:
      l.scales = n * s.bits / 8;
      l.mins = l.scales + 4 * nb;
      l.total = l.mins + (s.symmetric ? 0 : 4 * nb);
      break;
    case Kind::kFp8:
      l.scales = n;
      l.total = n + 4 * nb;
      break;
    case Kind::kErrorBounded:
      l.scales = (nb + 3) / 4 * 4;
      l.total = l.scales + 4 * n;
      break;
    case Kind::kPlugin: {
      // -1 where the plugin refuses: every size check then fails with a message.
      int64_t bytes = -1;
#if !defined(__CUDA_ARCH__)
      const jcoccl_codec_plugin* p = PluginOf(s);
      if (p == nullptr || p->payload_bytes(s.params, n, static_cast<int32_t>(d), &bytes) != 0)
        bytes = -1;
#endif
      l.total = bytes;
      break;
    }
  }
  if (s.spike > 0) {  // after the inner payload: values, then indices padded to 4 bytes
    const int64_t slots = static_cast<int64_t>(s.spike) * nb;
    l.spike = l.total;
    l.total += 4 * slots + (2 * slots + 3) / 4 * 4;
  }
  return l;
}

// Bytes of one encoded row of n elements of dtype d.
JCOCCL_HD int64_t PayloadBytes(const CodecSpec& s, int64_t n, DType d) {
  return RowLayout(s, n, d).total;
}

// ---- CPU (synchronous, single-threaded) -------------------------------------------------
// x: n elements of `dtype`; out: PayloadBytes(spec, n, dtype) bytes.
void EncodeRowCpu(const CodecSpec& spec, DType dtype, const void* x, int64_t n, uint8_t* out);
// in: one payload of a row of n elements of `out_dtype`; out: n elements of out_dtype.
void DecodeRowCpu(const CodecSpec& spec, DType out_dtype, const uint8_t* in, int64_t n, void* out);
// Decodes nrows payloads (rows[r] each PayloadBytes(spec, n, dtype) bytes, any addresses),
// sums them in float32 in row order, casts once to dtype into out (n elements).
void DecodeSumCpu(const CodecSpec& spec, DType dtype, const uint8_t* const* rows, int nrows,
                  int64_t n, void* out);
// encode(decode_sum(rows)) into out (PayloadBytes(spec, n, dtype) bytes).
void DecodeSumEncodeCpu(const CodecSpec& spec, DType dtype, const uint8_t* const* rows, int nrows,
                        int64_t n, uint8_t* out);

// Row-batched forms, as the CUDA launches of codecs/codec_cuda.h (host memory, synchronous):
// rows contiguous rows; decode-sum reduction o reads the nrows payloads at
// in + (o * nrows + r) * row_stride and writes output row o.
void EncodeRowsCpu(const CodecSpec& spec, DType dtype, const void* x, int64_t rows, int64_t n,
                   uint8_t* out);
void DecodeRowsCpu(const CodecSpec& spec, DType out_dtype, const uint8_t* in, int64_t rows,
                   int64_t n, void* out);
void DecodeSumBatchCpu(const CodecSpec& spec, DType dtype, const uint8_t* in, int nrows,
                       int64_t row_stride, int64_t outs, int64_t n, void* out);
void DecodeSumEncodeBatchCpu(const CodecSpec& spec, DType dtype, const uint8_t* in, int nrows,
                             int64_t row_stride, int64_t outs, int64_t n, uint8_t* out);
// The addresses of reduction o's nrows payloads (as above).
std::vector<const uint8_t*> RowPointers(const uint8_t* in, int nrows, int64_t row_stride,
                                        int64_t o);

}  // namespace jcoccl::codecs
