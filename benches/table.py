#!/usr/bin/env python3
"""Prints docs/benchmarks.md's cached-pair table from criterion's medians (target/criterion).

Usage: python3 benches/table.py [target/criterion]
Ratios are computed between figures of the same run.
"""
import json
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/criterion")


def median_ns(group, name):
    path = root / group / name / "new" / "estimates.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())["median"]["point_estimate"]


def fmt(ns):
    return "n/a" if ns is None else (f"{ns:.1f} ns" if ns < 1000 else f"{ns / 1000:.2f} µs")


def ratio(a, b):
    if a is None or b is None:
        return "n/a"
    # Two decimals, or two significant digits for ratios far below one.
    return f"{a / b:.2f}x" if a / b >= 0.1 else f"{a / b:.2g}x"


print("| size | tidepool, 1k live | tidepool, 100k live | tidepool, no thread cache | glibc malloc+free | mimalloc "
      "| offset-allocator | host mmap+munmap | tidepool / glibc | tidepool / mimalloc | tidepool / offset-allocator "
      "| 100k / 1k | no cache / cache |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for size in ["512B", "64KiB", "4MiB", "64MiB"]:
    group = f"cached_pair_{size}"
    t1k = median_ns(group, "tidepool_1k_live")
    t100k = median_ns(group, "tidepool_100k_live")
    plain = median_ns(group, "tidepool_no_thread_cache_1k_live")
    glibc = median_ns(group, "glibc_malloc_free")
    mimalloc = median_ns(group, "mimalloc")
    offsets = median_ns(group, "offset_allocator")
    mmap = median_ns(group, "host_backend_mmap_munmap")
    worst = max(t for t in (t1k, t100k) if t is not None) if t1k or t100k else None
    print(f"| {size} | {fmt(t1k)} | {fmt(t100k)} | {fmt(plain)} | {fmt(glibc)} | {fmt(mimalloc)} | {fmt(offsets)} "
          f"| {fmt(mmap)} | {ratio(worst, glibc)} | {ratio(worst, mimalloc)} | {ratio(worst, offsets)} "
          f"| {ratio(t100k, t1k)} | {ratio(plain, t1k)} |")

print()
print("| feature | cached path off | on | on / off |")
print("|---|---|---|---|")
for group, label in [("recording", "recording (TIDEPOOL_TRACE), 512 B pair"),
                     ("reclaimer", "reclaimer every 10 ms, 512 B pair"),
                     ("expandable_pair", "expandable segments, 512 B pair"),
                     ("expandable_mixed", "expandable segments, 512 B + 3 MiB + 64 KiB"),
                     ("thread_cache_mixed", "threads' caches, 512 B + 3 MiB + 64 KiB")]:
    off, on = median_ns(group, "off"), median_ns(group, "on")
    print(f"| {label} | {fmt(off)} | {fmt(on)} | {ratio(on, off)} |")
