// Runs jcoccl's CUDA FFI handlers as XLA:CPU handlers, under the host shim: an adaptor in
// front of each handler models the parts of the GPU that the handler relies on.
//
//   XLA's stream   one shim stream per device ordinal; the handler gets it from
//                  PlatformStream<cudaStream_t> (the adaptor answers the FFI API's
//                  Stream_Get, which XLA:CPU has no stream for).
//   device memory  each argument and result is a separate allocation, followed by a red
//                  zone; results start filled with 0xff bytes; arguments are copied in by
//                  work queued on XLA's stream (as if an earlier op produced them there), so
//                  a handler that reads them without waiting on XLA's stream reads 0xff.
//   the return    the NCCL emulation's return gate (nccl_emul.h) learns when the handler
//                  returned;
//   the call's end results are copied back by work queued on XLA's stream after the handler
//                  returns, and the adaptor synchronises XLA's stream: what XLA sees.
//
// Then it checks, and fails the call naming what it found:
//   - every stream of the device has finished the work queued during the call (a stream
//     that has not was never joined into XLA's stream: XLA would free or reuse the buffers
//     while it runs);
//   - no result changed after it was copied back, and no red zone was written;
//   - the thread left no NCCL group open;
//   - the shim's own findings (an event recorded again before its wait, a failed kernel,
//     misuse the NCCL emulation saw).
#pragma once

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jcoccl_emul {

constexpr size_t kRedZone = 256;
constexpr uint8_t kCanary = 0xcb;
constexpr uint8_t kPoison = 0xff;

inline size_t ElemBytes(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_S8:
    case XLA_FFI_DataType_U8:
    case XLA_FFI_DataType_PRED:
      return 1;
    case XLA_FFI_DataType_F16:
    case XLA_FFI_DataType_BF16:
    case XLA_FFI_DataType_S16:
    case XLA_FFI_DataType_U16:
      return 2;
    case XLA_FFI_DataType_F32:
    case XLA_FFI_DataType_S32:
    case XLA_FFI_DataType_U32:
      return 4;
    default:
      return 8;
  }
}

inline size_t BufferBytes(const XLA_FFI_Buffer* b) {
  size_t n = ElemBytes(b->dtype);
  for (int64_t i = 0; i < b->rank; ++i) n *= static_cast<size_t>(b->dims[i]);
  return n;
}

// XLA's stream of each device ordinal.
inline cudaStream_t XlaStream(int device) {
  static std::mutex mu;
  static auto* table = new std::map<int, cudaStream_t>();
  std::lock_guard<std::mutex> lk(mu);
  cudaStream_t& s = (*table)[device];
  if (s == nullptr) {
    const int saved = jcoccl_shim::g_device;
    jcoccl_shim::g_device = device;
    s = jcoccl_shim::NewStream(0);
    jcoccl_shim::g_device = saved;
  }
  return s;
}

inline thread_local cudaStream_t g_platform_stream = nullptr;

inline XLA_FFI_Error* StreamGet(XLA_FFI_Stream_Get_Args* args) {
  args->stream = g_platform_stream;
  return nullptr;
}

struct DeviceBuffer {
  XLA_FFI_Buffer desc;
  void* host;  // XLA's buffer
  std::vector<uint8_t> mem;
  size_t bytes;
};

inline std::string ErrorText(const XLA_FFI_Api* api, XLA_FFI_Error* e) {
  XLA_FFI_Error_GetDetails_Args a{XLA_FFI_Error_GetDetails_Args_STRUCT_SIZE, nullptr, e, nullptr,
                                  XLA_FFI_Error_Code_OK};
  api->XLA_FFI_Error_GetDetails(&a);
  return a.message != nullptr ? a.message : "";
}

inline XLA_FFI_Error* MakeError(const XLA_FFI_Api* api, const std::string& msg,
                                XLA_FFI_Error_Code code) {
  XLA_FFI_Error_Create_Args a{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr, msg.c_str(), code};
  return api->XLA_FFI_Error_Create(&a);
}

// Waits up to `seconds` for stream s to finish its first `target` items.
inline bool WaitForUntil(CUstream_st* s, uint64_t target, double seconds) {
  std::unique_lock<std::mutex> lk(jcoccl_shim::Rt().mu);
  return jcoccl_shim::Rt().progress.wait_for(lk, std::chrono::duration<double>(seconds),
                                             [&] { return s->completed >= target; });
}

inline XLA_FFI_Error* Adapt(XLA_FFI_Handler* inner, XLA_FFI_CallFrame* frame) {
  if (frame->extension_start != nullptr || frame->stage != XLA_FFI_ExecutionStage_EXECUTE)
    return inner(frame);
  const XLA_FFI_Api* api = frame->api;
  XLA_FFI_DeviceOrdinal_Get_Args dev{XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE, nullptr,
                                     frame->ctx, 0};
  if (XLA_FFI_Error* e = api->XLA_FFI_DeviceOrdinal_Get(&dev)) return e;
  const int device = dev.device_ordinal;
  cudaStream_t xla = XlaStream(device);

  XLA_FFI_Api patched{};
  std::memcpy(&patched, api, std::min(sizeof(patched), api->struct_size));
  patched.XLA_FFI_Stream_Get = StreamGet;
  XLA_FFI_CallFrame call = *frame;
  call.api = &patched;

  // Device copies of every buffer (the vectors never reallocate after this).
  std::vector<DeviceBuffer> args(frame->args.size), rets(frame->rets.size);
  std::vector<void*> arg_ptrs(frame->args.args, frame->args.args + frame->args.size);
  std::vector<void*> ret_ptrs(frame->rets.rets, frame->rets.rets + frame->rets.size);
  auto place = [](DeviceBuffer& d, void* xla_buf) {
    d.desc = *static_cast<XLA_FFI_Buffer*>(xla_buf);
    d.host = d.desc.data;
    d.bytes = BufferBytes(&d.desc);
    d.mem.assign(d.bytes + kRedZone, kCanary);
    std::fill(d.mem.begin(), d.mem.begin() + d.bytes, kPoison);
    d.desc.data = d.mem.data();
  };
  for (int64_t i = 0; i < frame->args.size; ++i) {
    if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER) continue;
    place(args[i], frame->args.args[i]);
    arg_ptrs[i] = &args[i].desc;
    DeviceBuffer* d = &args[i];
    jcoccl_shim::Enqueue(xla, jcoccl_shim::kXlaWork,
                         [d] { std::memcpy(d->mem.data(), d->host, d->bytes); });
  }
  for (int64_t i = 0; i < frame->rets.size; ++i) {
    if (frame->rets.types[i] != XLA_FFI_RetType_BUFFER) continue;
    place(rets[i], frame->rets.rets[i]);
    ret_ptrs[i] = &rets[i].desc;
  }
  call.args.args = arg_ptrs.data();
  call.rets.rets = ret_ptrs.data();

  g_platform_stream = xla;
  const uint64_t call_no = BeginCall(device);
  XLA_FFI_Error* err = inner(&call);
  EndCall(device, call_no);
  g_platform_stream = nullptr;

  for (DeviceBuffer& d : rets) {
    if (d.mem.empty()) continue;
    DeviceBuffer* p = &d;
    jcoccl_shim::Enqueue(xla, 0, [p] { std::memcpy(p->host, p->mem.data(), p->bytes); });
  }
  const auto queued = jcoccl_shim::Snapshot(device);
  cudaStreamSynchronize(xla);
  std::vector<std::string> found;
  for (const auto& [s, n] : queued) {
    const uint64_t done = jcoccl_shim::Completed(s);
    if (s != xla && done < n)
      found.push_back("stream " + std::to_string(s->id) + " of device " + std::to_string(device) +
                      " still had " + std::to_string(n - done) +
                      " queued operation(s) when XLA's stream passed the call (not joined into "
                      "XLA's stream)");
  }
  if (GroupDepth() != 0) {
    found.push_back("the handler returned with an NCCL group left open (ncclGroupStart depth " +
                    std::to_string(GroupDepth()) + ")");
    ResetGroup();
  }
  // Let late work finish before the buffers are checked and freed.
  bool drained = true;
  for (const auto& [s, n] : queued) drained &= WaitForUntil(s, n, 60.0);
  auto check = [&](std::vector<DeviceBuffer>& bufs, const char* what, bool results) {
    for (size_t i = 0; i < bufs.size(); ++i) {
      DeviceBuffer& d = bufs[i];
      if (d.mem.empty()) continue;
      if (std::any_of(d.mem.begin() + d.bytes, d.mem.end(), [](uint8_t b) { return b != kCanary; }))
        found.push_back(std::string("a write past the end of ") + what + " " + std::to_string(i) +
                        " (" + std::to_string(d.bytes) + " bytes)");
      if (results && std::memcmp(d.host, d.mem.data(), d.bytes) != 0)
        found.push_back("result " + std::to_string(i) +
                        " changed after XLA's stream passed the call");
    }
  };
  check(args, "argument", false);
  check(rets, "result", true);
  for (std::string& f : jcoccl_shim::Findings(device)) found.push_back(std::move(f));
  if (!drained) {
    found.push_back("queued work of device " + std::to_string(device) +
                    " did not finish within 60 s after the call");
    // Its buffers must outlive it: leak them.
    for (auto* v : {&args, &rets})
      for (DeviceBuffer& d : *v) new std::vector<uint8_t>(std::move(d.mem));
  }
  if (found.empty()) return err;
  std::string msg = "jcoccl shim found: ";
  for (size_t i = 0; i < found.size(); ++i) msg += (i ? "; " : "") + found[i];
  if (err != nullptr) {
    msg = ErrorText(api, err) + " [" + msg + "]";
    XLA_FFI_Error_Destroy_Args a{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr, err};
    api->XLA_FFI_Error_Destroy(&a);
  }
  return MakeError(api, msg, XLA_FFI_Error_Code_INTERNAL);
}

// One exported entry point per handler: XLA calls a plain function of the call frame.
constexpr int kSlots = 16;
inline XLA_FFI_Handler* g_inner[kSlots] = {};

template <int I>
XLA_FFI_Error* Slot(XLA_FFI_CallFrame* frame) {
  return Adapt(g_inner[I], frame);
}

template <int... I>
constexpr std::array<XLA_FFI_Handler*, kSlots> SlotTable(std::integer_sequence<int, I...>) {
  return {&Slot<I>...};
}

}  // namespace jcoccl_emul
