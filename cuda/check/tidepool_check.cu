// GPU check of tidepool through its C ABI, on a real device.
//
// 1. Patterns across streams: blocks allocated on one stream are filled by
//    kernels on another (after an event wait, as a correct program does),
//    handed to tidepool_record_stream, freed and reallocated at random; at
//    every free a kernel on the block's own stream checks the block still
//    holds its owner's bytes. Any overlap or early reuse shows as mismatches.
//    Every 1000 operations the cache is emptied under the queued kernels.
// 2. Latency of an allocation+free pair: tidepool (cached) against
//    cuMemAlloc/cuMemFree and cuMemAllocAsync/cuMemFreeAsync.
// Build: nvcc -O2 -I ffi cuda/check/tidepool_check.cu -L target/release -ltidepool -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tidepool.h"

#include "check_cuda.h"

__global__ void fill(unsigned char* p, size_t n, unsigned char v) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}

__global__ void verify(const unsigned char* p, size_t n, unsigned char v, unsigned long long* bad) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (p[i] != v) atomicAdd(bad, 1ULL);
}

struct Live {
    unsigned char* ptr;
    size_t size;
    int stream;
    unsigned char tag;
};

static double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
    int ops = argc > 1 ? atoi(argv[1]) : 20000;
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaFree(0));  // create the primary context
    tidepool_init(1);
    const int S = 4;
    cudaStream_t streams[S];
    cudaEvent_t events[S];
    for (int i = 0; i < S; i++) {
        CHECK_CUDA(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
        CHECK_CUDA(cudaEventCreateWithFlags(&events[i], cudaEventDisableTiming));
    }
    unsigned long long* bad;
    CHECK_CUDA(cudaMalloc(&bad, sizeof *bad));
    CHECK_CUDA(cudaMemset(bad, 0, sizeof *bad));
    std::vector<Live> live;
    unsigned seed = 12345;
    auto rnd = [&]() { seed = seed * 1103515245u + 12345u; return seed >> 8; };
    for (int op = 0; op < ops; op++) {
        int own = rnd() % S, other = rnd() % S;
        size_t size = 512 + rnd() % (rnd() % 16 == 0 ? (8u << 20) : (64u << 10));
        auto* p = (unsigned char*)tidepool_malloc(size, 0, streams[own]);
        if (!p) {
            char msg[512];
            tidepool_last_error(msg, sizeof msg);
            fprintf(stderr, "tidepool_malloc failed: %s\n", msg);
            return 1;
        }
        unsigned char tag = (unsigned char)(op * 7 + 1);
        fill<<<32, 256, 0, streams[own]>>>(p, size, tag);
        if (other != own) {
            CHECK_CUDA(cudaEventRecord(events[own], streams[own]));
            CHECK_CUDA(cudaStreamWaitEvent(streams[other], events[own], 0));
            fill<<<32, 256, 0, streams[other]>>>(p, size, tag);  // same bytes, another stream
            tidepool_record_stream(p, streams[other]);
        }
        live.push_back({p, size, own, tag});
        while (live.size() > 64 || (!live.empty() && rnd() % 3 == 0)) {
            size_t i = rnd() % live.size();
            Live b = live[i];
            live[i] = live.back();
            live.pop_back();
            verify<<<32, 256, 0, streams[b.stream]>>>(b.ptr, b.size, b.tag, bad);
            tidepool_free(b.ptr, b.size, 0, streams[b.stream]);
        }
        // Cache goes back (pages unmapped, with expandable segments) while
        // kernels are still queued on the blocks around it.
        if (op % 1000 == 999) tidepool_empty_cache();
    }
    for (auto& b : live) {
        verify<<<32, 256, 0, streams[b.stream]>>>(b.ptr, b.size, b.tag, bad);
        tidepool_free(b.ptr, b.size, 0, streams[b.stream]);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    unsigned long long mismatches = 0;
    CHECK_CUDA(cudaMemcpy(&mismatches, bad, sizeof mismatches, cudaMemcpyDeviceToHost));
    tidepool_stats st;
    st.size = sizeof st;
    tidepool_get_stats(0, &st);
    printf("patterns: %d operations on %d streams, %llu mismatched bytes, peak reserved %.1f MiB, %llu device allocs\n",
           ops, S, mismatches, st.peak_reserved_bytes / 1048576.0, (unsigned long long)st.num_device_allocs);

    // Latency of one allocation + free.
    size_t sizes[] = {512, 1u << 20, 64u << 20};
    CUstream raw = (CUstream)streams[0];
    CUmemoryPool pool;
    cuDeviceGetDefaultMemPool(&pool, 0);
    printf("\n%-8s %14s %14s %18s %10s\n", "size", "tidepool", "cuMemAlloc", "cuMemAllocAsync", "speedup");
    for (size_t size : sizes) {
        void* warm = tidepool_malloc(size, 0, streams[0]);
        tidepool_free(warm, size, 0, streams[0]);
        int n = 20000;
        double t0 = now_us();
        for (int i = 0; i < n; i++) tidepool_free(tidepool_malloc(size, 0, streams[0]), size, 0, streams[0]);
        double tp = (now_us() - t0) / n;
        int m = 500;
        CUdeviceptr d;
        t0 = now_us();
        for (int i = 0; i < m; i++) {
            cuMemAlloc(&d, size);
            cuMemFree(d);
        }
        double plain = (now_us() - t0) / m;
        t0 = now_us();
        for (int i = 0; i < m; i++) {
            cuMemAllocAsync(&d, size, raw);
            cuMemFreeAsync(d, raw);
            cuStreamSynchronize(raw);
        }
        double async = (now_us() - t0) / m;
        printf("%-8zu %11.3f us %11.3f us %15.3f us %9.0fx\n", size, tp, plain, async, plain / tp);
    }
    (void)pool;
    return mismatches == 0 ? 0 : 1;
}
