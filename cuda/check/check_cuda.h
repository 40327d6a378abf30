// The check of the GPU programs of cuda/check: CHECK_CUDA(call) prints the
// call and CUDA's error and exits 1 when the call fails.
#ifndef TIDEPOOL_CHECK_CUDA_H
#define TIDEPOOL_CHECK_CUDA_H

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(x)                                                              \
    do {                                                                           \
        cudaError_t e = (x);                                                       \
        if (e != cudaSuccess) {                                                    \
            fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e));       \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

#endif
