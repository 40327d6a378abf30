#!/usr/bin/env bash
# The first of the GPU check's two steps, run here, where cargo is (the
# GPU machine has none): builds what cuda/check/run.sh needs without debug
# information (the `gpu-check` profile: release, stripped of debug info),
# stages it in cuda/check/staged/ (ignored by git), checks that the
# tracked tree, the untracked files git does not ignore and the staged
# folder together stay under the bound of what may travel to the GPU
# machine in one call, and prints that call: the command and its carry
# list, as the device tool takes them. docs/testing.md#on-a-gpu.
#
#   cuda/check/prepare.sh               build, stage, check the size, print the call
#   cuda/check/prepare.sh --check-size  only check the size of what is staged
#
# STAGE (default cuda/check/staged) and LIMIT_MIB (default 60: 64 MiB may
# travel, 4 kept for what the call itself adds) can be set; a folder over
# the bound fails with the figures, whatever staged it.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${STAGE:-cuda/check/staged}
LIMIT_MIB=${LIMIT_MIB:-60}
PROFILE=gpu-check

# check_size: the bytes that travel (tracked files, untracked files git
# does not ignore, the staged folder) against LIMIT_MIB; fails over it.
check_size() {
  python3 - "$STAGE" "$LIMIT_MIB" <<'PY'
import os, subprocess, sys
stage, limit_mib = sys.argv[1], float(sys.argv[2])
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.decode(errors="surrogateescape").split("\0")
stage_abs = os.path.realpath(stage)
# Files under the staged folder count once, as staged (it is ignored by git when it is the default).
tree = sum(os.lstat(p).st_size for p in listed
           if p and os.path.lexists(p) and not os.path.realpath(p).startswith(stage_abs + os.sep))
staged = []
for root, _, files in os.walk(stage):
    for name in files:
        path = os.path.join(root, name)
        staged.append((os.lstat(path).st_size, os.path.relpath(path, stage)))
staged_bytes = sum(size for size, _ in staged)
total = tree + staged_bytes
mib = lambda b: b / 2**20
print(f"size check: tracked and untracked files {mib(tree):.1f} MiB + {stage} {mib(staged_bytes):.1f} MiB "
      f"= {mib(total):.1f} MiB (bound {limit_mib:g} MiB)")
for size, name in sorted(staged, reverse=True):
    print(f"  {mib(size):6.1f} MiB  {name}")
if not staged:
    sys.exit(f"size check: {stage} is empty or missing: run cuda/check/prepare.sh")
if mib(total) > limit_mib:
    sys.exit(f"size check: FAILED: {mib(total):.1f} MiB is over the {limit_mib:g} MiB bound by {mib(total) - limit_mib:.1f} MiB "
             f"(a debug build staged? prepare.sh builds the `gpu-check` profile, without debug information)")
print("size check: ok")
PY
}

if [ "${1:-}" = "--check-size" ]; then
  check_size
  exit
fi
[ $# -eq 0 ] || { echo "usage: $0 [--check-size]" >&2; exit 2; }

# stage FILE: copies a built file into the staged folder.
stage() { install -m 755 "$1" "$STAGE/"; }

rm -rf "$STAGE" && mkdir -p "$STAGE"
echo "prepare: building the $PROFILE profile (release without debug information)"
cargo build --locked --profile $PROFILE -p tidepool --lib
stage target/$PROFILE/libtidepool.so
cargo build --locked --profile $PROFILE -p tidepool-tools --bin tidepool
stage target/$PROFILE/tidepool
# The engine's test binary (its conformance suite runs on the real driver);
# cargo names it with a hash: its path is read from cargo's messages.
engine=$(cargo test --locked --profile $PROFILE -p tidepool --test engine --no-run --message-format=json \
  | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "engine" and m.get("executable"):
        print(m["executable"])')
[ -n "$engine" ] || { echo "prepare: the engine test binary was not built" >&2; exit 1; }
install -m 755 "$engine" "$STAGE/engine-test"
# The Rust runtime example through cudarc (the feature builds the library
# again, so it comes after the library was staged).
cargo build --locked --profile $PROFILE --features cudarc --example rust_runtime
stage target/$PROFILE/examples/rust_runtime

# The newest glibc each staged file needs: the GPU machine's must be as new.
for f in "$STAGE"/*; do
  need=$(objdump -T "$f" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -t. -k2,2n -k3,3n -u | tail -1)
  echo "prepare: $(basename "$f") needs ${need:-no versioned glibc symbol}"
done
check_size
echo
echo "The one call on the GPU machine (device tool, run):"
echo "  command: bash cuda/check/run.sh"
echo "  carry:   [\"$STAGE\"]"
echo "  timeout_s: 540 (run.sh keeps to its 450 s budget)"
echo "Here, without a GPU, over simgpu: bash cuda/check/run.sh --rehearse"
