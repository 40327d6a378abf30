#!/usr/bin/env bash
# tidepool's GPU check, the second of two steps (docs/testing.md#on-a-gpu):
#   here, where cargo is:  cuda/check/prepare.sh  (builds, strips and stages
#                          what this script needs in cuda/check/staged/)
#   on the GPU machine:    bash cuda/check/run.sh  (carry cuda/check/staged)
# The GPU machine needs an NVIDIA GPU, nvcc, a C++ compiler, Python with
# PyTorch and transformers; no cargo. Run from anywhere in the checkout.
#
#   bash cuda/check/run.sh --rehearse
# runs, here and without a GPU, every section that can run over simgpu
# (the stand-in libcuda.so of cuda/simgpu, built with cc) with the staged
# files, and names each section it skips and why: CI runs it after
# prepare.sh, so that a broken section, a missing file or a wrong path
# fails long before a GPU is lent.
#
# The whole script finishes within BUDGET seconds (default 450: a device
# lent for 15 minutes in all, start-up included): each section runs under
# `timeout` with its own limit, cut to what is left of the budget (less
# what the summary needs), writes its results under $OUT as it goes, and a
# section that times out leaves the others' figures; the summary, printed
# whatever happened, lists every section (ok, FAILED, timed out, skipped)
# and the figures. Record what it prints in docs/gpu-results.md with the
# date, GPU and driver.
#
# The sections' own limits on a GPU, in their order: build-cuda 90,
# python-package 60, e2e-* 4 x 45 (the training step's time: 330 s at most
# by then), runtimes 90, memory-saver 45, conformance and conformance-whole
# 45 each, c-abi 60, tools 60, vmm 60, warmup-* 4 x 30, check 60,
# check-whole 30, tags 60, rust-runtime and rust-runtime-whole 30 each,
# card 30, model-* 2 x 45: 1185 s in all, more than the 430 s the budget leaves them (450 less 20
# for the summary). A limit stops a section that hangs; the budget bounds
# the whole: a section gets what is left of it when it starts, so the run
# ends by 450 s whatever the sections take, and a section whose turn comes
# with nothing left is recorded as timed out, not started. What each takes
# on a GPU has not been measured yet: the first run's times (the summary
# gives each section's seconds against its limit) are the ones to set the
# limits from. The rehearsal's sections (warmup on the host 60,
# e2e-tidepool on the host 60, the GPU's skipped) run within the same
# budget; their limits add up to about 645 s, so on a machine slow enough
# to need them all a late one is recorded as timed out (here they take
# well under a minute in all).
set -uo pipefail
cd "$(dirname "$0")/../.."
REHEARSE=0
case "${1:-}" in
  --rehearse) REHEARSE=1 ;;
  "") ;;
  *) echo "usage: $0 [--rehearse]" >&2; exit 2 ;;
esac
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
BUDGET=${BUDGET:-450}
STAGE=${STAGE:-cuda/check/staged}
PYTHON=${PYTHON:-python3}
START=$SECONDS
# Builds and copies that need not come back with $OUT.
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
: > "$OUT/sections.tsv"

# limit SECONDS: the seconds a section may take, at most SECONDS and what
# the budget has left (20 s kept for the summary); 0 when none is left.
limit() {
  local left=$(( BUDGET - 20 - (SECONDS - START) ))
  (( left < 0 )) && left=0
  echo $(( $1 < left ? $1 : left ))
}
# bounded SECONDS CMD...: runs CMD (a command, or a function of this
# script) under timeout SECONDS (a limit already cut to the budget:
# `limit`); with 0 it is not started, with exit status 124, as a timeout.
bounded() {
  local seconds=$1; shift
  if (( seconds == 0 )); then echo "run.sh: out of time budget: not started: $*"; return 124; fi
  declare -F "$1" >/dev/null && export -f "$1"
  timeout "$seconds" bash -c '"$@"' bash "$@"
}
# record NAME STATUS [TIME]: a section's outcome for the summary (an exit
# status, or a word: skipped, missing), and the time it took of its limit.
record() {
  local verdict
  case "$2" in
    0) verdict=ok ;;
    124|137) verdict="timed out" ;;
    [0-9]*) verdict="FAILED ($2)" ;;
    *) verdict=$2 ;;
  esac
  printf '%s\t%s\t%s\n' "$1" "$verdict" "${3:-}" >> "$OUT/sections.tsv"
}
# section NAME SECONDS CMD...: runs CMD bounded, its output shown and kept
# in $OUT/NAME.txt, and records its outcome.
section() {
  local name=$1 seconds=$2 began=$SECONDS given; shift 2
  given=$(limit "$seconds")
  echo "-- $name"
  bounded "$given" "$@" 2>&1 | tee "$OUT/$name.txt"
  record "$name" "${PIPESTATUS[0]}" "$(( SECONDS - began )) s of $given s"
}
# skip NAME REASON: a section this mode cannot run, named with the reason.
skip() {
  echo "-- $1: skipped: $2" | tee "$OUT/$1.txt"
  record "$1" "skipped: $2"
}
# gpu_only NAME SECONDS CMD...: a section that needs a GPU (and nvcc).
gpu_only() {
  if (( REHEARSE )); then skip "$1" "needs a GPU"; else section "$@"; fi
}

# The staged files (prepare.sh), from which everything below runs.
for file in libtidepool.so tidepool engine-test rust_runtime; do
  [ -x "$STAGE/$file" ] || { echo "run.sh: $STAGE/$file missing: run cuda/check/prepare.sh first (where cargo is)" >&2; exit 2; }
done
STAGE=$(cd "$STAGE" && pwd)
# What the sections' functions read (they run in a shell of their own, under timeout).
export REHEARSE STAGE WORK OUT PYTHON
export TIDEPOOL_LIBRARY=$STAGE/libtidepool.so TIDEPOOL_CONF=${TIDEPOOL_CONF:-backend:cuda}
# Child processes of the engine's tests and the registries of the processes
# below keep their files here, not in the machine's /tmp.
export TMPDIR=$WORK XDG_RUNTIME_DIR=$WORK

echo "== the driver"
if (( REHEARSE )); then
  # simgpu: the CUDA driver's calls on host memory, two devices of 4 GiB.
  mkdir -p "$WORK/simgpu"
  cc -std=c11 -O2 -shared -fPIC -pthread cuda/simgpu/simgpu.c -o "$WORK/simgpu/libcuda.so" || exit 1
  export LD_LIBRARY_PATH=$WORK/simgpu:${LD_LIBRARY_PATH:-} SIMGPU_DEVICES=2 SIMGPU_CAPACITY=4G
  echo "simgpu (a rehearsal: nothing here is measured)" | tee "$OUT/gpu.txt"
else
  # tidepool (through cudarc) opens libcuda.so; drivers often ship only libcuda.so.1.
  if ! ldconfig -p | grep -q 'libcuda.so '; then
    real=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
    mkdir -p "$WORK/libcuda" && ln -sf "$real" "$WORK/libcuda/libcuda.so"
    export LD_LIBRARY_PATH=$WORK/libcuda:${LD_LIBRARY_PATH:-}
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
fi

echo "== build: the CUDA programs (nvcc) and the Python package's C++ libraries (against this machine's torch)"
if (( REHEARSE )); then
  skip build-cuda "needs nvcc"
else
  build_cuda() {
    for program in tidepool_check tags_check; do
      nvcc -O2 -I ffi "cuda/check/$program.cu" -L "$STAGE" -ltidepool -lcuda \
        -Xlinker -rpath -Xlinker "$STAGE" -o "$WORK/$program" || return 1
    done
  }
  section build-cuda 90 build_cuda
fi
# The package's pure-Python files from the tree, its two C++ libraries
# built here beside them (pip builds them where cargo is at hand), in a
# copy: the checkout keeps no build of this machine's.
build_package() {
  mkdir -p "$WORK/python" && cp -r ffi/python/tidepool "$WORK/python/" || return 1
  c++ -std=c++17 -O2 -shared -fPIC ffi/python/csrc/torch_alloc.cpp -o "$WORK/python/tidepool/libtidepool_torch.so" || return 1
  c++ -std=c++17 -O2 -shared -fPIC "-I$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    ffi/python/csrc/stacks.cpp -o "$WORK/python/tidepool/_stacks$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
    || return 1
  # The package as the scripts below import it: made PyTorch's allocator
  # (torch starts no CUDA here, so this runs without a GPU too).
  PYTHONPATH=$WORK/python "$PYTHON" -c 'import tidepool, torch; tidepool.install(); print("tidepool installed into torch", torch.__version__, "from", tidepool.__file__)'
}
export TIDEPOOL_CHECK_PACKAGE=$WORK/python
section python-package 60 build_package

# First after the package it needs: the step figures issue 51 asks for
# (4 x 45 s) are in before the sections that may run long.
echo "== PyTorch end to end, and a training step's time: PyTorch's allocator, its expandable segments, tidepool's default, tidepool's whole segments"
# e2e ALLOCATOR [ARGS...]: torch_e2e.py in a process of its own (PyTorch's
# allocator is chosen before CUDA starts); its JSON line to
# $OUT/e2e-ALLOCATOR.json, which must hold the step figures.
e2e() {
  local allocator=$1; shift
  "$PYTHON" cuda/check/torch_e2e.py --allocator "$allocator" --steps 20 --snapshot "$OUT/snapshot.pickle" "$@" \
    | tail -1 | tee "$OUT/e2e-$allocator.json"
  local status=${PIPESTATUS[0]}
  (( status == 0 )) || return "$status"
  grep -q '"steady_step_ms"' "$OUT/e2e-$allocator.json" || { echo "run.sh: e2e-$allocator wrote no step figures"; return 1; }
}
for a in native native-expandable tidepool tidepool-whole; do
  if (( REHEARSE )) && [ "$a" = tidepool ]; then
    # On the host: the script, the model, tidepool installed and its
    # statistics read from the library (over simgpu), nothing measured.
    section "e2e-$a" 60 e2e "$a" --device cpu --steps 3 --batch 1 --lengths 32,16,64
  else
    gpu_only "e2e-$a" 45 e2e "$a"
  fi
done

echo "== other runtimes on tidepool: CuPy and Numba (tidepool.cupy, tidepool.numba; each skipped where not installed)"
# Each runtime in a process of its own (40 s each): arrays, kernels, out of
# memory and tidepool's figures; the rehearsal runs the allocators' layer
# under the runtimes over simgpu, no kernel.
runtimes=("$PYTHON" cuda/check/runtimes_check.py --timeout 40 --json "$OUT/runtimes.json")
(( REHEARSE )) && runtimes+=(--rehearse)
[ "${CI:-}" = true ] && runtimes+=(--require) # CI installs both: a missing one fails there
section runtimes 90 "${runtimes[@]}"

echo "== sleep and wake as RL and serving frameworks call it: torch_memory_saver's API and vLLM's CuMemAllocator (tidepool.memory_saver, tidepool.vllm)"
# A model's weights paused and resumed (with and without CPU backup, under
# a CUDA graph, through vLLM's sleep and wake_up): the same forward output.
memory_saver=("$PYTHON" cuda/check/memory_saver_check.py --json "$OUT/memory_saver.json")
(( REHEARSE )) && memory_saver+=(--rehearse)
section memory-saver 45 env PYTHONPATH="$WORK/python" "${memory_saver[@]}"

echo "== conformance suite on the driver"
conformance() {
  if (( REHEARSE )); then
    env TIDEPOOL_TEST_CHILD=1 TIDEPOOL_TEST_BACKEND=cuda SIMGPU_CAPACITY=256M "$@" \
      "$STAGE/engine-test" --ignored --exact backends::child_cuda_conformance --nocapture --test-threads=1
  else
    env TIDEPOOL_TEST_CHILD=1 TIDEPOOL_TEST_DEVICE_MEMORY=1 TIDEPOOL_TEST_BACKEND=cuda "$@" \
      "$STAGE/engine-test" --ignored --exact backends::child_cuda_conformance --nocapture --test-threads=1
  fi
}
# tidepool's default (expandable segments: the cuda backend maps pages), then whole segments.
section conformance 45 conformance
section conformance-whole 45 conformance TIDEPOOL_TEST_CONF=expandable:false

echo "== the C ABI from C (tests/c/ffi_test.c; on a GPU over the host backend: its checks write into the memory they get)"
c_abi() {
  cc -std=c11 -D_DEFAULT_SOURCE -O1 -pthread -I ffi tests/c/ffi_test.c -L "$STAGE" -ltidepool \
    -Wl,-rpath,"$STAGE" -o "$WORK/ffi_test" || return 1
  local conf=backend:host,host_capacity_mb:4096
  (( REHEARSE )) && conf=backend:cuda
  TIDEPOOL_CONF=$conf "$WORK/ffi_test" "$WORK/ffi_test.pickle" 2000
}
section c-abi 60 c_abi

echo "== the command-line tools (the staged tidepool command)"
tools() {
  local tp=$STAGE/tidepool
  "$tp" --version && "$tp" cards &&
    TIDEPOOL_CONF=expandable:false,max_split_size_mb:256 "$tp" config &&
    "$tp" replay examples/traces/transformer-varlen-train.csv --policy all &&
    "$tp" plan examples/traces/transformer-varlen-train.csv
}
section tools 60 tools

echo "== what each driver call of expandable segments costs, and a warm-up in each setting"
if (( REHEARSE )); then
  section vmm 60 "$PYTHON" cuda/check/vmm_calls.py --sizes-mib 2,20,128 --repeats 3 --warm-up 1 --json "$OUT/vmm.json"
else
  section vmm 60 "$PYTHON" cuda/check/vmm_calls.py --json "$OUT/vmm.json"
fi

echo "== a 20 GiB trace's warm-up through PyTorch: its expandable segments, tidepool's default (8 MiB allocations), page by page, and as large as each run split when reused (a stream synchronization each)"
warmup() {
  "$PYTHON" cuda/check/trace_warmup.py --trace examples/traces/transformer-varlen-train.csv "$@" | tail -1 | tee -a "$OUT/warmup.json"
  return "${PIPESTATUS[0]}"
}
: > "$OUT/warmup.json"
if (( REHEARSE )); then
  # On the host: the script and the trace, nothing measured.
  section warmup 60 warmup --allocator native --device cpu --target-gib 1
else
  section warmup-native-expandable 30 warmup --allocator native-expandable
  section warmup-default 30 warmup --allocator tidepool
  section warmup-page-by-page 30 warmup --allocator tidepool --conf expandable_allocation_mb:2
  section warmup-split 30 warmup --allocator tidepool --conf expandable_allocation_mb:unlimited,expandable_split_allocations:true
fi

echo "== patterns across streams, and latency"
echo "-- tidepool's default: expandable segments (kernels write into pages tidepool mapped)"
gpu_only check 60 "$WORK/tidepool_check" 10000
echo "-- whole segments"
gpu_only check-whole 30 env TIDEPOOL_CONF="$TIDEPOOL_CONF,expandable:false" "$WORK/tidepool_check" 3000

echo "== tags: a CUDA graph across pause and resume, offload bandwidth, pause/resume latency"
gpu_only tags 60 "$WORK/tags_check" 2

echo "== Rust runtime: Buffer<T> through cudarc, a PTX kernel per layer, results against the host"
section rust-runtime 30 "$STAGE/rust_runtime" 48 8
section rust-runtime-whole 30 env TIDEPOOL_CONF="$TIDEPOOL_CONF,expandable:false" "$STAGE/rust_runtime" 48 8

echo "== what the card gives an allocator (tidepool cards assumes nvidia-smi's total less 1.5 GiB)"
card() {
  "$PYTHON" - <<'PY'
import subprocess
import torch
a = torch.randn(1024, 1024, device="cuda")
(a @ a).sum().item()  # cuBLAS and its kernels loaded, as in a training process
free, total = torch.cuda.mem_get_info()
available = (free + torch.cuda.memory_reserved()) >> 20  # what PyTorch's own cache holds counts as available
smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                     capture_output=True, text=True).stdout.split()
smi = int(smi[0]) if smi else total >> 20
print(f"card: nvidia-smi total {smi} MiB, CUDA total {total >> 20} MiB, available to an allocator after init and a "
      f"matmul {available} MiB: {smi - available} MiB kept (tidepool cards assumes 1536)")
PY
}
gpu_only card 30 card

echo "== tidepool's models of PyTorch's allocator against PyTorch itself (the loop recorded, then replayed)"
model() {
  "$PYTHON" cuda/check/torch_e2e.py --allocator "$1" --steps 10 --history "$OUT/history-$1.pickle" | tail -1 || return 1
  "$STAGE/tidepool" replay "$OUT/history-$1.pickle" --policy "$2" --json | tee "$OUT/model-$1.json"
  return "${PIPESTATUS[0]}"
}
gpu_only model-native 45 model native pytorch
gpu_only model-native-expandable 45 model native-expandable pytorch-expandable

echo
echo "== summary (after $(( SECONDS - START )) s of a $BUDGET s budget)"
"$PYTHON" cuda/check/summary.py "$OUT"
