// CUDA codecs (cuda/WIRE_FORMAT.md); their XLA FFI handlers are in codec_handlers.cu.
//
// Kernels:
// - int of 2, 4, 8 bits and fp8 (the chunk kernels): a thread decodes, sums or encodes the 16
//   code bytes of 16 to 64 consecutive elements with 128-bit loads and stores; one kernel per
//   kind, width and symmetry; a block's statistics come from the group of threads holding it;
// - the other codecs: error_bounded and int of 3, 5, 6, 7 bits encode with one warp per codec
//   block (two passes over the block: statistics, then codes); elementwise decode and
//   decode-sum (also cast and none, and buffers the chunk kernels cannot take);
// - Hadamard around int of 2, 4, 8 bits or fp8 (H and inner block <= 256): one warp per 256
//   elements, the transform in registers and shuffles;
// - spike around int of 2, 4, 8 bits or fp8 (blocks <= 256): a group of block / 8 lanes per
//   codec block, the reserved values found by k + 1 shuffle rounds;
// - the other Hadamard and spike codecs: one CUDA block per granule staged in shared memory.
// cuda/gpu/codec_bench.cu times these launches with CUDA events.
#include <cuda_runtime.h>

#include <string>

#include "codecs/codec.h"
#include "codecs/codec_cuda.h"
#include "codecs/format.h"

namespace jcoccl::codecs {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxGrid = 1 << 20;

int GridFor(int64_t work, int per_block) {
  int64_t g = (work + per_block - 1) / per_block;
  if (g < 1) g = 1;
  return static_cast<int>(g < kMaxGrid ? g : kMaxGrid);
}

// ElementwiseKernel's grid: one thread per element up to kElementwiseGrid blocks, then each
// thread takes several. A thread places its first element with two 64-bit divisions, which
// cost more instructions than decoding it; with one element per thread an H200 ran the
// 256 MiB int8 decode at 75% of its SM throughput and 7% of its DRAM bandwidth (Nsight
// Compute). 4096 blocks of 256 threads still fill any GPU several times over.
constexpr int kElementwiseGrid = 4096;
int ElementwiseGrid(int64_t elements) {
  const int g = GridFor(elements, kThreads);
  return g < kElementwiseGrid ? g : kElementwiseGrid;
}

// ---- element sources (row-relative indices) --------------------------------------------------
struct GlobalSrc {
  DType d;
  const void* x;  // row start
  __device__ float get(int64_t i) const { return LoadElem(d, x, i); }
  __device__ void get4(int64_t i, float v[4]) const {
    if (d == DType::kF32) {
      const float4 f = reinterpret_cast<const float4*>(x)[i >> 2];
      v[0] = f.x;
      v[1] = f.y;
      v[2] = f.z;
      v[3] = f.w;
    } else {
      const uint2 h = reinterpret_cast<const uint2*>(x)[i >> 2];
      const uint16_t e[4] = {static_cast<uint16_t>(h.x & 0xffffu), static_cast<uint16_t>(h.x >> 16),
                             static_cast<uint16_t>(h.y & 0xffffu),
                             static_cast<uint16_t>(h.y >> 16)};
      for (int t = 0; t < 4; ++t) v[t] = d == DType::kBF16 ? BF16ToF32(e[t]) : F16ToF32(e[t]);
    }
  }
};

// decode_sum of nrows payloads, rounded through the row dtype (non-Hadamard codecs).
struct SumSrc {
  ElemDecoder dec;
  DType d;
  const uint8_t* in;  // first payload
  int nrows;
  int64_t stride;
  __device__ float get(int64_t i) const {
    float acc = dec(in, i);
    for (int r = 1; r < nrows; ++r) acc = acc + dec(in + r * stride, i);
    return RoundTrip(d, nrows > 1 ? CanonNaN(acc) : acc);
  }
  __device__ void get4(int64_t i, float v[4]) const {
    for (int t = 0; t < 4; ++t) v[t] = get(i + t);
  }
};

struct SmemSrc {
  const float* v;  // tile start
  int64_t base;    // row index of v[0]
  __device__ float get(int64_t i) const { return v[i - base]; }
  __device__ void get4(int64_t i, float o[4]) const {
    for (int t = 0; t < 4; ++t) o[t] = v[i - base + t];
  }
};

// ---- one codec block per warp -----------------------------------------------------------------
__device__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ float WarpMin(float v) {
  for (int o = 16; o > 0; o >>= 1) v = MinZ(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ uint32_t WarpMaxU(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// As an EncodeBlockWarp template argument: the kind is s.kind, read at run time.
constexpr Kind kKindOfSpec = static_cast<Kind>(-1);

// Is the block's codec kind k? Constant for a fixed K, so each instantiation keeps only its
// own path.
template <Kind K>
__device__ bool KindIs(const CodecSpec& s, Kind k) {
  return K == kKindOfSpec ? s.kind == k : K == k;
}

// Encodes codec block b of a row (all 32 lanes call it). `out` is the row's payload. K is
// s.kind (kInt, kFp8 or kErrorBounded) fixed at compile time (see EncodeBlocksFor), or
// kKindOfSpec.
template <Kind K, class Src>
__device__ void EncodeBlockWarp(const CodecSpec& s, const Layout& l, const Src& src, int64_t b,
                                int64_t nb, uint8_t* out, int lane) {
  const int64_t B = s.block, base = b * B, quads = B / 4;
  if (KindIs<K>(s, Kind::kErrorBounded)) {
    const float step = 2.0f * s.abs_error;
    bool ok = true;
    uint32_t zmax = 0;
    for (int64_t q = lane; q < quads; q += 32) {
      float v[4];
      src.get4(base + 4 * q, v);
      for (int t = 0; t < 4; ++t) {
        const float qq = EbQuant(v[t], step);
        const bool good = EbElementOk(v[t], qq, step, s.abs_error);
        ok = ok && good;
        if (good) zmax = max(zmax, ZigZag(static_cast<int32_t>(qq)));
      }
    }
    ok = __all_sync(0xffffffffu, ok);
    zmax = WarpMaxU(zmax);
    const int w = ok ? BitLength(zmax) : kRawWidth;
    uint32_t* words = reinterpret_cast<uint32_t*>(out + l.scales) + base;
    const int64_t used = ok ? (static_cast<int64_t>(w) * B + 31) / 32 : B;
    for (int64_t k = lane; k < B; k += 32) {
      uint32_t word = 0;
      if (!ok) {
        word = FloatBits(src.get(base + k));
      } else if (k < used) {
        const int64_t first = (32 * k) / w;
        int64_t last = (32 * k + 31) / w;
        if (last > B - 1) last = B - 1;
        for (int64_t j = first; j <= last; ++j) {
          const uint64_t z = ZigZag(static_cast<int32_t>(EbQuant(src.get(base + j), step)));
          const int64_t sh = j * w - 32 * k;
          word |= static_cast<uint32_t>(sh >= 0 ? (z << sh) : (z >> -sh));
        }
      }
      words[k] = word;
    }
    if (lane == 0) {
      out[b] = static_cast<uint8_t>(w);
      if (b == nb - 1) {
        for (int64_t p = nb; p < l.scales; ++p) out[p] = 0;
      }
    }
    return;
  }
  // int / fp8: statistics.
  bool finite = true;
  float amax = 0.0f, lo = 3.4028235e38f, hi = -3.4028235e38f;
  for (int64_t q = lane; q < quads; q += 32) {
    float v[4];
    src.get4(base + 4 * q, v);
    for (int t = 0; t < 4; ++t) {
      finite = finite && IsFinite(v[t]);
      amax = fmaxf(amax, fabsf(v[t]));
      lo = MinZ(lo, v[t]);
      hi = fmaxf(hi, v[t]);
    }
  }
  finite = __all_sync(0xffffffffu, finite);
  amax = WarpMax(amax);
  lo = WarpMin(lo);
  hi = WarpMax(hi);
  const float qnan = BitsFloat(0x7fc00000u);
  if (KindIs<K>(s, Kind::kFp8)) {
    const Fp8Params p = Fp8Of(s.fp8);
    const float sc = finite ? amax * p.r : qnan;
    uint32_t* codes = reinterpret_cast<uint32_t*>(out + base);
    for (int64_t q = lane; q < quads; q += 32) {
      float v[4];
      src.get4(base + 4 * q, v);
      uint32_t word = 0;
      for (int t = 0; t < 4; ++t) {
        const uint32_t c = sc > 0.0f ? F32ToFp8(ClampF(v[t] / sc, -p.fmax, p.fmax), p) : 0u;
        word |= c << (8 * t);
      }
      codes[q] = word;
    }
    if (lane == 0) reinterpret_cast<float*>(out + l.scales)[b] = sc;
    return;
  }
  const int bits = s.bits;
  const float R = IntR(bits, s.symmetric);
  lo = PlusZero(lo);
  hi = PlusZero(hi);
  const float sc = finite ? (s.symmetric ? amax * R : (hi - lo) * R) : qnan;
  const float mn = finite ? lo : qnan;
  uint8_t* codes = out + base * bits / 8;
  if (8 % bits != 0) {
    // 3, 5, 6, 7 bits: each lane packs a group of 8 codes into `bits` whole bytes.
    for (int64_t g = lane; g < B / 8; g += 32) {
      float v[8];
      src.get4(base + 8 * g, v);
      src.get4(base + 8 * g + 4, v + 4);
      uint64_t word = 0;
      for (int t = 0; t < 8; ++t) {
        const uint32_t c =
            s.symmetric ? IntCodeSym(v[t], sc, bits) : IntCodeAsym(v[t], mn, sc, bits);
        word |= static_cast<uint64_t>(c) << (bits * t);
      }
      for (int j = 0; j < bits; ++j) codes[bits * g + j] = static_cast<uint8_t>(word >> (8 * j));
    }
  }
  // 2, 4, 8 bits: each lane packs a quad of codes into 4 * bits whole bits (bytes).
  const int64_t byte_quads = 8 % bits == 0 ? quads : 0;
  for (int64_t q = lane; q < byte_quads; q += 32) {
    float v[4];
    src.get4(base + 4 * q, v);
    uint32_t word = 0;
    for (int t = 0; t < 4; ++t) {
      const uint32_t c = s.symmetric ? IntCodeSym(v[t], sc, bits) : IntCodeAsym(v[t], mn, sc, bits);
      word |= c << (bits * t);
    }
    if (bits == 8)
      reinterpret_cast<uint32_t*>(codes)[q] = word;
    else if (bits == 4)
      reinterpret_cast<uint16_t*>(codes)[q] = static_cast<uint16_t>(word);
    else
      codes[q] = static_cast<uint8_t>(word);
  }
  if (lane == 0) {
    reinterpret_cast<float*>(out + l.scales)[b] = sc;
    if (!s.symmetric) reinterpret_cast<float*>(out + l.mins)[b] = mn;
  }
}

// Warp-per-block encode of rows*nb blocks of codec kind K. kFromX: the rows of x; else the
// decode-sum of nrows payloads per output row (in + o * nrows * stride).
template <Kind K, bool kFromX>
__global__ void EncodeBlocksKernel(CodecSpec s, DType d, const void* x, const uint8_t* in,
                                   int nrows, int64_t stride, int64_t rows, int64_t n, uint8_t* out,
                                   int64_t p) {
  const Layout l = RowLayout(s, n, d);
  const int64_t nb = n / s.block;
  const int lane = threadIdx.x & 31;
  const int64_t warp0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t w = warp0; w < rows * nb; w += nwarps) {
    const int64_t r = w / nb, b = w - r * nb;
    if constexpr (kFromX) {
      const GlobalSrc src{d, static_cast<const uint8_t*>(x) + r * n * DTypeBytes(d)};
      EncodeBlockWarp<K>(s, l, src, b, nb, out + r * p, lane);
    } else {
      const SumSrc src{MakeElemDecoder(s, d, n), d, in + r * nrows * stride, nrows, stride};
      EncodeBlockWarp<K>(s, l, src, b, nb, out + r * p, lane);
    }
  }
}

using EncodeBlocksFn = void (*)(CodecSpec, DType, const void*, const uint8_t*, int, int64_t,
                                int64_t, int64_t, uint8_t*, int64_t);

// The instantiation for s.kind. One kernel per kind and source keeps each to its own path's
// registers: the one generic kernel needed 112 per thread, which let an H200 SM hold only
// 25% of its warps, and it ran at about 16% of the copy bandwidth (Nsight Compute).
template <bool kFromX>
EncodeBlocksFn EncodeBlocksFor(Kind kind) {
  switch (kind) {
    case Kind::kFp8:
      return EncodeBlocksKernel<Kind::kFp8, kFromX>;
    case Kind::kErrorBounded:
      return EncodeBlocksKernel<Kind::kErrorBounded, kFromX>;
    default:
      return EncodeBlocksKernel<Kind::kInt, kFromX>;
  }
}

// ---- vectorised int (2, 4, 8 bits) and fp8 kernels --------------------------------------------
// A thread's unit of work is a chunk: the 16 code bytes of E = 128 / BITS consecutive elements
// (16 int8/fp8, 32 int4, 64 int2), all inside one codec block. It loads them as one 128-bit
// word, the block's scale once, and writes its elements with 128-bit stores; the kind, the
// width and the symmetry are template arguments, so the hot loop holds no switch on them.
// Nsight Compute showed the one-element-per-thread decode and the two-pass warp encode
// instruction-bound (52% and 80% SM throughput, 17% and 26% DRAM) on an H200.
constexpr int kChunkBytes = 16;
template <int BITS>
constexpr int kChunkElems = 8 * kChunkBytes / BITS;

__host__ __device__ __forceinline__ bool Aligned(const void* p, uintptr_t a) {
  return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0;
}
__device__ __forceinline__ bool Aligned8(const void* p) { return Aligned(p, 8); }

struct alignas(16) Words4 {
  uint32_t w[4];
};

// The 16 bytes at p (4-byte aligned: payload rows and their code sections are): one 128-bit
// load where p is 16-byte aligned, else four 32-bit loads (a row of a batch whose payload
// size is not a multiple of 16).
__device__ __forceinline__ Words4 LoadWords(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) return *reinterpret_cast<const Words4*>(p);
  const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
  return Words4{{q[0], q[1], q[2], q[3]}};
}

__device__ __forceinline__ void StoreWords(uint8_t* p, const Words4& v) {
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    *reinterpret_cast<Words4*>(p) = v;
    return;
  }
  uint32_t* q = reinterpret_cast<uint32_t*>(p);
  for (int t = 0; t < 4; ++t) q[t] = v.w[t];
}

// What a chunk's decode needs besides its codes, fixed per launch.
struct ChunkCodec {
  int64_t scales, mins;  // byte offsets of the f32 scales and minimums in a payload row
                         // (error_bounded: of its uint32 words)
  int64_t spike, total;  // spike: byte offset of the reserved values; the row's bytes
  int chunk_shift;       // log2(chunks per codec block)
  Fp8Params fp8;
  float step;  // error_bounded: 2 * abs_error
};

ChunkCodec ChunkCodecOf(const CodecSpec& s, DType d, int64_t n, int elems) {
  const Layout l = RowLayout(s, n, d);
  int shift = 0;
  while ((elems << shift) < s.block) ++shift;
  return ChunkCodec{l.scales, l.mins, l.spike, l.total, shift, Fp8Of(s.fp8), 2.0f * s.abs_error};
}

// Code e of a chunk's 16 bytes (a little-endian bit stream: WIRE_FORMAT.md).
template <int BITS>
__device__ __forceinline__ uint32_t ChunkCode(const Words4& w, int e) {
  return (w.w[e * BITS / 32] >> (e * BITS % 32)) & ((1u << BITS) - 1u);
}

// The width byte of error_bounded block b, read from its 32-bit word (the widths are padded
// to whole words).
__device__ __forceinline__ uint32_t EbWidth(const uint8_t* row, uint32_t b) {
  return (reinterpret_cast<const uint32_t*>(row)[b >> 2] >> (8 * (b & 3u))) & 0xffu;
}

// The values of the codes of codec block b of one payload row (int or fp8: its scale, and
// its minimum for asymmetric int), as DecodeChunk and DecodeLane read them.
template <Kind K, int BITS, bool SYM>
struct BlockCoder {
  __device__ __forceinline__ BlockCoder(const ChunkCodec& c, const float* lut, const uint8_t* row,
                                        uint32_t b)
      : lut(lut), sc(reinterpret_cast<const float*>(row + c.scales)[b]) {
    if constexpr (K == Kind::kInt && !SYM) mn = reinterpret_cast<const float*>(row + c.mins)[b];
  }
  __device__ __forceinline__ float operator()(uint32_t u) const {
    if constexpr (K == Kind::kFp8)
      return CanonNaN(lut[u] * sc);
    else if constexpr (SYM)
      return CanonNaN(IntDecodeSym(u, sc, BITS));
    else
      return CanonNaN(IntDecodeAsym(u, mn, sc));
  }
  const float* lut;
  float sc, mn = 0.0f;
};

// Decodes chunk ci of one payload row into v (the values of ElemDecoder, bit for bit).
// `lut`: fp8's 256 code values (Fp8ToF32), in shared memory. error_bounded (BITS 8: chunks of
// 16) reads its width and fields as 32-bit words.
template <Kind K, int BITS, bool SYM>
__device__ __forceinline__ void DecodeChunk(const ChunkCodec& c, const float* lut,
                                            const uint8_t* row, uint32_t ci, float* v) {
  constexpr int E = kChunkElems<BITS>;
  if constexpr (K == Kind::kErrorBounded) {
    const uint32_t b = ci >> c.chunk_shift;
    const int width = static_cast<int>(EbWidth(row, b));
    const uint32_t* words = reinterpret_cast<const uint32_t*>(row + c.scales) +
                            (static_cast<size_t>(b) << c.chunk_shift) * E;
    const int64_t j0 = static_cast<int64_t>(ci - (b << c.chunk_shift)) * E;
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] = EbDecode(words, j0 + e, width, c.step);
    return;
  }
  const Words4 w = LoadWords(row + static_cast<size_t>(ci) * kChunkBytes);
  const BlockCoder<K, BITS, SYM> coder(c, lut, row, ci >> c.chunk_shift);
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = coder(ChunkCode<BITS>(w, e));
}

// The float32 decode-sum of chunk ci over the nrows payload rows at row0 + r * stride, summed
// in row order (ElementwiseKernel's and SumSrc's order).
template <Kind K, int BITS, bool SYM>
__device__ __forceinline__ void SumChunk(const ChunkCodec& c, const float* lut, const uint8_t* row0,
                                         int nrows, int64_t stride, uint32_t ci, float* acc) {
  constexpr int E = kChunkElems<BITS>;
  DecodeChunk<K, BITS, SYM>(c, lut, row0, ci, acc);
  for (int r = 1; r < nrows; ++r) {
    float v[E];
    DecodeChunk<K, BITS, SYM>(c, lut, row0 + r * stride, ci, v);
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = acc[e] + v[e];
  }
  if (nrows > 1) {
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = CanonNaN(acc[e]);  // a sum's NaN is the canonical one
  }
}

// Stores E values as dtype d at p (16-byte aligned) with 128-bit stores.
template <int E>
__device__ __forceinline__ void StoreChunk(DType d, uint8_t* p, const float* v) {
  if (d == DType::kF32) {
#pragma unroll
    for (int q = 0; q < E / 4; ++q)
      reinterpret_cast<float4*>(p)[q] = float4{v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]};
    return;
  }
  const bool bf = d == DType::kBF16;
#pragma unroll
  for (int q = 0; q < E / 8; ++q) {
    Words4 w;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const float a = v[8 * q + 2 * t], b = v[8 * q + 2 * t + 1];
      const uint32_t lo = bf ? F32ToBF16(a) : F32ToF16(a), hi = bf ? F32ToBF16(b) : F32ToF16(b);
      w.w[t] = lo | (hi << 16);
    }
    reinterpret_cast<Words4*>(p)[q] = w;
  }
}

// Loads E elements of dtype d from x + k elements (16-byte aligned) as float32.
template <int E>
__device__ __forceinline__ void LoadChunkX(DType d, const void* x, int64_t k, float* v) {
  if (d == DType::kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + k);
#pragma unroll
    for (int q = 0; q < E / 4; ++q) {
      const float4 f = p[q];
      v[4 * q] = f.x;
      v[4 * q + 1] = f.y;
      v[4 * q + 2] = f.z;
      v[4 * q + 3] = f.w;
    }
    return;
  }
  const Words4* p = reinterpret_cast<const Words4*>(static_cast<const uint16_t*>(x) + k);
  const bool bf = d == DType::kBF16;
#pragma unroll
  for (int q = 0; q < E / 8; ++q) {
    const Words4 w = p[q];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const uint16_t h = static_cast<uint16_t>(w.w[t / 2] >> (16 * (t % 2)));
      v[8 * q + t] = bf ? BF16ToF32(h) : F16ToF32(h);
    }
  }
}

// Fills lut[0, 256) with fp8's code values, one per thread (every thread of the block calls
// it; the chunk kernels run kThreads >= 256 threads).
static_assert(kThreads >= 256, "FillFp8Lut: one code per thread");
__device__ __forceinline__ void FillFp8Lut(float* lut, const Fp8Params& p) {
  if (threadIdx.x < 256) lut[threadIdx.x] = Fp8ToF32(static_cast<uint8_t>(threadIdx.x), p);
  __syncthreads();
}

// Decode-sum of `chunks` chunks (chunks_per_row per output row); output row o is the sum of
// the nrows payloads at in + o * nrows * stride, stored as d. Plain decode: nrows = 1.
template <Kind K, int BITS, bool SYM>
__global__ void __launch_bounds__(kThreads)
    DecodeChunksKernel(ChunkCodec c, DType d, const uint8_t* in, int nrows, int64_t stride,
                       uint32_t chunks_per_row, uint32_t chunks, void* out) {
  constexpr int E = kChunkElems<BITS>;
  extern __shared__ float lut[];
  if constexpr (K == Kind::kFp8) FillFp8Lut(lut, c.fp8);
  const int64_t out_chunk = static_cast<int64_t>(E) * DTypeBytes(d);
  const int64_t out_row = out_chunk * chunks_per_row;
  for (uint32_t k = blockIdx.x * blockDim.x + threadIdx.x; k < chunks;
       k += gridDim.x * blockDim.x) {
    const uint32_t o = k / chunks_per_row, ci = k - o * chunks_per_row;
    float v[E];
    SumChunk<K, BITS, SYM>(c, lut, in + static_cast<int64_t>(o) * nrows * stride, nrows, stride, ci,
                           v);
    StoreChunk<E>(d, static_cast<uint8_t*>(out) + o * out_row + ci * out_chunk, v);
  }
}

// Statistics of one codec block spread over a group of 2^group_shift consecutive threads:
// every thread of the group gets the group's values. Groups wider than a warp combine their
// warps' values through `red` (4 * kWarps floats of shared memory). The reductions (and, or
// max, MinZ) give the same result in any order.
__device__ __forceinline__ void GroupStats(int group_shift, bool& finite, float& amax, float& lo,
                                           float& hi, float* red) {
  const int span = 1 << (group_shift < 5 ? group_shift : 5);
  uint32_t fin = finite ? 1u : 0u;
  for (int o = 1; o < span; o <<= 1) {
    fin &= __shfl_xor_sync(0xffffffffu, fin, o);
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    lo = MinZ(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  if (group_shift > 5) {  // uniform over the CUDA block
    const int warp = threadIdx.x >> 5, warps = 1 << (group_shift - 5);
    if ((threadIdx.x & 31) == 0) {
      red[warp] = fin ? 1.0f : 0.0f;
      red[kWarps + warp] = amax;
      red[2 * kWarps + warp] = lo;
      red[3 * kWarps + warp] = hi;
    }
    __syncthreads();
    const int w0 = warp & ~(warps - 1);
    for (int w = w0; w < w0 + warps; ++w) {
      fin &= red[w] != 0.0f ? 1u : 0u;
      amax = fmaxf(amax, red[kWarps + w]);
      lo = MinZ(lo, red[2 * kWarps + w]);
      hi = fmaxf(hi, red[3 * kWarps + w]);
    }
    __syncthreads();  // red is written again by the next tile
  }
  finite = fin != 0;
}

// A thread's share of its codec block's statistics (EncodeBlockWarp's): all finite, max |v|,
// min and max.
template <int E>
__device__ __forceinline__ void LaneStats(const float* v, bool& finite, float& amax, float& lo,
                                          float& hi) {
  finite = true;
  amax = 0.0f;
  lo = 3.4028235e38f;
  hi = -3.4028235e38f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    finite = finite && IsFinite(v[e]);
    amax = fmaxf(amax, fabsf(v[e]));
    lo = MinZ(lo, v[e]);
    hi = fmaxf(hi, v[e]);
  }
}

// A codec block's scale (and, int asymmetric, minimum) from its statistics (WIRE_FORMAT.md).
template <Kind K, int BITS, bool SYM>
__device__ __forceinline__ void BlockScale(const ChunkCodec& c, bool finite, float amax, float lo,
                                           float hi, float& sc, float& mn) {
  const float qnan = BitsFloat(0x7fc00000u);
  mn = 0.0f;
  if constexpr (K == Kind::kFp8) {
    sc = finite ? amax * c.fp8.r : qnan;
  } else {
    const float R = IntR(BITS, SYM);
    sc = finite ? (SYM ? amax * R : (PlusZero(hi) - PlusZero(lo)) * R) : qnan;
    mn = finite ? PlusZero(lo) : qnan;
  }
}

// The code of value v in a block of scale sc and minimum mn.
template <Kind K, int BITS, bool SYM>
__device__ __forceinline__ uint32_t Quantize(const ChunkCodec& c, float v, float sc, float mn) {
  if constexpr (K == Kind::kFp8)
    return sc > 0.0f ? F32ToFp8(ClampF(v / sc, -c.fp8.fmax, c.fp8.fmax), c.fp8) : 0u;
  else
    return SYM ? IntCodeSym(v, sc, BITS) : IntCodeAsym(v, mn, sc, BITS);
}

// Encode of `blocks` codec blocks (nb per row) of codec kind K (int of BITS bits, or fp8),
// each by a group of 2^group_shift threads holding one chunk of E elements in registers: one
// read of the input, statistics over the group, then each thread packs its chunk's codes into
// 16 bytes. kFromX: the rows of x; else the decode-sum (rounded through d) of nrows payloads
// of the same codec per output row, at in + o * nrows * stride.
template <Kind K, int BITS, bool SYM, bool kFromX>
__global__ void __launch_bounds__(kThreads)
    EncodeChunksKernel(ChunkCodec c, DType d, const void* x, const uint8_t* in, int nrows,
                       int64_t stride, uint32_t nb, uint32_t blocks, int group_shift, uint8_t* out,
                       int64_t p) {
  constexpr int E = kChunkElems<BITS>;
  extern __shared__ float smem[];
  float* red = smem;               // 4 * kWarps floats: GroupStats
  float* lut = smem + 4 * kWarps;  // 256 floats (fp8 decode-sum)
  if constexpr (K == Kind::kFp8 && !kFromX) FillFp8Lut(lut, c.fp8);
  const uint32_t group = threadIdx.x >> group_shift,
                 lane = threadIdx.x & ((1u << group_shift) - 1u);
  const uint32_t per_tile = kThreads >> group_shift;
  const uint32_t tiles = (blocks + per_tile - 1) / per_tile;
  for (uint32_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const uint32_t gb = t * per_tile + group;  // the group's codec block, over all rows
    const bool active = gb < blocks;
    const uint32_t r = active ? gb / nb : 0, b = active ? gb - r * nb : 0;
    const uint32_t ci = (b << group_shift) + lane;  // the thread's chunk in its row
    float v[E];
    if (!active) {
#pragma unroll
      for (int e = 0; e < E; ++e) v[e] = 0.0f;
    } else if constexpr (kFromX) {
      LoadChunkX<E>(d, x, static_cast<int64_t>(gb) * (E << group_shift) + lane * E, v);
    } else {
      SumChunk<K, BITS, SYM>(c, lut, in + static_cast<int64_t>(r) * nrows * stride, nrows, stride,
                             ci, v);
#pragma unroll
      for (int e = 0; e < E; ++e) v[e] = RoundTrip(d, v[e]);
    }
    bool finite;
    float amax, lo, hi, sc, mn;
    LaneStats<E>(v, finite, amax, lo, hi);
    GroupStats(group_shift, finite, amax, lo, hi, red);
    if (!active) continue;
    uint8_t* orow = out + static_cast<int64_t>(r) * p;
    BlockScale<K, BITS, SYM>(c, finite, amax, lo, hi, sc, mn);
    Words4 w{{0u, 0u, 0u, 0u}};
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const uint32_t code = Quantize<K, BITS, SYM>(c, v[e], sc, mn);
      w.w[e * BITS / 32] |= code << (e * BITS % 32);
    }
    if (lane == 0) {
      reinterpret_cast<float*>(orow + c.scales)[b] = sc;
      if (K == Kind::kInt && !SYM) reinterpret_cast<float*>(orow + c.mins)[b] = mn;
    }
    StoreWords(orow + static_cast<size_t>(ci) * kChunkBytes, w);
  }
}

template <Kind K, int BITS, bool SYM>
struct ChunkKind {};

// Returns f(ChunkKind<K, BITS, SYM>{}) for the inner codecs the chunk and warp kernels take
// (int of 2, 4 or 8 bits, fp8, and error_bounded, which only the chunk decode takes; no
// spike), false for every other codec (the kernels above serve those). f returns false where
// its kernel does not apply.
template <class F>
bool WithChunkKind(const CodecSpec& s, F&& f) {
  if (s.spike > 0) return false;
  if (s.kind == Kind::kFp8) return f(ChunkKind<Kind::kFp8, 8, true>{});
  if (s.kind == Kind::kErrorBounded) return f(ChunkKind<Kind::kErrorBounded, 8, true>{});
  if (s.kind != Kind::kInt) return false;
  const bool sym = s.symmetric;
  switch (s.bits) {
    case 8:
      return sym ? f(ChunkKind<Kind::kInt, 8, true>{}) : f(ChunkKind<Kind::kInt, 8, false>{});
    case 4:
      return sym ? f(ChunkKind<Kind::kInt, 4, true>{}) : f(ChunkKind<Kind::kInt, 4, false>{});
    case 2:
      return sym ? f(ChunkKind<Kind::kInt, 2, true>{}) : f(ChunkKind<Kind::kInt, 2, false>{});
    default:
      return false;
  }
}

// Whether the warp and chunk encodes take an inner codec kind (error_bounded varies its width
// per block: only its decode has a chunk kernel).
template <class T>
constexpr bool kChunkEncodes = true;
template <int BITS, bool SYM>
constexpr bool kChunkEncodes<ChunkKind<Kind::kErrorBounded, BITS, SYM>> = false;

constexpr int64_t kMaxChunkWork = int64_t{1}
                                  << 31;  // the kernels index chunks and blocks in 32 bits

template <Kind K, int BITS, bool SYM>
bool LaunchDecodeChunks(ChunkKind<K, BITS, SYM>, const CodecSpec& s, DType d, const uint8_t* in,
                        int nrows, int64_t stride, int64_t outs, int64_t n, void* out,
                        cudaStream_t stream) {
  constexpr int E = kChunkElems<BITS>;
  const int64_t chunks = outs * (n / E);
  if (s.hadamard > 0 || s.block % E != 0 || chunks >= kMaxChunkWork) return false;
  const size_t smem = K == Kind::kFp8 ? 256 * sizeof(float) : 0;
  const auto k = DecodeChunksKernel<K, BITS, SYM>;
  k<<<GridFor(chunks, kThreads), kThreads, smem, stream>>>(ChunkCodecOf(s, d, n, E), d, in, nrows,
                                                           stride, static_cast<uint32_t>(n / E),
                                                           static_cast<uint32_t>(chunks), out);
  return true;
}

template <bool kFromX, Kind K, int BITS, bool SYM>
bool LaunchEncodeChunks(ChunkKind<K, BITS, SYM>, const CodecSpec& s, DType d, const void* x,
                        const uint8_t* in, int nrows, int64_t stride, int64_t rows, int64_t n,
                        uint8_t* out, int64_t p, cudaStream_t stream) {
  constexpr int E = kChunkElems<BITS>;
  const int64_t nb = n / s.block, blocks = rows * nb;
  if (s.hadamard > 0 || s.block % E != 0 || blocks >= kMaxChunkWork) return false;
  int group_shift = 0;  // threads per codec block: block / E, at most 4096 / 16 = kThreads
  while ((E << group_shift) < s.block) ++group_shift;
  const int64_t tiles = (blocks + (kThreads >> group_shift) - 1) / (kThreads >> group_shift);
  const size_t smem = (4 * kWarps + (K == Kind::kFp8 && !kFromX ? 256 : 0)) * sizeof(float);
  const auto k = EncodeChunksKernel<K, BITS, SYM, kFromX>;
  k<<<GridFor(tiles, 1), kThreads, smem, stream>>>(
      ChunkCodecOf(s, d, n, E), d, x, in, nrows, stride, static_cast<uint32_t>(nb),
      static_cast<uint32_t>(blocks), group_shift, out, p);
  return true;
}

// The chunk kernels' launches for a codec; each returns false (nothing launched) where they
// do not apply: another codec, Hadamard, blocks not a multiple of the chunk, payload rows or
// strides not 4-byte aligned, x or decoded rows not 16-byte aligned, 2^31 chunks or blocks or
// more.
bool DecodeSumChunks(const CodecSpec& s, DType d, const uint8_t* in, int nrows, int64_t stride,
                     int64_t outs, int64_t n, void* out, cudaStream_t stream) {
  if (!Aligned(in, 4) || stride % 4 != 0 || !Aligned(out, 16)) return false;
  return WithChunkKind(s, [&](auto kind) {
    return LaunchDecodeChunks(kind, s, d, in, nrows, stride, outs, n, out, stream);
  });
}

bool EncodeChunks(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n, uint8_t* out,
                  int64_t p, cudaStream_t stream) {
  if (!Aligned(x, 16) || !Aligned(out, 4)) return false;
  return WithChunkKind(s, [&](auto kind) {
    if constexpr (kChunkEncodes<decltype(kind)>)
      return LaunchEncodeChunks<true>(kind, s, d, x, nullptr, 1, 0, rows, n, out, p, stream);
    else
      return false;
  });
}

bool DecodeSumEncodeChunks(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                           int64_t stride, int64_t outs, int64_t n, uint8_t* out, int64_t p,
                           cudaStream_t stream) {
  if (!Aligned(in, 4) || stride % 4 != 0 || !Aligned(out, 4)) return false;
  return WithChunkKind(s, [&](auto kind) {
    if constexpr (kChunkEncodes<decltype(kind)>)
      return LaunchEncodeChunks<false>(kind, s, d, nullptr, in, nrows, stride, outs, n, out, p,
                                       stream);
    else
      return false;
  });
}

// ---- Hadamard in registers: one warp per tile of 256 elements ----------------------------------
// Lane l holds elements [8l, 8l + 8) of its warp's tile. The butterflies of a stage pair
// elements len apart: within a lane in registers for len < 8, across lanes through one shuffle
// per element for len >= 8, in the spec's stage order (WIRE_FORMAT.md), so the arithmetic is
// BlockHadamard's operation for operation. The block-wide kernel needed a barrier per stage and
// ran the Hadamard codecs at 2-3% of the copy bandwidth on an H200.
constexpr int kTile = 256;
constexpr int kPerLane = kTile / 32;

template <int LEN>
__device__ __forceinline__ void LaneStage(float* v) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    if ((j & LEN) == 0) {
      const float x = v[j], y = v[j + LEN];
      v[j] = x + y;
      v[j + LEN] = x - y;
    }
  }
}

// The normalised transform of every run of h (2..256) values of the warp's tile: times pre,
// the butterflies, times post, NaNs made canonical.
__device__ __forceinline__ void WarpHadamard(float* v, int h, float pre, float post, int lane) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) v[j] = v[j] * pre;
  if (h > 1) LaneStage<1>(v);
  if (h > 2) LaneStage<2>(v);
  if (h > 4) LaneStage<4>(v);
  for (int m = 1; m < h / kPerLane; m <<= 1) {  // len = 8m: the partner is lane ^ m
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const float other = __shfl_xor_sync(0xffffffffu, v[j], m);
      v[j] = upper ? other - v[j] : v[j] + other;  // (x, y) -> (x + y, x - y)
    }
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) v[j] = CanonNaN(v[j] * post);
}

// The BITS bytes of 8 codes at p (4-byte aligned for 4 and 8 bits, 2-byte for 2), and back.
template <int BITS>
__device__ __forceinline__ uint64_t LoadCodes8(const uint8_t* p) {
  if constexpr (BITS == 2) return *reinterpret_cast<const uint16_t*>(p);
  if constexpr (BITS == 4) return *reinterpret_cast<const uint32_t*>(p);
  if (Aligned8(p)) return *reinterpret_cast<const uint64_t*>(p);
  const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
  return q[0] | (static_cast<uint64_t>(q[1]) << 32);
}

template <int BITS>
__device__ __forceinline__ void StoreCodes8(uint8_t* p, uint64_t w) {
  if constexpr (BITS == 2) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(w);
  } else if constexpr (BITS == 4) {
    *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(w);
  } else if (Aligned8(p)) {
    *reinterpret_cast<uint64_t*>(p) = w;
  } else {
    uint32_t* q = reinterpret_cast<uint32_t*>(p);
    q[0] = static_cast<uint32_t>(w);
    q[1] = static_cast<uint32_t>(w >> 32);
  }
}

// Code e of a lane's 8 codes (a little-endian bit stream).
template <int BITS>
__device__ __forceinline__ uint32_t LaneCode(uint64_t w, int e) {
  return static_cast<uint32_t>(w >> (e * BITS)) & ((1u << BITS) - 1u);
}

// Decodes the 8 values from element e0 of one payload row (c.chunk_shift: log2 of the block).
template <Kind K, int BITS, bool SYM>
__device__ __forceinline__ void DecodeLane(const ChunkCodec& c, const float* lut,
                                           const uint8_t* row, uint32_t e0, float* v) {
  const uint64_t w = LoadCodes8<BITS>(row + e0 / 8 * BITS);
  const BlockCoder<K, BITS, SYM> coder(c, lut, row, e0 >> c.chunk_shift);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) v[e] = coder(LaneCode<BITS>(w, e));
}

// The inner encode of a lane's 8 values, elements [first, first + 8) of payload row `orow`: the
// statistics of their codec block over its 2^group_shift lanes, then 8 codes; the block's
// first lane (`leader`) writes its scale. Every lane of the warp calls it; an inactive lane
// (a group past the last block) only takes part in the shuffles.
template <Kind K, int BITS, bool SYM>
__device__ __forceinline__ void EncodeLane(const ChunkCodec& c, const float* v, int group_shift,
                                           bool active, uint8_t* orow, uint32_t first,
                                           bool leader) {
  bool finite;
  float amax, lo, hi, sc, mn;
  LaneStats<kPerLane>(v, finite, amax, lo, hi);
  GroupStats(group_shift, finite, amax, lo, hi, nullptr);
  if (!active) return;
  BlockScale<K, BITS, SYM>(c, finite, amax, lo, hi, sc, mn);
  uint64_t w = 0;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e)
    w |= static_cast<uint64_t>(Quantize<K, BITS, SYM>(c, v[e], sc, mn)) << (e * BITS);
  StoreCodes8<BITS>(orow + first / 8 * BITS, w);
  if (leader) {
    reinterpret_cast<float*>(orow + c.scales)[first >> c.chunk_shift] = sc;
    if (K == Kind::kInt && !SYM)
      reinterpret_cast<float*>(orow + c.mins)[first >> c.chunk_shift] = mn;
  }
}

// Hadamard codecs whose inner codec is int of 2, 4, 8 bits or fp8 (blocks of at most 256),
// H <= 256: one warp per tile of 256 consecutive elements of the rows laid end to end, as
// HadamardKernel's modes: 0 encode (x rows -> payloads), 1 decode-sum (nrows payloads per
// output row -> d values), 2 decode-sum-encode. A tile may span rows, but a transform or an
// inner block never does (both divide the granule, which divides n); lanes past the last row
// only take part in the shuffles. An inner block spans 2^group_shift lanes.
template <Kind K, int BITS, bool SYM>
__global__ void __launch_bounds__(kThreads)
    HadamardWarpKernel(int mode, ChunkCodec c, int h, float pre, float post, int group_shift,
                       DType d, const void* x, const uint8_t* in, int nrows, int64_t stride,
                       uint32_t n, uint32_t total, void* out, int64_t out_row_bytes) {
  extern __shared__ float lut[];  // fp8: the 256 code values
  if constexpr (K == Kind::kFp8) FillFp8Lut(lut, c.fp8);
  const int lane = threadIdx.x & 31;
  const uint32_t warp0 = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t nwarps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t tiles = (total + kTile - 1) / kTile;
  for (uint32_t t = warp0; t < tiles; t += nwarps) {
    const uint32_t g = t * kTile + lane * kPerLane;  // the lane's first element, over all rows
    const bool active = g < total;
    const uint32_t o = active ? g / n : 0, e0 = active ? g - o * n : 0;  // row o, element e0
    float v[kPerLane];
    if (mode == 0) {
      if (active)
        LoadChunkX<kPerLane>(d, x, g, v);
      else
        for (int j = 0; j < kPerLane; ++j) v[j] = 0.0f;
      WarpHadamard(v, h, pre, post, lane);
    } else {
      const uint8_t* row0 = in + static_cast<int64_t>(o) * nrows * stride;
      for (int r = 0; r < nrows; ++r) {
        float u[kPerLane];
        if (active)
          DecodeLane<K, BITS, SYM>(c, lut, row0 + r * stride, e0, u);
        else
          for (int j = 0; j < kPerLane; ++j) u[j] = 0.0f;
        WarpHadamard(u, h, pre, post, lane);
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
          const float s = r == 0 ? u[j] : v[j] + u[j];
          v[j] = r > 0 && r == nrows - 1 ? CanonNaN(s) : s;  // a sum's NaN is the canonical one
        }
      }
      if (mode == 1) {
        if (active)
          StoreChunk<kPerLane>(
              d, static_cast<uint8_t*>(out) + o * out_row_bytes + e0 * DTypeBytes(d), v);
        continue;
      }
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) v[j] = RoundTrip(d, v[j]);
      WarpHadamard(v, h, pre, post, lane);
    }
    EncodeLane<K, BITS, SYM>(c, v, group_shift, active,
                             static_cast<uint8_t*>(out) + o * out_row_bytes, e0,
                             (lane & ((1 << group_shift) - 1)) == 0);
  }
}

// HadamardWarpKernel's launch, or false (nothing launched) where it does not apply: H or the
// inner block above 256, x or decoded rows not 16-byte aligned, payload rows or strides not
// 4-byte aligned, 2^31 elements or more.
template <Kind K, int BITS, bool SYM>
bool LaunchHadamardWarp(ChunkKind<K, BITS, SYM>, int mode, const CodecSpec& s, DType d,
                        const void* x, const uint8_t* in, int nrows, int64_t stride, int64_t rows,
                        int64_t n, void* out, int64_t out_row_bytes, cudaStream_t stream) {
  const int64_t total = rows * n;
  if (s.hadamard > kTile || s.block > kTile || total >= kMaxChunkWork) return false;
  if (mode == 0 ? !Aligned(x, 16) : (!Aligned(in, 4) || stride % 4 != 0)) return false;
  if (mode == 1 ? !Aligned(out, 16) : (!Aligned(out, 4) || out_row_bytes % 4 != 0)) return false;
  int group_shift = 0;  // lanes per inner block: block / 8, 4 to 32
  while ((kPerLane << group_shift) < s.block) ++group_shift;
  const size_t smem = K == Kind::kFp8 ? 256 * sizeof(float) : 0;
  const auto k = HadamardWarpKernel<K, BITS, SYM>;
  k<<<GridFor((total + kTile - 1) / kTile, kWarps), kThreads, smem, stream>>>(
      mode, ChunkCodecOf(s, d, n, 1), s.hadamard, HadamardPre(s.hadamard), HadamardPost(s.hadamard),
      group_shift, d, x, in, nrows, stride, static_cast<uint32_t>(n), static_cast<uint32_t>(total),
      out, out_row_bytes);
  return true;
}

bool HadamardWarp(int mode, const CodecSpec& s, DType d, const void* x, const uint8_t* in,
                  int nrows, int64_t stride, int64_t rows, int64_t n, void* out,
                  int64_t out_row_bytes, cudaStream_t stream) {
  if (s.hadamard == 0) return false;
  return WithChunkKind(s, [&](auto kind) {
    if constexpr (kChunkEncodes<decltype(kind)>)
      return LaunchHadamardWarp(kind, mode, s, d, x, in, nrows, stride, rows, n, out, out_row_bytes,
                                stream);
    else
      return false;
  });
}

// ---- spike reserving in a warp: a codec block of at most 256 elements per group of lanes -------
// Lane l of a group holds elements [8l, 8l + 8) of its block. The reserving order's k + 1
// largest keys come from k + 1 rounds of a max over the group's shuffles, with no barrier;
// the block-wide kernel (SpikeKernel) paid three barriers per round and ran at 1-3% of the
// copy bandwidth on an H200.

// v[j] for a j known only at run time, without indexing registers dynamically.
__device__ __forceinline__ float Pick(const float* v, uint32_t j) {
  float r = v[0];
#pragma unroll
  for (int e = 1; e < kPerLane; ++e) r = j == static_cast<uint32_t>(e) ? v[e] : r;
  return r;
}

// The value at in-block index j, from the lane of the group (first lane `base`) holding it.
__device__ __forceinline__ float GroupValue(const float* v, uint32_t j, int lane, int base) {
  const float mine = Pick(v, j & 7u);
  return __shfl_xor_sync(0xffffffffu, mine, lane ^ (base + static_cast<int>(j >> 3)));
}

// BlockSpikeSplit for the block a group holds: its k reserved values and indices go to `vals`
// and `idx` (written by the group's first lane when `write`), and each is replaced in v by
// the (k + 1)-th value of the reserving order.
__device__ __forceinline__ void SpikeSplitLanes(float* v, int k, int group_shift, int lane,
                                                uint32_t first, bool write, float* vals,
                                                uint16_t* idx) {
  const int span = 1 << group_shift, base = lane & ~(span - 1);
  uint32_t marks = 0;  // bit e: this lane's element e is reserved
  uint64_t key = ~uint64_t{0};
  for (int r = 0; r <= k; ++r) {
    uint64_t best = 0;  // below every key
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const uint64_t ke = SpikeKey(v[e], first + e);
      best = ke < key && ke > best ? ke : best;
    }
    for (int o = 1; o < span; o <<= 1) {
      const uint64_t other = __shfl_xor_sync(0xffffffffu, best, o);
      best = other > best ? other : best;
    }
    key = best;
    if (r == k) break;
    const bool used = SpikeUsed(key);
    const uint32_t at = SpikeIndex(key);
    const float val = GroupValue(v, at, lane, base);
    if (write) {
      vals[r] = used ? val : 0.0f;
      idx[r] = used ? static_cast<uint16_t>(at) : kSpikeUnused;
    }
    if (used && (at >> 3) == first / kPerLane) marks |= 1u << (at & 7u);
  }
  const float fill = GroupValue(v, SpikeIndex(key), lane, base);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) v[e] = (marks >> e) & 1u ? fill : v[e];
}

// BlockSpikeRestore for a lane's 8 decoded values (elements [first, first + 8) of block b): a
// used index past the block or repeated makes the whole block the canonical NaN.
__device__ __forceinline__ void SpikeRestoreLane(float* v, int k, int block, uint32_t first,
                                                 const float* vals, const uint16_t* idx) {
  bool ok = true;
  for (int r = 0; r < k; ++r) {
    const uint32_t i = idx[r];
    if (i == kSpikeUnused) continue;
    ok = ok && i < static_cast<uint32_t>(block);
    for (int q = 0; q < r; ++q) ok = ok && idx[q] != i;
  }
  if (!ok) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] = BitsFloat(kCanonicalNaN);
    return;
  }
  for (int r = 0; r < k; ++r) {
    const uint32_t i = idx[r];
    if (i == kSpikeUnused || i - first >= static_cast<uint32_t>(kPerLane)) continue;
    const float val = CanonNaN(vals[r]);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] = i - first == static_cast<uint32_t>(e) ? val : v[e];
  }
}

// Spike codecs around int of 2, 4, 8 bits or fp8 with blocks of at most 256: a group of
// block / 8 lanes per codec block, as SpikeKernel's modes (0 encode, 1 decode-sum, 2
// decode-sum-encode) over `blocks` codec blocks, nb per row.
template <Kind K, int BITS, bool SYM>
__global__ void __launch_bounds__(kThreads)
    SpikeWarpKernel(int mode, ChunkCodec c, int k, int group_shift, DType d, const void* x,
                    const uint8_t* in, int nrows, int64_t stride, uint32_t nb, uint32_t blocks,
                    void* out, int64_t out_row_bytes) {
  extern __shared__ float lut[];  // fp8: the 256 code values
  if constexpr (K == Kind::kFp8) FillFp8Lut(lut, c.fp8);
  const int lane = threadIdx.x & 31, block = kPerLane << group_shift;
  const uint32_t per_warp = 32u >> group_shift, group = static_cast<uint32_t>(lane) >> group_shift;
  const uint32_t warp0 = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t nwarps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t tiles = (blocks + per_warp - 1) / per_warp;
  const uint32_t lane_first = (lane & ((1 << group_shift) - 1)) * kPerLane;  // in the block
  for (uint32_t t = warp0; t < tiles; t += nwarps) {
    const uint32_t gb = t * per_warp + group;
    const bool active = gb < blocks;
    const uint32_t o = active ? gb / nb : 0, b = active ? gb - o * nb : 0;
    const uint32_t first = b * block + lane_first;  // the lane's first element in row o
    float v[kPerLane];
    if (!active) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) v[e] = 0.0f;
    } else if (mode == 0) {
      LoadChunkX<kPerLane>(d, x, static_cast<int64_t>(gb) * block + lane_first, v);
    } else {
      const uint8_t* row0 = in + static_cast<int64_t>(o) * nrows * stride;
      for (int r = 0; r < nrows; ++r) {
        const uint8_t* row = row0 + r * stride;
        float u[kPerLane];
        DecodeLane<K, BITS, SYM>(c, lut, row, first, u);
        SpikeRestoreLane(u, k, block, lane_first,
                         reinterpret_cast<const float*>(row + c.spike) + b * k,
                         reinterpret_cast<const uint16_t*>(row + c.spike + 4 * nb * k) + b * k);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) {
          const float s = r == 0 ? u[e] : v[e] + u[e];
          v[e] = r > 0 && r == nrows - 1 ? CanonNaN(s) : s;  // a sum's NaN is the canonical one
        }
      }
      if (mode == 1) {
        StoreChunk<kPerLane>(
            d, static_cast<uint8_t*>(out) + o * out_row_bytes + first * DTypeBytes(d), v);
        continue;
      }
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) v[e] = RoundTrip(d, v[e]);
    }
    if (mode == 1) continue;  // an inactive group of a decode: nothing to write
    uint8_t* orow = static_cast<uint8_t*>(out) + o * out_row_bytes;
    const bool leader = lane_first == 0;
    SpikeSplitLanes(v, k, group_shift, lane, lane_first, active && leader,
                    reinterpret_cast<float*>(orow + c.spike) + b * k,
                    reinterpret_cast<uint16_t*>(orow + c.spike + 4 * nb * k) + b * k);
    EncodeLane<K, BITS, SYM>(c, v, group_shift, active, orow, first, leader);
    if (active && leader && b == nb - 1) {
      for (int64_t q = c.spike + 6 * int64_t{nb} * k; q < c.total; ++q) orow[q] = 0;  // padding
    }
  }
}

// SpikeWarpKernel's launch, or false (nothing launched) where it does not apply: blocks above
// 256, x or decoded rows not 16-byte aligned, payload rows or strides not 4-byte aligned,
// 2^31 blocks or row elements or more.
template <Kind K, int BITS, bool SYM>
bool LaunchSpikeWarp(ChunkKind<K, BITS, SYM>, int mode, const CodecSpec& s, DType d, const void* x,
                     const uint8_t* in, int nrows, int64_t stride, int64_t rows, int64_t n,
                     void* out, int64_t out_row_bytes, cudaStream_t stream) {
  const int64_t nb = n / s.block, blocks = rows * nb;
  if (s.block > kTile || blocks >= kMaxChunkWork || n >= kMaxChunkWork) return false;
  if (mode == 0 ? !Aligned(x, 16) : (!Aligned(in, 4) || stride % 4 != 0)) return false;
  if (mode == 1 ? !Aligned(out, 16) : (!Aligned(out, 4) || out_row_bytes % 4 != 0)) return false;
  int group_shift = 0;  // lanes per block: block / 8, 4 to 32
  while ((kPerLane << group_shift) < s.block) ++group_shift;
  const int64_t warps = (blocks + (32 >> group_shift) - 1) / (32 >> group_shift);
  const size_t smem = K == Kind::kFp8 ? 256 * sizeof(float) : 0;
  const auto k = SpikeWarpKernel<K, BITS, SYM>;
  k<<<GridFor(warps, kWarps), kThreads, smem, stream>>>(
      mode, ChunkCodecOf(s, d, n, 1), s.spike, group_shift, d, x, in, nrows, stride,
      static_cast<uint32_t>(nb), static_cast<uint32_t>(blocks), out, out_row_bytes);
  return true;
}

bool SpikeWarp(int mode, const CodecSpec& s, DType d, const void* x, const uint8_t* in, int nrows,
               int64_t stride, int64_t rows, int64_t n, void* out, int64_t out_row_bytes,
               cudaStream_t stream) {
  if (s.spike == 0) return false;
  CodecSpec inner = s;  // WithChunkKind takes the inner codec
  inner.spike = 0;
  return WithChunkKind(inner, [&](auto kind) {
    if constexpr (kChunkEncodes<decltype(kind)>)
      return LaunchSpikeWarp(kind, mode, s, d, x, in, nrows, stride, rows, n, out, out_row_bytes,
                             stream);
    else
      return false;
  });
}

// Elementwise: out row o = decode-sum of the nrows payloads at in + o * nrows * stride
// (nrows = 1: plain decode), or, when `x` is non-null, row o of x. The value is rounded
// through `via`, then stored as `od` (the row dtype, or the none/cast payload type).
__global__ void ElementwiseKernel(CodecSpec s, DType d, const void* x, const uint8_t* in, int nrows,
                                  int64_t stride, int64_t rows, int64_t n, void* out, DType via,
                                  DType od, int64_t out_row_bytes) {
  const int64_t total = rows * n;
  const ElemDecoder dec = MakeElemDecoder(s, d, n);
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // (row o, offset i) of element k, advanced by the grid stride with one compare instead of
  // a 64-bit division per element: the divisions happen once per thread.
  const int64_t step_o = step / n, step_i = step - step_o * n;
  int64_t o = k0 / n, i = k0 - o * n;
  for (int64_t k = k0; k < total; k += step) {
    float v;
    if (x != nullptr) {
      v = LoadElem(d, x, k);
    } else {
      const uint8_t* row = in + o * nrows * stride;
      v = dec(row, i);
      for (int r = 1; r < nrows; ++r) v = v + dec(row + r * stride, i);
      if (nrows > 1) v = CanonNaN(v);  // a sum's NaN is the canonical one (WIRE_FORMAT.md)
    }
    StoreElem(od, static_cast<uint8_t*>(out) + o * out_row_bytes, i, RoundTrip(via, v));
    o += step_o;
    i += step_i;
    if (i >= n) {
      i -= n;
      ++o;
    }
  }
}

// In-place normalised Walsh-Hadamard transform of every run of h in t[0, g): times
// HadamardPre(h), the butterflies, times `post` = HadamardPost(h), NaNs made canonical.
__device__ void BlockHadamard(float* t, int g, int h, float post) {
  const float pre = HadamardPre(h);
  __syncthreads();
  for (int j = threadIdx.x; j < g; j += blockDim.x) t[j] = t[j] * pre;
  for (int len = 1; len < h; len <<= 1) {
    __syncthreads();
    for (int pidx = threadIdx.x; pidx < g / 2; pidx += blockDim.x) {
      const int run = pidx / len, j = pidx - run * len;
      const int a = run * 2 * len + j;
      const float x = t[a], y = t[a + len];
      t[a] = x + y;
      t[a + len] = x - y;
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < g; j += blockDim.x) t[j] = CanonNaN(t[j] * post);
  __syncthreads();
}

// The Hadamard and spike kernels are bounded to three blocks of kThreads per SM (85
// registers): left free, ptxas gave them 80 to 90 depending on how the inner codec's code was
// arranged, and at 86 an H200 held two blocks and ran the Hadamard codec about 27% slower.

// One CUDA block per granule tile of g elements, for Hadamard codecs.
// mode 0 (encode): x rows -> payloads. mode 1 (decode-sum): nrows payloads per output row ->
// od values. mode 2 (decode-sum-encode): nrows payloads per output row -> payload.
__global__ void __launch_bounds__(kThreads, 3)
    HadamardKernel(int mode, CodecSpec s, DType d, const void* x, const uint8_t* in, int nrows,
                   int64_t stride, int64_t rows, int64_t n, void* out, int64_t out_row_bytes,
                   float post) {
  extern __shared__ float smem[];
  const int g = static_cast<int>(Granule(s));
  float* acc = smem;
  float* tmp = smem + g;
  const int64_t tiles = n / g;
  const Layout l = RowLayout(s, n, d);
  const ElemDecoder dec = MakeElemDecoder(s, d, n);
  const int64_t nb = s.block > 0 ? n / s.block : 0;
  for (int64_t t = blockIdx.x; t < rows * tiles; t += gridDim.x) {
    const int64_t o = t / tiles, base = (t - o * tiles) * g;
    if (mode == 0) {
      for (int j = threadIdx.x; j < g; j += blockDim.x) acc[j] = LoadElem(d, x, o * n + base + j);
      BlockHadamard(acc, g, s.hadamard, post);
    } else {
      const uint8_t* row0 = in + o * nrows * stride;
      for (int r = 0; r < nrows; ++r) {
        float* dst = r == 0 ? acc : tmp;
        for (int j = threadIdx.x; j < g; j += blockDim.x) dst[j] = dec(row0 + r * stride, base + j);
        BlockHadamard(dst, g, s.hadamard, post);
        if (r > 0) {
          for (int j = threadIdx.x; j < g; j += blockDim.x) {
            const float v = acc[j] + tmp[j];
            acc[j] = r == nrows - 1 ? CanonNaN(v) : v;  // a sum's NaN is the canonical one
          }
        }
      }
      __syncthreads();
      if (mode == 1) {
        uint8_t* orow = static_cast<uint8_t*>(out) + o * out_row_bytes;
        for (int j = threadIdx.x; j < g; j += blockDim.x) StoreElem(d, orow, base + j, acc[j]);
        __syncthreads();
        continue;
      }
      for (int j = threadIdx.x; j < g; j += blockDim.x) acc[j] = RoundTrip(d, acc[j]);
      BlockHadamard(acc, g, s.hadamard, post);
    }
    // Inner encode of the rotated float32 tile.
    uint8_t* orow = static_cast<uint8_t*>(out) + o * out_row_bytes;
    if (s.kind == Kind::kNone || s.kind == Kind::kCast) {
      const DType pd = s.kind == Kind::kNone ? DType::kF32 : s.cast_dtype;
      for (int j = threadIdx.x; j < g; j += blockDim.x) StoreElem(pd, orow, base + j, acc[j]);
    } else {
      const SmemSrc src{acc, base};
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
      for (int64_t b = base / s.block + warp; b < (base + g) / s.block; b += blockDim.x / 32)
        EncodeBlockWarp<kKindOfSpec>(s, l, src, b, nb, orow, lane);
    }
    __syncthreads();
  }
}

// ---- spike reserving: one CUDA block per codec block, staged in shared memory ---------------
// The largest SpikeKey below `below` in t[0, g); every thread calls it and gets it. `red`:
// kWarps + 1 words of shared scratch.
__device__ uint64_t BlockNextKey(const float* t, int g, uint64_t below, uint64_t* red) {
  uint64_t best = 0;  // below every key
  for (int j = threadIdx.x; j < g; j += blockDim.x) {
    const uint64_t key = SpikeKey(t[j], j);
    best = key < below && key > best ? key : best;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, best, o);
    best = other > best ? other : best;
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t m = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) m = red[w] > m ? red[w] : m;
    red[kWarps] = m;
  }
  __syncthreads();
  const uint64_t m = red[kWarps];
  __syncthreads();  // red is written again by the next call
  return m;
}

// Reserves codec block b, staged in t[0, g): its k largest finite magnitudes, one per round
// (keys are distinct, so "largest below the last one" walks the reserving order), go to the
// row's payload, and are replaced in t by the (k+1)-th value. `mark`: g words of scratch.
__device__ void BlockSpikeSplit(const CodecSpec& s, const Layout& l, float* t, int g, int64_t b,
                                int64_t nb, uint8_t* orow, uint32_t* mark, uint64_t* red) {
  const int k = s.spike;
  float* vals = reinterpret_cast<float*>(orow + l.spike) + b * k;
  uint16_t* idx = reinterpret_cast<uint16_t*>(orow + l.spike + 4 * nb * k) + b * k;
  for (int j = threadIdx.x; j < g; j += blockDim.x) mark[j] = 0;
  __syncthreads();
  uint64_t key = ~uint64_t{0};
  for (int r = 0; r <= k; ++r) {
    key = BlockNextKey(t, g, key, red);
    if (r < k && threadIdx.x == 0) {
      const bool used = SpikeUsed(key);
      const uint32_t j = SpikeIndex(key);
      vals[r] = used ? t[j] : 0.0f;
      idx[r] = used ? static_cast<uint16_t>(j) : kSpikeUnused;
      if (used) mark[j] = 1;
    }
  }
  const float fill = t[SpikeIndex(key)];
  __syncthreads();
  for (int j = threadIdx.x; j < g; j += blockDim.x) t[j] = mark[j] ? fill : t[j];
  if (threadIdx.x == 0 && b == nb - 1) {
    for (int64_t p = l.spike + 6 * nb * k; p < l.total; ++p) orow[p] = 0;  // padding
  }
  __syncthreads();
}

// Puts codec block b's reserved values (a NaN as the canonical NaN) into its decoded inner
// values t[0, g), or makes the whole block the canonical NaN when an index is past the
// block or repeated. `seen`: g / 32 words and `flag`: one word of shared scratch.
__device__ void BlockSpikeRestore(const CodecSpec& s, const Layout& l, float* t, int g, int64_t b,
                                  int64_t nb, const uint8_t* row, uint32_t* seen, uint32_t* flag) {
  const int k = s.spike;
  const float* vals = reinterpret_cast<const float*>(row + l.spike) + b * k;
  const uint16_t* idx = reinterpret_cast<const uint16_t*>(row + l.spike + 4 * nb * k) + b * k;
  if (threadIdx.x == 0) {
    for (int w = 0; w < g / 32; ++w) seen[w] = 0;
    uint32_t ok = 1;
    for (int r = 0; r < k; ++r) {
      const uint32_t i = idx[r];
      if (i == kSpikeUnused) continue;
      if (i >= static_cast<uint32_t>(g) || ((seen[i >> 5] >> (i & 31)) & 1u)) ok = 0;
      if (i < static_cast<uint32_t>(g)) seen[i >> 5] |= 1u << (i & 31);
    }
    *flag = ok;
  }
  __syncthreads();
  if (*flag == 0) {
    for (int j = threadIdx.x; j < g; j += blockDim.x) t[j] = BitsFloat(kCanonicalNaN);
  } else {
    for (int r = threadIdx.x; r < k; r += blockDim.x) {
      const uint32_t i = idx[r];
      if (i != kSpikeUnused) t[i] = CanonNaN(vals[r]);
    }
  }
  __syncthreads();
}

// One CUDA block per codec block of spike codecs; modes as HadamardKernel's (0 encode,
// 1 decode-sum, 2 decode-sum-encode).
__global__ void __launch_bounds__(kThreads, 3)
    SpikeKernel(int mode, CodecSpec s, DType d, const void* x, const uint8_t* in, int nrows,
                int64_t stride, int64_t rows, int64_t n, void* out, int64_t out_row_bytes) {
  extern __shared__ float smem[];
  const int g = s.block;
  float* acc = smem;
  float* tmp = smem + g;
  uint64_t* red = reinterpret_cast<uint64_t*>(smem + 2 * g);
  uint32_t* seen = reinterpret_cast<uint32_t*>(red + kWarps + 1);
  uint32_t* flag = seen + g / 32;
  const int64_t nb = n / g;
  const Layout l = RowLayout(s, n, d);
  const ElemDecoder dec = MakeElemDecoder(s, d, n);
  for (int64_t t = blockIdx.x; t < rows * nb; t += gridDim.x) {
    const int64_t o = t / nb, b = t - o * nb, base = b * g;
    if (mode == 0) {
      for (int j = threadIdx.x; j < g; j += blockDim.x) acc[j] = LoadElem(d, x, o * n + base + j);
    } else {
      const uint8_t* row0 = in + o * nrows * stride;
      for (int r = 0; r < nrows; ++r) {
        float* dst = r == 0 ? acc : tmp;
        for (int j = threadIdx.x; j < g; j += blockDim.x) dst[j] = dec(row0 + r * stride, base + j);
        __syncthreads();
        BlockSpikeRestore(s, l, dst, g, b, nb, row0 + r * stride, seen, flag);
        if (r > 0) {
          for (int j = threadIdx.x; j < g; j += blockDim.x) {
            const float v = acc[j] + tmp[j];
            acc[j] = r == nrows - 1 ? CanonNaN(v) : v;  // a sum's NaN is the canonical one
          }
        }
        __syncthreads();
      }
      if (mode == 1) {
        uint8_t* orow = static_cast<uint8_t*>(out) + o * out_row_bytes;
        for (int j = threadIdx.x; j < g; j += blockDim.x) StoreElem(d, orow, base + j, acc[j]);
        __syncthreads();
        continue;
      }
      for (int j = threadIdx.x; j < g; j += blockDim.x) acc[j] = RoundTrip(d, acc[j]);
    }
    uint8_t* orow = static_cast<uint8_t*>(out) + o * out_row_bytes;
    BlockSpikeSplit(s, l, acc, g, b, nb, orow, reinterpret_cast<uint32_t*>(tmp), red);
    if (threadIdx.x < 32)
      EncodeBlockWarp<kKindOfSpec>(s, l, SmemSrc{acc, base}, b, nb, orow, threadIdx.x);
    __syncthreads();
  }
}

size_t SpikeSmem(const CodecSpec& s) {
  return 2 * sizeof(float) * s.block + sizeof(uint64_t) * (kWarps + 1) +
         sizeof(uint32_t) * (s.block / 32 + 1);
}

cudaError_t CheckArgs(const CodecSpec& s, int64_t n) {
  // Plugin codecs run the plugin's own launches (codecs/plugin.h), never these kernels.
  if (s.kind == Kind::kPlugin) return cudaErrorInvalidValue;
  if (Validate(s) != nullptr || n <= 0 || n % Granule(s) != 0) return cudaErrorInvalidValue;
  return cudaSuccess;
}

size_t HadamardSmem(const CodecSpec& s) { return 2 * sizeof(float) * Granule(s); }

}  // namespace

// Decode-sum of `outs` output rows, each the sum of nrows payloads (decode_rows: nrows = 1).
cudaError_t DecodeSumBatch(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                           int64_t stride, int64_t outs, int64_t n, void* out,
                           cudaStream_t stream) {
  if (cudaError_t e = CheckArgs(s, n); e != cudaSuccess) return e;
  if (nrows < 1 || outs < 1) return cudaErrorInvalidValue;
  const int64_t ob = n * DTypeBytes(d);
  if (HadamardWarp(1, s, d, nullptr, in, nrows, stride, outs, n, out, ob, stream)) {
    // launched: inner int (2, 4, 8 bits) or fp8, H and block <= 256
  } else if (s.hadamard > 0) {
    const int64_t tiles = outs * (n / Granule(s));
    HadamardKernel<<<GridFor(tiles, 1), kThreads, HadamardSmem(s), stream>>>(
        1, s, d, nullptr, in, nrows, stride, outs, n, out, ob, HadamardPost(s.hadamard));
  } else if (SpikeWarp(1, s, d, nullptr, in, nrows, stride, outs, n, out, ob, stream)) {
    // launched: inner int (2, 4, 8 bits) or fp8, block <= 256
  } else if (s.spike > 0) {
    SpikeKernel<<<GridFor(outs * (n / s.block), 1), kThreads, SpikeSmem(s), stream>>>(
        1, s, d, nullptr, in, nrows, stride, outs, n, out, ob);
  } else if (DecodeSumChunks(s, d, in, nrows, stride, outs, n, out, stream)) {
    // launched: int (2, 4, 8 bits), fp8 and error_bounded
  } else if (s.kind == Kind::kNone && d == DType::kF32 && nrows == 1 && stride == ob) {
    // A float32 `none` row's sum is its bits (16-bit rows convert: their NaNs change).
    return cudaMemcpyAsync(out, in, outs * ob, cudaMemcpyDeviceToDevice, stream);
  } else {
    ElementwiseKernel<<<ElementwiseGrid(outs * n), kThreads, 0, stream>>>(
        s, d, nullptr, in, nrows, stride, outs, n, out, DType::kF32, d, ob);
  }
  return cudaGetLastError();
}

cudaError_t DecodeSumEncodeBatch(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                                 int64_t stride, int64_t outs, int64_t n, uint8_t* out,
                                 cudaStream_t stream) {
  if (cudaError_t e = CheckArgs(s, n); e != cudaSuccess) return e;
  if (nrows < 1 || outs < 1) return cudaErrorInvalidValue;
  const int64_t p = PayloadBytes(s, n, d);
  if (HadamardWarp(2, s, d, nullptr, in, nrows, stride, outs, n, out, p, stream)) {
    // launched
  } else if (s.hadamard > 0) {
    const int64_t tiles = outs * (n / Granule(s));
    HadamardKernel<<<GridFor(tiles, 1), kThreads, HadamardSmem(s), stream>>>(
        2, s, d, nullptr, in, nrows, stride, outs, n, out, p, HadamardPost(s.hadamard));
  } else if (SpikeWarp(2, s, d, nullptr, in, nrows, stride, outs, n, out, p, stream)) {
    // launched
  } else if (s.spike > 0) {
    SpikeKernel<<<GridFor(outs * (n / s.block), 1), kThreads, SpikeSmem(s), stream>>>(
        2, s, d, nullptr, in, nrows, stride, outs, n, out, p);
  } else if (s.kind == Kind::kNone || s.kind == Kind::kCast) {
    // The sum is rounded to d first, then (cast) to the payload type.
    const DType pd = s.kind == Kind::kNone ? d : s.cast_dtype;
    ElementwiseKernel<<<ElementwiseGrid(outs * n), kThreads, 0, stream>>>(
        s, d, nullptr, in, nrows, stride, outs, n, out, d, pd, p);
  } else if (!DecodeSumEncodeChunks(s, d, in, nrows, stride, outs, n, out, p, stream)) {
    const EncodeBlocksFn k = EncodeBlocksFor<false>(s.kind);
    k<<<GridFor(outs * (n / s.block) * 32, kThreads), kThreads, 0, stream>>>(
        s, d, nullptr, in, nrows, stride, outs, n, out, p);
  }
  return cudaGetLastError();
}

cudaError_t EncodeRowsCuda(const CodecSpec& s, DType d, const void* x, int64_t rows, int64_t n,
                           uint8_t* out, cudaStream_t stream) {
  if (cudaError_t e = CheckArgs(s, n); e != cudaSuccess) return e;
  if (rows < 1) return cudaSuccess;
  const int64_t p = PayloadBytes(s, n, d);
  if (HadamardWarp(0, s, d, x, nullptr, 1, 0, rows, n, out, p, stream)) {
    // launched
  } else if (s.hadamard > 0) {
    const int64_t tiles = rows * (n / Granule(s));
    HadamardKernel<<<GridFor(tiles, 1), kThreads, HadamardSmem(s), stream>>>(
        0, s, d, x, nullptr, 1, 0, rows, n, out, p, HadamardPost(s.hadamard));
  } else if (SpikeWarp(0, s, d, x, nullptr, 1, 0, rows, n, out, p, stream)) {
    // launched
  } else if (s.spike > 0) {
    SpikeKernel<<<GridFor(rows * (n / s.block), 1), kThreads, SpikeSmem(s), stream>>>(
        0, s, d, x, nullptr, 1, 0, rows, n, out, p);
  } else if (s.kind == Kind::kNone) {
    return cudaMemcpyAsync(out, x, rows * p, cudaMemcpyDeviceToDevice, stream);
  } else if (s.kind == Kind::kCast) {
    ElementwiseKernel<<<ElementwiseGrid(rows * n), kThreads, 0, stream>>>(
        s, d, x, nullptr, 1, 0, rows, n, out, DType::kF32, s.cast_dtype, p);
  } else if (!EncodeChunks(s, d, x, rows, n, out, p, stream)) {
    const EncodeBlocksFn k = EncodeBlocksFor<true>(s.kind);
    k<<<GridFor(rows * (n / s.block) * 32, kThreads), kThreads, 0, stream>>>(s, d, x, nullptr, 1, 0,
                                                                             rows, n, out, p);
  }
  return cudaGetLastError();
}

cudaError_t DecodeRowsCuda(const CodecSpec& s, DType d, const uint8_t* in, int64_t rows, int64_t n,
                           void* out, cudaStream_t stream) {
  if (cudaError_t e = CheckArgs(s, n); e != cudaSuccess || rows < 1) return e;
  if (s.hadamard == 0 && (s.kind == Kind::kNone || (s.kind == Kind::kCast && s.cast_dtype == d))) {
    // none, and cast decoded to its own dtype: the payload's bits (WIRE_FORMAT.md).
    return cudaMemcpyAsync(out, in, rows * n * DTypeBytes(d), cudaMemcpyDeviceToDevice, stream);
  }
  return DecodeSumBatch(s, d, in, 1, PayloadBytes(s, n, d), rows, n, out, stream);
}

cudaError_t DecodeSumCuda(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                          int64_t row_stride, int64_t n, void* out, cudaStream_t stream) {
  return DecodeSumBatch(s, d, in, nrows, row_stride, 1, n, out, stream);
}

cudaError_t DecodeSumEncodeCuda(const CodecSpec& s, DType d, const uint8_t* in, int nrows,
                                int64_t row_stride, int64_t n, uint8_t* out, cudaStream_t stream) {
  return DecodeSumEncodeBatch(s, d, in, nrows, row_stride, 1, n, out, stream);
}

}  // namespace jcoccl::codecs
