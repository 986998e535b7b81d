// The part of <nccl.h> that jcoccl's NCCL transport, the interposer's tests and the XLA
// call-pattern driver use, for the NCCL emulation (nccl_emul.h): the types, the codes and
// the entry points, with NCCL's names, values and struct layouts (those of NCCL 2.32's
// nccl.h: ncclConfig_t is passed by pointer across the interposer, so its layout is ABI).
#pragma once

#include <climits>
#include <cstddef>

#include "cuda_runtime.h"

#define NCCL_UNIQUE_ID_BYTES 128
#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_SPLIT_NOCOLOR -1
#define NCCL_API_MAGIC 0xcafebeef
#define NCCL_EMUL_VERSION_CODE 23206

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
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,
  ncclFloat8e5m2 = 11,
  ncclNumTypes = 12
} ncclDataType_t;

// Values from ncclNumOps up are operators made by ncclRedOpCreatePreMulSum.
typedef enum {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,
  ncclNumOps = 5,
  ncclMaxRedOp = 0x7fffffff
} ncclRedOp_t;

typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;

// NCCL 2.32's ncclConfig_t (ncclConfig_v23100); the emulation reads `blocking` only.
typedef struct ncclConfig_v23100 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
  int trafficClass;
  const char* commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
  int graphUsageMode;
  int numRmaCtx;
  int maxP2pPeers;
  int graphStreamOrdering;
  int launchOrderImplicit;
  int numRmaSig;
  int rmaEagerInit;
  int hostCftMode;
  int nvlsHostMode;
} ncclConfig_t;

// Every field after `version` unset, as NCCL_CONFIG_INITIALIZER does.
#define NCCL_CONFIG_INITIALIZER                                                                 \
  {sizeof(ncclConfig_t),  NCCL_API_MAGIC,        NCCL_EMUL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT, \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,  NCCL_CONFIG_UNDEF_PTR, \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_PTR,  NCCL_CONFIG_UNDEF_INT, \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,  NCCL_CONFIG_UNDEF_INT, \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,  NCCL_CONFIG_UNDEF_INT, \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,  NCCL_CONFIG_UNDEF_INT, \
   NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT}

#define JCE_NCCL_API extern "C" __attribute__((visibility("default")))

JCE_NCCL_API ncclResult_t ncclGetVersion(int* version);
JCE_NCCL_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
JCE_NCCL_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
JCE_NCCL_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                                 int rank, ncclConfig_t* config);
JCE_NCCL_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                        ncclConfig_t* config);
JCE_NCCL_API ncclResult_t ncclCommDestroy(ncclComm_t comm);
JCE_NCCL_API ncclResult_t ncclCommAbort(ncclComm_t comm);
JCE_NCCL_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* err);
JCE_NCCL_API const char* ncclGetErrorString(ncclResult_t r);
JCE_NCCL_API ncclResult_t ncclGroupStart();
JCE_NCCL_API ncclResult_t ncclGroupEnd();
JCE_NCCL_API ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar,
                                                   ncclDataType_t type,
                                                   ncclScalarResidence_t residence,
                                                   ncclComm_t comm);
JCE_NCCL_API ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
JCE_NCCL_API ncclResult_t ncclAllGather(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, ncclComm_t comm, cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count,
                                            ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                            cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclReduce(const void* send, void* recv, size_t count,
                                     ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm,
                                     cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count,
                                        ncclDataType_t type, int root, ncclComm_t comm,
                                        cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclAlltoAll(const void* send, void* recv, size_t count,
                                       ncclDataType_t type, ncclComm_t comm, cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                                   ncclComm_t comm, cudaStream_t s);
JCE_NCCL_API ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer,
                                   ncclComm_t comm, cudaStream_t s);
