"""What a `device` argument means: the memory functions and tags take one
as torch.cuda's memory functions do (None or "cuda" for the current
device, an int, "cuda:N", a torch.device); the library takes its index."""


def current_device():
    """PyTorch's current CUDA device, or 0 before CUDA starts (or without torch)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


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
