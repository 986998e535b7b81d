// The fused collective engine: every algorithm written once, over two small interfaces.
//
//   Codec     -- row codec ops (CPU functions, or CUDA launches on a lane's stream)
//   Transport -- byte collectives within a communicator (host rendezvous or NCCL)
//   Lanes     -- where work runs: three lanes (encode, communicate, decode) that are
//                synchronous on CPU and CUDA streams ordered by events on GPU.
//
// Messages arrive already laid out by the Python side (jcoccl/_src/engine/fused_ops.py) as `k`
// slices (the `chunks` of the collective), each a block of rows whose length is a multiple of the
// codec granule; slice s's payloads live in their own part of the workspace, so slice s+1's
// encode overlaps slice s's communication with no reuse hazards. Reductions are the f32
// left fold over source ranks in rank order, cast once (cuda/WIRE_FORMAT.md "Reductions"),
// which makes every result bit-identical to the XLA backend's.
#pragma once
#include <cstdint>
#include <vector>

#include "codecs/codec.h"
#include "transport/transport.h"

namespace jcoccl::engine {

using codecs::CodecSpec;
using codecs::DType;
using transport::CallCtx;
using transport::Status;
using transport::Transport;

enum Lane : int { kEncode = 0, kComm = 1, kDecode = 2 };

class Lanes {
 public:
  virtual ~Lanes() = default;
  virtual void* stream(Lane l) = 0;
  // Work enqueued on `to` after this call starts after all work enqueued on `from` so far.
  virtual Status Handoff(Lane from, Lane to) = 0;
  // Fills `bytes` bytes at `p` with zeros on lane `l`.
  virtual Status Zero(Lane l, void* p, int64_t bytes) = 0;
};

// Row codec ops for one CodecSpec and one element type (the collective's dtype).
class Codec {
 public:
  Codec(const CodecSpec& spec, DType dtype) : spec_(spec), dtype_(dtype) {}
  virtual ~Codec() = default;
  int64_t Payload(int64_t n) const { return codecs::PayloadBytes(spec_, n, dtype_); }
  int64_t ElemBytes() const { return codecs::DTypeBytes(dtype_); }
  const CodecSpec& spec() const { return spec_; }
  DType dtype() const { return dtype_; }
  // rows x n elements -> rows contiguous payloads.
  virtual Status EncodeRows(void* stream, const void* x, int64_t rows, int64_t n, uint8_t* out) = 0;
  // rows contiguous payloads -> rows x n elements.
  virtual Status DecodeRows(void* stream, const uint8_t* in, int64_t rows, int64_t n,
                            void* out) = 0;
  // nrows contiguous payloads -> n elements (f32 left fold, cast once).
  virtual Status DecodeSum(void* stream, const uint8_t* in, int nrows, int64_t n, void* out) = 0;
  // nrows contiguous payloads -> one payload of their (cast) sum.
  virtual Status DecodeSumEncode(void* stream, const uint8_t* in, int nrows, int64_t n,
                                 uint8_t* out) = 0;

 protected:
  CodecSpec spec_;
  DType dtype_;
};

// Carves aligned pieces out of the workspace buffer.
class Arena {
 public:
  Arena(uint8_t* base, int64_t bytes) : base_(base), cap_(bytes) {}
  static int64_t Align(int64_t b) { return (b + 255) / 256 * 256; }
  uint8_t* Take(int64_t bytes) {
    uint8_t* p = base_ == nullptr ? nullptr : base_ + used_;
    used_ += Align(bytes);
    return p;
  }
  int64_t used() const { return used_; }
  bool fits() const { return used_ <= cap_; }

 private:
  uint8_t* base_;
  int64_t cap_;
  int64_t used_ = 0;
};

enum class Op : int32_t {
  kAllReduceOneShot = 0,
  kAllReduceTwoShot = 1,
  kAllReduceHierarchical = 2,
  kReduceScatter = 3,
  kAllGather = 4,
  kAllToAll = 5,
  kPpermute = 6,
  // Uncompressed baselines: the transport's own collective, no codec and no workspace
  // (on GPU ncclAllReduce / ncclReduceScatter / ncclAllGather). The reductions are float32.
  kPlainAllReduce = 7,
  kPlainReduceScatter = 8,
  kPlainAllGather = 9,
};

// Everything one call needs. Shapes (elements) per op, k slices of rows of length m:
//   all_reduce one_shot:     x [k, m]          -> out [k, m]
//   all_reduce two_shot:     x [k, size, m]    -> out [k, size, m]
//   all_reduce hierarchical: x [k, inner, m]   -> out [k, inner, m]  (outer codec/transport too)
//   reduce_scatter:          x [k, size, m]    -> out [k, m]
//   all_gather:              x [k, m]          -> out [k, size, m]
//   all_to_all:              x [k, size, m]    -> out [k, size, m]
//   ppermute:                x [k, m]          -> out [k, m]  (zeros where no source)
//   plain all_reduce:        x [k, m]          -> out [k, m]      (float32)
//   plain reduce_scatter:    x [k, size, m]    -> out [k, m]      (float32)
//   plain all_gather:        x [k, m]          -> out [k, size, m]
// The plain ops ignore `codec` except for its element type.
struct Call {
  Op op;
  int64_t k = 1;
  int64_t m = 0;
  const void* x = nullptr;
  void* out = nullptr;
  Codec* codec = nullptr;
  Transport* comm = nullptr;
  Codec* outer_codec = nullptr;     // hierarchical only
  Transport* outer_comm = nullptr;  // hierarchical only
  int send_to = -1;                 // ppermute: destination rank of this rank, or -1
  int recv_from = -1;               // ppermute: source rank of this rank, or -1
  CallCtx ctx;
};

// Bytes of workspace Run needs (computed with a null arena; same code path as Run).
int64_t WorkspaceBytes(const Call& c);

// Runs the collective. With `ws` null only sizes the workspace.
Status Run(const Call& c, Lanes* lanes, uint8_t* ws, int64_t ws_bytes);

}  // namespace jcoccl::engine

#include "engine/engine_impl.h"
