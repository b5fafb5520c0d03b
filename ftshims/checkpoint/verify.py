"""The weights a checkpoint holds, against the weights in memory (the monitor) or against themselves (the doctor).

``read_weights(directory)`` loads what ``save_pretrained`` / the ``Trainer`` wrote: ``model.safetensors`` or its
shards, ``pytorch_model.bin``, a PEFT adapter (``adapter_model.*``). ``expected_weights(model)`` is what that
save should contain, from the model in memory: PEFT's ``get_peft_model_state_dict`` for an adapter (LoRA
tensors, ``modules_to_save`` copies, resized embeddings saved with it), else ``state_dict()``; tied aliases
(two names, one storage) count as one. ``compare(on_disk, expected)`` lists what differs:

* ``missing``: a tensor of the model (not an alias of one that is there) the files lack;
* ``empty``: a tensor with no elements on disk while the model's has some;
* ``zero``: all zeros on disk while the model's is not (or, offline, all zeros where training should have moved
  it: ``lora_B`` starts at zero, so an untrained adapter shows here);
* ``changed``: another dtype, another shape, or other values than in memory.

Imports torch (and safetensors) inside the functions only.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

SAFETENSORS_WEIGHTS = ("model.safetensors", "adapter_model.safetensors")
PICKLE_WEIGHTS = ("pytorch_model.bin", "adapter_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def weight_files(directory: str) -> List[str]:
    """The weight files of a checkpoint (relative names), shards through their index."""
    names = set(os.listdir(directory))
    found = [n for n in SAFETENSORS_WEIGHTS + PICKLE_WEIGHTS if n in names]
    for index in INDEXES:
        if index in names:
            try:
                with open(os.path.join(directory, index), encoding="utf-8") as handle:
                    shards = sorted(set(json.load(handle).get("weight_map", {}).values()))
            except (OSError, ValueError):
                shards = []
            found.extend(s for s in shards if s not in found)
    return found


def read_weights(directory: str) -> Tuple[Dict[str, object], Dict[str, str], List[str]]:
    """``(tensors, file of each key, problems)``; a file that cannot be read is a problem, not an exception."""
    import torch

    tensors, where, problems = {}, {}, []
    for name in weight_files(directory):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"{name}: listed by the index but absent")
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                loaded = load_file(path)
            else:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or corrupted file: reported with the file's name
            problems.append(f"{name}: cannot be read ({type(exc).__name__}: {str(exc)[:160]})")
            continue
        for key, value in loaded.items():
            if torch.is_tensor(value):
                tensors[key] = value
                where[key] = name
    return tensors, where, problems


def _storage_key(tensor):
    try:
        return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
    except Exception:  # meta tensors, tensor subclasses without a storage
        return None


def expected_weights(model) -> Dict[str, object]:
    """What a save of ``model`` should hold: name -> tensor (still in memory; detached). Aliases dropped."""
    state = None
    if type(model).__module__.split(".", 1)[0] == "peft" and hasattr(model, "peft_config"):
        try:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(model)
        except Exception:  # an adapter type this PEFT cannot dump: compare the whole model instead
            state = None
    if state is None:
        state = dict(model.state_dict())
        for key in getattr(model, "_keys_to_ignore_on_save", None) or ():  # save_pretrained drops these names
            state.pop(key, None)
    out, seen = {}, {}
    for name, tensor in state.items():
        if not hasattr(tensor, "detach"):
            continue
        key = _storage_key(tensor)
        if key is not None and key in seen:
            continue  # a tied alias: the save keeps one name of the two
        if key is not None:
            seen[key] = name
        out[name] = tensor.detach()
    return out


def _dtype(tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def compare(on_disk: Dict[str, object], expected: Optional[Dict[str, object]]) -> List[Dict[str, object]]:
    """What differs: ``[{"problem": missing/empty/zero/changed, "key": name, "detail": text}]``.

    ``expected`` None (offline): only the tensors themselves are judged (empty; all zero, biases excepted)."""
    import torch

    problems = []
    if expected is None:
        for key, tensor in on_disk.items():
            if tensor.numel() == 0:
                problems.append({"problem": "empty", "key": key, "detail": f"shape {list(tensor.shape)}"})
            elif tensor.numel() > 1 and not key.endswith("bias") and not bool(tensor.any()):
                problems.append({"problem": "zero", "key": key, "detail": f"all {tensor.numel()} values are 0"})
        return problems
    by_storage = {}
    for key, tensor in on_disk.items():
        by_storage.setdefault(_storage_key(tensor), key)
    for key, memory in expected.items():
        disk = on_disk.get(key)
        if disk is None:
            problems.append({"problem": "missing", "key": key,
                             "detail": f"{_dtype(memory)} {list(memory.shape)} in memory, not in the files"})
            continue
        memory = memory.to("cpu") if memory.device.type != "cpu" else memory
        if disk.numel() == 0 and memory.numel() > 0:
            problems.append({"problem": "empty", "key": key, "detail": f"0 elements on disk, {memory.numel()} in memory"})
        elif disk.dtype != memory.dtype or disk.shape != memory.shape:
            problems.append({"problem": "changed", "key": key,
                             "detail": f"{_dtype(disk)} {list(disk.shape)} on disk, {_dtype(memory)} {list(memory.shape)} in memory"})
        elif disk.numel() > 1 and not bool(disk.any()) and bool(memory.any()):
            problems.append({"problem": "zero", "key": key, "detail": "all zeros on disk, not in memory"})
        elif not torch.equal(disk, memory):
            gap = float((disk.float() - memory.float()).abs().max())
            problems.append({"problem": "changed", "key": key, "detail": f"values differ from memory (max {gap:.3g})"})
    return problems


def compare_saved(on_disk: Dict[str, object], expected: Dict[str, object]) -> Tuple[List[Dict[str, object]], List[str]]:
    """``compare`` for a save, where the files may name tensors otherwise than the model does: ``(problems, renamed)``.

    transformers 5 converts some checkpoints' layouts on load and back on save (MoE experts: ``experts.0.w1.weight``
    on disk, one fused ``experts.gate_up_proj`` in memory). When the files hold names the model does not have
    (``renamed``, listed), a tensor of the model missing from them proves nothing, so only the tensors both name
    are compared; otherwise every tensor of the model must be there."""
    renamed = sorted(set(on_disk) - set(expected))
    if not renamed:
        return compare(on_disk, expected), []
    shared = {key: tensor for key, tensor in expected.items() if key in on_disk}
    return compare(on_disk, shared), renamed


def tensor_records(tensors: Dict[str, object]) -> Dict[str, Dict[str, object]]:
    """``{key: {"dtype", "shape"}}`` for the manifest."""
    return {key: {"dtype": _dtype(t), "shape": list(t.shape)} for key, t in sorted(tensors.items())}
