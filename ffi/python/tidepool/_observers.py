"""Out-of-memory observers: attach_oom_observer's callables, called at each
out-of-memory before the error is raised, as torch.cuda's are."""
import logging
import threading

from . import _native

_log = logging.getLogger("tidepool")

_attached = []
_attached_lock = threading.Lock()
_c_observer = None


def attach_oom_observer(observer):
    """Calls observer(device, bytes requested, device bytes allocated,
    device bytes free) at each out-of-memory, before the error is raised
    (torch._C._cuda_attach_out_of_memory_observer's signature). An observer
    that raises is logged; the out-of-memory error is raised all the same."""
    if not callable(observer):
        raise TypeError(f"an out-of-memory observer must be callable, not {type(observer).__name__}")
    global _c_observer
    with _attached_lock:
        if _c_observer is None:
            callback = _native.OOM_OBSERVER(_notify_observers)
            _native.check(_native.lib().tidepool_attach_oom_observer(callback, None))
            _c_observer = callback  # kept alive: the library calls it
        _attached.append(observer)


def _notify_observers(device, requested, allocated, free, _user):
    for observer in list(_attached):
        try:
            observer(device, requested, allocated, free)
        except Exception:
            _log.exception("an out-of-memory observer raised; the out-of-memory error is raised all the same")
