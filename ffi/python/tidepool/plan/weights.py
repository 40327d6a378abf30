"""Weights loaded from files, for `python -m tidepool.plan run`: a script
that loads a checkpoint gets its tensors with their shapes and dtypes, on
the devices it asked for, and no byte of their data is read (a 7B model's
14 GB would be read into host memory for tensors that then live on a card
without data).

What is read: a checkpoint's headers and its pickled structure (the zip
records' directory, data.pkl; a safetensors file's JSON header). What is
not: the tensors' bytes.

- `torch.load` of a checkpoint torch.save writes (a zip) given by its
  path maps the file (`mmap=True`, whatever the script says): a tensor
  restored to the CPU is a view of the mapping, its pages read only if
  the script reads them on the CPU (a copy to the card reads none:
  fake_cuda.py's copies take the source's shape alone). A storage restored
  to CUDA (saved from the card with `map_location` None, or mapped there
  by a string, a device, a dict or a callable that returns None) is a
  storage of the meta device that says it is on the card
  (`_CardStorage`): torch rebuilds its tensors on it as CudaTensors, one
  allocation of the storage's size, as the driver's copy of it would be.
  A callable `map_location` that returns a storage is left to do what it
  does.
- transformers' `from_pretrained` reads safetensors files through
  safetensors' `safe_open`, whose tensors are views of the file's mapping
  already; their copies to the card read nothing. What is done here: its
  loading threads are switched off (HF_DEACTIVATE_ASYNC_LOAD=1), so that
  a `device_map` ("cuda", "auto") moves each weight to the card on the
  thread where fake_cuda's modes are (modes are per thread: a worker
  would ask the driver). Its `.bin` checkpoints go through `torch.load`.
"""
import contextlib
import os

import torch
import torch.serialization

from .patching import environment, replaced

_ZIP = b"PK\x03\x04"  # how torch.save's zip files begin (torch.serialization._is_zipfile)


class _CardStorage(torch.UntypedStorage):
    """A storage torch.load restores to the card: bytes of the meta device
    (none), `device` the card's, so that torch's rebuild of its tensors
    (`torch.empty((0,), device=storage.device).set_(storage, ...)`) makes
    CudaTensors over it."""

    @property
    def device(self):
        return self._tidepool_card


def _card_storage(nbytes, device):
    storage = _CardStorage(nbytes, device="meta")
    storage._tidepool_card = device
    return storage


def _card(location):
    """The CUDA device a location names (with its index), or None; a device
    the run does not have is refused as torch refuses it."""
    if not (location == "cuda" or location.startswith("cuda:")):
        return None
    device = torch.device(location)
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"Attempting to deserialize object on CUDA device {index} but "
                           f"torch.cuda.device_count() is {torch.cuda.device_count()}. Please use torch.load with "
                           "map_location to map your storages to an existing device.")
    return torch.device("cuda", index)


def _restoring(map_location):
    """`map_location` as torch applies it (torch.serialization's
    _get_restore_location), with the storages it puts on CUDA made
    _CardStorages; None where it puts none there."""
    if isinstance(map_location, bytes):
        map_location = map_location.decode()
    if isinstance(map_location, (str, torch.device)) and _card(str(map_location)) is None:
        return None  # "cpu", "meta": torch's own paths

    def restore(storage, location):
        if map_location is None:
            target = location
        elif isinstance(map_location, dict):
            target = map_location.get(location, location)
        elif isinstance(map_location, (str, torch.device)):
            target = str(map_location)
        else:
            target = map_location(storage, location)
            if target is not None:
                return target  # the script's callable restored it itself
            target = location
        device = _card(str(target))
        if device is None:
            return torch.serialization.default_restore_location(storage, str(target))
        return _card_storage(storage.nbytes(), device)

    return restore


def _is_checkpoint(f):
    """Whether `f` is the path of a zip checkpoint (torch.save's format)."""
    if not isinstance(f, (str, os.PathLike)) or str(f).endswith(".safetensors"):
        return False
    try:
        with open(f, "rb") as opened:
            return opened.read(4) == _ZIP
    except OSError:
        return False  # torch.load says why


def _mapped_load(load):
    def mapped(f, map_location=None, *args, mmap=None, **kwargs):
        if not _is_checkpoint(f):
            return load(f, map_location, *args, mmap=mmap, **kwargs)
        restore = _restoring(map_location)
        return load(f, restore or map_location, *args, mmap=True, **kwargs)

    mapped.__wrapped__ = load
    mapped.__doc__ = load.__doc__
    return mapped


@contextlib.contextmanager
def weights_from_files():
    """torch.load and transformers' loading as the module says, inside."""
    mapped = _mapped_load(torch.load)
    with environment(HF_DEACTIVATE_ASYNC_LOAD="1"), \
            replaced((torch, "load", mapped), (torch.serialization, "load", mapped)):
        yield
