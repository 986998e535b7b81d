// Scaled sign codec ("sign1"): CUDA kernels. Each launch is enqueued on the stream jcoccl
// passes; failures (bad arguments, launch errors) return nonzero with a message.
#include <cuda_runtime.h>

#include "sign.h"

namespace {

constexpr int kThreads = 128;

int Grid(int64_t work) {
  int64_t g = (work + kThreads - 1) / kThreads;
  if (g < 1) g = 1;
  return static_cast<int>(g < (1 << 20) ? g : (1 << 20));
}

// One thread per codec block (rows * n / B of them): the scale, then its sign bytes.
__global__ void EncodeKernel(int32_t d, const void* x, int64_t rows, int64_t n, int64_t B,
                             uint8_t* out) {
  const int64_t per_row = n / B, eb = jcoccl_dtype_bytes(d), p = n / 8 + 4 * per_row;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < rows * per_row;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = t / per_row;
    const sign1::RowValues v{d, static_cast<const uint8_t*>(x) + r * n * eb};
    sign1::EncodeBlock(v, n, B, t % per_row, out + r * p);
  }
}

// One thread per codec block of a sum: the dtype-rounded sum is computed where it is read.
__global__ void SumEncodeKernel(int32_t d, const uint8_t* in, int nrows, int64_t stride,
                                int64_t outs, int64_t n, int64_t B, uint8_t* out) {
  const int64_t per_row = n / B, p = n / 8 + 4 * per_row;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < outs * per_row;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t o = t / per_row;
    const sign1::SumValues v{nullptr, in + o * nrows * stride, stride, nrows, n, B, d};
    sign1::EncodeBlock(v, n, B, t % per_row, out + o * p);
  }
}

// One thread per output value: decode (nrows = 1) or decode-and-sum.
__global__ void SumKernel(int32_t d, const uint8_t* in, int nrows, int64_t stride, int64_t outs,
                          int64_t n, int64_t B, void* out) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < outs * n;
       t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t o = t / n, i = t % n;
    jcoccl_store(d, out, t, sign1::SumAt(nullptr, in + o * nrows * stride, stride, nrows, n, B, i));
  }
}

int Launched() {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return 0;
  return sign1_fail(cudaGetErrorString(e));
}

cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

int sign1_cuda_encode(const double* params, int32_t d, const void* x, int64_t rows, int64_t n,
                      uint8_t* out, void* stream) {
  int64_t B;
  if (sign1::CheckArgs(params, d, n, &B) != 0) return 1;
  if (rows < 1) return 0;
  EncodeKernel<<<Grid(rows * (n / B)), kThreads, 0, Stream(stream)>>>(d, x, rows, n, B, out);
  return Launched();
}

int sign1_cuda_decode(const double* params, int32_t d, const uint8_t* in, int64_t rows, int64_t n,
                      void* out, void* stream) {
  int64_t B;
  if (sign1::CheckArgs(params, d, n, &B) != 0) return 1;
  if (rows < 1) return 0;
  const int64_t p = sign1::PayloadBytes(n, B);
  SumKernel<<<Grid(rows * n), kThreads, 0, Stream(stream)>>>(d, in, 1, p, rows, n, B, out);
  return Launched();
}

int sign1_cuda_decode_sum(const double* params, int32_t d, const uint8_t* in, int32_t nrows,
                          int64_t stride, int64_t outs, int64_t n, void* out, void* stream) {
  int64_t B;
  if (sign1::CheckArgs(params, d, n, &B) != 0) return 1;
  if (nrows < 1 || outs < 1) return sign1_fail("sign1: decode_sum needs nrows, outs >= 1");
  SumKernel<<<Grid(outs * n), kThreads, 0, Stream(stream)>>>(d, in, nrows, stride, outs, n, B, out);
  return Launched();
}

int sign1_cuda_decode_sum_encode(const double* params, int32_t d, const uint8_t* in, int32_t nrows,
                                 int64_t stride, int64_t outs, int64_t n, uint8_t* out,
                                 void* stream) {
  int64_t B;
  if (sign1::CheckArgs(params, d, n, &B) != 0) return 1;
  if (nrows < 1 || outs < 1) return sign1_fail("sign1: decode_sum_encode needs nrows, outs >= 1");
  SumEncodeKernel<<<Grid(outs * (n / B)), kThreads, 0, Stream(stream)>>>(d, in, nrows, stride, outs,
                                                                         n, B, out);
  return Launched();
}
