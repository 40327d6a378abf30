"""Builds the tidepool Python package from a checkout of the tidepool crate.

Three shared libraries go into the package beside its Python modules, and
the `tidepool` command into the environment's bin directory:
- libtidepool.so, the allocator, built by cargo from ../../Cargo.toml (the
  `tidepool` crate; setuptools-rust, as a plain cdylib: Python loads it
  with ctypes);
- libtidepool_torch.so, the C++ entry points PyTorch calls, which turn an
  out-of-memory into a C++ exception PyTorch raises in Python;
- _stacks, a small extension module that captures Python frames for
  record_memory_history(stacks="python");
- the tidepool command (replay, plan, top, exporter), a cargo binary of the
  `tidepool-tools` crate (../../tools/Cargo.toml).
"""
import os
import pathlib
import shutil
import sys

from setuptools import Extension, setup

HERE = pathlib.Path(__file__).resolve().parent
CRATE = HERE.parents[1] / "Cargo.toml"
TOOLS = HERE.parents[1] / "tools" / "Cargo.toml"
CARGO_HOME_BIN = pathlib.Path.home() / ".cargo" / "bin"


def require_cargo():
    """Puts rustup's cargo on PATH if it is installed but not there; fails
    with what to install when there is none."""
    if shutil.which("cargo") is None and (CARGO_HOME_BIN / "cargo").exists():
        os.environ["PATH"] = f"{CARGO_HOME_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    if shutil.which("cargo") is None:
        sys.exit(
            "error: building tidepool needs Rust's cargo, which is not installed.\n"
            "Install a Rust toolchain (https://rustup.rs: curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh),\n"
            "then run pip again; or install a tidepool wheel built elsewhere (pip wheel ./ffi/python), which needs no Rust."
        )
    if not CRATE.exists():
        sys.exit(
            f"error: {CRATE} not found: the tidepool Python package builds from a checkout of the tidepool "
            "repository (pip install ./ffi/python from its root)."
        )


def rust_extensions():
    from setuptools_rust import Binding, RustBin, RustExtension

    return [
        RustExtension(
            "tidepool.libtidepool",
            path=str(CRATE),
            binding=Binding.NoBinding,
            args=["--locked"],
        ),
        # The tidepool command (replay, plan, top, exporter), installed into
        # the environment's bin directory: `python -m tidepool.plan` runs it.
        RustBin("tidepool", path=str(TOOLS), args=["--locked"]),
    ]


cxx_flags = ["-std=c++17", "-O2", "-fvisibility=hidden"]

require_cargo()
# pip builds in this folder: a module renamed or removed since an earlier
# build must not reach the wheel from build/lib.
for stale in HERE.glob("build/lib*/tidepool"):
    shutil.rmtree(stale)
setup(
    rust_extensions=rust_extensions(),
    ext_modules=[
        Extension(
            "tidepool.libtidepool_torch",
            sources=["csrc/torch_alloc.cpp"],
            language="c++",
            # Not a Python module: loaded with ctypes, its C symbols exported.
            extra_compile_args=cxx_flags + ["-fvisibility=default"],
        ),
        Extension(
            "tidepool._stacks",
            sources=["csrc/stacks.cpp"],
            language="c++",
            extra_compile_args=cxx_flags,
        ),
    ],
    zip_safe=False,
)
