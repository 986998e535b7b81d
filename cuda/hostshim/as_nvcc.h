// Included before any CUDA source by a translation unit that compiles CUDA sources through the host
// shim (shim_api.cc, emul/cuda_ext.cc): the macros nvcc's device pass defines, for sm_90, so the
// sources take their CUDA branches (codecs/codec.h's JCOCCL_HD, the kernels' intrinsics).
#pragma once
#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif
