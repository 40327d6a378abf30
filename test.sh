#!/usr/bin/env bash
# Every test tidepool has, on a Linux machine without a GPU: sets up what
# the tests need, then runs them (README's test command; CI runs exactly
# this, .ci/run, on a fresh clone).
#
# Needs a Rust toolchain (cargo) and Python 3 with venv; installs the
# other tools the tests run (below) with apt where they are missing;
# Rust crates come from crates.io through Cargo.lock, Python packages from
# PyPI: a venv with the pinned torch (its PyPI build loads pluggable
# allocators and imports without a GPU), the planner's transformers and
# peft, CuPy and numba-cuda, and the Python package's build tools, kept
# under ~/.cache/tidepool-ci between runs. With everything set up, the
# tests run with CI=true: a missing tool fails its test instead of
# skipping it. docs/testing.md says what each part covers.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "test.sh: cargo not found; install a Rust toolchain (rustup) first" >&2
    exit 1
  fi
fi
cargo --version

TORCH_VERSION=2.15.0
# tidepool.plan's tests build real transformers models and peft adapters.
PLANNER_PACKAGES=("transformers==5.24.0" "peft==0.21.2")
venv="${XDG_CACHE_HOME:-$HOME/.cache}/tidepool-ci/venv-torch-$TORCH_VERSION"
if ! "$venv/bin/python" -c "import torch, numpy, setuptools_rust, wheel" >/dev/null 2>&1; then
  echo "test.sh: making $venv (torch $TORCH_VERSION and the package's build tools)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" numpy "setuptools>=77" "setuptools-rust>=1.9" wheel
fi
# Added to an existing venv as to a new one (torch stays as it is).
if ! "$venv/bin/python" -c "import transformers, peft" >/dev/null 2>&1; then
  echo "test.sh: installing ${PLANNER_PACKAGES[*]} into $venv"
  "$venv/bin/python" -m pip install --quiet "${PLANNER_PACKAGES[@]}"
fi
# tidepool.cupy's and tidepool.numba's tests run inside the real CuPy and
# numba-cuda (their CUDA 13 builds, as torch's; both import without a GPU;
# about 0.5 GB with numba's llvmlite and libnvvm).
RUNTIME_PACKAGES=("cupy-cuda13x==14.2.0" "numba-cuda[cu13]==0.30.4")
if ! "$venv/bin/python" -c "import cupy, numba_cuda" >/dev/null 2>&1; then
  echo "test.sh: installing ${RUNTIME_PACKAGES[*]} into $venv"
  "$venv/bin/python" -m pip install --quiet "${RUNTIME_PACKAGES[@]}"
fi
export TIDEPOOL_TEST_PYTHON="$venv/bin/python"
"$TIDEPOOL_TEST_PYTHON" -c "import torch, transformers, peft; print('test.sh: torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
"$TIDEPOOL_TEST_PYTHON" -c "import cupy, numba, numba_cuda; print('test.sh: cupy', cupy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__)"

# The tools the tests run, from Debian's packages where a command is
# missing; under CI=true (set below) a missing one fails its test:
# tools/tests/tools/exporter.rs runs a real Prometheus server and promtool
# (prometheus), tests/cabi/c.rs and tests/cabi/tags.rs valgrind's memcheck
# (valgrind), tests/cabi/header.rs nm (binutils), simgpu and the C and C++
# tests cc and c++ (gcc, g++).
# Without root (and no sudo), Prometheus comes as Debian's package
# unpacked under the CI cache (its two programs are static: no install
# needed); the other tools must then be on the machine already.
cache="${XDG_CACHE_HOME:-$HOME/.cache}/tidepool-ci"
unpacked="$cache/prometheus-deb"
[ -x "$unpacked/usr/bin/prometheus" ] && export PATH="$unpacked/usr/bin:$PATH"
packages=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
command -v valgrind >/dev/null 2>&1 || packages+=(valgrind)
command -v nm >/dev/null 2>&1 || packages+=(binutils)
command -v cc >/dev/null 2>&1 || packages+=(gcc)
command -v c++ >/dev/null 2>&1 || packages+=(g++)
if [ ${#packages[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] || command -v sudo >/dev/null 2>&1; then
    echo "test.sh: installing ${packages[*]}"
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}"
  elif [ "${packages[*]}" = "prometheus" ]; then
    echo "test.sh: no root: unpacking Debian's prometheus package into $unpacked"
    rm -rf "$unpacked" && mkdir -p "$unpacked/deb"
    (cd "$unpacked/deb" && apt-get download prometheus) \
      || { echo "test.sh: apt-get download prometheus failed (no package lists? run apt-get update as root once)" >&2; exit 1; }
    dpkg-deb -x "$unpacked"/deb/prometheus_*.deb "$unpacked"
    export PATH="$unpacked/usr/bin:$PATH"
  else
    echo "test.sh: missing ${packages[*]} and no root to install them: install them first" >&2
    exit 1
  fi
fi
prometheus --version 2>&1 | head -1
valgrind --version
export CI=true


# The test command of docs/testing.md (both crates of the workspace; it
# runs the commands README.md and docs/ show, tools/tests/tools/readme.rs):
cargo test --locked
# Load tests, alone: they measure time while flooding the machine.
cargo test --locked -p tidepool-tools --test tools -- --ignored --exact \
  exporter::a_flood_of_connects_and_partial_requests_fails_no_scrape_and_delays_none_past_100_ms
# and the tests the cudarc interop changes, with it (Buffer<T> as cudarc
# device memory, over simgpu; the rest of the suite does not see the feature):
cargo test --locked -p tidepool --features cudarc --lib --test cudarc
cargo test --locked -p tidepool --features cudarc --test engine -- buffer::
# The GPU check, staged as for a GPU machine and rehearsed here over simgpu
# (docs/testing.md#on-a-gpu): a section that breaks, a missing file or a
# staged folder past the bound fails here, not on the first GPU.
cuda/check/prepare.sh
rm -rf target/gpu-check-rehearsal
OUT=target/gpu-check-rehearsal PYTHON="$TIDEPOOL_TEST_PYTHON" bash cuda/check/run.sh --rehearse
# The guard on the cached path: the instructions of the cached 512 B pair,
# counted by callgrind in the `gpu-check` build prepare.sh just made (only
# the example's link is new), against a bound (docs/benchmarks.md#profiling).
.ci/cached_pair.sh
# The benchmarks must keep compiling (they are not run here: timing on a
# shared CI machine means nothing).
cargo build --locked --benches --examples
cargo build --locked -p tidepool --features cudarc --examples
