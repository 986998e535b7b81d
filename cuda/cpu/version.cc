// A trivial handler, so that registration works before any codec exists.
#include "xla/ffi/api/ffi.h"
#include "cpu/registry.h"

namespace ffi = xla::ffi;

static ffi::Error NoopImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcocclNoop, NoopImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
JCOCCL_CPU_REGISTER("jcoccl_noop", JcocclNoop);
