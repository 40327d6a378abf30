"""Tags, for sleep and wake: name the memory a block of code allocates,
give that memory back to the GPU (pause) and take it again at the same
addresses (resume).

    with tidepool.region("weights"):
        model = build_model()                    # allocations tagged "weights"
    tidepool.pause("weights", offload=True)      # contents to host memory, GPU memory freed
    ...                                          # another engine uses the memory
    tidepool.resume("weights")                   # same addresses, same bytes

Every allocation carries the tag of the thread that made it ("default"
outside any region). A tag's memory lives on pages of its own, so a pause
touches no other tag. Pointers keep their values across a pause (the
address space stays reserved), so CUDA graphs captured on them replay after
resume.
"""
import threading

from . import _native
from ._devices import device_index
from ._native import TidepoolError

_local = threading.local()

# The longest tag, in bytes of UTF-8 (the C ABI refuses a longer one).
MAX_TAG_BYTES = 63
# The tag of allocations made outside any region; never paused.
DEFAULT = "default"


def _stack():
    if not hasattr(_local, "tags"):
        _local.tags = []
    return _local.tags


def _encode(tag):
    if not isinstance(tag, str):
        raise TypeError(f"a tag is a str, not {type(tag).__name__}")
    return tag.encode("utf-8")


def _device(device):
    # None: every device (pause, resume); otherwise as torch.cuda takes one.
    return -1 if device is None else device_index(device)


class region:
    """Tags the calling thread's allocations with `tag` while the block runs;
    regions nest, and leaving one puts back the tag that was current before.
    A tag is 1 to 63 bytes of UTF-8 ("default" is the tag outside any region).

    Under PyTorch, allocations made by this thread carry the tag; autograd
    runs backward on threads of its own, so memory allocated during
    loss.backward() carries "default" unless those threads set a tag.
    """

    def __init__(self, tag):
        self.tag = tag
        self._name = _encode(tag)

    def __enter__(self):
        _native.check(_native.lib().tidepool_set_tag(self._name))
        _stack().append(self.tag)
        return self

    def __exit__(self, *exc):
        stack = _stack()
        stack.pop()
        previous = stack[-1].encode("utf-8") if stack else None
        _native.check(_native.lib().tidepool_set_tag(previous))
        return False


def pause(tag, offload=False, device=None):
    """Gives every page of `tag`'s memory on `device` (None: every device)
    back to the GPU, after the work queued on the streams that used it has
    run. offload=True copies the contents of its live tensors to pinned
    host memory first and restores them at resume; offload=False discards
    them (a KV cache). Allocating under a paused tag raises until resume;
    freeing a paused tensor is allowed.

    Raises TidepoolError, changing nothing, for a tag no thread ever set,
    "default", a tag already paused, during a CUDA graph capture (or while a
    private pool is open), or when host memory for the offload cannot be had.
    """
    _native.check(_native.lib().tidepool_pause(_encode(tag), _device(device), _native.PAUSE_OFFLOAD if offload else 0))


def resume(tag, device=None):
    """Maps `tag`'s memory on `device` (None: every device where it is
    paused) again at the same addresses and copies offloaded contents back;
    returns once the memory is usable. When the GPU is full, tidepool first
    releases its other cached memory and asks other tidepool processes; if
    that is not enough it raises TidepoolError, the tag still paused and its
    saved contents intact (resume again once memory is free)."""
    _native.check(_native.lib().tidepool_resume(_encode(tag), _device(device)))


def pause_all(plan):
    """Pauses each (tag, offload) of `plan` in order, as one step: if one
    fails, resumes those this call paused (their offloaded contents come
    back) and raises its error."""
    _all_or_none(plan, lambda tag, offload: pause(tag, offload=offload), lambda tag, _: resume(tag))


def resume_all(plan):
    """Resumes each (tag, offload) of `plan` in order, as one step: if one
    fails (that one stays paused, contents intact), pauses again those this
    call resumed, with their offload, and raises its error."""
    _all_or_none(plan, lambda tag, _: resume(tag), lambda tag, offload: pause(tag, offload=offload))


def _all_or_none(plan, do, undo):
    done = []
    try:
        for tag, offload in plan:
            do(tag, offload)
            done.append((tag, offload))
    except BaseException as err:
        for tag, offload in reversed(done):
            try:
                undo(tag, offload)
            except TidepoolError as undo_err:  # noted on the error raised, not raised instead of it
                add_note = getattr(err, "add_note", None)  # Python 3.11 and later
                if add_note is not None:
                    add_note(f"undoing the call on {tag!r} failed too: {undo_err}")
        raise


def tag_stats(tag, device=None):
    """What `tag` holds on `device` (None: the current one): allocated_bytes
    (its live tensors), reserved_bytes (GPU memory its pages hold now),
    paused_bytes (GPU memory the pause gave back), offloaded_bytes (host
    memory holding its contents), num_allocations, paused. All zeros for
    "default", which has no memory of its own (memory_stats() has what
    untagged tensors hold)."""
    s = _native.get_tag_stats(_encode(tag), device_index(device))
    out = {name: getattr(s, name) for name in ("allocated_bytes", "reserved_bytes", "paused_bytes", "offloaded_bytes", "num_allocations")}
    out["paused"] = bool(s.paused)
    return out


__all__ = ["region", "pause", "resume", "pause_all", "resume_all", "tag_stats", "MAX_TAG_BYTES", "DEFAULT", "TidepoolError"]
