// tidepool._stacks: the Python frames of each allocation, for
// record_memory_history(stacks="python").
//
// `capture` runs inside every allocation PyTorch makes while frames are
// recorded (libtidepool_torch.so calls it through the address
// `source_address()` returns). On a Python thread it holds the GIL (taking
// it back if the thread let it go: PyTorch's operators release the GIL
// before they allocate, and PyTorch's own stack recording takes it back the
// same way), walks the Python frames, innermost first, as (code object,
// instruction offset) pairs, and interns the sequence: a sequence seen
// before costs one hash lookup and gives its context id at once; a new one
// is turned into (filename, line, function) frames once and registered with
// tidepool (tidepool_register_context), which writes them into snapshots.
// A thread Python does not know (autograd's device threads, which run the
// backward pass) gets context 0: it has no Python frames.
//
// Interned code objects are kept alive, so an address in a key never
// names another code object later. Everything here runs with the GIL held,
// which serializes it.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct Frame {
    const char* filename;
    const char* name;
    int64_t line;
};
using register_fn = int (*)(uint64_t, const Frame*, size_t);

// Frames deeper than this are cut (the outermost ones).
constexpr size_t kMaxDepth = 128;
// Distinct stacks kept at most; later new ones get no frames.
constexpr size_t kMaxContexts = 1 << 20;

struct KeyHash {
    size_t operator()(const std::vector<uintptr_t>& key) const {
        uint64_t h = 0xcbf29ce484222325ull;
        for (uintptr_t word : key) {
            h = (h ^ word) * 0x100000001b3ull;
        }
        return static_cast<size_t>(h ^ (h >> 29));
    }
};

register_fn register_context = nullptr;
std::unordered_map<std::vector<uintptr_t>, uint64_t, KeyHash> contexts;
uint64_t captures = 0;

// Scratch reused by every capture (the GIL serializes captures).
std::vector<uintptr_t> key;
std::vector<PyFrameObject*> frames;

int instruction_of(PyFrameObject* frame) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(frame);
#else
    return PyFrame_GetLineNumber(frame);
#endif
}

std::string utf8_attr(PyObject* code, const char* name) {
    PyObject* value = PyObject_GetAttrString(code, name);
    std::string text = "??";
    if (value != nullptr && PyUnicode_Check(value)) {
        const char* utf8 = PyUnicode_AsUTF8(value);
        if (utf8 != nullptr) {
            text = utf8;
        }
    }
    Py_XDECREF(value);
    PyErr_Clear();
    return text;
}

// Registers the frames of a new stack as context `id`; false if tidepool refused.
bool register_frames(uint64_t id) {
    std::vector<std::string> texts;
    texts.reserve(frames.size() * 2);
    std::vector<int64_t> lines;
    for (PyFrameObject* frame : frames) {
        PyCodeObject* code = PyFrame_GetCode(frame);
        texts.push_back(utf8_attr(reinterpret_cast<PyObject*>(code), "co_filename"));
        texts.push_back(utf8_attr(reinterpret_cast<PyObject*>(code), "co_name"));
        lines.push_back(PyFrame_GetLineNumber(frame));
        Py_DECREF(code);
    }
    std::vector<Frame> out(frames.size());
    for (size_t i = 0; i < frames.size(); i++) {
        out[i] = Frame{texts[2 * i].c_str(), texts[2 * i + 1].c_str(), lines[i]};
    }
    return register_context(id, out.data(), out.size()) == 0;
}

void release_frames() {
    for (PyFrameObject* frame : frames) {
        Py_DECREF(frame);
    }
    frames.clear();
}

// The context id of the calling thread's frames (the GIL held); 0 when
// there are none or no room is left.
uint64_t capture_holding_gil() {
    PyFrameObject* frame = PyEval_GetFrame();  // borrowed
    if (frame == nullptr) {
        return 0;
    }
    Py_INCREF(frame);
    key.clear();
    while (frame != nullptr && frames.size() < kMaxDepth) {
        PyCodeObject* code = PyFrame_GetCode(frame);
        key.push_back(reinterpret_cast<uintptr_t>(code));
        key.push_back(static_cast<uintptr_t>(instruction_of(frame)));
        Py_DECREF(code);  // the frame holds it
        frames.push_back(frame);
        frame = PyFrame_GetBack(frame);  // new reference
    }
    Py_XDECREF(frame);
    captures++;
    auto found = contexts.find(key);
    if (found != contexts.end()) {
        release_frames();
        return found->second;
    }
    uint64_t id = 0;
    if (contexts.size() < kMaxContexts) {
        id = contexts.size() + 1;
        // Symbolizing calls into Python: keep any exception the caller had pending.
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        bool registered = register_frames(id);
        PyErr_Restore(type, value, traceback);
        if (registered) {
            for (size_t i = 0; i < key.size(); i += 2) {
                Py_INCREF(reinterpret_cast<PyObject*>(key[i]));  // keeps the address meaning this code
            }
            contexts.emplace(key, id);
        } else {
            id = 0;
        }
    }
    release_frames();
    return id;
}

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

// The calling thread's context id; 0 off a Python thread.
uint64_t capture() {
    if (register_context == nullptr || !Py_IsInitialized() || finalizing()) {
        return 0;
    }
    if (PyGILState_Check()) {
        return capture_holding_gil();
    }
    if (PyGILState_GetThisThreadState() == nullptr) {
        return 0;  // not a Python thread: no frames, and no thread state to make
    }
    PyGILState_STATE state = PyGILState_Ensure();
    uint64_t id = capture_holding_gil();
    PyGILState_Release(state);
    return id;
}

PyObject* bind(PyObject*, PyObject* arg) {
    void* address = PyLong_AsVoidPtr(arg);
    if (address == nullptr) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "the address of tidepool_register_context is NULL");
        }
        return nullptr;
    }
    register_context = reinterpret_cast<register_fn>(address);
    Py_RETURN_NONE;
}

PyObject* source_address(PyObject*, PyObject*) {
    return PyLong_FromVoidPtr(reinterpret_cast<void*>(&capture));
}

PyObject* capture_now(PyObject*, PyObject*) {
    return PyLong_FromUnsignedLongLong(capture());
}

PyObject* counts(PyObject*, PyObject*) {
    return Py_BuildValue("{s:K,s:K}", "contexts", static_cast<unsigned long long>(contexts.size()), "captures",
                         static_cast<unsigned long long>(captures));
}

PyMethodDef methods[] = {
    {"bind", bind, METH_O, "bind(address): the address of tidepool_register_context in the loaded library."},
    {"source_address", source_address, METH_NOARGS, "The address of the capture function (uint64_t (*)(void))."},
    {"capture_now", capture_now, METH_NOARGS, "Captures the calling frames now; returns their context id."},
    {"counts", counts, METH_NOARGS, "{'contexts': distinct stacks registered, 'captures': stacks captured}."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "tidepool._stacks", "Python frames of allocations.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__stacks(void) {
    return PyModule_Create(&module);
}
