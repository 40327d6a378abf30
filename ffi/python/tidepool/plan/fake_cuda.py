"""CUDA without a GPU, for `python -m tidepool.plan run`: every CUDA tensor
a script makes is a tensor without storage (the meta device's) that says it
is on "cuda:N", and torch.cuda answers as a card of the cards table would.

How (as PyTorch's FakeTensor, without the rest of it, and without its
CUDA dispatch keys: with those, autograd asks the driver for the device's
streams):
- `CudaTensor` is a tensor subclass over a meta tensor (the same storage,
  which is what the Recorder counts): C++ sees a meta tensor, Python sees
  "cuda:N" (`.device`, `.is_cuda`, `.get_device()`);
- `FakeCuda`, a dispatch mode under the Recorder, runs every operator that
  touches CUDA (a CudaTensor argument, `device="cuda"`, a copy to CUDA) on
  the meta kernels and wraps what comes out as CudaTensors; operators on
  CPU tensors run as written, on their data;
- `CudaDevices`, a function mode, gives "cuda" its index before C++ would
  ask the driver for it, and keeps `.to(device)` of a tensor already there
  from copying;
- `Module._apply` keeps each parameter object through `.cuda()` and
  `.to()` (`_moving_keeps_parameters`), and `torch.autocast("cuda")`
  applies CUDA's rules (`cuda_autocast_regions`, autocast.py's);
- what reads data back (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`,
  printing) gets a placeholder (reads.py's), a copy to the CPU filled
  with it;
- torch.cuda's functions answer from the card and the recording
  (`fake_cuda()`); `torch.cuda._lazy_init` does nothing, so that no driver
  is asked for.
"""
import collections
import contextlib
import importlib

import torch
import torch.utils._device
import torch.utils._foreach_utils
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .patching import replaced
from .reads import placeholder, reads

_ITEM = torch.ops.aten._local_scalar_dense.default
_DATA = {_ITEM, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
_TO_COPY, _COPY = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default


def _masked_select(x, mask):
    return x.new_empty(torch.broadcast_shapes(x.shape, mask.shape).numel())


def _unique(x, sorted=True, return_inverse=False, return_counts=False, *rest):  # noqa: A002 - aten's names
    return (x.new_empty(x.numel()), x.new_empty(x.shape if return_inverse else 0, dtype=torch.long),
            x.new_empty(x.numel() if return_counts else 0, dtype=torch.long))


# Operators whose result's size is the data's (how many are true, how many
# differ): the largest, every element counted (the Recorder's plan for the
# ordinary input, and an upper bound), the read noted. nonzero (and the
# indexing by a mask made of it) has its meta kernel for that
# (meta_nonzero_assume_all_nonzero, set in fake_cuda()).
_SIZED_BY_DATA = {torch.ops.aten.nonzero.default: None, torch.ops.aten.masked_select.default: _masked_select,
                  torch.ops.aten._unique2.default: _unique, torch.ops.aten.unique_consecutive.default: _unique,
                  torch.ops.aten.unique_dim.default: None}


def _cuda(device):
    """The CUDA device `device` names (index filled in), or None."""
    if device is None:
        return None
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", _state.current)


def _index(device):
    """The index of the CUDA device `device` names (None: the current one)."""
    if device is None:
        return _state.current
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else _state.current


class _State:
    """What the fake CUDA devices are: how many, which is current."""

    def __init__(self):
        self.count = 1
        self.current = 0
        self.in_kernel = False
        self.adopting = None  # the CUDA device C++'s meta tensors are on (adopting())
        self.dtypes = set()  # the dtypes of the CUDA tensors made


_state = _State()


class CudaTensor(torch.Tensor):
    """A CUDA tensor without storage: a meta tensor that says "cuda:N" to
    Python (`.device`, `.is_cuda`); C++ sees the meta tensor it is, so that
    nothing asks a driver for the device's streams."""

    @staticmethod
    def __new__(cls, elem, device):
        self = torch.Tensor._make_subclass(cls, elem, elem.requires_grad)
        self._cuda_device = device
        return self

    @property
    def device(self):
        # Inside a kernel (a decomposition written in Python) the meta device.
        return torch.device("meta") if _state.in_kernel else self._cuda_device

    @property
    def is_cuda(self):
        return not _state.in_kernel

    @property
    def is_meta(self):
        return _state.in_kernel

    def get_device(self):
        return -1 if _state.in_kernel else self._cuda_device.index

    def __repr__(self, *, tensor_contents=None):
        reads.note("print")
        return f"tensor(<no data: shape {tuple(self.shape)}>, device='{self._cuda_device}', dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    __torch_function__ = torch._C._disabled_torch_function_impl


# Optimizers and clip_grad_norm_ take their foreach paths for these types
# only (DTensor adds itself the same way): as on CUDA, CudaTensors too.
for _types in (importlib.import_module("torch.optim.optimizer")._foreach_supported_types,
               torch.utils._foreach_utils._foreach_supported_types):
    if CudaTensor not in _types:
        _types.append(CudaTensor)


def wrap(tensor, device):
    """A meta tensor as a CudaTensor on `device` (the same storage)."""
    if isinstance(tensor, CudaTensor) or not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
        return tensor
    _state.dtypes.add(tensor.dtype)
    return CudaTensor(tensor, device)


def dtypes_made():
    """The dtypes of the CUDA tensors made since fake_cuda() was entered."""
    return set(_state.dtypes)


@contextlib.contextmanager
def _in_kernel():
    # As FakeTensor's in_kernel_invocation_manager: the meta kernels, without
    # coming back to Python's dispatch.
    before = _state.in_kernel
    with torch._C._DisableTorchDispatch():
        _state.in_kernel = True
        try:
            yield
        finally:
            _state.in_kernel = before


def _to_meta(value):
    if isinstance(value, torch.device) or isinstance(value, str):
        return value  # devices are rewritten by name below
    if isinstance(value, torch.Tensor) and not isinstance(value, CudaTensor) and value.device.type == "cpu" \
            and value.dim() > 0:
        # A CPU tensor an operator on CUDA reads (the source of `.to("cuda")`,
        # say): its shape on the meta device.
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _dispatch(func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    device = _cuda(kwargs.get("device"))
    if device is None:
        device = next((t._cuda_device for t in flat if isinstance(t, CudaTensor)), None)
    if device is None and _state.adopting is not None and _on_meta(flat, kwargs):
        device = _state.adopting
    if device is None:
        return func(*args, **kwargs)  # CPU work (and the script's own meta tensors) as written
    if func in _SIZED_BY_DATA:
        reads.note(f"{func._overloadpacket.__name__}() sized as if every element counted")
        sized = _SIZED_BY_DATA[func]
        if sized is not None:
            with _in_kernel():
                out = sized(*tree_map(_to_meta, args), **kwargs)
            return tree_map(lambda t: wrap(t, device), out)
    if func in _DATA:
        # A bool tensor's value is read by `if t:` and `while t.any():` far
        # more than by `.item()`; both reach the same operator.
        asked = ".item()" if func is _ITEM and args[0].dtype != torch.bool else "bool()"
        spinning = reads.note(asked)
        if func is not _ITEM:
            return not spinning
        return placeholder(args[0], spinning)
    if func is _TO_COPY and str(kwargs.get("device", "")).startswith("cpu"):
        # Data never leaves the fake card: a copy to the CPU holds the
        # placeholder (`.tolist()`, `.numpy()`, printing read it).
        reads.note("copy to the CPU")
        source = args[0]
        return torch.full(source.shape, placeholder(source), dtype=kwargs.get("dtype") or source.dtype,
                          device="cpu")
    if func is _COPY and args[0].device.type == "cpu":
        reads.note("copy to the CPU")
        return args[0].fill_(placeholder(args[1]))
    if "device" in kwargs:
        kwargs = dict(kwargs, device=torch.device("meta"))
    args, kwargs = tree_map(_to_meta, (args, kwargs))
    with _in_kernel():
        out = func(*args, **kwargs)
    return tree_map(lambda t: wrap(t, device), out)


def _on_meta(flat, kwargs):
    return str(kwargs.get("device")) == "meta" or any(
        isinstance(t, torch.Tensor) and t.device.type == "meta" for t in flat)


@contextlib.contextmanager
def adopting(device):
    """Meta tensors made inside are CudaTensors on `device`: for C++ that
    makes a CUDA module's tensors from the meta tensors it sees
    (DistributedDataParallel's gradient buckets), where no script runs."""
    before, _state.adopting = _state.adopting, device
    try:
        yield
    finally:
        _state.adopting = before


class FakeCuda(TorchDispatchMode):
    """Runs operators that touch CUDA on the meta kernels (see the module)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _indexed(value):
    """"cuda" and torch.device("cuda") as the current device with its index:
    PyTorch asks the driver for the index of a device without one."""
    if isinstance(value, str) and value == "cuda":
        return torch.device("cuda", _state.current)
    if isinstance(value, torch.device) and value.type == "cuda" and value.index is None:
        return torch.device("cuda", _state.current)
    return value


_CUDA_METHOD, _TO = torch.Tensor.cuda, torch.Tensor.to


class CudaDevices(TorchFunctionMode):
    """Gives every CUDA device an argument names its index (the current
    device's), before PyTorch would ask the driver for it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device:
            return func(*args, **kwargs)
        if func is _CUDA_METHOD:
            device = kwargs.pop("device", args[1] if len(args) > 1 else None)
            device = torch.device("cuda", _state.current) if device is None else device
            device = torch.device("cuda", device) if isinstance(device, int) else _indexed(torch.device(device))
            if isinstance(args[0], CudaTensor) and args[0]._cuda_device == device:
                return args[0]  # already there: itself, as on CUDA
            return func(args[0], device, *args[2:], **kwargs)
        args, kwargs = tree_map(_indexed, (args, kwargs))
        if kwargs.get("pin_memory"):
            # Page-locked host memory is the driver's: host memory is host memory.
            kwargs = dict(kwargs, pin_memory=False)
        if func is _TO and isinstance(args[0], CudaTensor):
            # To the device it is on: no copy (C++ sees the meta device and
            # would copy); to another dtype: the cast, on the card.
            copy = kwargs.get("copy", False)
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(
                *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
            if device is None or device.type == "cuda" and device == args[0]._cuda_device:
                if copy or dtype not in (None, args[0].dtype) or \
                        memory_format not in (None, torch.preserve_format):
                    return func(args[0], dtype=dtype or args[0].dtype, non_blocking=non_blocking,
                                copy=bool(copy), memory_format=memory_format or torch.preserve_format)
                return args[0]
            if device.type == "cuda":
                # To another card: the copy itself (C++ would guard the
                # target card first, which asks the driver).
                return torch.ops.aten._to_copy.default(args[0], dtype=dtype or args[0].dtype, device=device,
                                                       non_blocking=bool(non_blocking),
                                                       memory_format=memory_format or torch.preserve_format)
        default = torch.utils._device.CURRENT_DEVICE
        if default is not None and default.type == "cuda" and kwargs.get("device") is None and \
                func in torch.utils._device._device_constructors():
            # torch.set_default_device("cuda"): its mode sits under this one.
            kwargs = dict(kwargs, device=_indexed(default))
        if func in _FROM_DATA or func is _NEW_TENSOR:
            # These build the tensor below Python's dispatch: built on the
            # CPU, then copied to the (fake) card.
            device = _cuda(kwargs.get("device"))
            if device is None and func is _NEW_TENSOR and isinstance(args[0], CudaTensor) \
                    and "device" not in kwargs:
                device = args[0].device
            if device is not None:
                return func(*args, **dict(kwargs, device="cpu")).to(device)
        return func(*args, **kwargs)


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_NEW_TENSOR = torch.Tensor.new_tensor


_COMPATIBLE = torch._has_compatible_shallow_copy_type


def _moving_keeps_parameters(recorder):
    """Module._apply (`.cuda()`, `.to("cuda")`) as on CUDA: each parameter
    keeps its identity (an optimizer made before the move, weights tied
    between modules), where a CudaTensor cannot be given to it with `.data =`.

    Each distinct tensor is converted once (tied weights stay one), the
    module gets a new Parameter from it, then the old parameter object and
    the new one swap contents (torch.utils.swap_tensors, as PyTorch's
    swap_module_params_on_conversion), and every module holds the old
    object, now the CudaTensor."""
    apply = torch.nn.Module._apply
    depth = [0]

    def _apply(module, fn, recurse=True):
        if depth[0]:
            return apply(module, fn, recurse)
        memo = {}

        def once(tensor):
            key = id(tensor)
            if key not in memo:
                memo[key] = (tensor, fn(tensor))  # the tensor kept: its id stays its own
            return memo[key][1]

        before = {(m, name): p for m in (module.modules() if recurse else [module])
                  for name, p in m._parameters.items() if p is not None}
        depth[0] += 1
        try:
            result = apply(module, once, recurse)
        finally:
            depth[0] -= 1
        swapped = {}
        for (m, name), old in before.items():
            new = m._parameters.get(name)
            if id(old) in swapped:  # a tied weight, swapped where first held
                m._parameters[name] = old
                continue
            if new is None or new is old or not isinstance(new, CudaTensor) or isinstance(old, CudaTensor):
                continue
            # The recorder lets go of the new object (swap_tensors refuses
            # objects with weak references) and counts the old one instead.
            known = recorder.objects.pop(id(new), None)
            if known is not None:
                recorder._let_go(known[1][0])
                del known
            torch.utils.swap_tensors(old, new)
            recorder._track(old, "to")
            swapped[id(old)] = old
            m._parameters[name] = old
        return result

    return _apply


def _compatible(input: torch.Tensor, from_: torch.Tensor) -> bool:  # noqa: A002 - torch's signature (dynamo checks it)
    # Module.to("cuda") gives a parameter CUDA data with `.data =` where the
    # types agree; a CudaTensor's cannot be given to a plain tensor that way
    # (it would report the meta device): the module gets a new parameter
    # instead, as PyTorch does for FakeTensor.
    if isinstance(input, CudaTensor) != isinstance(from_, CudaTensor):
        return False
    if isinstance(input, CudaTensor):
        return True  # `.half()` on the card: `.data =`, as CUDA tensors do
    return _COMPATIBLE(input, from_)


# -- torch.cuda as on a card of the cards table ---------------------------

class DeviceProperties:
    """What torch.cuda.get_device_properties says of a card."""

    def __init__(self, card):
        self.name = f"NVIDIA {card.name}"
        self.total_memory = card.total
        self.major, self.minor = card.compute_capability or (8, 0)
        self.multi_processor_count = 132 if self.major >= 9 else 108
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.warp_size = 32
        self.L2_cache_size = 50 << 20
        self.gcnArchName = ""
        self.uuid = "GPU-00000000-0000-0000-0000-000000000000"

    def __repr__(self):
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count={self.multi_processor_count})")


class Stream:
    """A CUDA stream that orders nothing: the recording has one timeline."""

    def __init__(self, device=None, priority=0, **_):
        self.device = _cuda(device or "cuda")
        self.priority = priority
        self.cuda_stream = self.stream_id = 0
        self.device_index, self.device_type = self.device.index, 1  # c10::DeviceType::CUDA

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self):
        return True

    def synchronize(self):
        pass

    def is_capturing(self):
        return False

    def __eq__(self, other):
        return isinstance(other, Stream)

    def __hash__(self):
        return 0


class Event:
    """A CUDA event; elapsed_time is NaN: no kernel ran, so no time is known."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **_):
        self.enable_timing = enable_timing

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event):
        return float("nan")


_OPEN = 1 << 62  # the end of a memory history still being recorded


class Memory:
    """torch.cuda's memory figures, answered from the recording, each of the
    device asked about (the current one by default): the live bytes of the
    Recorder's events on it, their peak since the last reset; what PyTorch's
    allocator would reserve for them from `pytorch_reserved(recording)` (a
    model of its policy over that device's events), asked again only when
    events came."""

    def __init__(self, recorder, pytorch_reserved=None):
        self.recorder = recorder
        self.pytorch_reserved = pytorch_reserved
        self.reserved_at = {}  # device -> (events, bytes) of the last answer
        # The events walked so far, and each device's live bytes after them
        # and their peak since the last reset_peak_memory_stats: each call
        # walks only the events that came since the last.
        self.walked, self.live, self.peak = 0, collections.Counter(), collections.Counter()
        self.history = None  # the events the snapshots hold (_record_memory_history); None: none yet

    def _walk(self, device):
        self.recorder._collect()
        events, device_of = self.recorder.events, self.recorder.device_of
        if len(events) < self.walked:  # the recording started anew (Recorder.start)
            self.walked, self.live, self.peak = 0, collections.Counter(), collections.Counter()
        for _, action, pointer, size, _ in events[self.walked:]:
            on = device_of.get(pointer, 0)
            self.live[on] += size if action == "allocate" else -size
            self.peak[on] = max(self.peak[on], self.live[on])
        self.walked = len(events)
        return _index(device)

    def reserved(self, device=None):
        index = self._walk(device)
        if self.pytorch_reserved is None:
            return self.peak[index]
        if self.reserved_at.get(index, (None,))[0] != self.walked:
            on_device = self.recorder.on_device(index)
            self.reserved_at[index] = (self.walked, self.pytorch_reserved(on_device) if on_device.events else 0)
        return self.reserved_at[index][1]

    def allocated(self, device=None):
        return self.live[self._walk(device)]

    def max_allocated(self, device=None):
        return self.peak[self._walk(device)]

    def reset_peak(self, device=None):
        index = self._walk(device)
        self.peak[index] = self.live[index]

    def stats(self, device=None):
        current, peak = self.allocated(device), self.max_allocated(device)
        out = {}
        for key in ("allocated_bytes", "active_bytes", "requested_bytes"):
            out[f"{key}.all.current"], out[f"{key}.all.peak"] = current, peak
        out["reserved_bytes.all.current"] = out["reserved_bytes.all.peak"] = self.reserved(device)
        out["num_alloc_retries"] = out["num_ooms"] = 0
        return out

    def summary(self, device=None, abbreviated=False):
        mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
        return (f"tidepool.plan run: cuda:{_index(device)} planned without data: {mib(self.allocated(device))} live, "
                f"{mib(self.max_allocated(device))} at the peak, {mib(self.reserved(device))} reserved by PyTorch's "
                "allocator (the report gives what each allocator needs)")

    def record_history(self, enabled="all", *args, **kwargs):
        """`torch.cuda.memory._record_memory_history`: the snapshots hold the
        events from here (the recorder keeps every event anyway) until it
        is called with None or False; called again, from there anew."""
        self.recorder._collect()
        now = len(self.recorder.events)
        recording = self.history is not None and self.history.stop == _OPEN
        if enabled in (None, False):
            if recording:
                self.history = range(self.history.start, now)
        elif not recording:
            self.history = range(now, _OPEN)

    def _history(self):
        """The events a snapshot holds now (none before any history)."""
        self.recorder._collect()
        return self.history if self.history is not None else range(0)

    def dump_snapshot(self, filename="dump_snapshot.pickle"):
        self.recorder.write_snapshot(filename, self._history())

    def snapshot(self, *args, **kwargs):
        return self.recorder.snapshot(self._history())


@contextlib.contextmanager
def fake_cuda(card, recorder, count=1, pytorch_reserved=None):
    """torch.cuda as on `count` cards like `card` (cards.Card), its memory
    figures from `recorder` (what PyTorch would reserve from
    `pytorch_reserved(recorder)`; None: the peak of live bytes); CUDA
    tensors as CudaTensors (FakeCuda, under `recorder`, which is entered
    here too)."""
    # Dynamo reads torch.cuda's functions when first imported (which torch
    # does on a first call of many of its functions): before they change.
    import torch._dynamo  # noqa: F401

    memory = Memory(recorder, pytorch_reserved)
    properties = DeviceProperties(card)
    _state.count, _state.current = count, 0
    _state.dtypes.clear()

    def set_device(device):
        index = _index(device)
        if not 0 <= index < _state.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index}; {_state.count} planned)")
        _state.current = index

    class device:  # noqa: N801 - torch.cuda.device
        def __init__(self, device):
            self.index = _index(device) if device is not None else -1
            self.before = None

        def __enter__(self):
            self.before = _state.current
            if self.index >= 0:
                set_device(self.index)

        def __exit__(self, *exc):
            _state.current = self.before
            return False

    stream = Stream()
    nothing = lambda *args, **kwargs: None  # noqa: E731
    answers = {
        "_lazy_init": nothing, "init": nothing, "is_initialized": lambda: True, "is_available": lambda: True,
        "device_count": lambda: _state.count, "current_device": lambda: _state.current, "set_device": set_device,
        "device": device, "get_device_properties": lambda device=None: properties,
        "get_device_name": lambda device=None: properties.name,
        "get_device_capability": lambda device=None: (properties.major, properties.minor),
        "get_arch_list": lambda: [f"sm_{properties.major}{properties.minor}"],
        "is_bf16_supported": lambda including_emulation=True: properties.major >= 8,
        "is_tf32_supported": lambda: properties.major >= 8,
        "synchronize": nothing, "empty_cache": nothing, "ipc_collect": nothing,
        "manual_seed": nothing, "manual_seed_all": nothing, "seed": nothing, "seed_all": nothing,
        "Stream": Stream, "Event": Event, "current_stream": lambda device=None: stream,
        "default_stream": lambda device=None: stream, "set_stream": nothing,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "mem_get_info": lambda device=None: (max(0, card.usable - memory.reserved(device)), card.total),
        "memory_allocated": memory.allocated, "max_memory_allocated": memory.max_allocated,
        "memory_reserved": memory.reserved, "max_memory_reserved": memory.reserved,
        "reset_peak_memory_stats": memory.reset_peak, "reset_max_memory_allocated": memory.reset_peak,
        "reset_accumulated_memory_stats": nothing, "memory_stats": memory.stats, "memory_summary": memory.summary,
        "_record_memory_history": memory.record_history, "_dump_snapshot": memory.dump_snapshot,
        "_snapshot": memory.snapshot, "memory_snapshot": lambda *a, **k: memory.snapshot()["segments"],
    }
    accelerator = {
        "is_available": lambda *a, **k: True, "device_count": lambda: _state.count,
        "current_device_index": lambda: _state.current, "current_device_idx": lambda: _state.current,
        "set_device_index": set_device, "set_device_idx": set_device, "current_stream": lambda device=None: stream,
        "synchronize": nothing, "current_accelerator": lambda check_available=False: torch.device("cuda"),
    }
    import torch.cuda.memory as cuda_memory

    import torch.fx.experimental._config as fx_config

    patches = [(module, name, value) for name, value in answers.items() for module in (torch.cuda, cuda_memory)
               if hasattr(module, name)]
    patches += [(torch.accelerator, name, value) for name, value in accelerator.items()
                if hasattr(torch.accelerator, name)]
    patches += [(torch, "_has_compatible_shallow_copy_type", _compatible),
                (fx_config, "meta_nonzero_assume_all_nonzero", True),
                (torch._C, "_get_accelerator", lambda check=False: torch.device("cuda")),
                (torch.nn.Module, "_apply", _moving_keeps_parameters(recorder)),
                (torch.Tensor, "record_stream", nothing),
                (torch.Tensor, "pin_memory", lambda self, device=None: self)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(*patches))
        stack.enter_context(FakeCuda())
        stack.enter_context(recorder)
        stack.enter_context(CudaDevices())
        stack.enter_context(cuda_autocast_regions())
        from .attention import cuda_attention
        from .comm import between_cards
        from .recompute import function_modes_in_recomputation

        stack.enter_context(cuda_attention())
        stack.enter_context(function_modes_in_recomputation())
        stack.enter_context(between_cards())
        yield memory


# -- torch.autocast("cuda") ------------------------------------------------

_autocasts = []  # the script's CUDA autocast regions, innermost last


def _region_mode(dtype, enabled):
    from .autocast import cuda_autocast

    class Region(cuda_autocast):
        """One `torch.autocast("cuda")` region: CUDA's rules (autocast.py)
        while it is the innermost region and enabled."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not _autocasts or _autocasts[-1] is not self or not self.on:
                return func(*args, **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs)

    region = Region(dtype)
    region.on = enabled
    return region


@contextlib.contextmanager
def cuda_autocast_regions():
    """`torch.autocast("cuda", ...)` (and torch.cuda.amp.autocast) applies
    CUDA autocast's rules to CudaTensors, which C++ autocast does not see
    (they are meta tensors to it)."""
    autocast = torch.amp.autocast_mode.autocast
    enter, exit_ = autocast.__enter__, autocast.__exit__

    def entered(self):
        result = enter(self)
        if self.device == "cuda":
            region = _region_mode(self.fast_dtype, bool(self._enabled))
            _autocasts.append(region)
            region.__enter__()
            self._tidepool_region = region
        return result

    def exited(self, *exc):
        region = self.__dict__.pop("_tidepool_region", None)
        if region is not None:
            region.__exit__(*exc)
            _autocasts.remove(region)
        return exit_(self, *exc)

    autocast.__enter__, autocast.__exit__ = entered, exited
    try:
        yield
    finally:
        autocast.__enter__, autocast.__exit__ = enter, exit_
