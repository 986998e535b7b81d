// A trivial handler, so that registration works before any kernel exists.
#include "xla/ffi/api/ffi.h"
#include "gpu/registry.h"

namespace ffi = xla::ffi;

static ffi::Error NoopImpl(cudaStream_t, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclGpuNoop, NoopImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
JCOCCL_GPU_REGISTER("jcoccl_noop", JcocclGpuNoop);
