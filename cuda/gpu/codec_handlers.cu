// XLA FFI handlers of the CUDA codecs (codecs/handlers.h over gpu/platform.h: the kernels
// of codecs.cu). The handlers may call cudaMemcpyAsync (codec `none`), so none is declared
// command-buffer compatible.
#include <cuda_runtime.h>

#include "codecs/handlers.h"
#include "gpu/platform.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

JCOCCL_DEFINE_CODEC_HANDLERS(JcocclGpu, ::jcoccl::codecs::CudaPlatform, JCOCCL_WITH_STREAM,
                             ffi::Ffi::Bind()
                                 .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                 .Arg<ffi::AnyBuffer>()
                                 .Ret<ffi::AnyBuffer>()
                                 .Attrs());
