// CUDA codecs (cuda/WIRE_FORMAT.md); their XLA FFI handlers are in codec_handlers.cu.
//
// Kernels: int/fp8/error_bounded encode with one warp per codec block (two passes over the
// block: statistics, then codes; 16-byte loads of 4 elements); elementwise decode and
// decode-sum; Hadamard and spike variants with one CUDA block per granule staged in shared
// memory.
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
  if (s.hadamard > 0) {
    const int64_t tiles = outs * (n / Granule(s));
    HadamardKernel<<<GridFor(tiles, 1), kThreads, HadamardSmem(s), stream>>>(
        1, s, d, nullptr, in, nrows, stride, outs, n, out, ob, HadamardPost(s.hadamard));
  } else if (s.spike > 0) {
    SpikeKernel<<<GridFor(outs * (n / s.block), 1), kThreads, SpikeSmem(s), stream>>>(
        1, s, d, nullptr, in, nrows, stride, outs, n, out, ob);
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
  if (s.hadamard > 0) {
    const int64_t tiles = outs * (n / Granule(s));
    HadamardKernel<<<GridFor(tiles, 1), kThreads, HadamardSmem(s), stream>>>(
        2, s, d, nullptr, in, nrows, stride, outs, n, out, p, HadamardPost(s.hadamard));
  } else if (s.spike > 0) {
    SpikeKernel<<<GridFor(outs * (n / s.block), 1), kThreads, SpikeSmem(s), stream>>>(
        2, s, d, nullptr, in, nrows, stride, outs, n, out, p);
  } else if (s.kind == Kind::kNone || s.kind == Kind::kCast) {
    // The sum is rounded to d first, then (cast) to the payload type.
    const DType pd = s.kind == Kind::kNone ? d : s.cast_dtype;
    ElementwiseKernel<<<ElementwiseGrid(outs * n), kThreads, 0, stream>>>(
        s, d, nullptr, in, nrows, stride, outs, n, out, d, pd, p);
  } else {
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
  if (s.hadamard > 0) {
    const int64_t tiles = rows * (n / Granule(s));
    HadamardKernel<<<GridFor(tiles, 1), kThreads, HadamardSmem(s), stream>>>(
        0, s, d, x, nullptr, 1, 0, rows, n, out, p, HadamardPost(s.hadamard));
  } else if (s.spike > 0) {
    SpikeKernel<<<GridFor(rows * (n / s.block), 1), kThreads, SpikeSmem(s), stream>>>(
        0, s, d, x, nullptr, 1, 0, rows, n, out, p);
  } else if (s.kind == Kind::kNone) {
    return cudaMemcpyAsync(out, x, rows * p, cudaMemcpyDeviceToDevice, stream);
  } else if (s.kind == Kind::kCast) {
    ElementwiseKernel<<<ElementwiseGrid(rows * n), kThreads, 0, stream>>>(
        s, d, x, nullptr, 1, 0, rows, n, out, DType::kF32, s.cast_dtype, p);
  } else {
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
