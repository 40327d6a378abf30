"""Bytes as the package writes them, for people: GIB and human_bytes, the
one copy (gib: in GiB) that memory_summary (_memory.py) and the planner's table and
picture (plan/report.py, plan/plot.py) share. It imports nothing: the
bottom layer, beside _native and _devices."""

GIB = 1 << 30
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n, unit=None):
    """`n` bytes as text. In `unit` (one of B, KiB, MiB, GiB, TiB) with two
    decimals, as the planner writes its figures in a column ("17.77 GiB");
    by default in the largest unit below 1024 of it (TiB at most), bytes
    whole and the others with two decimals, as memory_summary writes
    them ("512 B", "3.50 MiB")."""
    if unit is not None:
        return f"{n / (1 << 10 * _UNITS.index(unit)):.2f} {unit}"
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def gib(n):
    """`n` bytes in GiB with two decimals: the planner's figures."""
    return human_bytes(n, "GiB")
