// CPU fused collectives: the engine (engine/engine.h) over the in-process host transport,
// one XLA custom call per collective. Each XLA CPU device runs its program on its own
// thread, so the ranks of a group meet inside the host transport's rendezvous.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codecs/codec.h"
#include "codecs/plugin.h"
#include "engine/ffi_call.h"
#include "registry.h"
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

class CpuCodec final : public Codec {
 public:
  using Codec::Codec;
  Status EncodeRows(void*, const void* x, int64_t rows, int64_t n, uint8_t* out) override {
    if (spec_.kind == codecs::Kind::kPlugin)
      return Of(codecs::PluginEncodeCpu(spec_, dtype_, x, rows, n, out));
    const int64_t P = Payload(n), rb = n * ElemBytes();
    for (int64_t r = 0; r < rows; ++r)
      codecs::EncodeRowCpu(spec_, dtype_, static_cast<const uint8_t*>(x) + r * rb, n, out + r * P);
    return Status::Ok();
  }
  Status DecodeRows(void*, const uint8_t* in, int64_t rows, int64_t n, void* out) override {
    if (spec_.kind == codecs::Kind::kPlugin)
      return Of(codecs::PluginDecodeCpu(spec_, dtype_, in, rows, n, out));
    const int64_t P = Payload(n), rb = n * ElemBytes();
    for (int64_t r = 0; r < rows; ++r)
      codecs::DecodeRowCpu(spec_, dtype_, in + r * P, n, static_cast<uint8_t*>(out) + r * rb);
    return Status::Ok();
  }
  Status DecodeSum(void*, const uint8_t* in, int nrows, int64_t n, void* out) override {
    std::vector<const uint8_t*> rows = Rows(in, nrows, n);
    if (spec_.kind == codecs::Kind::kPlugin)
      return Of(codecs::PluginDecodeSumCpu(spec_, dtype_, rows.data(), nrows, n, out));
    codecs::DecodeSumCpu(spec_, dtype_, rows.data(), nrows, n, out);
    return Status::Ok();
  }
  Status DecodeSumEncode(void*, const uint8_t* in, int nrows, int64_t n, uint8_t* out) override {
    std::vector<const uint8_t*> rows = Rows(in, nrows, n);
    if (spec_.kind == codecs::Kind::kPlugin)
      return Of(codecs::PluginDecodeSumEncodeCpu(spec_, dtype_, rows.data(), nrows, n, out));
    codecs::DecodeSumEncodeCpu(spec_, dtype_, rows.data(), nrows, n, out);
    return Status::Ok();
  }

 private:
  static Status Of(const std::string& e) { return e.empty() ? Status::Ok() : Status::Error(e); }
  std::vector<const uint8_t*> Rows(const uint8_t* in, int nrows, int64_t n) const {
    std::vector<const uint8_t*> rows(nrows);
    for (int r = 0; r < nrows; ++r) rows[r] = in + r * Payload(n);
    return rows;
  }
};

ffi::Error FusedImpl(ffi::RunId run_id, int32_t device, ffi::AnyBuffer x,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws,
                     ffi::Dictionary attrs) {
  Resolved r;
  if (ffi::Error e = ResolveCall(attrs, run_id, device, x, *out, &r); e.failure()) return e;
  CpuCodec codec(r.spec, r.dtype);
  CpuCodec outer(r.outer_spec, r.dtype);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclFusedCpu, jcoccl::engine::FusedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs());
// One handler, one target name per collective (the "op" attribute picks the algorithm).
JCOCCL_REGISTER_HANDLER(JcocclFusedCpu, "jcoccl_fused_all_reduce", "jcoccl_fused_reduce_scatter",
                        "jcoccl_fused_all_gather", "jcoccl_fused_all_to_all",
                        "jcoccl_fused_ppermute");
