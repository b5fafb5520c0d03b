"""Python, platform and torch facts for the report.

torch is imported here (it is the one package whose runtime facts — CUDA,
cuDNN, GPUs, bf16 — cannot be read from metadata), inside a guard: a torch
whose import raises is reported, not propagated. Every runtime query after the
import is guarded on its own, so a broken CUDA driver costs one field, not the
section.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional

IMPORTED = "imported"
NOT_INSTALLED = "not installed"
IMPORT_FAILED = "import failed"


def error_text(exc: BaseException, limit: int = 500) -> str:
    """``Type: message`` on one line, shortened."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


BYTECODE_PACKAGES = ("torch", "transformers")


def python_info() -> Dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "virtualenv": sys.prefix != getattr(sys, "base_prefix", sys.prefix),
        "writes_bytecode": not sys.dont_write_bytecode,
        "no_bytecode": packages_without_bytecode(),
    }


def packages_without_bytecode(names=BYTECODE_PACKAGES) -> List[str]:
    """The installed packages among ``names`` whose ``__init__`` has no compiled bytecode next to it.

    Found without importing them. Without bytecode Python compiles the package from source in every
    process that imports it, and with ``PYTHONDONTWRITEBYTECODE`` set it never keeps the result: torch,
    transformers, peft and trl then take ~13 s to import instead of ~5 s (2 cores). uv installs without
    bytecode unless asked (``--compile-bytecode``); pip compiles at install.
    """
    missing = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) or ""
        if origin.endswith(".py") and not os.path.exists(importlib.util.cache_from_source(origin)):
            missing.append(name)
    return missing


def platform_info() -> Dict[str, Any]:
    libc_name, libc_version = platform.libc_ver()
    return {
        "platform": platform.platform(),
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "libc": f"{libc_name} {libc_version}".strip() or None,
        "cpu_count": os.cpu_count(),
    }


def ftshims_info() -> Dict[str, Any]:
    import ftshims
    from ftshims.settings import environment_problems

    return {
        "version": ftshims.__version__,
        "location": os.path.dirname(os.path.abspath(ftshims.__file__)),
        "env": {name: value for name, value in sorted(os.environ.items()) if name.startswith("FTSHIMS_")},
        # The checks apply() and the start-up hook make: a bad value there means no shim gets applied.
        "env_errors": environment_problems(),
    }


def _field(errors: List[str], name: str, getter: Callable[[], Any]) -> Any:
    try:
        return getter()
    except Exception as exc:
        errors.append(f"{name}: {error_text(exc)}")
        return None


def torch_details(torch) -> Dict[str, Any]:
    """Runtime facts of an imported torch module; each query guarded on its own."""
    errors: List[str] = []
    info: Dict[str, Any] = {}
    info["version"] = _field(errors, "version", lambda: str(torch.__version__))
    info["cuda"] = _field(errors, "cuda", lambda: getattr(torch.version, "cuda", None))
    info["hip"] = _field(errors, "hip", lambda: getattr(torch.version, "hip", None))
    info["cudnn"] = _field(errors, "cudnn", lambda: _cudnn_version(torch))
    info["cxx11_abi"] = _field(errors, "cxx11_abi", lambda: _cxx11_abi(torch))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an old driver warns here; the fields say what matters
        available = _field(errors, "cuda_available", lambda: bool(torch.cuda.is_available()))
        info["cuda_available"] = available
        count = _field(errors, "device_count", lambda: int(torch.cuda.device_count())) if available else 0
        info["device_count"] = count
        info["devices"] = [_device(torch, index, errors) for index in range(count or 0)]
        if available:
            info["bf16_supported"] = _field(errors, "bf16_supported", lambda: bool(torch.cuda.is_bf16_supported()))
        else:
            info["bf16_supported"] = None
    info["mps_available"] = _field(errors, "mps_available", lambda: _mps(torch))
    info["field_errors"] = errors
    return info


def _cudnn_version(torch) -> Optional[int]:
    backend = getattr(getattr(torch, "backends", None), "cudnn", None)
    if backend is None or not backend.is_available():
        return None
    return backend.version()


def _cxx11_abi(torch) -> Optional[bool]:
    check = getattr(torch, "compiled_with_cxx11_abi", None)
    if check is not None:
        return bool(check())
    return bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def _mps(torch) -> Optional[bool]:
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    return bool(mps.is_available()) if mps is not None else None


def _device(torch, index: int, errors: List[str]) -> Dict[str, Any]:
    props = _field(errors, f"device {index}", lambda: torch.cuda.get_device_properties(index))
    if props is None:
        return {"index": index, "name": None, "capability": None, "memory_gib": None, "bf16": None}
    major, minor = getattr(props, "major", None), getattr(props, "minor", None)
    memory = getattr(props, "total_memory", None)
    return {
        "index": index,
        "name": getattr(props, "name", None),
        "capability": f"{major}.{minor}" if major is not None else None,
        "memory_gib": round(memory / 2**30, 1) if memory else None,
        # Ampere (sm_80) and newer have native bf16 on CUDA; ROCm decides by arch, see bf16_supported.
        "bf16": (major >= 8) if isinstance(major, int) and not getattr(torch.version, "hip", None) else None,
    }


def torch_info() -> Dict[str, Any]:
    """The torch section: status imported / not installed / import failed, then the runtime facts."""
    base: Dict[str, Any] = {"status": NOT_INSTALLED, "error": None}
    try:
        found = "torch" in sys.modules or importlib.util.find_spec("torch") is not None
    except Exception as exc:  # a broken torch entry in sys.modules
        base.update(status=IMPORT_FAILED, error=error_text(exc))
        return base
    if not found:
        return base
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch = importlib.import_module("torch")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # ImportError, OSError from a shared library, even SystemExit
        base.update(status=IMPORT_FAILED, error=error_text(exc))
        return base
    base["status"] = IMPORTED
    base.update(torch_details(torch))
    return base
