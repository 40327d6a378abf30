"""A sleep-mode allocator of the shape of vLLM's CuMemAllocator
(vllm/device_allocator/cumem.py), over tidepool's tags.

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = load_model()
    with allocator.use_memory_pool(tag="kv_cache"):
        kv_caches = allocate_kv_cache()
    allocator.sleep(offload_tags=("weights",))   # weights to pinned host memory, the KV cache discarded
    allocator.wake_up(["weights"])               # same addresses, weights back
    allocator.wake_up(["kv_cache"])              # same addresses, contents undefined

Each vLLM tag is the tidepool tag "vllm:" + tag (`tidepool_tag(tag)`).
tidepool must be PyTorch's allocator (tidepool.install(), before CUDA
starts); vLLM's own allocator is a pluggable allocator inside a MemPool
instead. patch_vllm() puts this class where vLLM's GPU worker looks for its
allocator; docs/runtimes.md says when and how to call it.
"""
import contextlib
import gc
import sys
import threading

from . import _memory
from . import tags as _tags
from ._devices import current_device
from ._native import TidepoolError

_PREFIX = "vllm:"


def tidepool_tag(tag):
    """The tidepool tag use_memory_pool(tag) allocates under."""
    return _PREFIX + tag


class CuMemAllocator:
    """vLLM's CuMemAllocator over tidepool's tags: tensors made inside
    use_memory_pool(tag) carry the tag; sleep() gives back every tag's
    memory, copying the offload tags' contents to pinned host memory first
    and discarding the rest; wake_up() maps it again at the same addresses.
    A singleton, as vLLM's: get_instance()."""

    instance = None
    default_tag = "default"

    @staticmethod
    def get_instance():
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def __init__(self):
        self.current_tag = CuMemAllocator.default_tag
        self._lock = threading.RLock()
        self._tags = {}  # vLLM tag -> tidepool tag, for every pool used
        self._sleeping = {}  # vLLM tag -> offloaded, for the tags asleep

    @contextlib.contextmanager
    def use_memory_pool(self, tag=None):
        """Tensors this thread makes in the block carry `tag` (None: "default").
        Unlike vLLM's, no MemPool is made: tidepool keeps the tag's memory on
        pages of its own, and what the block frees stays cached for the tag
        (sleep gives it back too)."""
        if tag is None:
            tag = CuMemAllocator.default_tag
        if not isinstance(tag, str):
            raise TypeError(f"CuMemAllocator: a tag is a str, not {type(tag).__name__}")
        name = tidepool_tag(tag)
        if not tag or len(name.encode("utf-8")) > _tags.MAX_TAG_BYTES:
            raise ValueError(f"CuMemAllocator: tag {tag!r} must be 1 to {_tags.MAX_TAG_BYTES - len(_PREFIX)} bytes of UTF-8 under tidepool")
        old_tag = self.current_tag
        with _tags.region(name):
            with self._lock:
                self._tags[tag] = name
            self.current_tag = tag
            try:
                yield
            finally:
                self.current_tag = old_tag

    def sleep(self, offload_tags=None):
        """Gives back the memory of every tag used and awake: the offload
        tags' contents (None: the "default" tag's) go to pinned host memory
        first, the other tags' are discarded. Tags asleep already are left
        as they are (as vLLM's current allocator does), so sleeping twice is
        harmless. If a pause fails, the tags this call paused are woken
        again and the error raised."""
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        offload_tags = tuple(offload_tags)
        with self._lock:
            plan = [(tag, tag in offload_tags) for tag in self._tags if tag not in self._sleeping]
            _tags.pause_all([(self._tags[tag], offload) for tag, offload in plan])
            self._sleeping.update(plan)
        gc.collect()
        _memory.empty_cache()  # the untagged cache too, as vLLM's torch.cuda.empty_cache()

    def discard(self, tags):
        """Gives back the memory of `tags` (a str or a tuple), contents
        discarded, as vLLM's MemAllocator.discard; tags asleep already are
        left as they are. Raises TidepoolError for a tag never used."""
        if isinstance(tags, str):
            tags = (tags,)
        with self._lock:
            self._check_known("discard", tags)
            plan = [tag for tag in dict.fromkeys(tags) if tag not in self._sleeping]
            _tags.pause_all([(self._tags[tag], False) for tag in plan])
            self._sleeping.update((tag, False) for tag in plan)

    def _check_known(self, verb, tags):
        unknown = [tag for tag in tags if tag not in self._tags]
        if unknown:
            raise TidepoolError(f"CuMemAllocator.{verb}: unknown tag: {', '.join(map(repr, unknown))} (no use_memory_pool(tag) with it in this process)")

    def wake_up(self, tags=None):
        """Maps the memory of `tags` (None: every tag asleep) again at the same
        addresses and copies back what sleep offloaded; the others' contents
        are undefined. Raises TidepoolError, changing nothing, for a tag never
        used or not asleep, and when the GPU has no room (the tags stay
        asleep, their contents intact)."""
        if isinstance(tags, str):
            tags = [tags]
        with self._lock:
            if tags is None:
                tags = [tag for tag in self._tags if tag in self._sleeping]
            else:
                tags = list(dict.fromkeys(tags))
                self._check_known("wake_up", tags)
                awake = [tag for tag in tags if tag not in self._sleeping]
                if awake:
                    raise TidepoolError(f"CuMemAllocator.wake_up: not asleep: {', '.join(map(repr, awake))}")
            _tags.resume_all([(self._tags[tag], self._sleeping[tag]) for tag in tags])
            for tag in tags:
                del self._sleeping[tag]

    def get_current_usage(self):
        """Bytes of the live tensors made in the memory pools, on the current
        device, asleep or not (vLLM's sums its allocations' sizes)."""
        device = current_device()
        with self._lock:
            return sum(_tags.tag_stats(name, device)["allocated_bytes"] for name in self._tags.values())


# Where vLLM's versions keep the names patch_vllm replaces: the allocator's
# module and its package (newer versions keep them under
# vllm.backends.platform, vllm.device_allocator then being a shim that
# forwards there), and the GPU worker, which imports them.
_VLLM_MODULES = (
    "vllm.device_allocator.cumem",
    "vllm.device_allocator",
    "vllm.backends.platform.device_allocator.cumem",
    "vllm.backends.platform.device_allocator",
    "vllm.v1.worker.gpu_worker",
)


def patch_vllm():
    """Puts CuMemAllocator where vLLM's GPU worker gets its sleep-mode
    allocator, in the vLLM modules this process has or can import
    (_VLLM_MODULES): CuMemAllocator (and cumem_available) in the
    allocator's module, get_mem_allocator_instance in its package, and
    either name in vllm.v1.worker.gpu_worker where it imports it.
    Returns the names replaced; raises TidepoolError when there is none.
    Call it in every worker process, after tidepool.install()."""
    import importlib

    replaced = []
    for module_name in _VLLM_MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        if hasattr(module, "CuMemAllocator"):
            module.CuMemAllocator = CuMemAllocator
            replaced.append(f"{module_name}.CuMemAllocator")
        if hasattr(module, "cumem_available"):
            module.cumem_available = True
            replaced.append(f"{module_name}.cumem_available")
        if hasattr(module, "get_mem_allocator_instance"):
            module.get_mem_allocator_instance = CuMemAllocator.get_instance
            replaced.append(f"{module_name}.get_mem_allocator_instance")
    if not replaced:
        raise TidepoolError("patch_vllm: found no vLLM module with a CuMemAllocator or get_mem_allocator_instance to replace (" + ", ".join(_VLLM_MODULES) + ")")
    return replaced


__all__ = ["CuMemAllocator", "patch_vllm", "tidepool_tag", "TidepoolError"]
