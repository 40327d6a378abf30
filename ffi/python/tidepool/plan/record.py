"""Record the allocation trace of a PyTorch model without a GPU.

The model runs on the meta device (shapes and dtypes, no data) under a
TorchDispatchMode: every storage an operator creates is an allocation of
its size, and the death of its last reference is its free. The trace is
written as RMM's logging CSV with one more column, `Operator` (the aten
operator that allocated), which `tidepool replay` and `tidepool plan` read.

This module owns the Recorder (and the cuBLAS workspace it allocates per
thread); demo workloads to record and the command line are demos.py's:

    python -m tidepool.record mlp --steps 3 --out mlp.csv
    python -m tidepool.record transformer-varlen --out varlen.csv

or, for a model of your own:

    from tidepool.record import Recorder
    with Recorder("trace.csv") as rec:
        rec.track(model, optimizer)      # tensors that exist already
        for _ in range(steps):
            step()                       # forward, backward, optimizer step on "meta"

What the recorder does so that the trace is what CUDA would allocate:
- frees are seen when they happen, without scanning every live storage:
  a weak reference on each tensor object says when to look at its storage;
- only tensors on the recorded devices count (`devices`, meta and cuda by
  default): CPU tensors such as the optimizer's step counters are not
  device memory;
- a storage resized in place (`untyped_storage().resize_()`, as FSDP
  frees and refills its all-gathered weights) is a free and an allocation;
- a tensor given another storage (`set_`, `tensor.data = other`, as
  `Module.to(dtype)` converts parameters) lets go of its old one, which is
  freed when nothing else holds it;
- a cuBLAS workspace is allocated for each thread that runs a matmul (the
  calling thread, and autograd's device thread for backward) on each
  device, as PyTorch's cuBLAS handle pool does on CUDA;
- each allocation's device is kept (`device_of`: its index, where not 0):
  `on_device(i)` is the recording of device i alone, for a process that
  uses several;
- optimizers built with `foreach=None` take the foreach path, as on CUDA,
  and `fused=True` runs as there (its kernels work on meta);
- backward formulas that take another path under a dispatch mode
  (`gather`'s and `index`'s: zeros, then an out-of-place scatter_add or
  index_put) are run in place, as they run without one;
- a Python value read from a meta tensor (`.item()`, `if t.all():`) is
  True, 1 or 1.0: the data is not there, and code that branches on it
  takes the branch of ordinary inputs (no padding, no packed sequences),
  and a copy to the CPU (`.cpu()`) is an uninitialised CPU tensor;
- tensors can be labelled (weights, gradients, optimizer) so that the
  peak can be broken down by category (`Recorder.breakdown_at_peak`); a
  tracked optimizer's states (made at its first step, as PyTorch's and
  most optimizers make them) count as optimizer, a copy of a weight in
  another type (autocast's bf16 or fp16 casts, cached for its region) as
  precision copies (in its own type, to another card, as weights: a
  replica), everything else unlabelled (the temporaries of the
  optimizer's step too) as activations and temporaries.

`Recorder.write_snapshot(path)` writes the same recording as a PyTorch
memory snapshot (each allocation's frame names its operator) for
`tidepool replay` and pytorch.org/memory_viz.

Recording can start after a warm-up: `Recorder(path, start=False)` tracks
every tensor but writes nothing until `start()`, which writes the tensors
then live as allocations (as a real snapshot's live set at its start).

torch is needed for this module only.
"""
import bisect
import contextlib
import os
import time
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "Recorder",
    "cublas_workspace_bytes",
    "HEADER",
    "WEIGHTS",
    "GRADIENTS",
    "OPTIMIZER",
    "ACTIVATIONS",
    "COPIES",
    "CATEGORIES",
    "DEFAULT_CUBLAS_WORKSPACE",
    "LARGE_CUBLAS_WORKSPACE",
]

HEADER = "Thread,Time,Action,Pointer,Size,Stream,Operator\n"

# Categories of an allocation, for the breakdown of a peak.
WEIGHTS, GRADIENTS, OPTIMIZER, ACTIVATIONS = "weights", "gradients", "optimizer", "activations"
COPIES = "copies"  # weights cast to another type: autocast's, and the like
CATEGORIES = (WEIGHTS, GRADIENTS, OPTIMIZER, COPIES, ACTIVATIONS)

# The cuBLAS workspace PyTorch allocates per (thread, stream) through its
# caching allocator: CUBLAS_WORKSPACE_CONFIG's default, ":4096:2:16:8"
# (two 4 MiB chunks and eight 16 KiB ones), and 32 MiB on the cards
# cuBLAS recommends it for (`_LARGE_WORKSPACE_MAJORS`).
DEFAULT_CUBLAS_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
LARGE_CUBLAS_WORKSPACE = 32 << 20
# The compute capability majors torch gives 32 MiB, by the release that
# began to: 9.0 alone (Hopper) from torch 2.0; Blackwell (10 and 12) from
# 2.11; 11 (Thor) from 2.14.
_LARGE_WORKSPACE_MAJORS = (((2, 14), (9, 10, 11, 12)), ((2, 11), (9, 10, 12)))

# Operators that call cuBLAS on CUDA (and so need the thread's workspace),
# as the dispatcher shows them: composite ones (linear, matmul, einsum, ...)
# arrive whole under inference_mode and decomposed under autograd.
_MATMULS = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "inner", "addr", "_addmm_activation",
    "_scaled_mm", "_int_mm", "_grouped_mm", "_scaled_grouped_mm", "linear", "matmul", "einsum", "tensordot",
    "bilinear", "_trilinear", "chain_matmul", "linalg_multi_dot",
}

# Out-of-place operators that a backward formula under a dispatch mode runs
# on a fresh zeros tensor where it would otherwise run their in-place form.
_IN_PLACE_FORM = {"scatter_add", "index_put", "index_add", "scatter", "index_copy", "masked_scatter", "index_fill"}
_ZEROS = {"new_zeros", "zeros_like", "zeros"}
_ITEM = torch.ops.aten._local_scalar_dense.default
_TO_COPY, _COPY = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default
# Operators that read data and return a Python value.
_DATA = {_ITEM, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


def cublas_workspace_bytes(compute_capability=None, torch_version=None):
    """The workspace one thread's cuBLAS handle takes: CUBLAS_WORKSPACE_CONFIG
    (":SIZE_KIB:COUNT" pairs) when set, else PyTorch's default for a card of
    `compute_capability` ((major, minor); None: one of compute capability
    8.x, the default's) under `torch_version` ((major, minor); None: the
    installed torch's)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    parts = [p for p in config.split(":") if p]
    if len(parts) >= 2 and len(parts) % 2 == 0 and all(p.isdigit() for p in parts):
        return sum(int(size) * 1024 * int(count) for size, count in zip(parts[::2], parts[1::2]))
    if compute_capability is None:
        return DEFAULT_CUBLAS_WORKSPACE
    if torch_version is None:
        torch_version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    majors = next((majors for since, majors in _LARGE_WORKSPACE_MAJORS if torch_version >= since), None)
    large = compute_capability[0] in majors if majors else tuple(compute_capability) == (9, 0)
    return LARGE_CUBLAS_WORKSPACE if large else DEFAULT_CUBLAS_WORKSPACE


class _Live:
    """One live storage: where it is in the trace, and who holds it."""

    __slots__ = ("pointer", "size", "ref", "objects")

    def __init__(self, pointer, size, ref):
        self.pointer, self.size, self.ref, self.objects = pointer, size, ref, 0


class Recorder(TorchDispatchMode):
    """A dispatch mode that writes every device storage's birth and death.

    path: the CSV to write at exit (None: keep the events in memory only).
    devices: the device types whose tensors are device memory.
    cublas_workspace: bytes per matmul thread (None: cublas_workspace_bytes();
        0: none).
    cuda_optimizers: optimizers choose foreach, and may be fused, as on CUDA.
    start: record from entry (False: track, and write from start()).
    """

    def __init__(self, path=None, *, devices=("meta", "cuda"), cublas_workspace=None, cuda_optimizers=True,
                 start=True):
        super().__init__()
        self.path = path
        self.devices = frozenset(devices)
        self.workspace_size = cublas_workspace_bytes() if cublas_workspace is None else int(cublas_workspace)
        self.cuda_optimizers = cuda_optimizers
        self.recording = start
        self.events = []  # (time_us, action, pointer, size, operator)
        self.marks = []  # (label, index into events)
        self.labels = {}  # pointer -> category (unlabelled: activations and temporaries)
        self.live = {}  # storage key -> _Live
        self.objects = {}  # id(tensor) -> (weak reference, [storage key])
        self.suspects = set()  # storage keys whose tensor objects all died: look at them next
        self.emptied = {}  # storage key -> weak reference: device storages resized to 0 bytes
        self.workspaces = {}  # (thread name, device index) -> pointer
        self.device_of = {}  # pointer -> device index, where it is not 0
        self.next_pointer = 0x1000
        self.start_time = time.perf_counter()
        self.allocs = 0
        self._zeros = None  # weak reference to the last zeros tensor a backward made
        self._patches = contextlib.ExitStack()
        self._phase = None  # the category of what is allocated now (labelling())

    # -- events ------------------------------------------------------------
    def _event(self, action, pointer, size, operator):
        if self.recording:
            self.events.append((int((time.perf_counter() - self.start_time) * 1e6), action, pointer, size, operator))
            if action == "allocate":
                self.allocs += 1

    def _new_pointer(self, size):
        pointer = self.next_pointer
        self.next_pointer += (size + 0xFFF) // 0x1000 * 0x1000 + 0x1000
        return pointer

    # -- storages ----------------------------------------------------------
    def _storages(self, tensor):
        """The device storages a tensor holds (a sparse one: its parts)."""
        if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
            # A wrapper subclass (DTensor, say) holds no storage of its own:
            # its inner tensors do (a DTensor's shard on this rank).
            names, _ = tensor.__tensor_flatten__()
            inner = [getattr(tensor, name, None) for name in names]
            return tuple(part for t in inner if isinstance(t, torch.Tensor) for part in self._storages(t))
        if tensor.device.type not in self.devices:
            return ()
        layout = tensor.layout
        if layout == torch.strided:
            return (tensor,)
        if layout == torch.sparse_coo:
            return (tensor._indices(), tensor._values())
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            return (tensor.crow_indices(), tensor.col_indices(), tensor.values())
        if layout in (torch.sparse_csc, torch.sparse_bsc):
            return (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
        return ()

    def _track(self, tensor, operator, category=None):
        """Counts a tensor object; its storage is an allocation if new."""
        if not isinstance(tensor, torch.Tensor):
            return
        for part in self._storages(tensor):
            self._track_dense(part, operator, category)

    def _track_dense(self, tensor, operator, category):
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self.live.get(key)
        if entry is not None and entry.ref.expired():
            self._free(key)  # a dead storage whose address was taken again
            entry = None
        if entry is None:
            size = storage.nbytes()
            if size == 0:
                return
            entry = _Live(self._new_pointer(size), size, StorageWeakRef(storage))
            self.live[key] = entry
            if tensor.device.index:
                self.device_of[entry.pointer] = tensor.device.index
            self._event("allocate", entry.pointer, size, operator)
            if category is None and self._phase is not None:
                category = self._phase
        if category is not None:
            self.labels[entry.pointer] = category
        tid = id(tensor)
        known = self.objects.get(tid)
        if known is not None and known[0]() is tensor:
            held = known[1]
            if held[0] != key:
                # The tensor was given another storage (`set_`, `.data =`):
                # it holds the old one no more.
                self._let_go(held[0])
                held[0] = key
                entry.objects += 1
                self.suspects.discard(key)
            return
        held = [key]
        self.objects[tid] = (weakref.ref(tensor, self._object_died(tid, held)), held)
        entry.objects += 1
        self.suspects.discard(key)

    def _labelled(self, tensor):
        """The category `tensor`'s storage is labelled with, if any."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type not in self.devices or tensor.layout != torch.strided:
            return None
        entry = self.live.get(tensor.untyped_storage()._cdata)
        return self.labels.get(entry.pointer) if entry is not None else None

    def _let_go(self, key):
        """One tensor object of ours holds the storage `key` no more."""
        entry = self.live.get(key)
        if entry is not None:
            entry.objects -= 1
            if entry.objects <= 0:
                # Freed when the storage is: at the next look, unless
                # C++ (autograd's saved tensors, a view) still holds it.
                self.suspects.add(key)

    def _object_died(self, tid, held):
        def died(_ref):
            known = self.objects.get(tid)
            if known is not None and known[0] is _ref:
                del self.objects[tid]
            self._let_go(held[0])
        return died

    def _data_set(self, tensor):
        """`tensor.data = other` reaches no operator: the tensor, if it is
        one of ours, now holds `other`'s storage."""
        known = self.objects.get(id(tensor))
        if known is not None and known[0]() is tensor:
            self._track(tensor, "set_data")

    def _free(self, key):
        entry = self.live.pop(key)
        self.suspects.discard(key)
        self._event("free", entry.pointer, entry.size, "")

    def _collect(self):
        """Frees the storages whose last reference died since the last look."""
        if self.suspects:
            live = self.live
            gone = [key for key in self.suspects if key not in live]
            self.suspects.difference_update(gone)
            # In the order they were allocated, so that a trace does not
            # depend on where Python put the storages.
            dead = sorted((live[key].pointer, key) for key in self.suspects if live[key].ref.expired())
            for _, key in dead:
                self._free(key)

    # -- what users call ---------------------------------------------------
    def track(self, *things, category=None):
        """Counts tensors that exist already: tensors, modules (parameters
        as weights, buffers), optimizers (their state), and lists, tuples
        and dicts of these. Optimizers are also watched: after each step,
        gradients and states are labelled as such (the temporaries of
        the step are not state)."""
        for thing in things:
            if isinstance(thing, torch.nn.Module):
                for p in thing.parameters():
                    self._track(p, "pre-existing", category or WEIGHTS)
                    if p.grad is not None:
                        self._track(p.grad, "pre-existing", GRADIENTS)
                for b in thing.buffers():
                    self._track(b, "pre-existing", category or WEIGHTS)
            elif isinstance(thing, torch.optim.Optimizer):
                self._label_optimizer(thing)
                thing.register_step_post_hook(self._optimizer_stepped)
            elif isinstance(thing, dict):
                self.track(*thing.values(), category=category)
            elif isinstance(thing, (list, tuple)):
                self.track(*thing, category=category)
            elif isinstance(thing, torch.Tensor):
                self._track(thing, "pre-existing", category)

    def _optimizer_stepped(self, optimizer, *_):
        self._label_optimizer(optimizer)

    def _label_optimizer(self, optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._track(p.grad, "pre-existing", GRADIENTS)
        for state in optimizer.state.values():
            # An optimizer of one's own may keep lists or dicts of tensors.
            for value in tree_flatten(state)[0]:
                self._track(value, "pre-existing", OPTIMIZER)
        inner = getattr(optimizer, "optim", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            # A wrapper's (ZeroRedundancyOptimizer's): the state is its inner optimizer's.
            self._label_optimizer(inner)

    def label(self, tensor, category):
        """Says what a tensor is (one of CATEGORIES) for the breakdown."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {', '.join(CATEGORIES)}, not {category!r}")
        self._track(tensor, "pre-existing", category)

    @contextlib.contextmanager
    def labelling(self, category):
        """Counts what is allocated inside the block as `category`."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {', '.join(CATEGORIES)}, not {category!r}")
        outer, self._phase = self._phase, category
        try:
            yield
        finally:
            self._phase = outer

    def start(self):
        """Starts writing: every storage live now is written as allocated."""
        self._collect()
        if self.recording:
            return
        self.recording = True
        for entry in self.live.values():
            self._event("allocate", entry.pointer, entry.size, "pre-existing")
        for pointer in self.workspaces.values():
            self._event("allocate", pointer, self.workspace_size, "cublas_workspace")

    def mark(self, label):
        """Marks this point of the recording (a step's end, say)."""
        self._collect()
        self.marks.append((label, len(self.events)))

    # -- the mode ----------------------------------------------------------
    def _workspace(self, args):
        # Backward runs on autograd's device thread on CUDA, whose cuBLAS
        # handle has a workspace of its own; each device's handle has its own.
        thread = "backward" if torch._C._current_graph_task_id() != -1 else "main"
        device = next((t.device.index or 0 for t in args if isinstance(t, torch.Tensor)), 0)
        if (thread, device) not in self.workspaces:
            pointer = self._new_pointer(self.workspace_size)
            self.workspaces[(thread, device)] = pointer
            if device:
                self.device_of[pointer] = device
            self._event("allocate", pointer, self.workspace_size, "cublas_workspace")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._collect()
        kwargs = kwargs or {}
        if func in _DATA and args[0].device.type == "meta":
            if func is not _ITEM:
                return True  # is_nonzero, equal
            # Data the meta device does not have: code that branches on it
            # (`if mask.all():`) takes the branch of ordinary inputs.
            return True if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
        if func is _TO_COPY and args[0].device.type == "meta" and str(kwargs.get("device", "meta")) == "cpu":
            # Data never leaves the meta device: a copy to the CPU is an
            # uninitialised CPU tensor of the same shape.
            return torch.empty(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device="cpu")
        if func is _COPY and args[0].device.type == "cpu" and args[1].device.type == "meta":
            return args[0]
        name = func._overloadpacket.__name__
        if self.workspace_size and name in _MATMULS:
            self._workspace(args)
        zeros = self._zeros() if self._zeros is not None else None
        if zeros is not None and name in _IN_PLACE_FORM and args and args[0] is zeros:
            # The formula's own path: the in-place form on the fresh zeros.
            self._zeros = None
            inplace = getattr(torch.ops.aten, name + "_")
            getattr(inplace, func._overloadname)(*args, **kwargs)
            return args[0]
        result = func(*args, **kwargs)
        operator = str(func)
        # A weight cast to another type (autocast's, cached for its region);
        # copied in its own type, to another card, a replica: weights.
        category = None
        if func is _TO_COPY and self._labelled(args[0]) == WEIGHTS:
            category = WEIGHTS if kwargs.get("dtype") in (None, args[0].dtype) else COPIES
        for item in tree_flatten(result)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item, operator, category)
        if name in _ZEROS and isinstance(result, torch.Tensor) and torch._C._current_graph_task_id() != -1:
            self._zeros = weakref.ref(result)
        else:
            self._zeros = None
        return result

    def __enter__(self):
        if self.cuda_optimizers:
            import torch.optim.optimizer as optimizer_module

            cuda_like = lambda: ["cuda", "meta"]  # noqa: E731 - a new list each call: callers remove from it
            for name in ("_get_foreach_kernels_supported_devices", "_get_fused_kernels_supported_devices"):
                self._patches.callback(setattr, optimizer_module, name, getattr(optimizer_module, name))
                setattr(optimizer_module, name, cuda_like)
        # A storage resized in place (FSDP frees and refills its all-gather
        # buffers this way) is a free and an allocation: the call reaches no
        # operator, so the recorder hears it from the method itself.
        resize = torch.UntypedStorage.resize_
        recorder = self

        def resize_(storage, size):
            result = resize(storage, size)
            recorder._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._patches.callback(setattr, torch.UntypedStorage, "resize_", resize)
        # `tensor.data = other` (Module.to and .half convert parameters this
        # way) gives a tensor another storage without an operator either.
        own = torch.Tensor.__dict__.get("data")  # None: inherited from the C base
        data = torch.Tensor.data if own is None else own

        def set_data(tensor, other):
            data.__set__(tensor, other)
            recorder._data_set(tensor)

        torch.Tensor.data = property(data.__get__, set_data, doc=data.__doc__)
        if own is None:
            self._patches.callback(delattr, torch.Tensor, "data")
        else:
            self._patches.callback(setattr, torch.Tensor, "data", own)
        return super().__enter__()

    def _resized(self, storage):
        key = storage._cdata
        emptied = self.emptied.pop(key, None)
        # A storage of a device tensor, though it says "meta" (a CudaTensor's
        # under `tidepool.plan run`): known live, or emptied by resize_(0).
        ours = key in self.live or emptied is not None and not emptied.expired()
        if storage.device.type not in self.devices and not ours:
            return
        entry = self.live.get(key)
        size = storage.nbytes()
        if entry is not None and entry.size == size:
            return
        category = None
        if entry is not None:
            category = self.labels.get(entry.pointer)
            self.live.pop(key)
            self._event("free", entry.pointer, entry.size, "")
        if size == 0:
            self.suspects.discard(key)
            self.emptied[key] = StorageWeakRef(storage)
            return
        fresh = _Live(self._new_pointer(size), size, StorageWeakRef(storage))
        if entry is not None and entry.pointer in self.device_of:
            self.device_of[fresh.pointer] = self.device_of[entry.pointer]
        fresh.objects = entry.objects if entry is not None else 0
        self.live[key] = fresh
        self._event("allocate", fresh.pointer, size, "resize_")
        category = category or self._phase
        if category is not None:
            self.labels[fresh.pointer] = category
        if fresh.objects <= 0:
            self.suspects.add(key)  # no tensor object of ours holds it: look at it each time

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._patches.close()
        self._collect()
        # Whatever is still live (weights, optimizer state) stays live: the
        # trace ends with it allocated, as the process would.
        if self.path is not None:
            self.write(self.path)
        return result

    # -- results -----------------------------------------------------------
    def write(self, path):
        """Writes the events as RMM CSV (with the Operator column), each
        mark as a `mark` row where it was made, its label as its operator
        (`tidepool replay` tells a step's end by it: `step N`)."""
        marks = sorted(self.marks, key=lambda mark: mark[1])
        with open(path, "w") as out:
            out.write(HEADER)

            def row(micros, action, pointer, size, operator):
                secs = micros // 1_000_000
                out.write(
                    f"1,{secs // 3600:02}:{secs // 60 % 60:02}:{secs % 60:02}.{micros % 1_000_000:06},"
                    f"{action},{pointer:#x},{size},0,{operator}\n"
                )

            at = 0
            for index, (micros, action, pointer, size, operator) in enumerate(self.events):
                while at < len(marks) and marks[at][1] <= index:
                    row(micros, "mark", 0, 0, marks[at][0].replace(",", ";"))
                    at += 1
                row(micros, action, pointer, size, operator)
            last = self.events[-1][0] if self.events else 0
            for label, _ in marks[at:]:
                row(last, "mark", 0, 0, label.replace(",", ";"))

    def snapshot(self, events=None):
        """The recording as a PyTorch memory snapshot (the dict
        `torch.cuda.memory._snapshot()` returns): each allocation's frame
        names its operator; what is live at the end sits in segments of
        its own, on its device (a trace per device). `events` (a range of
        event indices; None: all) are the ones its traces hold, as
        PyTorch's hold those of the time its history was recorded: an
        allocation made before them and freed among them is a free without
        its allocation, as there.
        `tidepool replay` and pytorch.org/memory_viz read it."""
        window = range(len(self.events)) if events is None else events
        traces, live = [[] for _ in range(max(self.devices_used()) + 1)], {}
        for index, (micros, action, pointer, size, operator) in enumerate(self.events):
            traced = index in window
            trace = traces[self.device_of.get(pointer, 0)]
            frames = [{"name": operator or "free", "filename": "tidepool.record", "line": 0}]
            if action == "allocate":
                live[pointer] = size
                if traced:
                    trace.append({"action": "alloc", "addr": pointer, "size": size, "stream": 0, "time_us": micros,
                                  "frames": frames})
            else:
                live.pop(pointer, None)
                for kind in ("free_requested", "free_completed") if traced else ():
                    trace.append({"action": kind, "addr": pointer, "size": size, "stream": 0, "time_us": micros,
                                  "frames": []})
        segments = [{"device": self.device_of.get(pointer, 0), "address": pointer,
                     "total_size": (size + 511) // 512 * 512, "stream": 0,
                     "segment_type": "large" if size > (1 << 20) else "small", "allocated_size": size,
                     "active_size": size, "requested_size": size,
                     "blocks": [{"address": pointer, "size": (size + 511) // 512 * 512, "requested_size": size,
                                 "state": "active_allocated"}]}
                    for pointer, size in sorted(live.items())]
        return {"segments": segments, "device_traces": traces}

    def write_snapshot(self, path, events=None):
        """Writes snapshot(events) as a pickle, as torch.cuda.memory._dump_snapshot does."""
        import pickle

        with open(path, "wb") as f:
            pickle.dump(self.snapshot(events), f)

    def devices_used(self):
        """The indices of the devices the recording allocated on ([0] for none)."""
        return sorted({self.device_of.get(pointer, 0) for _, action, pointer, _, _ in self.events} or {0})

    def on_device(self, index):
        """The recording of device `index` alone: a Recorder (never entered)
        holding its events, their labels and marks, and its workspaces."""
        view = Recorder(None, devices=self.devices, cublas_workspace=self.workspace_size)
        kept = [i for i, event in enumerate(self.events) if self.device_of.get(event[2], 0) == index]
        view.events = [self.events[i] for i in kept]
        view.allocs = sum(1 for event in view.events if event[1] == "allocate")
        view.labels = self.labels
        view.device_of = self.device_of
        view.workspaces = {key: pointer for key, pointer in self.workspaces.items() if key[1] == index}
        view.marks = [(label, bisect.bisect_left(kept, at)) for label, at in self.marks]
        return view

    def peak(self):
        """(peak live bytes, index of the event that reached it)."""
        live = peak = at = 0
        for i, (_, action, _, size, _) in enumerate(self.events):
            live += size if action == "allocate" else -size
            if live > peak:
                peak, at = live, i
        return peak, at

    def breakdown_at_peak(self):
        """Bytes live at the peak, by category (they sum to the peak)."""
        return self.breakdown_at(self.peak()[1])

    def breakdown_at(self, at):
        """Bytes live just after event `at`, by category."""
        live = {}
        for _, action, pointer, size, _ in self.events[: at + 1]:
            if action == "allocate":
                live[pointer] = size
            else:
                live.pop(pointer, None)
        sums = dict.fromkeys(CATEGORIES, 0)
        for pointer, size in live.items():
            sums[self.labels.get(pointer, ACTIVATIONS)] += size
        return sums

    def timeline(self, points=400):
        """Live bytes by category over the recording: [(event index, {category: bytes})]."""
        step = max(1, len(self.events) // points)
        sums = dict.fromkeys(CATEGORIES, 0)
        out = []
        for i, (_, action, pointer, size, _) in enumerate(self.events):
            sums[self.labels.get(pointer, ACTIVATIONS)] += size if action == "allocate" else -size
            if i % step == 0 or i == len(self.events) - 1:
                out.append((i, dict(sums)))
        return out
