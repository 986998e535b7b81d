// CUDA fused collectives: the engine (engine/engine.h) over NCCL, one XLA custom call per
// collective. Work runs on three streams per device -- encode, communicate (high
// priority) and decode -- ordered by events, so slice s+1's encode overlaps slice s's
// communication (COCCL-style pipeline, depth = the number of slices `k`). The workspace
// for in-flight payloads is an extra output of the custom call: FFI scratch memory would be
// released when the handler returns, before the streams are done with it.
//
// The handler never waits on the host: it joins XLA's stream into the lanes, enqueues the
// engine's work, joins the lanes back into XLA's stream and returns. A lost peer is the
// communicator's watchdog's business (transport/nccl.h: NcclTransport::Watch), and the next
// call on that communicator reports it.
//
// CUDA graphs: not capture-safe, and XLA is told so (no kCmdBufferCompatible trait, so XLA
// never records the call into a command buffer): NCCL calls inside XLA's CUDA graphs fail,
// and the watchdog needs an event per executed call, which a replayed graph would not give.
// A handler that finds XLA's stream capturing anyway refuses with an error saying so.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/ffi_call.h"
#include "engine/platform_codec.h"
#include "gpu/platform.h"
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
    for (cudaEvent_t* e : {&ds->ev[0], &ds->ev[1], &ds->ev[2], &ds->ev[3]}) {
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

Status RunGpu(cudaStream_t xla, Resolved& r, int device, ffi::AnyBuffer x,
              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws) {
  JCOCCL_RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "set device"));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JCOCCL_RETURN_IF_ERROR(Cuda(cudaStreamIsCapturing(xla, &capture), "capture status"));
  if (capture != cudaStreamCaptureStatusNone)
    return Status::Error(
        "jcoccl fused: XLA's stream is being captured into a CUDA graph; the fused engine is "
        "not capture-safe (NCCL inside XLA's command buffers, per-call watchdog events). Run "
        "it outside CUDA graphs (XLA_FLAGS=--xla_gpu_enable_command_buffer= disables XLA's)");
  Call& c = r.call;
  std::vector<transport::NcclTransport*> comms;
  for (Transport* t : {c.comm, c.outer_comm}) {
    if (t == nullptr) continue;
    comms.push_back(static_cast<transport::NcclTransport*>(t));
    // A communicator the watchdog aborted fails here, before anything is enqueued.
    JCOCCL_RETURN_IF_ERROR(comms.back()->Healthy());
  }
  DeviceStreams* ds = nullptr;
  JCOCCL_RETURN_IF_ERROR(StreamsFor(device, &ds));
  PlatformCodec<codecs::CudaPlatform> codec(r.spec, r.dtype);
  PlatformCodec<codecs::CudaPlatform> outer(r.outer_spec, r.dtype);
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
  // Each communicator's watchdog learns when this call's work is done (a failed call's too:
  // what it queued before failing may wait for peers); nothing waits here.
  for (transport::NcclTransport* t : comms) {
    Status w = t->Watch(xla, c.ctx.timeout_s);
    if (s.ok()) s = w;
  }
  return s;
}

ffi::Error FusedGpuImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws,
                        ffi::Dictionary attrs) {
  Resolved r;
  if (ffi::Error e = ResolveCall(attrs, run_id, device, x, *out, &r); e.failure()) return e;
  Status s = RunGpu(stream, r, device, x, out, ws);
  if (!s.ok()) return Fail(s.msg);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jcoccl::engine

// Not kCmdBufferCompatible (see the top): the macro declares no traits.
JCOCCL_DEFINE_FUSED_HANDLER(JcocclFusedGpu, jcoccl::engine::FusedGpuImpl,
                            ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>());
