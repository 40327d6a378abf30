"""Values read back from the card under `python -m tidepool.plan run`: a
CUDA tensor there has no data, so what reads it (`.item()`, `bool(t)`,
`.tolist()`, printing, a copy to the CPU) gets a placeholder (True, 1 or
1.0: the branch of ordinary inputs), and each place in the script that
read one is counted (`reads`), for the report.
"""
import collections
import os
import sysconfig
import traceback

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _libraries():
    """Where installed packages and the standard library live."""
    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.abspath(paths[key]) + os.sep for key in ("purelib", "platlib", "stdlib")
                         if paths.get(key)}))


_LIBRARIES = _libraries()


class Reads:
    """Where a script read a value from a CUDA tensor: {(file, line, what,
    via): count}, at the innermost frame of the script's own code (outside
    torch, the planner and installed packages), `via` the innermost frame
    of an installed package that read it (transformers' generate, say) or
    None.

    A loop waiting on the data spins on the placeholder forever (torch's
    own `trunc_normal_` redraws `while mask.any()`): a value read at the
    same place SPIN times in a row, with no other read, module call or
    optimizer step between, is answered the other way from then on (False,
    0 or 0.0) until something else happens; the places it happened at are
    kept (`loops`)."""

    SPIN = 16

    def __init__(self):
        self.places = collections.Counter()
        self.loops = set()
        self.last, self.in_a_row = None, 0

    def clear(self):
        self.places.clear()
        self.loops.clear()
        self.progress()

    def progress(self):
        """Something else happened (a module call, an optimizer step)."""
        self.last, self.in_a_row = None, 0

    def note(self, what):
        """Counts a read here; True where the loop reading it spins."""
        place, via, library = None, None, None
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = os.path.abspath(frame.filename)
            if path.startswith(_HERE) or path.startswith(_TORCH) or "/torch/" in path:
                continue
            if path.startswith(_LIBRARIES):
                if via is None:
                    library = (frame.filename, frame.lineno, what, None)
                    root = next(p for p in _LIBRARIES if path.startswith(p))
                    via = f"{os.path.relpath(path, root)}:{frame.lineno}"
                continue
            place = (frame.filename, frame.lineno, what, via)
            break
        # A script that is itself an installed package's: the package's frame.
        place = place or library or ("?", 0, what, None)
        self.places[place] += 1
        self.in_a_row = self.in_a_row + 1 if place == self.last else 1
        self.last = place
        if self.in_a_row > self.SPIN:
            self.loops.add(place)
            return True
        return False


reads = Reads()


def placeholder(tensor, spinning=False):
    """The value a read of `tensor` gets: True, 1 or 1.0 (False, 0 or 0.0
    in a loop that spins on it: Reads)."""
    if tensor.dtype == torch.bool:
        return not spinning
    value = 0 if spinning else 1
    return float(value) if tensor.is_floating_point() or tensor.is_complex() else value
