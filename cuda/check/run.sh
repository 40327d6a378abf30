#!/usr/bin/env bash
# GPU checks of tidepool, for a machine with an NVIDIA GPU, nvcc, PyTorch
# and transformers, but no cargo: build elsewhere first
#   cargo build --release -p tidepool --lib && cargo build --release -p tidepool-tools --bin tidepool
#   cargo test --release -p tidepool --test engine --no-run
#   cp target/release/deps/engine-<hash> target/release/backends-test
#   cargo build --release --features cudarc --example rust_runtime
# (carry target/release/libtidepool.so, target/release/tidepool,
# target/release/backends-test and target/release/examples/rust_runtime),
# then run this from the repository root. Prints a short table last.
# Record what it prints in docs/gpu-results.md with the date, GPU and driver.
#
# The whole script finishes within BUDGET seconds (default 450: a device
# lent for 10 minutes a command, start-up included): each section runs
# under `timeout` with its own limit, cut to what is left of the budget
# (less what the summary needs), writes its results under $OUT as it
# goes, and a section that times out leaves the others' figures; the
# summary is printed whatever happened.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
BUDGET=${BUDGET:-450}
START=$SECONDS
# limit SECONDS: the seconds a section may take, at most SECONDS and what
# the budget has left (20 s kept for the summary); 0 when none is left.
limit() {
  local left=$(( BUDGET - 20 - (SECONDS - START) ))
  (( left < 0 )) && left=0
  echo $(( $1 < left ? $1 : left ))
}
# bounded SECONDS CMD...: runs CMD under timeout (limit SECONDS); a section
# with no time left is skipped with exit status 124, as a timeout.
bounded() {
  local seconds; seconds=$(limit "$1"); shift
  if (( seconds == 0 )); then echo "run.sh: out of time budget: skipped: $*"; return 124; fi
  timeout "$seconds" "$@"
}
LIB=target/release/libtidepool.so
[ -f "$LIB" ] || { echo "run.sh: $LIB missing: build it with cargo first" >&2; exit 2; }
export TIDEPOOL_LIBRARY=$PWD/$LIB TIDEPOOL_CONF=${TIDEPOOL_CONF:-backend:cuda}

# tidepool (through cudarc) opens libcuda.so; drivers often ship only libcuda.so.1.
if ! ldconfig -p | grep -q 'libcuda.so '; then
  real=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
  mkdir -p "$OUT/libcuda" && ln -sf "$real" "$OUT/libcuda/libcuda.so"
  export LD_LIBRARY_PATH=$OUT/libcuda:${LD_LIBRARY_PATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== build"
nvcc -O2 -I ffi cuda/check/tidepool_check.cu -L target/release -ltidepool -lcuda \
  -Xlinker -rpath -Xlinker "$PWD/target/release" -o "$OUT/tidepool_check" || exit 1

echo "== conformance suite on the real driver"
if [ -x target/release/backends-test ]; then
  TIDEPOOL_TEST_CHILD=1 TIDEPOOL_TEST_DEVICE_MEMORY=1 TIDEPOOL_TEST_BACKEND=cuda bounded 45 \
    target/release/backends-test --ignored --exact backends::child_cuda_conformance --nocapture --test-threads=1 | tee "$OUT/conformance.txt"
  echo "-- with expandable segments"
  TIDEPOOL_TEST_CHILD=1 TIDEPOOL_TEST_DEVICE_MEMORY=1 TIDEPOOL_TEST_BACKEND=cuda TIDEPOOL_TEST_CONF=expandable:true bounded 45 \
    target/release/backends-test --ignored --exact backends::child_cuda_conformance --nocapture --test-threads=1 | tee "$OUT/conformance-expandable.txt"
else
  echo "target/release/backends-test missing: conformance skipped" | tee "$OUT/conformance.txt" "$OUT/conformance-expandable.txt"
fi

echo "== what each driver call of expandable segments costs, and a 20 GiB warm-up in each setting"
bounded 60 python3 cuda/check/vmm_calls.py --json "$OUT/vmm.json" | tee "$OUT/vmm.txt"
vmm_rc=${PIPESTATUS[0]}

echo "== a 20 GiB trace's warm-up through PyTorch: its expandable segments, tidepool's page by page, in 8 MiB allocations, and as large as each run split when reused (a stream synchronization each)"
warmup() {
  bounded 30 python3 cuda/check/trace_warmup.py --trace examples/traces/transformer-varlen-train.csv "$@" | tail -1 | tee -a "$OUT/warmup.json"
}
warmup --allocator native-expandable
warmup --allocator tidepool-expandable
warmup --allocator tidepool-expandable --conf expandable_allocation_mb:8
warmup --allocator tidepool-expandable --conf expandable_allocation_mb:unlimited,expandable_split_allocations:true

echo "== patterns across streams, and latency"
bounded 60 "$OUT/tidepool_check" 10000 | tee "$OUT/check.txt"
check_rc=${PIPESTATUS[0]}
echo "-- with expandable segments (kernels write into pages tidepool mapped)"
TIDEPOOL_CONF="$TIDEPOOL_CONF,expandable:true" bounded 30 "$OUT/tidepool_check" 3000 | tee "$OUT/check-expandable.txt"
check_expandable_rc=${PIPESTATUS[0]}

echo "== tags: a CUDA graph across pause and resume, offload bandwidth, pause/resume latency"
nvcc -O2 -I ffi cuda/check/tags_check.cu -L target/release -ltidepool -lcuda \
  -Xlinker -rpath -Xlinker "$PWD/target/release" -o "$OUT/tags_check" || exit 1
bounded 60 "$OUT/tags_check" 2 | tee "$OUT/tags.txt"
tags_rc=${PIPESTATUS[0]}

echo "== Rust runtime: Buffer<T> through cudarc, a PTX kernel per layer, results against the host"
RUNTIME=target/release/examples/rust_runtime
if [ -x "$RUNTIME" ]; then
  bounded 30 "$RUNTIME" 48 8 2>&1 | tee "$OUT/rust-runtime.txt"
  runtime_rc=${PIPESTATUS[0]}
  echo "-- with expandable segments"
  TIDEPOOL_CONF="$TIDEPOOL_CONF,expandable:true" bounded 30 "$RUNTIME" 48 8 2>&1 | tee "$OUT/rust-runtime-expandable.txt"
  runtime_expandable_rc=${PIPESTATUS[0]}
else
  echo "$RUNTIME missing: build it with --features cudarc; skipped" | tee "$OUT/rust-runtime.txt"
  runtime_rc=missing runtime_expandable_rc=missing
fi

echo "== what the card gives an allocator (tidepool cards assumes nvidia-smi's total less 1.5 GiB)"
bounded 30 python3 - <<'PY' 2>&1 | tee "$OUT/card.txt"
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

echo "== PyTorch end to end"
# The C++ entry points PyTorch calls and the frame capture, built in place
# (pip builds them into the package where cargo is at hand).
c++ -std=c++17 -O2 -shared -fPIC ffi/python/csrc/torch_alloc.cpp -o ffi/python/tidepool/libtidepool_torch.so || exit 1
c++ -std=c++17 -O2 -shared -fPIC "-I$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
  ffi/python/csrc/stacks.cpp -o "ffi/python/tidepool/_stacks$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" || exit 1
for a in native native-expandable tidepool tidepool-expandable; do
  bounded 45 python3 cuda/check/torch_e2e.py --allocator $a --steps 20 --snapshot "$OUT/snapshot.pickle" | tail -1 | tee "$OUT/e2e-$a.json"
done

echo "== tidepool's models of PyTorch's allocator against PyTorch itself (the loop recorded, then replayed)"
if [ -x target/release/tidepool ]; then
  for a in native native-expandable; do
    bounded 30 python3 cuda/check/torch_e2e.py --allocator $a --steps 10 --history "$OUT/history-$a.pickle" | tail -1
  done
  bounded 15 target/release/tidepool replay "$OUT/history-native.pickle" --policy pytorch --json | tee "$OUT/model-native.json"
  bounded 15 target/release/tidepool replay "$OUT/history-native-expandable.pickle" --policy pytorch-expandable --json \
    | tee "$OUT/model-native-expandable.json"
else
  echo "target/release/tidepool missing: the models are not checked"
fi

echo
echo "== summary (after $(( SECONDS - START )) s of a $BUDGET s budget)"
python3 - "$OUT" "$check_rc" "$check_expandable_rc" "$runtime_rc" "$runtime_expandable_rc" "$tags_rc" "$vmm_rc" <<'PY'
import json, sys, pathlib
out, check_rc, check_expandable_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
runtime_rcs = sys.argv[4:6]
tags_rc, vmm_rc = sys.argv[6], sys.argv[7]
print("gpu:", (out / "gpu.txt").read_text().strip())
card = (out / "card.txt").read_text().strip().splitlines() if (out / "card.txt").exists() else []
print(card[-1] if card else "card: no result")
for name in ["conformance", "conformance-expandable"]:
    print(f"{name} on the driver:", "ok" if "cuda conformance: ok" in (out / f"{name}.txt").read_text() else "not ok")
print("patterns/latency check:", "ok" if check_rc == 0 else f"FAILED ({check_rc})")
print("patterns check, expandable segments:", "ok" if check_expandable_rc == 0 else f"FAILED ({check_expandable_rc})")
tags_text = (out / "tags.txt").read_text() if (out / "tags.txt").exists() else ""
print("tags (graph across pause, bandwidth, latency):", "ok" if tags_rc == "0" and "tags check: ok" in tags_text else f"FAILED ({tags_rc})")
for line in tags_text.splitlines():
    if line.startswith(("graph across pause", "bandwidth", "latency")):
        print("  " + line)
vmm_text = (out / "vmm.txt").read_text() if (out / "vmm.txt").exists() else ""
print("driver calls of expandable segments:", "ok" if vmm_rc == "0" and "vmm calls: ok" in vmm_text else f"FAILED ({vmm_rc})")
for line in vmm_text.splitlines():
    if line.startswith(("calls at", "warm-up")):
        print("  " + line)
warmups = [json.loads(l) for l in (out / "warmup.json").read_text().splitlines() if l.startswith("{")] if (out / "warmup.json").exists() else []
for w in warmups:
    print(f"  trace warm-up, {w['allocator']} {w['conf']}: {w['warm_up_s']} s then {w['steady_s']} s, peak reserved "
          f"{w['peak_reserved_bytes'] / 2**30:.2f} GiB for {w['peak_live_bytes'] / 2**30:.2f} live, allocations {w.get('device_allocs')}")
if len(warmups) < 4:
    print(f"  trace warm-up: {len(warmups)} of 4 runs reported")
for name, rc in zip(["rust-runtime", "rust-runtime-expandable"], runtime_rcs):
    text = (out / f"{name}.txt").read_text() if (out / f"{name}.txt").exists() else ""
    verdict = "ok" if rc == "0" and "equal to the host's" in text else ("skipped" if rc == "missing" else f"FAILED ({rc})")
    print(f"{name} (cudarc, PTX kernel, results vs host): {verdict}")
runs = {}
for name in ["native", "native-expandable", "tidepool", "tidepool-expandable"]:
    try:
        runs[name] = json.loads((out / f"e2e-{name}.json").read_text())
    except Exception as e:
        print(f"{name}: no result ({e})")
if "native" in runs and "tidepool" in runs:
    n, t = runs["native"], runs["tidepool"]
    print(f"losses identical: {n['losses'] == t['losses']}")
    print(f"step time tidepool/native: {t['median_step_s'] / n['median_step_s']:.3f} (target <= 1.02)")
    for name, r in runs.items():
        print(f"peak reserved {name:18s} {r['peak_reserved_bytes'] / 2**30:7.3f} GiB")
    print(f"tidepool stats sane: {t.get('stats_sane')}, snapshot in memory_viz: {t.get('snapshot_loads_in_memory_viz')}")
    for key in ["oom_raises", "oom_observer_calls", "continues_after_oom", "batch_search_found", "peak_api_ok",
                "memory_stats_keys", "frames_name_this_file", "api_error"]:
        print(f"{key:22s} " + ", ".join(f"{name} {r.get(key)}" for name, r in runs.items()))
    print("CUDA graph replay intact: " + ", ".join(f"{name} {r.get('graph_ok')}" for name, r in runs.items()))
    if "tidepool-expandable" in runs:
        e = runs["tidepool-expandable"]
        print(f"expandable: losses identical {n['losses'] == e['losses']}, step time/native {e['median_step_s'] / n['median_step_s']:.3f}, "
              f"pages mapped/unmapped after warm-up {e.get('pages_mapped_after_warm_up')}/{e.get('pages_unmapped_after_warm_up')} (target 0/0)")
for name in ["native", "native-expandable"]:
    try:
        m = json.loads((out / f"model-{name}.json").read_text().splitlines()[0])
        recorded = m["pytorch_recorded_peak_reserved_bytes"]
        print(f"model of {name}: peak reserved {m['peak_reserved_bytes'] / 2**30:.3f} GiB, PyTorch recorded "
              f"{recorded / 2**30:.3f} GiB ({100 * (m['peak_reserved_bytes'] / recorded - 1):+.2f} %)")
    except Exception as e:  # noqa: BLE001 - a missing file is reported, the summary goes on
        print(f"model of {name}: no result ({e})")
PY
