// Definitions for engine/engine.h (header-only: compiled into both jcoccl._cpu and
// jcoccl._cuda, each with its own Lanes, Codec and Transport implementations).
#pragma once

namespace jcoccl::engine {
namespace detail {

// One pass over the algorithm either sizes the workspace (dry) or runs it.
struct Runner {
  const Call& c;
  Lanes* lanes;  // null when dry
  Arena arena;
  bool dry() const { return lanes == nullptr; }
  void* S(Lane l) { return lanes->stream(l); }
  CallCtx Ctx() {
    CallCtx x = c.ctx;
    x.stream = S(kComm);
    return x;
  }
  Status Handoff(Lane a, Lane b) { return lanes->Handoff(a, b); }
};

#define JCOCCL_STEP(expr)                       \
  do {                                          \
    if (!r.dry()) JCOCCL_RETURN_IF_ERROR(expr); \
  } while (0)

inline const uint8_t* At(const void* p, int64_t off) {
  return static_cast<const uint8_t*>(p) + off;
}
inline uint8_t* At(void* p, int64_t off) { return static_cast<uint8_t*>(p) + off; }

// Reduce-scatter of `rows` = comm size rows of m elements: encode, all_to_all, decode_sum.
inline Status ReduceScatterSlice(Runner& r, Codec* cd, Transport* t, const void* x, int64_t m,
                                 void* out) {
  const int n = t->size();
  const int64_t P = cd->Payload(m);
  uint8_t* enc = r.arena.Take(n * P);
  uint8_t* got = r.arena.Take(n * P);
  JCOCCL_STEP(cd->EncodeRows(r.S(kEncode), x, n, m, enc));
  JCOCCL_STEP(r.Handoff(kEncode, kComm));
  JCOCCL_STEP(t->AllToAll(r.Ctx(), enc, P, got));
  JCOCCL_STEP(r.Handoff(kComm, kDecode));
  JCOCCL_STEP(cd->DecodeSum(r.S(kDecode), got, n, m, out));
  return Status::Ok();
}

// One-shot all-reduce of m elements: encode, all_gather, decode_sum. `x` is read on
// `in_lane` (the encode lane for call inputs; the decode lane for intermediate results).
inline Status AllReduceSlice(Runner& r, Codec* cd, Transport* t, const void* x, int64_t m,
                             void* out, Lane in_lane) {
  const int n = t->size();
  const int64_t P = cd->Payload(m);
  uint8_t* enc = r.arena.Take(P);
  uint8_t* got = r.arena.Take(n * P);
  JCOCCL_STEP(cd->EncodeRows(r.S(in_lane), x, 1, m, enc));
  JCOCCL_STEP(r.Handoff(in_lane, kComm));
  JCOCCL_STEP(t->AllGather(r.Ctx(), enc, P, got));
  JCOCCL_STEP(r.Handoff(kComm, kDecode));
  JCOCCL_STEP(cd->DecodeSum(r.S(kDecode), got, n, m, out));
  return Status::Ok();
}

// All-gather of m elements: encode (on in_lane), all_gather, decode every row.
inline Status AllGatherSlice(Runner& r, Codec* cd, Transport* t, const void* x, int64_t m,
                             void* out, Lane in_lane) {
  const int n = t->size();
  const int64_t P = cd->Payload(m);
  uint8_t* enc = r.arena.Take(P);
  uint8_t* got = r.arena.Take(n * P);
  JCOCCL_STEP(cd->EncodeRows(r.S(in_lane), x, 1, m, enc));
  JCOCCL_STEP(r.Handoff(in_lane, kComm));
  JCOCCL_STEP(t->AllGather(r.Ctx(), enc, P, got));
  JCOCCL_STEP(r.Handoff(kComm, kDecode));
  JCOCCL_STEP(cd->DecodeRows(r.S(kDecode), got, n, m, out));
  return Status::Ok();
}

inline Status TwoShotSlice(Runner& r, Codec* cd, Transport* t, const void* x, int64_t m,
                           void* out) {
  const int n = t->size();
  const int64_t P = cd->Payload(m);
  uint8_t* enc = r.arena.Take(n * P);
  uint8_t* got = r.arena.Take(n * P);
  uint8_t* mine = r.arena.Take(P);
  uint8_t* all = r.arena.Take(n * P);
  JCOCCL_STEP(cd->EncodeRows(r.S(kEncode), x, n, m, enc));
  JCOCCL_STEP(r.Handoff(kEncode, kComm));
  JCOCCL_STEP(t->AllToAll(r.Ctx(), enc, P, got));
  JCOCCL_STEP(r.Handoff(kComm, kDecode));
  // The reduced shard is re-encoded once; every rank (this one included) decodes the
  // same gathered payloads, so all ranks end with identical bits.
  JCOCCL_STEP(cd->DecodeSumEncode(r.S(kDecode), got, n, m, mine));
  JCOCCL_STEP(r.Handoff(kDecode, kComm));
  JCOCCL_STEP(t->AllGather(r.Ctx(), mine, P, all));
  JCOCCL_STEP(r.Handoff(kComm, kDecode));
  JCOCCL_STEP(cd->DecodeRows(r.S(kDecode), all, n, m, out));
  return Status::Ok();
}

// Hierarchical: reduce-scatter over the inner group, one-shot all-reduce of the shard over
// the outer group (outer codec), all-gather over the inner group (inner codec).
inline Status HierarchicalSlice(Runner& r, const void* x, int64_t m, void* out) {
  Codec* ci = r.c.codec;
  Codec* co = r.c.outer_codec;
  uint8_t* shard = r.arena.Take(m * ci->ElemBytes());
  uint8_t* reduced = r.arena.Take(m * ci->ElemBytes());
  JCOCCL_RETURN_IF_ERROR(ReduceScatterSlice(r, ci, r.c.comm, x, m, shard));
  JCOCCL_RETURN_IF_ERROR(AllReduceSlice(r, co, r.c.outer_comm, shard, m, reduced, kDecode));
  JCOCCL_RETURN_IF_ERROR(AllGatherSlice(r, ci, r.c.comm, reduced, m, out, kDecode));
  return Status::Ok();
}

inline Status PpermuteSlice(Runner& r, const void* x, int64_t m, void* out) {
  Codec* cd = r.c.codec;
  const int64_t P = cd->Payload(m);
  uint8_t* enc = r.arena.Take(P);
  uint8_t* got = r.arena.Take(P);
  JCOCCL_STEP(cd->EncodeRows(r.S(kEncode), x, 1, m, enc));
  JCOCCL_STEP(r.Handoff(kEncode, kComm));
  JCOCCL_STEP(r.c.comm->SendRecv(r.Ctx(), enc, r.c.send_to, got, r.c.recv_from, P));
  JCOCCL_STEP(r.Handoff(kComm, kDecode));
  if (r.c.recv_from >= 0) {
    JCOCCL_STEP(cd->DecodeRows(r.S(kDecode), got, 1, m, out));
  } else {
    JCOCCL_STEP(r.lanes->Zero(kDecode, out, m * cd->ElemBytes()));
  }
  return Status::Ok();
}

inline const float* F32(const uint8_t* p) { return reinterpret_cast<const float*>(p); }
inline float* F32(uint8_t* p) { return reinterpret_cast<float*>(p); }

// The identity codec (kind none) through the transport's own collectives: no encode, no
// workspace, no decode, so the call costs what the transport's op costs (on GPU: NCCL's
// ncclAllReduce / ncclReduceScatter / ncclAllGather / grouped send-recv). Sums take this
// path for float32 only: a 16-bit NCCL sum rounds at every hop, where the engine's fold
// rounds once. The host transport folds in rank order, as DecodeSum does, so on CPU the
// bits are those of the codec path; NCCL sums in its own order (the same bits on every rank).
inline bool IdentityFastPath(const Call& c) {
  const CodecSpec& sp = c.codec->spec();
  if (sp.kind != codecs::Kind::kNone || sp.hadamard != 0 || sp.spike != 0) return false;
  switch (c.op) {
    case Op::kAllReduceOneShot:
    case Op::kAllReduceTwoShot:
    case Op::kReduceScatter:
      return c.codec->dtype() == DType::kF32;
    case Op::kAllGather:
    case Op::kAllToAll:
    case Op::kPpermute:
      return true;
    default:
      return false;
  }
}

inline Status RunIdentity(Runner& r) {
  const Call& c = r.c;
  const int n = c.comm->size();
  const int64_t eb = c.codec->ElemBytes();
  switch (c.op) {
    case Op::kAllReduceOneShot:  // the k slices are contiguous: one call
    case Op::kAllReduceTwoShot: {
      const int64_t count = c.k * (c.op == Op::kAllReduceTwoShot ? n : 1) * c.m;
      JCOCCL_STEP(c.comm->AllReduceSum(r.Ctx(), F32(At(c.x, 0)), count, F32(At(c.out, 0))));
      return Status::Ok();
    }
    default:
      break;
  }
  for (int64_t s = 0; s < c.k; ++s) {
    switch (c.op) {
      case Op::kReduceScatter:
        JCOCCL_STEP(c.comm->ReduceScatterSum(r.Ctx(), F32(At(c.x, s * n * c.m * eb)), c.m,
                                             F32(At(c.out, s * c.m * eb))));
        break;
      case Op::kAllGather:
        JCOCCL_STEP(c.comm->AllGather(r.Ctx(), At(c.x, s * c.m * eb), c.m * eb,
                                      At(c.out, s * n * c.m * eb)));
        break;
      case Op::kAllToAll:
        JCOCCL_STEP(c.comm->AllToAll(r.Ctx(), At(c.x, s * n * c.m * eb), c.m * eb,
                                     At(c.out, s * n * c.m * eb)));
        break;
      case Op::kPpermute:
        JCOCCL_STEP(c.comm->SendRecv(r.Ctx(), At(c.x, s * c.m * eb), c.send_to,
                                     At(c.out, s * c.m * eb), c.recv_from, c.m * eb));
        if (c.recv_from < 0) JCOCCL_STEP(r.lanes->Zero(kComm, At(c.out, s * c.m * eb), c.m * eb));
        break;
      default:
        return Status::Error("jcoccl fused: no identity path for op " + std::to_string(int(c.op)));
    }
  }
  return Status::Ok();
}

inline Status RunAll(Runner& r) {
  const Call& c = r.c;
  if (IdentityFastPath(c)) return RunIdentity(r);
  const int n = c.comm->size();
  const int64_t eb = c.codec->ElemBytes();
  for (int64_t s = 0; s < c.k; ++s) {
    switch (c.op) {
      case Op::kAllReduceOneShot:
        JCOCCL_RETURN_IF_ERROR(AllReduceSlice(r, c.codec, c.comm, At(c.x, s * c.m * eb), c.m,
                                              At(c.out, s * c.m * eb), kEncode));
        break;
      case Op::kAllReduceTwoShot:
        JCOCCL_RETURN_IF_ERROR(TwoShotSlice(r, c.codec, c.comm, At(c.x, s * n * c.m * eb), c.m,
                                            At(c.out, s * n * c.m * eb)));
        break;
      case Op::kAllReduceHierarchical:
        JCOCCL_RETURN_IF_ERROR(
            HierarchicalSlice(r, At(c.x, s * n * c.m * eb), c.m, At(c.out, s * n * c.m * eb)));
        break;
      case Op::kReduceScatter:
        JCOCCL_RETURN_IF_ERROR(ReduceScatterSlice(r, c.codec, c.comm, At(c.x, s * n * c.m * eb),
                                                  c.m, At(c.out, s * c.m * eb)));
        break;
      case Op::kAllGather:
        JCOCCL_RETURN_IF_ERROR(AllGatherSlice(r, c.codec, c.comm, At(c.x, s * c.m * eb), c.m,
                                              At(c.out, s * n * c.m * eb), kEncode));
        break;
      case Op::kAllToAll: {
        const int64_t P = c.codec->Payload(c.m);
        uint8_t* enc = r.arena.Take(n * P);
        uint8_t* got = r.arena.Take(n * P);
        JCOCCL_STEP(c.codec->EncodeRows(r.S(kEncode), At(c.x, s * n * c.m * eb), n, c.m, enc));
        JCOCCL_STEP(r.Handoff(kEncode, kComm));
        JCOCCL_STEP(c.comm->AllToAll(r.Ctx(), enc, P, got));
        JCOCCL_STEP(r.Handoff(kComm, kDecode));
        JCOCCL_STEP(c.codec->DecodeRows(r.S(kDecode), got, n, c.m, At(c.out, s * n * c.m * eb)));
        break;
      }
      case Op::kPpermute:
        JCOCCL_RETURN_IF_ERROR(
            PpermuteSlice(r, At(c.x, s * c.m * eb), c.m, At(c.out, s * c.m * eb)));
        break;
      case Op::kPlainAllReduce:
        JCOCCL_STEP(c.comm->AllReduceSum(r.Ctx(), F32(At(c.x, s * c.m * eb)), c.m,
                                         F32(At(c.out, s * c.m * eb))));
        break;
      case Op::kPlainReduceScatter:
        JCOCCL_STEP(c.comm->ReduceScatterSum(r.Ctx(), F32(At(c.x, s * n * c.m * eb)), c.m,
                                             F32(At(c.out, s * c.m * eb))));
        break;
      case Op::kPlainAllGather:
        JCOCCL_STEP(c.comm->AllGather(r.Ctx(), At(c.x, s * c.m * eb), c.m * eb,
                                      At(c.out, s * n * c.m * eb)));
        break;
      default:
        return Status::Error("jcoccl fused: unknown op " + std::to_string(int(c.op)));
    }
  }
  return Status::Ok();
}

#undef JCOCCL_STEP

}  // namespace detail

inline int64_t WorkspaceBytes(const Call& c) {
  detail::Runner r{c, nullptr, Arena(nullptr, 0)};
  (void)detail::RunAll(r);
  return r.arena.used();
}

inline Status Run(const Call& c, Lanes* lanes, uint8_t* ws, int64_t ws_bytes) {
  if (c.codec == nullptr || c.comm == nullptr) return Status::Error("jcoccl fused: no codec/comm");
  if (c.op == Op::kAllReduceHierarchical && (c.outer_codec == nullptr || c.outer_comm == nullptr))
    return Status::Error("jcoccl fused: hierarchical all_reduce needs an outer communicator");
  if ((c.op == Op::kPlainAllReduce || c.op == Op::kPlainReduceScatter) &&
      c.codec->dtype() != DType::kF32)
    return Status::Error("jcoccl fused: plain all_reduce / reduce_scatter sum float32 only");
  const int64_t need = WorkspaceBytes(c);
  if (need > ws_bytes) {
    return Status::Error("jcoccl fused: workspace of " + std::to_string(ws_bytes) +
                         " bytes is smaller than the " + std::to_string(need) + " needed");
  }
  detail::Runner r{c, lanes, Arena(ws, ws_bytes)};
  return detail::RunAll(r);
}

}  // namespace jcoccl::engine
