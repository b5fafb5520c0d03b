"""DeepSpeed in the environment report: its version (metadata) and the accelerator it would run on.

DeepSpeed is never imported here (its import initialises its accelerator and can JIT-build ops). The
accelerator is what ``deepspeed.accelerator.real_accelerator.get_accelerator`` (deepspeed 0.19.8) picks:
``DS_ACCELERATOR`` when set, else the first of xpu (``torch.xpu.is_available()``), npu (``torch_npu``),
sdaa, mps, hpu (``habana_frameworks``), mlu, supa, klxpu that is present, then cuda
(``torch.cuda.device_count() > 0 and torch.cuda.is_available()``), and cpu as the catch-all. The
vendor extensions are looked for with ``importlib.util.find_spec`` (found, not imported); xpu and cuda
come from the torch facts the doctor already has (its torch section, or torch itself when the doctor
process imported it).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Dict, Optional

# DS_ACCELERATOR values deepspeed 0.19.8 accepts (real_accelerator.py SUPPORTED_ACCELERATOR_LIST)
SUPPORTED = ("cuda", "cpu", "xpu", "xpu.external", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu")
# Auto-detection order between xpu and cuda: (name, top-level module whose presence selects it)
VENDOR_MODULES = (("npu", "torch_npu"), ("sdaa", "torch_sdaa"), ("hpu", "habana_frameworks"), ("mlu", "torch_mlu"),
                  ("supa", "torch_supa"), ("klxpu", "torch_xmlir"))


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _xpu_available() -> bool:
    torch = sys.modules.get("torch")  # only when already imported: the doctor never imports torch for this
    xpu = getattr(torch, "xpu", None) if torch is not None else None
    try:
        return bool(xpu is not None and xpu.is_available())
    except Exception:  # a broken XPU runtime: deepspeed would not pick it either
        return False


def accelerator(torch_section: Dict[str, Any], env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """``{"accelerator", "source", "detail"}``: what DeepSpeed would run on, and why."""
    env = os.environ if env is None else env
    chosen = env.get("DS_ACCELERATOR")
    if chosen is not None:
        ok = chosen in SUPPORTED
        detail = None if ok else f"DeepSpeed raises ValueError: DS_ACCELERATOR must be one of {', '.join(SUPPORTED)}"
        return {"accelerator": chosen, "source": "DS_ACCELERATOR", "detail": detail}
    if _xpu_available():
        return {"accelerator": "xpu", "source": "detected", "detail": "torch.xpu is available"}
    for name, module in VENDOR_MODULES[:2]:
        if _present(module):
            return {"accelerator": name, "source": "detected", "detail": f"{module} is installed"}
    if torch_section.get("mps_available"):
        return {"accelerator": "mps", "source": "detected", "detail": "Apple MPS is available"}
    for name, module in VENDOR_MODULES[2:]:
        if _present(module):
            return {"accelerator": name, "source": "detected", "detail": f"{module} is installed"}
    if torch_section.get("status") != "imported":
        return {"accelerator": None, "source": "detected", "detail": "unknown: torch did not import"}
    if torch_section.get("cuda_available") and (torch_section.get("device_count") or 0) > 0:
        return {"accelerator": "cuda", "source": "detected", "detail": f"{torch_section['device_count']} CUDA device(s)"}
    # the CPU accelerator: gloo, ops JIT-built with g++; the Trainer needs a configured state (docs/deepspeed.md)
    return {"accelerator": "cpu", "source": "detected", "detail": "no CUDA device"}


def deepspeed_section(package_row: Optional[Dict[str, Any]], torch_section: Dict[str, Any]) -> Dict[str, Any]:
    """The environment's ``deepspeed`` entry: ``status`` and ``version`` from the packages section (metadata),
    and, when installed, the accelerator DeepSpeed would pick."""
    row = package_row or {}
    info: Dict[str, Any] = {"status": row.get("status"), "version": row.get("version"),
                            "accelerator": None, "source": None, "detail": None}
    if row.get("version"):
        info.update(accelerator(torch_section))
    return info
