// The part of <nccl.h> that jcoccl's NCCL transport uses, for the NCCL emulation
// (nccl_emul.h): the types, the codes and the entry points, with NCCL's names and values.
#pragma once

#include <cstddef>

#include "cuda_runtime.h"

#define NCCL_UNIQUE_ID_BYTES 128

typedef struct ncclComm* ncclComm_t;
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclHalf = 6,
  ncclFloat32 = 7,
  ncclFloat = 7,
  ncclFloat64 = 8,
  ncclDouble = 8,
  ncclBfloat16 = 9
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

#define JCE_NCCL_API extern "C" __attribute__((visibility("default")))

JCE_NCCL_API ncclResult_t ncclGetVersion(int* version);
JCE_NCCL_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
JCE_NCCL_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
JCE_NCCL_API ncclResult_t ncclCommDestroy(ncclComm_t comm);
JCE_NCCL_API ncclResult_t ncclCommAbort(ncclComm_t comm);
JCE_NCCL_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* err);
JCE_NCCL_API const char* ncclGetErrorString(ncclResult_t r);
JCE_NCCL_API ncclResult_t ncclGroupStart();
JCE_NCCL_API ncclResult_t ncclGroupEnd();
JCE_NCCL_API ncclResult_t ncclAllGather(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, ncclComm_t comm, cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count,
                                            ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                            cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                                   ncclComm_t comm, cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer,
                                   ncclComm_t comm, cudaStream_t s);
