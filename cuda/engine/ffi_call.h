// Shared by the CPU and CUDA fused handlers: reads a fused call's attributes.
//
// Attributes (Python: jcoccl/_src/engine/fused_ffi.py):
//   op: int32 (engine::Op; 7-9 are the plain uncompressed ops), k: int64 slices,
//   m: int64 row length, comm: int64 id, timeout_s: float64 seconds a rank waits for its
//   peers (jcoccl.config's timeout_s),
//   outer_comm: int64 id (hierarchical; else -1), perm: int32[size] destination of each
//   rank or -1 (ppermute; else empty), codec: the codec descriptor (a dictionary,
//   codecs/descriptor.h), and outer: the outer codec's (hierarchical only).
#pragma once
#include <memory>
#include <string>
#include <utility>

#include "codecs/ffi_attrs.h"
#include "engine/comms.h"
#include "engine/engine.h"
#include "registry.h"

namespace jcoccl::engine {

namespace ffi = xla::ffi;

template <class T>
inline ffi::ErrorOr<T> Attr(const ffi::Dictionary& a, const std::string& name) {
  auto v = a.get<T>(name);
  if (v.has_error()) return ffi::Unexpected(v.error());
  return *v;
}

// The outer codec of a hierarchical all-reduce, from the "outer" attribute.
inline ffi::ErrorOr<CodecSpec> OuterSpec(const ffi::Dictionary& a) {
  return codecs::SpecFromAttrs(a, "outer", "jcoccl outer codec: ");
}

// Codec stand-in for sizing: the engine only asks it for payload sizes.
class SizingCodec final : public Codec {
 public:
  using Codec::Codec;
  Status EncodeRows(void*, const void*, int64_t, int64_t, uint8_t*) override { return Err(); }
  Status DecodeRows(void*, const uint8_t*, int64_t, int64_t, void*) override { return Err(); }
  Status DecodeSum(void*, const uint8_t*, int, int64_t, void*) override { return Err(); }
  Status DecodeSumEncode(void*, const uint8_t*, int, int64_t, uint8_t*) override { return Err(); }

 private:
  static Status Err() { return Status::Error("sizing codec cannot run"); }
};

// The workspace bytes of a fused call, from a dry run of the engine over size-only
// transports: what the dry run in Python (fused_workspace_bytes) asks before it binds the
// call, and what the handler's engine then checks its workspace against (WorkspaceBytes).
inline int64_t FusedWorkspaceBytes(Op op, int64_t k, int64_t m, int size, int outer_size,
                                   const CodecSpec& spec, const CodecSpec& outer, DType dtype) {
  SizingCodec c(spec, dtype), oc(outer_size > 0 ? outer : CodecSpec{}, dtype);
  SizeOnlyTransport t(size), ot(outer_size > 0 ? outer_size : 1);
  Call call;
  call.op = op;
  call.k = k;
  call.m = m;
  call.codec = &c;
  call.comm = &t;
  call.outer_codec = &oc;
  call.outer_comm = &ot;
  return WorkspaceBytes(call);
}

inline ffi::Error Fail(const std::string& msg) { return ffi::Error::Internal(msg); }

// Everything a handler resolves before running the engine.
struct Resolved {
  Call call;
  CodecSpec spec, outer_spec;
  DType dtype = DType::kF32;
  std::shared_ptr<Transport> comm, outer_comm;
};

// Reads attributes, looks up this device's communicators, checks the buffer sizes.
inline ffi::Error Resolve(const ffi::Dictionary& a, int32_t device, ffi::DataType in_type,
                          int64_t in_elems, int64_t out_elems, Resolved* r) {
  auto op = Attr<int32_t>(a, "op");
  auto k = Attr<int64_t>(a, "k");
  auto m = Attr<int64_t>(a, "m");
  auto comm = Attr<int64_t>(a, "comm");
  if (op.has_error()) return op.error();
  if (k.has_error()) return k.error();
  if (m.has_error()) return m.error();
  if (comm.has_error()) return comm.error();
  if (!codecs::DTypeFromFfi(in_type, &r->dtype))
    return ffi::Error::InvalidArgument("jcoccl fused: dtype must be float32, bfloat16 or float16");
  auto spec = codecs::SpecFromAttrs(a);
  if (spec.has_error()) return spec.error();
  r->spec = *spec;
  Call& c = r->call;
  // Checked before any rank waits on another: an invalid value fails every rank alike
  // instead of leaving peers waiting.
  auto timeout = Attr<double>(a, "timeout_s");
  if (timeout.has_error()) return timeout.error();
  if (!transport::CheckTimeoutSeconds(*timeout, &c.ctx.timeout_s))
    return ffi::Error::InvalidArgument(
        "jcoccl fused: timeout_s must be a positive number of seconds, got " +
        std::to_string(*timeout));
  c.op = static_cast<Op>(*op);
  c.k = *k;
  c.m = *m;
  r->comm = Comms().Find(*comm, device);
  if (!r->comm) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jcoccl fused: device " + std::to_string(device) + " has no communicator " +
                          std::to_string(*comm) +
                          "; call jcoccl.init(mesh) before using backend='fused'");
  }
  c.comm = r->comm.get();
  const int n = c.comm->size();
  if (c.m <= 0 || c.k <= 0 || c.m % codecs::Granule(r->spec) != 0)
    return ffi::Error::InvalidArgument(
        "jcoccl fused: m must be a positive multiple of the granule");
  int64_t in_rows = 1, out_rows = 1;
  switch (c.op) {
    case Op::kAllReduceOneShot:
    case Op::kPpermute:
    case Op::kPlainAllReduce:
      break;
    case Op::kAllReduceTwoShot:
    case Op::kAllReduceHierarchical:
    case Op::kAllToAll:
      in_rows = out_rows = n;
      break;
    case Op::kReduceScatter:
    case Op::kPlainReduceScatter:
      in_rows = n;
      break;
    case Op::kAllGather:
    case Op::kPlainAllGather:
      out_rows = n;
      break;
    default:
      return ffi::Error::InvalidArgument("jcoccl fused: unknown op");
  }
  if ((c.op == Op::kPlainAllReduce || c.op == Op::kPlainReduceScatter) && r->dtype != DType::kF32)
    return ffi::Error::InvalidArgument(
        "jcoccl fused: plain all_reduce / reduce_scatter take float32 only");
  if (in_elems != c.k * in_rows * c.m || out_elems != c.k * out_rows * c.m)
    return ffi::Error::InvalidArgument(
        "jcoccl fused: buffer sizes do not match k, m and the group size");
  if (c.op == Op::kAllReduceHierarchical) {
    auto oc = Attr<int64_t>(a, "outer_comm");
    if (oc.has_error()) return oc.error();
    r->outer_comm = Comms().Find(*oc, device);
    if (!r->outer_comm)
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "jcoccl fused: device " + std::to_string(device) +
                            " has no outer communicator " + std::to_string(*oc));
    auto os = OuterSpec(a);
    if (os.has_error()) return os.error();
    r->outer_spec = *os;
    if (c.m % codecs::Granule(r->outer_spec) != 0)
      return ffi::Error::InvalidArgument("jcoccl fused: m must be a multiple of the outer granule");
    c.outer_comm = r->outer_comm.get();
  }
  if (c.op == Op::kPpermute) {
    auto perm = a.get<ffi::Span<const int32_t>>("perm");
    if (perm.has_error()) return perm.error();
    if (static_cast<int64_t>(perm->size()) != n)
      return ffi::Error::InvalidArgument("jcoccl fused: perm must have one entry per rank");
    const int me = c.comm->rank();
    c.send_to = (*perm)[me];
    for (int s = 0; s < n; ++s)
      if ((*perm)[s] == me) c.recv_from = s;
  }
  return ffi::Error::Success();
}

// Resolve for a fused handler's buffers: x and out of one dtype, and the call's run id.
inline ffi::Error ResolveCall(const ffi::Dictionary& a, ffi::RunId run_id, int32_t device,
                              const ffi::AnyBuffer& x, const ffi::AnyBuffer& out, Resolved* r) {
  if (x.element_type() != out.element_type())
    return ffi::Error::InvalidArgument("jcoccl fused: output dtype must equal the input dtype");
  if (ffi::Error e =
          Resolve(a, device, x.element_type(), x.element_count(), out.element_count(), r);
      e.failure())
    return e;
  r->call.ctx.run_id = run_id.run_id;
  return ffi::Error::Success();
}

}  // namespace jcoccl::engine

namespace jcoccl::engine {

// A fused handler's binding: `b` (the platform's context: ffi::Ffi::Bind(), or with XLA's
// stream first), then what every fused handler takes: run id, device, x, out, workspace and
// the attributes.
template <class B>
auto FusedBinding(B b) {
  return std::move(b)
      .template Ctx<ffi::RunId>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .Attrs();
}

}  // namespace jcoccl::engine

// Defines the fused handler symbol `Name` over `Impl`, bound as FusedBinding(binding) with no
// traits, and registers it under every fused target name (one handler for all collectives:
// the "op" attribute picks the algorithm).
#define JCOCCL_DEFINE_FUSED_HANDLER(Name, Impl, binding)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, Impl, ::jcoccl::engine::FusedBinding(binding), {}); \
  JCOCCL_REGISTER_HANDLER(Name, "jcoccl_fused_all_reduce", "jcoccl_fused_reduce_scatter", \
                          "jcoccl_fused_all_gather", "jcoccl_fused_all_to_all",           \
                          "jcoccl_fused_ppermute")
