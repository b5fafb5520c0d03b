"""Build entry point. The package itself is pure Python (configured in pyproject.toml);
this file only adds the optional C++/CUDA extension of ftshims.kernels (the rotary op).

What gets built, decided when setup.py runs:

* torch is a CUDA build, a CUDA toolkit (nvcc) is found and the architectures
  are known (``TORCH_CUDA_ARCH_LIST``, else the visible devices) -> ``CUDAExtension``
  (CPU and CUDA kernels);
* torch is a CPU-only build -> ``CppExtension`` (CPU kernels);
* otherwise (no torch importable, e.g. pip's isolated build environment; a
  CUDA torch without a toolkit; a CUDA torch with a toolkit but no device and no
  ``TORCH_CUDA_ARCH_LIST``, where torch's builder would stop with an IndexError)
  -> nothing: a pure-Python install, and the extension is JIT-compiled on first
  use instead, for the devices of the machine that uses it (see
  ftshims/kernels/_build.py).

A failed extension build never fails the install: the error is printed with a
clear message and the package installs without it. To build it ahead of time,
install with the build environment's torch visible:
``pip install --no-build-isolation .`` (or ``python setup.py build_ext --inplace``).

The C/C++/CUDA sources (csrc/) are also copied into the package as
``ftshims/kernels/_csrc`` so that an installed wheel can still JIT-build.
"""

from __future__ import annotations

import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")
CPU_SOURCES = ("rotary.cpp", "rotary_cpu.cpp", "rotary_cpu_avx2.cpp", "rotary_cpu_avx512.cpp")  # link order: see _build.py
SOURCE_NAMES = ("rotary.h", "rotary_op.h", "rotary_cpu.h") + CPU_SOURCES + ("rotary_cuda.cu",)
EXT_NAME = "ftshims.kernels._rotary"
AUTO_PTH = "ftshims-auto.pth"


def _say(message: str) -> None:
    print(f"ftshims setup: {message}", file=sys.stderr)


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package (ftshims/kernels/_csrc) for the JIT fallback, and the .pth hook."""

    def run(self):
        super().run()
        # The child-process hook (FTSHIMS_AUTO) must sit at the top of site-packages to be read at start-up.
        shutil.copy2(os.path.join(HERE, AUTO_PTH), os.path.join(self.build_lib, AUTO_PTH))
        target = os.path.join(self.build_lib, "ftshims", "kernels", "_csrc")
        if not all(os.path.isfile(os.path.join(CSRC, n)) for n in SOURCE_NAMES):
            return
        os.makedirs(target, exist_ok=True)
        for name in SOURCE_NAMES:
            shutil.copy2(os.path.join(CSRC, name), os.path.join(target, name))


class SdistWithSources(sdist):
    """Keep csrc/ in source distributions even when no extension is configured."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        target = os.path.join(base_dir, "csrc")
        os.makedirs(target, exist_ok=True)
        for name in SOURCE_NAMES:
            if os.path.isfile(os.path.join(CSRC, name)):
                shutil.copy2(os.path.join(CSRC, name), os.path.join(target, name))


def _extension_setup():
    """(ext_modules, cmdclass) for the extension, or ([], {}) with a printed reason."""
    if not all(os.path.isfile(os.path.join(CSRC, n)) for n in SOURCE_NAMES):
        _say("csrc/ not found; installing without the compiled rotary extension")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # ImportError, or a broken torch install
        _say(
            f"torch is not importable here ({type(exc).__name__}); installing without the compiled rotary "
            "extension (it will be JIT-compiled on first use; use --no-build-isolation to build it now)"
        )
        return [], {}

    sys.path.insert(0, os.path.join(HERE, "ftshims", "kernels"))
    try:
        import _build as flags  # the same flags the JIT build uses (no torch import at module level)
    finally:
        sys.path.pop(0)

    cuda_home = cpp_extension.CUDA_HOME
    has_toolkit = bool(cuda_home) and os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))
    sources = [os.path.join("csrc", name) for name in CPU_SOURCES]
    with_cuda, what = flags.plan()  # the JIT build's rule: CUDA kernels only for known architectures
    if torch.version.cuda is not None and has_toolkit and not with_cuda:
        # An ahead-of-time CPU-only library would be loaded in place of a CUDA one on the machine that
        # has the devices: leave the build to the JIT there.
        _say(f"{what}; installing without the compiled rotary extension (JIT-compiled on first use instead)")
        return [], {}
    if with_cuda:
        sources.append(os.path.join("csrc", "rotary_cuda.cu"))
        ext = cpp_extension.CUDAExtension(
            EXT_NAME,
            sources,
            include_dirs=[CSRC],
            extra_compile_args={"cxx": flags.cflags(True), "nvcc": flags.cuda_cflags()},
            extra_link_args=flags.ldflags(),
        )
        kind = f"CUDAExtension (torch {torch.__version__}, CUDA {torch.version.cuda}: {what})"
    elif torch.version.cuda is None:
        ext = cpp_extension.CppExtension(
            EXT_NAME,
            sources,
            include_dirs=[CSRC],
            extra_compile_args=flags.cflags(False),
            extra_link_args=flags.ldflags(),
        )
        kind = f"CppExtension (CPU torch {torch.__version__})"
    else:
        _say(
            f"torch {torch.__version__} is a CUDA build but no CUDA toolkit was found (CUDA_HOME={cuda_home}); "
            "installing without the compiled rotary extension"
        )
        return [], {}
    _say(f"building the rotary extension as a {kind}")

    base = cpp_extension.BuildExtension.with_options(no_python_abi_suffix=False)

    class OptionalBuildExtension(base):
        """Never fail the install because of the optional extension."""

        def run(self):
            try:
                super().run()
            except Exception as exc:
                self._skip(exc)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                # A library left from an earlier build must not be installed in its place.
                stale = self.get_ext_fullpath(ext.name)
                if os.path.exists(stale):
                    os.remove(stale)
                self.extensions = [e for e in self.extensions if e is not ext]
                self._skip(exc)

        def _skip(self, exc):
            _say(
                f"building the optional rotary extension failed ({type(exc).__name__}: {exc}); "
                "installing the pure-Python package without it (the kernels fall back to JIT or to the "
                "PyTorch reference at run time)"
            )

    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _extension_setup()
cmdclass["build_py"] = BuildPyWithSources
cmdclass["sdist"] = SdistWithSources

setup(ext_modules=ext_modules, cmdclass=cmdclass)
