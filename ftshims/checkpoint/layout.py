"""What a ``Trainer`` checkpoint directory holds, and what a resume from it needs.

A checkpoint written by ``Trainer._save_checkpoint`` (transformers 4.36-5.25 read) holds:

* the weights: ``model.safetensors`` / ``pytorch_model.bin`` (or their sharded index), a PEFT adapter
  (``adapter_model.safetensors`` / ``.bin`` beside ``adapter_config.json``), FSDP's sharded
  ``pytorch_model_fsdp_0/``, or DeepSpeed's ``global_step<N>/`` (which also holds the optimizer);
* what a resume needs besides: ``optimizer.pt`` (FSDP: ``optimizer_0/`` or ``optimizer.bin``), ``scheduler.pt``,
  ``rng_state.pth`` (one process) or ``rng_state_<rank>.pth``, and ``trainer_state.json`` (global step, epoch,
  the callbacks' state). ``save_only_model=True`` writes the weights and ``trainer_state.json`` only: the
  ``Trainer`` still resumes from it, with a new optimizer and a schedule restarted at step 0.

Nothing here imports torch or transformers: file names and JSON only.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
RNG = re.compile(r"^rng_state(_\d+)?\.pth$")
DEEPSPEED_STEP = re.compile(r"^global_step\d+$")


def listing(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def has_optimizer(path: str, names: Optional[List[str]] = None) -> bool:
    """The Trainer's own test (``_load_optimizer_and_scheduler``): optimizer.pt/.bin, or a directory whose name
    holds ``optimizer`` (FSDP's sharded optimizer)."""
    names = listing(path) if names is None else names
    if any(n in names for n in OPTIMIZER_FILES):
        return True
    return any("optimizer" in n and os.path.isdir(os.path.join(path, n)) for n in names)


def deepspeed_steps(path: str, names: Optional[List[str]] = None) -> List[str]:
    names = listing(path) if names is None else names
    return [n for n in names if DEEPSPEED_STEP.match(n) and os.path.isdir(os.path.join(path, n))]


def trainer_state(path: str) -> Optional[Dict]:
    """``trainer_state.json`` as a dict; None when absent; ``{"_error": ...}`` when it does not parse."""
    file = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError) as exc:
        return {"_error": f"{type(exc).__name__}: {exc}"}
    return value if isinstance(value, dict) else {"_error": "not a JSON object"}


def describe(path: str) -> Dict:
    """What the directory holds, and what a ``Trainer`` resume from it would lack.

    ``{"trainer_checkpoint": bool, "weights": [...], "adapter": bool, "deepspeed": [...], "optimizer": bool,
    "scheduler": bool, "rng": [...], "global_step": int | None, "missing_for_resume": [...],
    "save_only_model": bool}``; ``save_only_model`` is True when the weights and ``trainer_state.json`` are
    there and every resume file is missing (what ``save_only_model=True`` writes).
    """
    names = listing(path)
    state = trainer_state(path)
    steps = deepspeed_steps(path, names)
    out = {
        "trainer_checkpoint": state is not None,
        "weights": [n for n in names if n in WEIGHT_FILES or n in ADAPTER_FILES or n.startswith("pytorch_model_fsdp")],
        "adapter": any(n in names for n in ADAPTER_FILES) or "adapter_config.json" in names,
        "deepspeed": steps,
        "optimizer": has_optimizer(path, names) or bool(steps),
        "scheduler": SCHEDULER in names,
        "rng": [n for n in names if RNG.match(n)],
        "global_step": state.get("global_step") if isinstance(state, dict) else None,
    }
    missing = []
    if state is not None:
        if not out["optimizer"]:
            missing.append("optimizer state (optimizer.pt)")
        if not out["scheduler"] and not steps:  # DeepSpeed keeps a DeepSpeed scheduler in global_step*
            missing.append("scheduler state (scheduler.pt)")
        if not out["rng"]:
            missing.append("RNG state (rng_state*.pth)")
    out["missing_for_resume"] = missing
    out["save_only_model"] = bool(state is not None and out["weights"] and not out["optimizer"]
                                  and not out["scheduler"] and not out["rng"])
    return out
