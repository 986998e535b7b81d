// CUDA fused collectives: the engine (engine/engine.h) over NCCL, one XLA custom call per
// collective. Work runs on three streams per device -- encode, communicate (high
// priority) and decode -- ordered by events, so slice s+1's encode overlaps slice s's
// communication (COCCL-style pipeline, depth = the number of slices `k`). The workspace
// for in-flight payloads is an extra output of the custom call: FFI scratch memory would be
// released when the handler returns, before the streams are done with it.
//
// Not command-buffer compatible (NCCL must not be captured into XLA's CUDA graphs).
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "codecs/codec_cuda.h"
#include "codecs/plugin.h"
#include "engine/ffi_call.h"
#include "registry.h"
#include "transport/nccl.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jcoccl::engine {
namespace {

Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("jcoccl CUDA ") + what + ": " + cudaGetErrorString(e));
}

// The three lanes of one device and the events that order them, created once per device
// (never inside a collective's communication, and without any peer involvement). Events
// are reused: cudaStreamWaitEvent waits for the record that precedes it, so re-recording
// an event after the wait is enqueued is safe; `mu` keeps each record + wait pair together
// when several threads drive the same device.
constexpr int kXlaSource = 3;  // ev[] slot of XLA's stream (after the three lanes)

struct DeviceStreams {
  cudaStream_t s[3] = {nullptr, nullptr, nullptr};
  cudaEvent_t ev[4] = {nullptr, nullptr, nullptr, nullptr};  // one per source stream
  cudaEvent_t done = nullptr;                                // completion of a call
  std::mutex mu;
};

Status StreamsFor(int device, DeviceStreams** out) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<DeviceStreams>> table;
  std::lock_guard<std::mutex> lk(mu);
  if (device >= static_cast<int>(table.size())) table.resize(device + 1);
  if (!table[device]) {
    auto ds = std::make_unique<DeviceStreams>();
    int lo = 0, hi = 0;
    JCOCCL_RETURN_IF_ERROR(Cuda(cudaDeviceGetStreamPriorityRange(&lo, &hi), "priority range"));
    JCOCCL_RETURN_IF_ERROR(
        Cuda(cudaStreamCreateWithPriority(&ds->s[kEncode], cudaStreamNonBlocking, lo), "stream"));
    JCOCCL_RETURN_IF_ERROR(
        Cuda(cudaStreamCreateWithPriority(&ds->s[kComm], cudaStreamNonBlocking, hi), "stream"));
    JCOCCL_RETURN_IF_ERROR(
        Cuda(cudaStreamCreateWithPriority(&ds->s[kDecode], cudaStreamNonBlocking, lo), "stream"));
    for (cudaEvent_t* e : {&ds->ev[0], &ds->ev[1], &ds->ev[2], &ds->ev[3], &ds->done}) {
      JCOCCL_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "event"));
    }
    table[device] = std::move(ds);
  }
  *out = table[device].get();
  return Status::Ok();
}

// Makes `to` wait for everything enqueued on `from` so far; `source` picks the event
// (a lane, or kXlaSource).
Status StreamWait(DeviceStreams* ds, int source, cudaStream_t from, cudaStream_t to) {
  std::lock_guard<std::mutex> lk(ds->mu);
  JCOCCL_RETURN_IF_ERROR(Cuda(cudaEventRecord(ds->ev[source], from), "event record"));
  return Cuda(cudaStreamWaitEvent(to, ds->ev[source], 0), "stream wait");
}

class GpuLanes final : public Lanes {
 public:
  explicit GpuLanes(DeviceStreams* ds) : ds_(ds) {}
  void* stream(Lane l) override { return ds_->s[l]; }
  Status Handoff(Lane from, Lane to) override {
    if (from == to) return Status::Ok();
    return StreamWait(ds_, from, ds_->s[from], ds_->s[to]);
  }
  Status Zero(Lane l, void* p, int64_t bytes) override {
    return Cuda(cudaMemsetAsync(p, 0, bytes, ds_->s[l]), "memset");
  }

 private:
  DeviceStreams* ds_;
};

class GpuCodec final : public Codec {
 public:
  using Codec::Codec;
  Status EncodeRows(void* s, const void* x, int64_t rows, int64_t n, uint8_t* out) override {
    if (Plugin()) return Of(codecs::PluginEncodeCuda(spec_, dtype_, x, rows, n, out, s));
    return Cuda(codecs::EncodeRowsCuda(spec_, dtype_, x, rows, n, out, St(s)), "encode");
  }
  Status DecodeRows(void* s, const uint8_t* in, int64_t rows, int64_t n, void* out) override {
    if (Plugin()) return Of(codecs::PluginDecodeCuda(spec_, dtype_, in, rows, n, out, s));
    return Cuda(codecs::DecodeRowsCuda(spec_, dtype_, in, rows, n, out, St(s)), "decode");
  }
  Status DecodeSum(void* s, const uint8_t* in, int nrows, int64_t n, void* out) override {
    if (Plugin())
      return Of(codecs::PluginDecodeSumCuda(spec_, dtype_, in, nrows, Payload(n), 1, n, out, s));
    return Cuda(codecs::DecodeSumCuda(spec_, dtype_, in, nrows, Payload(n), n, out, St(s)),
                "decode_sum");
  }
  Status DecodeSumEncode(void* s, const uint8_t* in, int nrows, int64_t n, uint8_t* out) override {
    if (Plugin())
      return Of(
          codecs::PluginDecodeSumEncodeCuda(spec_, dtype_, in, nrows, Payload(n), 1, n, out, s));
    return Cuda(codecs::DecodeSumEncodeCuda(spec_, dtype_, in, nrows, Payload(n), n, out, St(s)),
                "decode_sum_encode");
  }

 private:
  bool Plugin() const { return spec_.kind == codecs::Kind::kPlugin; }
  static Status Of(const std::string& e) { return e.empty() ? Status::Ok() : Status::Error(e); }
  static cudaStream_t St(void* s) { return static_cast<cudaStream_t>(s); }
};

// `wait` is the call's nccl_wait attribute (jcoccl.config's nccl_wait, JCOCCL_NCCL_WAIT):
// true (the default) waits for completion, polling NCCL's asynchronous error, and aborts
// the communicator after the call's timeout_s; false returns as soon as the work is
// enqueued (fully asynchronous, but a lost peer then hangs the stream).
Status RunGpu(cudaStream_t xla, Resolved& r, int device, ffi::AnyBuffer x,
              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws, bool wait) {
  JCOCCL_RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "set device"));
  DeviceStreams* ds = nullptr;
  JCOCCL_RETURN_IF_ERROR(StreamsFor(device, &ds));
  GpuCodec codec(r.spec, r.dtype);
  GpuCodec outer(r.outer_spec, r.dtype);
  Call& c = r.call;
  c.x = x.untyped_data();
  c.out = out->untyped_data();
  c.codec = &codec;
  c.outer_codec = c.op == Op::kAllReduceHierarchical ? &outer : nullptr;
  GpuLanes lanes(ds);
  // Inputs are ready on XLA's stream.
  Status s = Status::Ok();
  for (int l = 0; l < 3 && s.ok(); ++l) s = StreamWait(ds, kXlaSource, xla, ds->s[l]);
  if (s.ok()) {
    s = Run(c, &lanes, static_cast<uint8_t*>(ws->untyped_data()),
            static_cast<int64_t>(ws->size_bytes()));
  }
  // Join every lane back into XLA's stream on every path, a failed one included: XLA may
  // free or reuse the buffers once its stream passes this point, so whatever the lanes
  // have queued must come before it.
  for (int l = 0; l < 3; ++l) {
    Status j = StreamWait(ds, l, ds->s[l], xla);
    if (s.ok()) s = j;
  }
  if (!s.ok() || !wait) return s;
  {
    std::lock_guard<std::mutex> lk(ds->mu);
    s = Cuda(cudaEventRecord(ds->done, xla), "event record");
  }
  // Another call on this device may re-record `done` meanwhile: this one then waits for
  // later work too, which is longer but never wrong.
  for (Transport* t : {c.comm, c.outer_comm}) {
    if (s.ok() && t != nullptr)
      s = static_cast<transport::NcclTransport*>(t)->Wait(ds->done, c.ctx.timeout_s);
  }
  return s;
}

ffi::Error FusedGpuImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws,
                        ffi::Dictionary attrs) {
  if (x.element_type() != out->element_type())
    return ffi::Error::InvalidArgument("jcoccl fused: output dtype must equal the input dtype");
  Resolved r;
  if (ffi::Error e =
          Resolve(attrs, device, x.element_type(), x.element_count(), out->element_count(), &r);
      e.failure())
    return e;
  auto wait = Attr<bool>(attrs, "nccl_wait");
  if (wait.has_error()) return wait.error();
  r.call.ctx.run_id = run_id.run_id;
  Status s = RunGpu(stream, r, device, x, out, ws, *wait);
  if (!s.ok()) return Fail(s.msg);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jcoccl::engine

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclFusedGpu, jcoccl::engine::FusedGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs());
// One handler, one target name per collective (the "op" attribute picks the algorithm).
JCOCCL_REGISTER_HANDLER(JcocclFusedGpu, "jcoccl_fused_all_reduce", "jcoccl_fused_reduce_scatter",
                        "jcoccl_fused_all_gather", "jcoccl_fused_all_to_all",
                        "jcoccl_fused_ppermute");
