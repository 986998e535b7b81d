// CUDA codec launches: asynchronous on `stream`, all pointers are device pointers.
// Same semantics and bytes as the CPU functions in codecs/codec.h.
#pragma once

#include <cuda_runtime.h>

#include "codecs/codec.h"

namespace jcoccl::codecs {

// x: rows x n elements of dtype (row-major, contiguous); out: rows x PayloadBytes(...).
cudaError_t EncodeRowsCuda(const CodecSpec& spec, DType dtype, const void* x, int64_t rows,
                           int64_t n, uint8_t* out, cudaStream_t stream);
// in: rows payloads (contiguous); out: rows x n elements of out_dtype.
cudaError_t DecodeRowsCuda(const CodecSpec& spec, DType out_dtype, const uint8_t* in, int64_t rows,
                           int64_t n, void* out, cudaStream_t stream);
// Row r's payload starts at in + r * row_stride (row_stride >= PayloadBytes(spec, n, dtype)).
cudaError_t DecodeSumCuda(const CodecSpec& spec, DType dtype, const uint8_t* in, int nrows,
                          int64_t row_stride, int64_t n, void* out, cudaStream_t stream);
// out: PayloadBytes(spec, n, dtype) bytes = encode(decode_sum(rows)).
cudaError_t DecodeSumEncodeCuda(const CodecSpec& spec, DType dtype, const uint8_t* in, int nrows,
                                int64_t row_stride, int64_t n, uint8_t* out, cudaStream_t stream);

// Batched forms (what the FFI handlers use): `outs` independent reductions; reduction o reads
// the nrows payloads at in + (o * nrows + r) * row_stride and writes output row o
// (n elements of dtype, or PayloadBytes(spec, n, dtype) bytes).
cudaError_t DecodeSumBatch(const CodecSpec& spec, DType dtype, const uint8_t* in, int nrows,
                           int64_t row_stride, int64_t outs, int64_t n, void* out,
                           cudaStream_t stream);
cudaError_t DecodeSumEncodeBatch(const CodecSpec& spec, DType dtype, const uint8_t* in, int nrows,
                                 int64_t row_stride, int64_t outs, int64_t n, uint8_t* out,
                                 cudaStream_t stream);

}  // namespace jcoccl::codecs
