#!/usr/bin/env bash
# The guard on the cached path: counts, with callgrind, the instructions of
# examples/pair_loop's cached 512 B pair (allocate, then free, from the
# thread's cache) in an optimized build, and fails above BOUND.
#
# The cached pair is fast because the thread's side of the cache is plain
# code the compiler inlines where `allocate` and `free` are called: a
# closure or a call it does not inline brings back about 90 instructions a
# pair (docs/benchmarks.md#profiling). Callgrind's count does not vary from
# run to run on one binary, so a bound a little above today's figure
# catches that, where a timing on a shared CI machine would not.
#
# Instructions per pair: the count for 200,000 iterations less the count
# for 100,000, divided by 100,000 (set-up and exit cancel out).
#
# Builds the example with the `gpu-check` profile (release without debug
# information), which cuda/check/prepare.sh builds just before in ./test.sh:
# only the example's link is new. Needs valgrind (installed by ./test.sh).
#
#   .ci/cached_pair.sh              build, count, check against BOUND
#   BOUND=120 .ci/cached_pair.sh    another bound (a failing run, on purpose)
set -euo pipefail
cd "$(dirname "$0")/.."

# 152, the highest count of 2026-12-05 (rustc 1.95.0; the same in the
# release profile; 148 to 152 across that day's builds), plus 10 %: room
# for a compiler release's drift of a few instructions, below what losing the inlining
# costs: `#[inline(never)]` on the cached allocate alone makes it 178, a
# closure on the path about 240.
BOUND=${BOUND:-167}
PROFILE=${PROFILE:-gpu-check}

command -v valgrind >/dev/null 2>&1 || { echo "cached pair: valgrind is missing" >&2; exit 1; }
cargo build --locked --profile "$PROFILE" -p tidepool --example pair_loop
example="target/$PROFILE/examples/pair_loop"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# count N: the instructions callgrind counts for N pairs (the whole run).
count() {
  valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.$1" "$example" 512 "$1" >/dev/null 2>"$out/valgrind.$1" \
    || { cat "$out/valgrind.$1" >&2; echo "cached pair: callgrind failed" >&2; exit 1; }
  # The file's `summary:` line (older valgrind: `totals:`) holds the count.
  awk '/^(summary|totals):/ { print $2; exit }' "$out/callgrind.$1"
}
small=$(count 100000)
large=$(count 200000)
[ -n "$small" ] && [ -n "$large" ] || { echo "cached pair: no instruction count in callgrind's output" >&2; exit 1; }
per_pair=$(( (large - small + 50000) / 100000 ))
echo "cached pair: $per_pair instructions per 512 B pair ($large for 200,000 pairs, $small for 100,000; bound $BOUND)"
if [ "$per_pair" -gt "$BOUND" ]; then
  echo "cached pair: FAILED: $per_pair instructions is over the bound of $BOUND: is something on the cached path" \
       "(src/thread_cache.rs, src/cache_owner.rs, src/cache_slot.rs, src/allocator.rs) no longer inlined?" \
       "docs/benchmarks.md#profiling" >&2
  exit 1
fi
