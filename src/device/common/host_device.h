// MOK_HOST_DEVICE marks functions shared by the CPU twins (compiled by g++) and the kernels (nvcc).
#pragma once

#if defined(__CUDACC__)
#define MOK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MOK_HOST_DEVICE inline
#endif
