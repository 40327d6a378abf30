// GPU check of tags, pause and resume through tidepool's C ABI, on a real device.
//
// 1. A CUDA graph captured on tagged memory: y = x * w + 1 over tagged
//    buffers is captured once and replayed; the tag is paused with offload
//    (the device's free memory must grow by the tag's reserved bytes),
//    resumed, and the graph replayed: x, w and y must be bit-identical to
//    before, at the same addresses.
// 2. Bandwidth: pause with offload + resume of argv[1] GiB (default 4) held
//    in 1,000 blocks, against cudaMemcpy of the same bytes to pinned host
//    memory and back on the same device (target: >= 50 % of the memcpy's
//    rate). The pause's time includes pinning its host memory
//    (cuMemHostAlloc); the memcpy's buffer is pinned before its clock starts.
// 3. Latency of pause + resume without offload for 1, 10 and 100 GiB (as
//    much as the device holds), and with offload for 1 and 10 GiB.
// Prints "tags check: ok" last when every check held.
// Build: nvcc -O2 -I ffi cuda/check/tags_check.cu -L target/release -ltidepool -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tidepool.h"

#include "check_cuda.h"

static int failures;

#define EXPECT(cond, ...)                                                          \
    do {                                                                           \
        if (!(cond)) {                                                             \
            fprintf(stderr, "tags check: FAILED at line %d: ", __LINE__);          \
            fprintf(stderr, __VA_ARGS__);                                          \
            fprintf(stderr, "\n");                                                 \
            failures++;                                                            \
        }                                                                          \
    } while (0)

static const char* last_error() {
    static char buf[1024];
    tidepool_last_error(buf, sizeof buf);
    return buf;
}

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static size_t device_free() {
    size_t free_bytes = 0, total = 0;
    CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total));
    return free_bytes;
}

static tidepool_tag_stats tag_stats(const char* tag) {
    tidepool_tag_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    int rc = tidepool_get_tag_stats(tag, 0, &s);
    if (rc != TIDEPOOL_OK) fprintf(stderr, "tidepool_get_tag_stats(%s): %d %s\n", tag, rc, last_error());
    return s;
}

__global__ void init(float* p, size_t n, float scale) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = scale * (float)(i % 977);
}

__global__ void layer(const float* x, const float* w, float* y, size_t n) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = x[i] * w[i] + 1.0f;
}

static std::vector<float> to_host(const float* p, size_t n) {
    std::vector<float> out(n);
    CHECK_CUDA(cudaMemcpy(out.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
}

static void graph_across_pause() {
    const size_t n = 64u << 20;  // 256 MiB per buffer
    cudaStream_t s;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    tidepool_set_tag("graph");
    float* x = (float*)tidepool_malloc(n * sizeof(float), 0, s);
    float* w = (float*)tidepool_malloc(n * sizeof(float), 0, s);
    float* y = (float*)tidepool_malloc(n * sizeof(float), 0, s);
    tidepool_set_tag(NULL);
    EXPECT(x && w && y, "tagged malloc: %s", last_error());
    if (!(x && w && y)) return;
    init<<<256, 256, 0, s>>>(x, n, 0.5f);
    init<<<256, 256, 0, s>>>(w, n, 0.25f);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    layer<<<256, 256, 0, s>>>(x, w, y, n);
    CHECK_CUDA(cudaStreamEndCapture(s, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    CHECK_CUDA(cudaGraphLaunch(exec, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
    std::vector<float> x0 = to_host(x, n), w0 = to_host(w, n), y0 = to_host(y, n);

    tidepool_tag_stats before = tag_stats("graph");
    size_t free_before = device_free();
    int rc = tidepool_pause("graph", 0, TIDEPOOL_PAUSE_OFFLOAD);
    EXPECT(rc == TIDEPOOL_OK, "pause: %d %s", rc, last_error());
    size_t free_paused = device_free();
    // The driver's figure moves in its own granularity: within 2 MiB per segment.
    EXPECT(free_paused + (64u << 20) >= free_before + before.reserved_bytes,
           "device free grew by %.1f MiB, the tag reserved %.1f MiB", ((double)free_paused - (double)free_before) / 1048576.0,
           before.reserved_bytes / 1048576.0);
    rc = tidepool_resume("graph", 0);
    EXPECT(rc == TIDEPOOL_OK, "resume: %d %s", rc, last_error());
    CHECK_CUDA(cudaMemsetAsync(y, 0, n * sizeof(float), s));  // the replay must write y again
    CHECK_CUDA(cudaGraphLaunch(exec, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
    std::vector<float> x1 = to_host(x, n), w1 = to_host(w, n), y1 = to_host(y, n);
    bool same = memcmp(x0.data(), x1.data(), n * 4) == 0 && memcmp(w0.data(), w1.data(), n * 4) == 0 &&
                memcmp(y0.data(), y1.data(), n * 4) == 0;
    EXPECT(same, "contents or graph output differ after pause and resume");
    printf("graph across pause: %s (device free +%.1f MiB while paused, tag reserved %.1f MiB)\n", same ? "identical" : "DIFFERENT",
           ((double)free_paused - (double)free_before) / 1048576.0, before.reserved_bytes / 1048576.0);
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    tidepool_free(x, n * 4, 0, s);
    tidepool_free(w, n * 4, 0, s);
    tidepool_free(y, n * 4, 0, s);
    CHECK_CUDA(cudaStreamDestroy(s));
}

// `gib` GiB under `tag` in 1,000 blocks (fewer when 1,000 would be under 2 MiB each).
static std::vector<void*> fill_tag(const char* tag, double gib, size_t* block_bytes) {
    size_t total = (size_t)(gib * (1ull << 30));
    size_t blocks = total / 1000 >= (2u << 20) ? 1000 : total / (2u << 20);
    size_t size = (total / blocks) & ~(size_t)4095;
    std::vector<void*> out;
    tidepool_set_tag(tag);
    for (size_t i = 0; i < blocks; i++) {
        void* p = tidepool_malloc(size, 0, NULL);
        if (!p) {
            fprintf(stderr, "%s: malloc %zu of %zu failed: %s\n", tag, i, blocks, last_error());
            break;
        }
        CHECK_CUDA(cudaMemset(p, (int)(i & 0xff), size));
        out.push_back(p);
    }
    tidepool_set_tag(NULL);
    CHECK_CUDA(cudaDeviceSynchronize());
    *block_bytes = size;
    return out;
}

static void free_all(std::vector<void*>& blocks, size_t size) {
    for (void* p : blocks) tidepool_free(p, size, 0, NULL);
    blocks.clear();
    tidepool_empty_cache();
}

static void bandwidth(double gib) {
    size_t size = 0;
    std::vector<void*> blocks = fill_tag("bandwidth", gib, &size);
    size_t bytes = blocks.size() * size;
    void* host = nullptr;
    CHECK_CUDA(cudaMallocHost(&host, bytes));
    double t0 = now_s();
    for (size_t i = 0; i < blocks.size(); i++)
        CHECK_CUDA(cudaMemcpy((char*)host + i * size, blocks[i], size, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < blocks.size(); i++)
        CHECK_CUDA(cudaMemcpy(blocks[i], (char*)host + i * size, size, cudaMemcpyHostToDevice));
    double memcpy_s = now_s() - t0;
    CHECK_CUDA(cudaFreeHost(host));
    t0 = now_s();
    int rc = tidepool_pause("bandwidth", 0, TIDEPOOL_PAUSE_OFFLOAD);
    double pause_s = now_s() - t0;
    EXPECT(rc == TIDEPOOL_OK, "pause: %d %s", rc, last_error());
    t0 = now_s();
    rc = tidepool_resume("bandwidth", 0);
    double resume_s = now_s() - t0;
    EXPECT(rc == TIDEPOOL_OK, "resume: %d %s", rc, last_error());
    // The contents came back: each block still holds its byte.
    unsigned char probe = 0;
    for (size_t i = 0; i < blocks.size(); i += 97) {
        CHECK_CUDA(cudaMemcpy(&probe, (char*)blocks[i] + size / 2, 1, cudaMemcpyDeviceToHost));
        EXPECT(probe == (unsigned char)(i & 0xff), "block %zu holds %u after resume", i, probe);
    }
    double gb = 2.0 * bytes / 1e9;
    double ratio = (memcpy_s) / (pause_s + resume_s);
    printf("bandwidth, %.2f GiB in %zu blocks: pause+resume %.1f GB/s (pause %.3f s, resume %.3f s), cudaMemcpy %.1f GB/s: %.0f %% (target >= 50 %%)\n",
           bytes / 1073741824.0, blocks.size(), gb / (pause_s + resume_s), pause_s, resume_s, gb / memcpy_s, 100 * ratio);
    EXPECT(ratio >= 0.5, "pause+resume at %.0f %% of cudaMemcpy", 100 * ratio);
    free_all(blocks, size);
}

static void latency(double gib, bool offload) {
    size_t size = 0;
    std::vector<void*> blocks = fill_tag("latency", gib, &size);
    double held = blocks.size() * (double)size / 1073741824.0;
    if (held + 0.01 < gib) {
        printf("latency %5.0f GiB %-8s: only %.1f GiB could be allocated; skipped\n", gib, offload ? "offload" : "discard", held);
        free_all(blocks, size);
        return;
    }
    double t0 = now_s();
    int rc = tidepool_pause("latency", 0, offload ? TIDEPOOL_PAUSE_OFFLOAD : 0);
    double pause_s = now_s() - t0;
    if (rc != TIDEPOOL_OK) {
        printf("latency %5.0f GiB %-8s: pause refused (%d: %s)\n", gib, offload ? "offload" : "discard", rc, last_error());
        EXPECT(offload && rc == TIDEPOOL_ERR_OUT_OF_MEMORY, "only host memory may be missing");
        free_all(blocks, size);
        return;
    }
    t0 = now_s();
    rc = tidepool_resume("latency", 0);
    double resume_s = now_s() - t0;
    EXPECT(rc == TIDEPOOL_OK, "resume: %d %s", rc, last_error());
    printf("latency %5.0f GiB %-8s: pause %8.3f s, resume %8.3f s (%zu blocks)\n", gib, offload ? "offload" : "discard", pause_s, resume_s,
           blocks.size());
    free_all(blocks, size);
}

int main(int argc, char** argv) {
    double bw_gib = argc > 1 ? atof(argv[1]) : 4.0;
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaFree(0));  // the primary context
    tidepool_init(1);
    graph_across_pause();
    bandwidth(bw_gib);
    size_t free_bytes = device_free();
    for (double gib : {1.0, 10.0, 100.0}) {
        if (gib * 1073741824.0 > 0.9 * free_bytes) {
            printf("latency %5.0f GiB: the device has %.1f GiB free; skipped\n", gib, free_bytes / 1073741824.0);
            continue;
        }
        latency(gib, false);
        if (gib <= 10.0) latency(gib, true);
    }
    if (failures == 0)
        printf("tags check: ok\n");
    else
        printf("tags check: %d FAILED\n", failures);
    return failures == 0 ? 0 : 1;
}
