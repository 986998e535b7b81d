// Device time of the CUDA codec launches, measured with CUDA events, for tools/gpu_codecs.py
// (which loads this symbol from jcoccl._cuda with ctypes). Each launch is timed on its own
// between two events on a stream of its own, on buffers allocated here with cudaMalloc: the
// figures leave out the host's dispatch and XLA's allocator, which the jax-level timings of
// the same script include.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "codecs/codec.h"
#include "codecs/codec_cuda.h"
#include "codecs/descriptor.h"

namespace {
namespace jc = jcoccl::codecs;

// Values of unit scale from a hash of the index: the sum of two uniforms in [-1, 1), plus an
// outlier of 30 at every 1000th element, so the codecs see ordinary and outlying blocks.
__global__ void FillKernel(float* x, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float a = static_cast<float>(h & 0xffffu) * (1.0f / 32768.0f) - 1.0f;
    const float b = static_cast<float>(h >> 16) * (1.0f / 32768.0f) - 1.0f;
    x[i] = i % 1000 == 0 ? 30.0f : a + b;
  }
}

struct Buffers {
  void* p[3] = {nullptr, nullptr, nullptr};
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;
  ~Buffers() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    if (stream != nullptr) cudaStreamDestroy(stream);
    for (void* q : p) cudaFree(q);
  }
};

cudaError_t Launch(const jc::CodecSpec& s, int op, int64_t rows, int64_t n, int nrows,
                   const float* x, const uint8_t* payload, void* out, cudaStream_t st) {
  const int64_t p = jc::PayloadBytes(s, n, jc::DType::kF32);
  switch (op) {
    case 0:
      return jc::EncodeRowsCuda(s, jc::DType::kF32, x, rows, n, static_cast<uint8_t*>(out), st);
    case 1:
      return jc::DecodeRowsCuda(s, jc::DType::kF32, payload, rows, n, out, st);
    case 2:
      return jc::DecodeSumBatch(s, jc::DType::kF32, payload, nrows, p, rows, n, out, st);
    default:
      return jc::DecodeSumEncodeBatch(s, jc::DType::kF32, payload, nrows, p, rows, n,
                                      static_cast<uint8_t*>(out), st);
  }
}

}  // namespace

// Times `iters` launches of one codec operation on float32 rows; ms[i] receives launch i's
// device time in milliseconds (a first, untimed launch warms up).
//   spec: the codec descriptor in its text form ("kind=2 bits=4 block=32 ...": codecs/
//         descriptor.h SpecFromText; Python: jcoccl.native.codec_text); no plugin codec.
//   op:   0 encode (rows x n values -> rows payloads), 1 decode (rows payloads -> rows x n),
//         2 decode_sum (rows outputs, each the sum of nrows payloads), 3 decode_sum_encode.
// Returns 0, or the cudaError_t of the first failing call (cudaErrorInvalidValue for bad
// arguments).
//
// Example (Python): lib.jcoccl_codec_time(b"kind=2 bits=8 block=256", 1, 256, 1 << 20, 1, 10, ms)
extern "C" __attribute__((visibility("default"))) int jcoccl_codec_time(const char* spec,
                                                                        int32_t op, int64_t rows,
                                                                        int64_t n, int32_t nrows,
                                                                        int32_t iters, float* ms) {
  if (spec == nullptr || ms == nullptr || op < 0 || op > 3 || rows < 1 || n < 1 || nrows < 1 ||
      iters < 1)
    return cudaErrorInvalidValue;
  jc::CodecSpec s;
  if (!jc::SpecFromText(spec, &s).empty() || s.kind == jc::Kind::kPlugin)
    return cudaErrorInvalidValue;
  const int64_t p = jc::PayloadBytes(s, n, jc::DType::kF32);
  const int64_t in_rows = op >= 2 ? rows * nrows : rows;  // payload rows the op reads
  Buffers b;
  cudaError_t e;
  const size_t out_bytes = static_cast<size_t>(rows) * (p > 4 * n ? p : 4 * n);
  if ((e = cudaMalloc(&b.p[0], sizeof(float) * in_rows * n)) != cudaSuccess ||
      (e = cudaMalloc(&b.p[1], static_cast<size_t>(in_rows) * p)) != cudaSuccess ||
      (e = cudaMalloc(&b.p[2], out_bytes)) != cudaSuccess ||
      (e = cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking)) != cudaSuccess)
    return e;
  b.events.resize(2 * static_cast<size_t>(iters), nullptr);
  for (cudaEvent_t& ev : b.events)
    if ((e = cudaEventCreate(&ev)) != cudaSuccess) return e;
  float* x = static_cast<float*>(b.p[0]);
  uint8_t* payload = static_cast<uint8_t*>(b.p[1]);
  FillKernel<<<4096, 256, 0, b.stream>>>(x, in_rows * n);
  if ((e = cudaGetLastError()) != cudaSuccess ||
      (e = jc::EncodeRowsCuda(s, jc::DType::kF32, x, in_rows, n, payload, b.stream)) !=
          cudaSuccess ||
      (e = Launch(s, op, rows, n, nrows, x, payload, b.p[2], b.stream)) != cudaSuccess)
    return e;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(b.events[2 * i], b.stream);
    if ((e = Launch(s, op, rows, n, nrows, x, payload, b.p[2], b.stream)) != cudaSuccess) return e;
    cudaEventRecord(b.events[2 * i + 1], b.stream);
  }
  if ((e = cudaStreamSynchronize(b.stream)) != cudaSuccess) return e;
  for (int i = 0; i < iters; ++i)
    if ((e = cudaEventElapsedTime(&ms[i], b.events[2 * i], b.events[2 * i + 1])) != cudaSuccess)
      return e;
  return cudaSuccess;
}
