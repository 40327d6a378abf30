// Drives ffi/python/csrc/torch_alloc.cpp the way PyTorch's
// CUDAPluggableAllocator does: through a std::function<void*(size_t, int,
// cudaStream_t)>, inside a try block like the one PyTorch's Python binding
// wraps every call in. Run by tests/torch_alloc.rs with TIDEPOOL_CONF
// selecting a small host backend (64 MiB).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>

#include "tidepool.h"

extern "C" {
int tidepool_torch_bind(void* malloc, void* malloc_with_context, void* free, void* last_error);
void* tidepool_torch_malloc(size_t size, int device, void* stream);
void tidepool_torch_free(void* ptr, size_t size, int device, void* stream);
}

typedef struct CUstream_st* cudaStream_t;  // as PyTorch sees a stream

static int passed = 0, failed = 0;

static void check(bool ok, const char* what) {
    if (ok) {
        passed++;
    } else {
        failed++;
        std::printf("FAILED: %s\n", what);
    }
}

// What PyTorch's binding layer does: call, and turn a std::exception into
// the message Python would see. Returns the pointer, or NULL and the message.
static void* call(const std::function<void*(size_t, int, cudaStream_t)>& alloc, size_t size, int device,
                  std::string* message) {
    message->clear();
    try {
        return alloc(size, device, nullptr);
    } catch (const std::exception& e) {
        *message = e.what();
        return nullptr;
    }
}

static int observed_ooms = 0;
static size_t observed_request = 0;

static void observer(int, size_t requested, size_t, size_t, void*) {
    observed_ooms++;
    observed_request = requested;
}

static bool starts_with(const std::string& text, const char* prefix) {
    return text.compare(0, std::strlen(prefix), prefix) == 0;
}

int main() {
    std::function<void*(size_t, int, cudaStream_t)> alloc =
        [](size_t size, int device, cudaStream_t stream) { return tidepool_torch_malloc(size, device, stream); };
    std::function<void(void*, size_t, int, cudaStream_t)> free_fn =
        [](void* ptr, size_t size, int device, cudaStream_t stream) { tidepool_torch_free(ptr, size, device, stream); };
    std::string message;

    // Before install() binds it, an allocation raises instead of returning NULL.
    check(call(alloc, 4096, 0, &message) == nullptr && message.find("not bound") != std::string::npos,
          "an unbound entry point raises");
    check(tidepool_torch_bind(nullptr, nullptr, (void*)&tidepool_free, (void*)&tidepool_last_error) == -1,
          "binding without malloc is refused");

    check(tidepool_torch_bind((void*)&tidepool_malloc, nullptr, (void*)&tidepool_free, (void*)&tidepool_last_error) == 0,
          "bind");
    void* small = call(alloc, 1 << 20, 0, &message);
    check(small != nullptr && message.empty(), "1 MiB is served");

    // Out of memory: the observers hear it, then an exception with PyTorch's
    // prefix and tidepool's report, never NULL.
    check(tidepool_attach_oom_observer(observer, nullptr) == TIDEPOOL_OK, "attach an observer");
    void* huge = call(alloc, (size_t)1 << 30, 0, &message);
    check(observed_ooms == 1 && observed_request == (size_t)1 << 30, "the observer heard the out of memory once");
    check(huge == nullptr, "1 GiB on a 64 MiB device is not served");
    check(starts_with(message, "CUDA out of memory. "), "the message starts as PyTorch's does");
    check(message.find("tried to allocate 1.00 GiB") != std::string::npos, "the message carries tidepool's report");
    std::printf("oom message: %s\n", message.c_str());

    // The process keeps working: the next smaller request is served.
    void* after = call(alloc, 8 << 20, 0, &message);
    check(after != nullptr && message.empty(), "a smaller request after the OOM is served");

    // A zero-byte request is NULL without an exception (PyTorch's empty tensors).
    check(call(alloc, 0, 0, &message) == nullptr && message.empty(), "0 bytes: NULL, no exception");

    // Another refusal is its own error, not an out-of-memory.
    check(call(alloc, 4096, 42, &message) == nullptr && !starts_with(message, "CUDA out of memory") &&
              message.find("no device 42") != std::string::npos,
          "a bad device raises its own error");

    // Nor is a paused tag, whatever its name says.
    check(tidepool_set_tag("out of memory tests") == TIDEPOOL_OK && tidepool_pause("out of memory tests", 0, 0) == TIDEPOOL_OK,
          "a tag named \"out of memory tests\", paused");
    check(call(alloc, 4096, 0, &message) == nullptr && !starts_with(message, "CUDA out of memory") &&
              message.find("is paused") != std::string::npos,
          "an allocation under a paused tag raises its own error");
    check(tidepool_set_tag(nullptr) == TIDEPOOL_OK, "back to the default tag");

    free_fn(small, 1 << 20, 0, nullptr);
    free_fn(after, 8 << 20, 0, nullptr);
    tidepool_stats stats;
    stats.size = sizeof stats;
    check(tidepool_get_stats(0, &stats) == TIDEPOOL_OK && stats.allocated_bytes == 0, "everything was freed");
    check(stats.num_ooms == 1, "one OOM counted");

    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
