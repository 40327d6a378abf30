// The allocation entry points PyTorch's CUDAPluggableAllocator calls when
// tidepool is installed (libtidepool_torch.so, built with the Python
// package).
//
// PyTorch wraps whatever `malloc` returns in a tensor without checking it,
// so a NULL from tidepool_malloc would become a tensor at address 0 and the
// next kernel would fault. Here an out-of-memory becomes a C++ exception
// (std::runtime_error whose message starts "CUDA out of memory."), thrown in
// this C++ frame straight into PyTorch's, which turns it into a Python
// RuntimeError at the call that allocated. tidepool_malloc itself (Rust)
// returns before anything is thrown: no exception crosses a Rust frame.
//
// The library is not linked against libtidepool.so: tidepool_torch_bind
// hands it the functions of the library Python loaded (TIDEPOOL_LIBRARY may
// name another one than the package's own), so one process has one cache.
//
// Python stack frames: when a context source is set (record_memory_history
// with stacks), each allocation asks it for the calling thread's context id
// and allocates with it, so snapshots show who allocated what.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace {

using malloc_fn = void* (*)(size_t, int, void*);
using malloc_with_context_fn = void* (*)(size_t, int, void*, uint64_t);
using free_fn = void (*)(void*, size_t, int, void*);
using last_error_fn = size_t (*)(char*, size_t);
using context_source_fn = uint64_t (*)();

std::atomic<malloc_fn> tidepool_malloc{nullptr};
std::atomic<malloc_with_context_fn> tidepool_malloc_with_context{nullptr};
std::atomic<free_fn> tidepool_free{nullptr};
std::atomic<last_error_fn> tidepool_last_error{nullptr};
std::atomic<context_source_fn> context_source{nullptr};

// This thread's last error from tidepool (the out-of-memory report).
std::string last_error() {
    last_error_fn get = tidepool_last_error.load(std::memory_order_acquire);
    if (get == nullptr) {
        return "";
    }
    std::string message(get(nullptr, 0), '\0');
    if (!message.empty()) {
        get(&message[0], message.size() + 1);
    }
    return message;
}

std::string human_bytes(size_t bytes) {
    const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
    double value = static_cast<double>(bytes);
    int unit = 0;
    while (value >= 1024.0 && unit < 4) {
        value /= 1024.0;
        unit++;
    }
    char text[64];
    if (unit == 0) {
        snprintf(text, sizeof text, "%zu bytes", bytes);
    } else {
        snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
    }
    return text;
}

}  // namespace

extern "C" {

// Binds the functions of the loaded libtidepool.so. Returns 0, or -1 when
// one of the required ones is NULL (nothing changes then).
int tidepool_torch_bind(void* malloc, void* malloc_with_context, void* free, void* last_error) {
    if (malloc == nullptr || free == nullptr || last_error == nullptr) {
        return -1;
    }
    tidepool_malloc_with_context.store(reinterpret_cast<malloc_with_context_fn>(malloc_with_context),
                                       std::memory_order_release);
    tidepool_free.store(reinterpret_cast<free_fn>(free), std::memory_order_release);
    tidepool_last_error.store(reinterpret_cast<last_error_fn>(last_error), std::memory_order_release);
    tidepool_malloc.store(reinterpret_cast<malloc_fn>(malloc), std::memory_order_release);
    return 0;
}

// Sets (or, with NULL, clears) the function that names the calling thread's
// context for each allocation (0: none).
void tidepool_torch_set_context_source(void* source) {
    context_source.store(reinterpret_cast<context_source_fn>(source), std::memory_order_release);
}

// PyTorch's alloc: `size` bytes on `device` for `stream`. Throws
// std::runtime_error("CUDA out of memory. ...") when tidepool cannot serve
// a non-zero request, and std::runtime_error when it was never bound.
void* tidepool_torch_malloc(size_t size, int device, void* stream) {
    malloc_fn plain = tidepool_malloc.load(std::memory_order_acquire);
    if (plain == nullptr) {
        throw std::runtime_error("tidepool: the PyTorch entry points are not bound to libtidepool (call tidepool.install())");
    }
    void* ptr;
    context_source_fn source = context_source.load(std::memory_order_acquire);
    malloc_with_context_fn with_context = tidepool_malloc_with_context.load(std::memory_order_acquire);
    uint64_t context = (source != nullptr && with_context != nullptr) ? source() : 0;
    if (context != 0) {
        ptr = with_context(size, device, stream, context);
    } else {
        ptr = plain(size, device, stream);
    }
    if (ptr == nullptr && size != 0) {
        std::string error = last_error();
        // Other refusals (no such device, a fork child, a paused tag) are
        // errors of their own. The report's first words say which it is: a
        // tag's name, in other messages, can say anything.
        if (!error.empty() && error.rfind("tidepool: out of memory", 0) != 0) {
            throw std::runtime_error(error);
        }
        // The report says what was asked, held and free, and what to do.
        if (error.empty()) {
            error = "Tried to allocate " + human_bytes(size) + " on device " + std::to_string(device) + ".";
        }
        throw std::runtime_error("CUDA out of memory. " + error);
    }
    return ptr;
}

// PyTorch's free: tidepool_free as it is (it never throws).
void tidepool_torch_free(void* ptr, size_t size, int device, void* stream) {
    free_fn free = tidepool_free.load(std::memory_order_acquire);
    if (free != nullptr) {
        free(ptr, size, device, stream);
    }
}

}  // extern "C"
