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

Every outcome is recorded with a reason (``status()``); nothing here raises
unless the caller asked for the compiled backend explicitly.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.machinery
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional

log = logging.getLogger("ftshims")

_LOCK = threading.Lock()
_STATE: Dict[str, object] = {"tried": False, "loaded": False, "how": None, "reason": None, "cuda": False}

HERE = Path(__file__).resolve().parent
SOURCE_NAMES = ("rotary.h", "rotary_op.h", "rotary.cpp", "rotary_cuda.cu")


def source_dir() -> Optional[Path]:
    """Where the C++/CUDA sources are: a copy inside the package (installed), or the repository's csrc/."""
    for candidate in (HERE / "_csrc", HERE.parent.parent / "csrc"):
        if all((candidate / name).is_file() for name in SOURCE_NAMES):
            return candidate
    return None


def cflags(with_cuda: bool) -> List[str]:
    flags = ["-O3"]  # the C++ standard is torch's choice (C++17 for 2.13, C++20 for 2.14)
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


def jit_build(verbose: bool = False) -> Path:
    """Build (or reuse) the extension in the cache folder and load it. Raises on failure."""
    from torch.utils import cpp_extension

    sources = source_dir()
    if sources is None:
        raise RuntimeError("the C++/CUDA sources are not installed (no ftshims/kernels/_csrc, no csrc/)")
    with_cuda = cuda_toolkit() is not None
    key = build_key(sources, with_cuda)
    name = f"ftshims_rotary_{key}"
    build_dir = cache_root() / name
    files = [str(sources / "rotary.cpp")] + ([str(sources / "rotary_cuda.cu")] if with_cuda else [])
    with _FileLock(cache_root() / f"{name}.lock"):
        build_dir.mkdir(parents=True, exist_ok=True)
        baton = build_dir / "lock"
        if baton.exists():
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
                try:
                    build_dir = jit_build()
                    _STATE.update(loaded=True, how=f"JIT build in {build_dir}", reason=None)
                except Exception as exc:  # compiler missing, ninja missing, build error: all mean "no extension"
                    _STATE["how"] = "jit-failed"
                    reasons.append(f"JIT build failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
            elif not _STATE["loaded"]:
                reasons.append("JIT build not attempted")
        if _STATE["loaded"]:
            from . import _ops

            _ops.register_python_parts()
            _STATE["cuda"] = _has_cuda_kernels()
            _STATE["reason"] = None
        else:
            _STATE["reason"] = "; ".join(reasons)
        return bool(_STATE["loaded"])


def has_cuda_kernels() -> bool:
    """True when the loaded extension carries the CUDA kernels (lock-free)."""
    return bool(_STATE["cuda"])


def status() -> Dict[str, object]:
    """What happened when loading: ``loaded``, ``how``, ``reason`` (when not loaded), ``cuda``."""
    with _LOCK:
        return dict(_STATE)
