"""Finding, building and loading the compiled rotary extension.

Order: (1) the ops are already registered in this process; (2) an
ahead-of-time build that ``setup.py`` placed next to this file
(``ftshims/kernels/_rotary*.so``); (3) a just-in-time build with
``torch.utils.cpp_extension.load`` into a cache folder.

The JIT cache folder is ``$TORCH_EXTENSIONS_DIR`` (torch's own variable) or
``~/.cache/torch_extensions``, plus ``ftshims_rotary_<hash>``: the hash covers
the sources, the compiler flags, torch's version and CUDA version and the
Python version, so a changed source or a different torch never reuses a stale
library. Several processes (ranks) starting together serialise on an
``fcntl`` lock file in the cache folder: the first builds, the others wait and
then load the finished library. The lock is released by the kernel when its
holder dies, so a killed build never leaves the others waiting forever (the
failure mode of torch's own lock file).

Which kernels are compiled (``plan()``, reported as ``status()["build"]``):
the CPU kernels always; the CUDA kernels too when torch is a CUDA build, a CUDA
toolkit is found (nvcc, and libcudart to link), and the target architectures are known: from
``TORCH_CUDA_ARCH_LIST`` when it is set (e.g. ``"8.0;9.0"``; no device needed),
else from the visible CUDA devices. A CUDA build of torch on a machine without
a CUDA device and without ``TORCH_CUDA_ARCH_LIST`` (a CI runner, a login node, a
laptop) gets the CPU kernels only: torch's extension builder would otherwise
fail there with a bare ``IndexError`` (it derives the architectures from the
devices, finds none, and indexes the empty list).

Every outcome is recorded with a reason (``status()``); nothing here raises
unless the caller asked for the compiled backend explicitly.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.machinery
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

log = logging.getLogger("ftshims")

_LOCK = threading.Lock()
_STATE: Dict[str, object] = {
    "tried": False, "loaded": False, "how": None, "reason": None, "cuda": False, "build": None, "cpu_isa": None,
}

HERE = Path(__file__).resolve().parent
# The C++ sources in link order: rotary.cpp (baseline flags) must come first, so that the inline functions of
# headers that every object emits are taken from it and never from the AVX2/AVX-512 builds of the CPU kernel
# (GNU ld, gold and lld keep the first copy), which would run them on CPUs without those instructions.
CPU_SOURCES = ("rotary.cpp", "rotary_cpu.cpp", "rotary_cpu_avx2.cpp", "rotary_cpu_avx512.cpp")
SOURCE_NAMES = ("rotary.h", "rotary_op.h", "rotary_cpu.h") + CPU_SOURCES + ("rotary_cuda.cu",)


def source_dir() -> Optional[Path]:
    """Where the C++/CUDA sources are: a copy inside the package (installed), or the repository's csrc/."""
    for candidate in (HERE / "_csrc", HERE.parent.parent / "csrc"):
        if all((candidate / name).is_file() for name in SOURCE_NAMES):
            return candidate
    return None


def cflags(with_cuda: bool) -> List[str]:
    # The C++ standard is torch's choice (C++17 for 2.13, C++20 for 2.14). No contraction of a*b - c*d into
    # fused multiply-adds: the CPU kernel's products and sums are rounded as the reference's are.
    flags = ["-O3", "-ffp-contract=off"]
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")  # at::parallel_for is inline OpenMP: without it the CPU kernel runs serially
    if with_cuda:
        flags.append("-DFTSHIMS_WITH_CUDA")
    return flags


def cuda_cflags() -> List[str]:
    # No --use_fast_math: the kernel relies on the accurate sincosf.
    return ["-O3", "-DFTSHIMS_WITH_CUDA", "-lineinfo"]


def ldflags() -> List[str]:
    return ["-fopenmp"] if sys.platform.startswith("linux") else []


def _ops_registered() -> bool:
    import torch

    try:
        torch.ops.ftshims.rotary.default  # noqa: B018 (attribute access resolves the op)
        return True
    except (AttributeError, RuntimeError):
        return False


def _has_cuda_kernels() -> bool:
    import torch

    try:
        return "cuda" in torch.ops.ftshims.rotary_build_info()
    except (AttributeError, RuntimeError):
        return False


def _cpu_isa() -> Optional[str]:
    """The instruction set the CPU kernel runs with here: "avx512", "avx2" or "default" (None: a library without it)."""
    import torch

    try:
        return str(torch.ops.ftshims.rotary_cpu_isa())
    except (AttributeError, RuntimeError):
        return None


def _aot_library() -> Optional[Path]:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for path in sorted(glob.glob(str(HERE / f"_rotary*{suffix}"))):
            return Path(path)
    return None


def cuda_toolkit() -> Optional[str]:
    """The CUDA toolkit torch's extension builder would use, or None (CPU torch, or no nvcc)."""
    import torch

    if torch.version.cuda is None:
        return None
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    return None


def _cudart_dir(toolkit: str) -> Optional[str]:
    """The folder torch's builder links the CUDA runtime from (``-L<it> -lcudart``) if libcudart is there.

    An ``nvcc`` wrapper script in ``/usr/local/bin`` makes torch take ``CUDA_HOME=/usr/local``, which compiles
    the CUDA sources and then fails to link (``cannot find -lcudart``).
    """
    lib = os.path.join(toolkit, "lib64")
    lib = lib if os.path.isdir(lib) else os.path.join(toolkit, "lib")  # torch's own choice (library_paths)
    return lib if glob.glob(os.path.join(lib, "libcudart.*")) else None


ARCH_ENV = "TORCH_CUDA_ARCH_LIST"  # torch's own variable, read by its extension builder


def plan() -> Tuple[bool, str]:
    """``(with_cuda, what)``: whether the CUDA kernels are compiled too, and a sentence saying which and why."""
    import torch

    if torch.version.cuda is None:
        return False, f"CPU kernels (torch {torch.__version__} is a CPU build)"
    toolkit = cuda_toolkit()
    if toolkit is None:
        from torch.utils import cpp_extension

        return False, (
            f"CPU kernels only (torch {torch.__version__} is a CUDA {torch.version.cuda} build, but no CUDA toolkit "
            f"was found: no nvcc under CUDA_HOME={cpp_extension.CUDA_HOME})"
        )
    arch = os.environ.get(ARCH_ENV, "").strip()
    devices = torch.cuda.device_count()  # what torch's builder reads; 0 without a driver, never raises
    if arch and arch != "native":
        target = f"{ARCH_ENV}={arch!r}"
    elif devices > 0:
        target = f"the architectures of the {devices} visible CUDA device(s)"
    else:
        given = f" ({ARCH_ENV}='native' needs a visible device)" if arch == "native" else f" and {ARCH_ENV} is not set"
        return False, (
            f"CPU kernels only: torch {torch.__version__} is a CUDA build, but no CUDA device is visible{given}; "
            f"set {ARCH_ENV} (e.g. '8.0;9.0') to compile the CUDA kernels without a device"
        )
    if _cudart_dir(toolkit) is None:
        return False, (
            f"CPU kernels only: the CUDA kernels for {target} cannot be linked: CUDA_HOME={toolkit} has bin/nvcc but "
            f"no libcudart in its lib64/ or lib/; set CUDA_HOME to the CUDA toolkit (e.g. /usr/local/cuda)"
        )
    return True, f"CPU and CUDA kernels for {target} (CUDA toolkit {toolkit})"


def cache_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "torch_extensions"


def build_key(sources: Path, with_cuda: bool) -> str:
    import torch

    digest = hashlib.sha256()
    for name in SOURCE_NAMES:
        digest.update(name.encode())
        digest.update((sources / name).read_bytes())
    parts = [torch.__version__, str(torch.version.cuda), sys.version.split()[0], str(with_cuda)]
    parts += cflags(with_cuda) + (cuda_cflags() if with_cuda else []) + ldflags()
    parts.append(os.environ.get("TORCH_CUDA_ARCH_LIST", "") if with_cuda else "")
    digest.update("|".join(parts).encode())
    return digest.hexdigest()[:16]


class _FileLock:
    """An exclusive ``flock`` on a file; released by the OS if the holder dies."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: Optional[int] = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:  # not POSIX: torch's own baton is the only guard
            return self
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self._fd is not None:
            try:
                import fcntl

                fcntl.flock(self._fd, fcntl.LOCK_UN)
            except ImportError:
                pass
            os.close(self._fd)
            self._fd = None
        return False


def jit_build(verbose: bool = False, with_cuda: Optional[bool] = None) -> Path:
    """Build (or reuse) the extension in the cache folder and load it. Raises on failure.

    ``with_cuda``: compile the CUDA kernels too; by default what :func:`plan` decides.
    """
    from torch.utils import cpp_extension

    sources = source_dir()
    if sources is None:
        raise RuntimeError("the C++/CUDA sources are not installed (no ftshims/kernels/_csrc, no csrc/)")
    if with_cuda is None:
        with_cuda = plan()[0]
    key = build_key(sources, with_cuda)
    name = f"ftshims_rotary_{key}"
    build_dir = cache_root() / name
    files = [str(sources / name) for name in CPU_SOURCES] + ([str(sources / "rotary_cuda.cu")] if with_cuda else [])
    with _FileLock(cache_root() / f"{name}.lock"):
        build_dir.mkdir(parents=True, exist_ok=True)
        baton = build_dir / "lock"
        # torch < 2.15 waits while that file exists (FileBaton); 2.15 takes an flock on it instead
        # (torch.utils._filelock), keeps the file, and a leftover one blocks nobody: nothing to remove.
        if baton.exists() and hasattr(cpp_extension, "FileBaton"):
            # torch's own lock file, left by a build that was killed: while we hold the flock
            # no other ftshims process can be building here, so it is stale (torch would wait forever).
            log.warning("removing a stale torch build lock %s (a previous build was interrupted)", baton)
            baton.unlink()
        cpp_extension.load(
            name=name,
            sources=files,
            extra_cflags=cflags(with_cuda),
            extra_cuda_cflags=cuda_cflags() if with_cuda else None,
            extra_ldflags=ldflags(),
            extra_include_paths=[str(sources)],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            is_python_module=False,
            verbose=verbose,
        )
    return build_dir


def load(jit: bool = True) -> bool:
    """Load the compiled ops once per process; True when ``torch.ops.ftshims.rotary`` is usable."""
    if _STATE["loaded"]:  # lock-free fast path (also what torch.compile traces through)
        return True
    with _LOCK:
        if _STATE["tried"] and (_STATE["loaded"] or not jit or _STATE["how"] == "jit-failed"):
            return bool(_STATE["loaded"])
        _STATE["tried"] = True
        import torch

        reasons = []
        if _ops_registered():
            _STATE.update(loaded=True, how="already registered", reason=None)
        else:
            aot = _aot_library()
            if aot is not None:
                try:
                    torch.ops.load_library(str(aot))
                    _STATE.update(loaded=True, how=f"ahead-of-time build {aot.name}", reason=None)
                except (OSError, RuntimeError) as exc:
                    reasons.append(f"ahead-of-time build {aot.name} failed to load ({exc}); was it built for another torch?")
            else:
                reasons.append("no ahead-of-time build")
            if not _STATE["loaded"] and jit:
                what = "the extension"
                try:
                    with_cuda, what = plan()
                    _STATE["build"] = what
                    build_dir = jit_build(with_cuda=with_cuda)
                    _STATE.update(loaded=True, how=f"JIT build in {build_dir}", reason=None)
                except Exception as exc:  # compiler missing, ninja missing, build error: all mean "no extension"
                    _STATE["how"] = "jit-failed"
                    reasons.append(f"JIT build of {what} failed: {_describe(exc)}")
            elif not _STATE["loaded"]:
                reasons.append("JIT build not attempted")
        if _STATE["loaded"]:
            from . import _ops

            _ops.register_python_parts()
            _STATE["cuda"] = _has_cuda_kernels()
            _STATE["cpu_isa"] = _cpu_isa()
            _STATE["reason"] = None
        else:
            _STATE["reason"] = "; ".join(reasons)
        return bool(_STATE["loaded"])


_BUILD_ERROR = re.compile(r"error|fatal|cannot find|undefined reference|no such file", re.IGNORECASE)


def _describe(exc: BaseException) -> str:
    """The exception in one line: its type, the first line of a build log that names an error (a compiler's or
    linker's ``...: error: ...``, ``cannot find -lcudart``), and the message's last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    cause = next((line for line in lines[:-1] if _BUILD_ERROR.search(line) and not line.startswith("Error building extension")), None)
    return f"{type(exc).__name__}: {cause + ' ... ' if cause else ''}{lines[-1]}"


def has_cuda_kernels() -> bool:
    """True when the loaded extension carries the CUDA kernels (lock-free)."""
    return bool(_STATE["cuda"])


def status() -> Dict[str, object]:
    """What happened when loading: ``loaded``, ``how``, ``reason`` (when not loaded), ``cuda`` (the loaded library
    has CUDA kernels), ``cpu_isa`` (the instruction set its CPU kernel runs with here: ``avx512``, ``avx2`` or
    ``default``, chosen as torch chooses its own, ``ATEN_CPU_CAPABILITY`` included) and ``build`` (for a JIT
    build: which kernels it compiles and why, from :func:`plan`)."""
    with _LOCK:
        return dict(_STATE)
