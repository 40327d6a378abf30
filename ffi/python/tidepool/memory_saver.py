"""torch_memory_saver's Python API over tidepool's tags.

A framework written against torch_memory_saver (sglang, verl, slime, ...)
switches by changing one import:

    # from torch_memory_saver import torch_memory_saver
    from tidepool.memory_saver import torch_memory_saver

    tidepool.install()                                   # first thing, before CUDA starts
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = build_model()
    with torch_memory_saver.region(tag="kv_cache"):
        kv = allocate_kv_cache()
    torch_memory_saver.pause("kv_cache")                 # contents discarded, memory given back
    torch_memory_saver.pause("weights")                  # contents to pinned host memory first
    torch_memory_saver.resume()                          # every paused tag, same addresses

Each (tag, enable_cpu_backup) pair a region names is a tidepool tag of its
own, `tidepool_tag(tag, enable_cpu_backup)`: "tms:weights+cpu" and
"tms:kv_cache" above, so `tidepool.tag_stats` and snapshots show them.
pause(tag) pauses both of a tag's tidepool tags, offloading the one with
CPU backup; pause() pauses every tag a region ever named.

Where it differs from torch_memory_saver (docs/runtimes.md has the list):
- tidepool must be PyTorch's allocator (tidepool.install()); there is no
  LD_PRELOAD and no second allocator: `hook_mode` is accepted and ignored.
- A region tags the calling thread's allocations only (torch_memory_saver's
  configuration is process-wide).
- Memory allocated outside any region, or under disable(), carries
  tidepool's "default" tag and is never paused; there is no
  TMS_INIT_ENABLE (pause everything, regions or not).
- The tag's cached free memory is given back too, and kept reserved for
  the tag: after resume the cache is as it was.
- cuda_graph(): the graph replays after resume when what it reads was
  allocated in regions; the graph's own pool (its intermediate tensors) is
  untagged and stays mapped.
- Bad calls raise TidepoolError (or ValueError / NotImplementedError)
  and change nothing, where torch_memory_saver prints and exits the
  process: pausing a paused tag, resuming one that is not paused, a tag no
  region ever named.
- No disk backup, no get_cpu_backup(), no retained CPU backup;
  memory_margin_bytes is kept but has no effect (resume that cannot get
  memory raises with the tag still paused and its contents intact).
"""
import contextlib
import threading

from . import _memory
from . import tags as _tags
from ._native import TidepoolError

_TAG_DEFAULT = "default"  # torch_memory_saver's default tag name (a tidepool tag "tms:default")
_PREFIX = "tms:"
_CPU = "+cpu"

_lock = threading.RLock()


def tidepool_tag(tag=_TAG_DEFAULT, enable_cpu_backup=False):
    """The tidepool tag that region(tag, enable_cpu_backup) allocates under."""
    return _PREFIX + tag + (_CPU if enable_cpu_backup else "")


def _check_tag(tag, what="tag"):
    if not isinstance(tag, str):
        raise TypeError(f"torch_memory_saver: a {what} is a str, not {type(tag).__name__}")
    longest = len(tidepool_tag(tag, True).encode("utf-8"))
    if not tag or longest > _tags.MAX_TAG_BYTES:
        limit = _tags.MAX_TAG_BYTES - len((_PREFIX + _CPU).encode("utf-8"))
        raise ValueError(f"torch_memory_saver: tag {tag!r} must be 1 to {limit} bytes of UTF-8 under tidepool")


class TorchMemorySaver:
    """torch_memory_saver's TorchMemorySaver over tidepool's tags; use the
    module's singleton, `torch_memory_saver`."""

    def __init__(self):
        # tag -> {enable_cpu_backup: tidepool tag} for every region entered.
        self._regions = {}
        # The tidepool tags paused by pause() and not resumed yet.
        self._paused = set()
        self._memory_margin_bytes = 0

    # -- regions -----------------------------------------------------------

    @contextlib.contextmanager
    def region(self, tag=_TAG_DEFAULT, enable_cpu_backup=False, enable_disk_backup=False, cpu_backup_backend=None):
        """Allocations this thread makes in the block carry `tag`: pause(tag)
        gives their memory back, copying it to pinned host memory first when
        enable_cpu_backup, discarding it otherwise. Regions nest; leaving one
        puts back the tag before it."""
        _check_tag(tag)
        self._check_backup(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        name = tidepool_tag(tag, enable_cpu_backup)
        with _tags.region(name):
            with _lock:
                self._regions.setdefault(tag, {})[bool(enable_cpu_backup)] = name
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode="global",
        tag=_TAG_DEFAULT,
        enable_cpu_backup=False,
        cpu_backup_backend=None,
    ):
        """torch.cuda.graph(cuda_graph, pool, stream, capture_error_mode) with
        region(tag, enable_cpu_backup) around the captured code. Under
        tidepool what a capture allocates goes to the graph's private pool,
        untagged: it stays mapped through a pause. The graph replays after
        resume as long as what it reads (weights, KV cache) was allocated
        in regions, whose addresses a pause keeps."""
        import torch

        _check_tag(tag)
        self._check_backup(enable_cpu_backup, False, cpu_backup_backend)
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with self.region(tag=tag, enable_cpu_backup=enable_cpu_backup, cpu_backup_backend=cpu_backup_backend):
                yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations this thread makes in the block carry tidepool's
        "default" tag, whatever region is open: pause() never touches them
        (slime allocates the weight-update buffers this way while paused).
        On leaving, empty_cache() gives back the whole free segments, as
        torch_memory_saver drops the block's memory pool."""
        try:
            with _tags.region(_tags.DEFAULT):
                yield
        finally:
            _memory.empty_cache()

    # -- pause and resume --------------------------------------------------

    def pause(self, tag=None):
        """Gives back the memory of `tag` (None: every tag a region named),
        after the work queued on it has run: with CPU backup its contents go
        to pinned host memory first, without they are discarded. Addresses
        are kept. Raises, changing nothing, for a tag no region named or one
        already paused."""
        with _lock:
            names = self._names(tag, "pause")
            paused = [name for name, _ in names if name in self._paused]
            if paused:
                raise TidepoolError(f"torch_memory_saver.pause({tag!r}): already paused: {', '.join(paused)}; resume it first")
            _tags.pause_all(names)
            self._paused.update(name for name, _ in names)

    def resume(self, tag=None):
        """Maps the memory of `tag` (None: every tag a region named) again at
        the same addresses and copies back what was backed up; returns once
        it is usable. Raises, changing nothing, for a tag no region named or
        one not paused, and when the GPU has no room (the tag stays paused,
        its backup intact: resume again later)."""
        with _lock:
            if tag is None:
                # Every paused tag; nothing to do when no region was entered
                # (as torch_memory_saver, which has no allocations then).
                names = [(name, offload) for name, offload in self._names(None, "resume") if name in self._paused]
                if self._regions and not names:
                    raise TidepoolError("torch_memory_saver.resume(): no tag is paused")
            else:
                # A region entered while its tag was paused made a tidepool
                # tag this pause never saw: resume leaves it alone.
                names = [(name, offload) for name, offload in self._names(tag, "resume") if name in self._paused]
                if not names:
                    raise TidepoolError(f"torch_memory_saver.resume({tag!r}): tag {tag!r} is not paused")
            _tags.resume_all(names)
            self._paused.difference_update(name for name, _ in names)

    def _names(self, tag, verb):
        if tag is None:
            return [(name, backup) for variants in self._regions.values() for backup, name in sorted(variants.items())]
        _check_tag(tag)
        variants = self._regions.get(tag)
        if not variants:
            raise TidepoolError(f"torch_memory_saver.{verb}({tag!r}): unknown tag: no region(tag={tag!r}) was entered in this process")
        return [(name, backup) for backup, name in sorted(variants.items())]

    # -- what torch_memory_saver offers besides ------------------------------

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        raise AttributeError("hook_mode can only be set")

    @hook_mode.setter
    def hook_mode(self, hook_mode):
        """Accepted ("preload" or "torch") and ignored: tidepool is PyTorch's
        allocator already (tidepool.install())."""
        if hook_mode not in ("preload", "torch"):
            raise ValueError(f"torch_memory_saver: hook_mode is 'preload' or 'torch', not {hook_mode!r}")

    @property
    def memory_margin_bytes(self):
        return self._memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value):
        """Kept, without effect: tidepool's resume fails cleanly (tag still
        paused, contents intact) when the GPU has no room, after releasing
        its own cache and asking the other tidepool processes."""
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"torch_memory_saver: memory_margin_bytes is an int >= 0, not {value!r}")
        self._memory_margin_bytes = value

    @property
    def retain_cpu_backup(self):
        return False

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value):
        if value:
            raise NotImplementedError("tidepool.memory_saver: retain_cpu_backup is not supported: resume frees the host copy")

    def get_cpu_backup(self, x, zero_copy=False):
        raise NotImplementedError(
            "tidepool.memory_saver: get_cpu_backup is not supported: a paused tag's host copy is not exposed; resume the tag and read the tensor"
        )

    def set_disk_backup_dir(self, path):
        raise NotImplementedError("tidepool.memory_saver: disk backup is not supported (enable_cpu_backup=True keeps contents in host memory)")

    @staticmethod
    def _check_backup(enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
        if enable_disk_backup:
            if enable_cpu_backup:
                raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
            raise NotImplementedError("tidepool.memory_saver: enable_disk_backup is not supported; use enable_cpu_backup=True")
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in ("pinned", "mmap"):
            raise ValueError(f"cpu_backup_backend is 'pinned' or 'mmap', not {cpu_backup_backend!r}")
        # Both are served by tidepool's offload, which copies to pinned host memory.


@contextlib.contextmanager
def configure_subprocess():
    """torch_memory_saver sets LD_PRELOAD here; tidepool needs nothing
    (each process calls tidepool.install())."""
    yield


# The module-level singleton frameworks import.
torch_memory_saver = TorchMemorySaver()

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "tidepool_tag", "TidepoolError"]
