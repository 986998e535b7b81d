// Row operations of plugin codecs (Kind::kPlugin): the calls from jcoccl's handlers and
// engine codecs into a loaded plugin's kernels (jcoccl/include/jcoccl/codec_plugin.h).
// Each returns "" on success, else a message that names the plugin and the operation; the
// callers turn it into an FFI error (a Python exception), never an abort.
#pragma once

#include <cstdint>
#include <string>

#include "codecs/codec.h"

namespace jcoccl::codecs {

namespace plugin_detail {

// The plugin's message first: PluginContext calls the plugin again.
inline std::string Failed(const CodecSpec& s, DType d, const jcoccl_codec_plugin* p, const char* op,
                          int64_t rows, int64_t n) {
  const std::string why = PluginError(p);
  return PluginContext(s, d, n) + op + " of " + std::to_string(rows) + " row(s) failed: " + why;
}

// The plugin of `s`, or an error (not loaded; CUDA kernels missing when `cuda`).
inline std::string Find(const CodecSpec& s, bool cuda, const jcoccl_codec_plugin** out) {
  *out = PluginOf(s);
  if (*out == nullptr)
    return "jcoccl plugin id " + std::to_string(s.plugin) +
           " is not loaded in this native module; call jcoccl.compressors.load_plugin(path)";
  if (cuda && (*out)->cuda_encode == nullptr)
    return std::string("jcoccl plugin '") + (*out)->name +
           "' has no CUDA kernels; rebuild it with CUDA or run this codec with impl='jnp'";
  return {};
}

}  // namespace plugin_detail

// `rows` and `n` name the sizes in an error (for reductions: the rows summed).
#define JCOCCL_PLUGIN_CALL(cuda, fn, op, rows_, n_, ...)                        \
  do {                                                                          \
    const jcoccl_codec_plugin* p = nullptr;                                     \
    if (std::string e = plugin_detail::Find(s, cuda, &p); !e.empty()) return e; \
    if (p->fn(s.params, static_cast<int32_t>(d), __VA_ARGS__) != 0)             \
      return plugin_detail::Failed(s, d, p, op, rows_, n_);                     \
    return {};                                                                  \
  } while (0)

// ---- CPU: synchronous, host memory -----------------------------------------------------
inline std::string PluginEncodeCpu(const CodecSpec& s, DType d, const void* x, int64_t rows,
                                   int64_t n, uint8_t* out) {
  JCOCCL_PLUGIN_CALL(false, cpu_encode, "encode", rows, n, x, rows, n, out);
}
inline std::string PluginDecodeCpu(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows,
                                   int64_t n, void* out) {
  JCOCCL_PLUGIN_CALL(false, cpu_decode, "decode", rows, n, in, rows, n, out);
}
inline std::string PluginDecodeSumCpu(const CodecSpec& s, DType d, const uint8_t* const* rows,
                                      int nrows, int64_t n, void* out) {
  JCOCCL_PLUGIN_CALL(false, cpu_decode_sum, "decode_sum", nrows, n, rows, nrows, n, out);
}
inline std::string PluginDecodeSumEncodeCpu(const CodecSpec& s, DType d, const uint8_t* const* rows,
                                            int nrows, int64_t n, uint8_t* out) {
  JCOCCL_PLUGIN_CALL(false, cpu_decode_sum_encode, "decode_sum_encode", nrows, n, rows, nrows, n,
                     out);
}

// ---- CUDA: enqueued on `stream` (a cudaStream_t), device memory -------------------------
inline std::string PluginEncodeCuda(const CodecSpec& s, DType d, const void* x, int64_t rows,
                                    int64_t n, uint8_t* out, void* stream) {
  JCOCCL_PLUGIN_CALL(true, cuda_encode, "encode", rows, n, x, rows, n, out, stream);
}
inline std::string PluginDecodeCuda(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows,
                                    int64_t n, void* out, void* stream) {
  JCOCCL_PLUGIN_CALL(true, cuda_decode, "decode", rows, n, in, rows, n, out, stream);
}
inline std::string PluginDecodeSumCuda(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                                       int64_t row_stride, int64_t outs, int64_t n, void* out,
                                       void* stream) {
  JCOCCL_PLUGIN_CALL(true, cuda_decode_sum, "decode_sum", outs * nrows, n, in, nrows, row_stride,
                     outs, n, out, stream);
}
inline std::string PluginDecodeSumEncodeCuda(const CodecSpec& s, DType d, const uint8_t* in,
                                             int nrows, int64_t row_stride, int64_t outs, int64_t n,
                                             uint8_t* out, void* stream) {
  JCOCCL_PLUGIN_CALL(true, cuda_decode_sum_encode, "decode_sum_encode", outs * nrows, n, in, nrows,
                     row_stride, outs, n, out, stream);
}

#undef JCOCCL_PLUGIN_CALL

}  // namespace jcoccl::codecs
