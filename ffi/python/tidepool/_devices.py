"""What a `device` argument means: the memory functions and tags take one
as torch.cuda's memory functions do (None or "cuda" for the current
device, an int, "cuda:N", a torch.device); the library takes its index."""
import sys


def current_device():
    """PyTorch's current CUDA device, or 0 before CUDA starts (or without
    torch). torch is not imported here: a program that has not imported it
    has not started CUDA through it, and an import made by whichever thread
    first reads a statistic would cost seconds and could be under way when
    another thread forks (the child would wait for its lock forever)."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return 0
    return cuda.current_device()


def device_index(device):
    """The index of `device`, given as torch.cuda's memory functions take
    one: None or "cuda" (the current device), an int, "cuda:N", or a
    torch.device."""
    if isinstance(device, str):
        kind, colon, index = device.partition(":")
        if kind.strip() != "cuda" or (colon and not index.strip().isdigit()):
            raise ValueError(f"not a CUDA device: {device!r} (expected an int, 'cuda', 'cuda:N' or a torch.device)")
        return int(index) if colon else current_device()
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    if getattr(device, "type", None) == "cuda":  # a torch.device
        return current_device() if device.index is None else device.index
    raise ValueError(f"not a CUDA device: {device!r} (expected an int, 'cuda', 'cuda:N' or a torch.device)")
