// CPU fused collectives: the engine (engine/engine.h) over the in-process host transport,
// one XLA custom call per collective. Each XLA CPU device runs its program on its own
// thread, so the ranks of a group meet inside the host transport's rendezvous.
#include <cstring>

#include "cpu/platform.h"
#include "engine/ffi_call.h"
#include "engine/platform_codec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jcoccl::engine {
namespace {

class CpuLanes final : public Lanes {
 public:
  void* stream(Lane) override { return nullptr; }
  Status Handoff(Lane, Lane) override { return Status::Ok(); }
  Status Zero(Lane, void* p, int64_t bytes) override {
    std::memset(p, 0, bytes);
    return Status::Ok();
  }
};

ffi::Error FusedImpl(ffi::RunId run_id, int32_t device, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws,
                     ffi::Dictionary attrs) {
  Resolved r;
  if (ffi::Error e = ResolveCall(attrs, run_id, device, x, *out, &r); e.failure()) return e;
  PlatformCodec<codecs::CpuPlatform> codec(r.spec, r.dtype);
  PlatformCodec<codecs::CpuPlatform> outer(r.outer_spec, r.dtype);
  Call& c = r.call;
  c.x = x.untyped_data();
  c.out = out->untyped_data();
  c.codec = &codec;
  c.outer_codec = c.op == Op::kAllReduceHierarchical ? &outer : nullptr;
  CpuLanes lanes;
  Status s = Run(c, &lanes, static_cast<uint8_t*>(ws->untyped_data()),
                 static_cast<int64_t>(ws->size_bytes()));
  if (!s.ok()) return Fail(s.msg);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jcoccl::engine

JCOCCL_DEFINE_FUSED_HANDLER(JcocclFusedCpu, jcoccl::engine::FusedImpl, ffi::Ffi::Bind());
