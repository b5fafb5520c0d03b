"""The offline re-check of a checkpoint directory: ``python -m ftshims.doctor --checkpoint DIR [--reload]``.

:func:`inspect` returns ``{"directory", "summary": {"exit_code", "sound", ...}, "findings": [...], "facts": {...}}``.
Each finding is ``{"code", "severity", "file", "message"}`` in the lint's severities (error / warning / info);
the codes (``CODES``) are stable. Exit code: 0 sound (no error or warning), 1 a finding, 2 unusable (not a
directory, or nothing in it that a save writes).

What is checked, each from the files alone (``--reload`` imports torch/transformers/peft and loads the model):

* the manifest (``ftshims-manifest.json``, written by the monitor): every file's SHA-256 and size (a changed
  byte names its file), files gone, files added after it; the tensors' dtype and shape it recorded;
* what a resume needs (:mod:`ftshims.checkpoint.layout`): optimizer, scheduler, RNG state and
  ``trainer_state.json``; a ``save_only_model`` checkpoint is named as not resumable;
* the weights: every file readable, no empty tensor, no all-zero tensor (biases excepted; an untrained
  ``lora_B`` is all zeros);
* a PEFT adapter: its ``adapter_config.json`` against its weights (each target module has LoRA tensors, each
  ``modules_to_save`` module is saved, the rank matches ``r``, the base model is recorded);
* the tokenizer saved beside the weights against the embedding rows (an id at or beyond the rows crashes, or
  reads memory it should not, at the first use of that token);
* ``--reload``: the model loads (no weight reported missing or newly initialised) and its logits on the
  manifest's fixed input equal the reference the monitor saved (``ftshims-reference.safetensors``), within
  ``tolerance`` (default 0: bit-identical, as a reload on the machine that trained gives).
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

from . import MANIFEST_NAME, layout, manifest

ERROR, WARNING, INFO = "error", "warning", "info"

CODES = {
    "checkpoint-unusable": (ERROR, "not a directory, or no file a save writes"),
    "file-changed": (ERROR, "a file's SHA-256 or size differs from the manifest (the file is named)"),
    "file-missing": (ERROR, "a file the manifest lists is gone"),
    "file-added": (INFO, "a file the manifest does not list (written after it)"),
    "manifest-absent": (INFO, "no ftshims-manifest.json: the files cannot be checked against their hashes"),
    "manifest-unreadable": (ERROR, "ftshims-manifest.json does not parse"),
    "weights-unreadable": (ERROR, "a weight file cannot be read (truncated, corrupted)"),
    "tensor-empty": (ERROR, "a saved tensor has no elements"),
    "tensor-all-zero": (WARNING, "a saved tensor is all zeros (biases excepted; an untrained lora_B is all zeros)"),
    "tensor-changed": (ERROR, "a saved tensor's dtype or shape differs from what the manifest recorded"),
    "tensor-missing": (ERROR, "a tensor the manifest recorded is not in the weight files"),
    "resume-incomplete": (ERROR, "a Trainer checkpoint lacks optimizer, scheduler or RNG state that a resume needs"),
    "not-resumable": (WARNING, "a save_only_model checkpoint: weights only; a resume would restart the optimizer and the schedule (ftshims refuses it)"),
    "adapter-config-invalid": (ERROR, "adapter_config.json does not parse"),
    "adapter-target-missing": (ERROR, "a target module of adapter_config.json has no adapter tensor in the weights"),
    "adapter-modules-to-save-missing": (ERROR, "a modules_to_save module of adapter_config.json is not in the weights"),
    "adapter-rank-mismatch": (ERROR, "a LoRA tensor's rank differs from adapter_config.json's r"),
    "adapter-base-unrecorded": (WARNING, "adapter_config.json does not record the base model (base_model_name_or_path)"),
    "tokenizer-beyond-embeddings": (ERROR, "the tokenizer has ids at or beyond the embedding's rows"),
    "reload-failed": (ERROR, "--reload: the checkpoint does not load"),
    "reload-missing-weights": (ERROR, "--reload: the loader reports weights missing (newly initialised) or unexpected"),
    "reload-logits-differ": (ERROR, "--reload: the reloaded model's logits differ from the reference saved with the manifest"),
    "reload-unavailable": (WARNING, "--reload could not run (no reference, base model not available offline, ...)"),
}


def _finding(code: str, message: str, file: Optional[str] = None) -> Dict[str, object]:
    return {"code": code, "severity": CODES[code][0], "file": file, "message": message}


def inspect(directory: str, reload: bool = False, tolerance: float = 0.0) -> Dict[str, object]:
    findings: List[Dict[str, object]] = []
    facts: Dict[str, object] = {}
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        findings.append(_finding("checkpoint-unusable", f"{directory} is not a directory"))
        return _done(directory, findings, facts, unusable=True)
    from .verify import read_weights, weight_files

    described = layout.describe(directory)
    facts["layout"] = described
    weights = weight_files(directory)
    if not weights and not described["trainer_checkpoint"] and not described["deepspeed"]:
        findings.append(_finding("checkpoint-unusable", f"{directory} holds no weights (model.safetensors, "
                                 "pytorch_model.bin, adapter_model.*, their shards) and no trainer_state.json"))
        return _done(directory, findings, facts, unusable=True)

    recorded = _check_manifest(directory, findings, facts)
    _check_resume(described, findings)
    tensors, where, unreadable = read_weights(directory) if weights else ({}, {}, [])
    for text in unreadable:
        findings.append(_finding("weights-unreadable", text, text.split(":", 1)[0]))
    facts["tensors"] = len(tensors)
    _check_tensors(tensors, where, recorded, findings)
    adapter = _check_adapter(directory, tensors, where, findings)
    _check_tokenizer(directory, tensors, findings)
    if reload:
        _reload(directory, adapter, tolerance, findings, facts)
    return _done(directory, findings, facts)


def _done(directory, findings, facts, unusable=False):
    counts = {severity: sum(f["severity"] == severity for f in findings) for severity in (ERROR, WARNING, INFO)}
    code = 2 if unusable else (1 if counts[ERROR] or counts[WARNING] else 0)
    return {"directory": directory, "summary": {"exit_code": code, "sound": code == 0, **counts},
            "findings": findings, "facts": facts}


def _check_manifest(directory, findings, facts) -> Optional[Dict]:
    found, why = manifest.read(directory)
    if why:
        findings.append(_finding("manifest-unreadable", why, MANIFEST_NAME))
        return None
    if found is None:
        findings.append(_finding("manifest-absent", f"no {MANIFEST_NAME} (the monitor writes one at each save it "
                                 "verifies): file hashes not checked"))
        return None
    facts["manifest"] = {"written_by": found.get("written_by"), "global_step": found.get("global_step"),
                         "files": len(found["files"])}
    for problem, rel in manifest.check(directory, found):
        if problem == "changed":
            findings.append(_finding("file-changed", f"{rel}: its SHA-256 (or size) differs from the manifest: the "
                                     "file changed after the save", rel))
        elif problem == "missing":
            findings.append(_finding("file-missing", f"{rel}: listed in the manifest, not in the directory", rel))
        elif rel != manifest.REFERENCE_NAME:
            findings.append(_finding("file-added", f"{rel}: not in the manifest (written after it)", rel))
    return found


def _check_resume(described, findings):
    if not described["trainer_checkpoint"]:
        return
    if described["save_only_model"]:
        findings.append(_finding("not-resumable", "a save_only_model checkpoint: weights and trainer_state.json only, "
                                 "no optimizer, scheduler or RNG state. Good for inference or a new run; a resume "
                                 "from it would restart the learning-rate schedule and the optimizer's moments "
                                 "(ftshims' resume_save_only_model_restarts_lr_schedule refuses it)"))
    elif described["missing_for_resume"]:
        missing = described["missing_for_resume"]
        guarded = not described["optimizer"] or not described["scheduler"]
        findings.append(_finding("resume-incomplete", "a Trainer checkpoint without " + ", ".join(missing) +
                                 ": a resume from it would not continue the run it was saved from (the Trainer starts "
                                 "what is missing afresh without an error" + ("; ftshims' "
                                 "resume_save_only_model_restarts_lr_schedule refuses such a resume)" if guarded else ")")))


def _check_tensors(tensors, where, recorded, findings):
    from .verify import compare

    for item in compare(tensors, None):
        code = "tensor-empty" if item["problem"] == "empty" else "tensor-all-zero"
        findings.append(_finding(code, f"{item['key']} ({where.get(item['key'])}): {item['detail']}", where.get(item["key"])))
    records = (recorded or {}).get("tensors") or {}
    for key, record in sorted(records.items()):
        tensor = tensors.get(key)
        if tensor is None:
            findings.append(_finding("tensor-missing", f"{key}: recorded in the manifest, not in the weight files"))
            continue
        dtype, shape = str(tensor.dtype).replace("torch.", ""), list(tensor.shape)
        if record.get("dtype") != dtype or record.get("shape") != shape:
            findings.append(_finding("tensor-changed", f"{key}: {dtype} {shape} in the files, {record.get('dtype')} "
                                     f"{record.get('shape')} recorded at the save", where.get(key)))


def _check_adapter(directory, tensors, where, findings) -> Optional[Dict]:
    path = os.path.join(directory, "adapter_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        findings.append(_finding("adapter-config-invalid", f"adapter_config.json: {type(exc).__name__}: {exc}",
                                 "adapter_config.json"))
        return None
    if not str(config.get("base_model_name_or_path") or "").strip():
        findings.append(_finding("adapter-base-unrecorded", "adapter_config.json has no base_model_name_or_path: "
                                 "nothing says which base model these adapter weights belong to", "adapter_config.json"))
    adapter_keys = [k for k in tensors if any(f".{part}" in k for part in ("lora_", "ia3_", "hada_", "lokr_", "oft_"))]
    modules = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapter_keys if ".lora_" in k}
    targets = config.get("target_modules")
    if isinstance(targets, list) and tensors:
        for target in targets:
            if not any(re.search(rf"(^|\.){re.escape(target)}\.(lora_|ia3_|hada_|lokr_|oft_)", k) for k in adapter_keys):
                findings.append(_finding("adapter-target-missing", f"target module {target!r} of adapter_config.json "
                                         f"has no adapter tensor in the weights (modules with LoRA tensors: "
                                         f"{sorted(modules) or 'none'})", "adapter_config.json"))
    elif isinstance(targets, str) and tensors and not adapter_keys:
        findings.append(_finding("adapter-target-missing", f"target_modules {targets!r}: no adapter tensor in the weights",
                                 "adapter_config.json"))
    for module in config.get("modules_to_save") or []:
        if not any(re.search(rf"(^|\.){re.escape(module)}\.", k) and ".lora_" not in k for k in tensors):
            findings.append(_finding("adapter-modules-to-save-missing", f"modules_to_save {module!r} is not in the "
                                     "weights: the reloaded adapter would use the base model's untrained module",
                                     "adapter_config.json"))
    rank, pattern = config.get("r"), config.get("rank_pattern") or {}
    if isinstance(rank, int) and not pattern:
        wrong = sorted(k for k in tensors if k.endswith("lora_A.weight") and tensors[k].dim() >= 2
                       and tensors[k].shape[0] != rank)
        if wrong:
            findings.append(_finding("adapter-rank-mismatch", f"{len(wrong)} lora_A tensors have another rank than r={rank} "
                                     f"(first: {wrong[0]} {list(tensors[wrong[0]].shape)})", where.get(wrong[0])))
    return config


def _embedding_rows(directory, tensors) -> Optional[tuple]:
    for key, tensor in tensors.items():
        if tensor.dim() == 2 and re.search(r"(embed_tokens|word_embeddings|wte|embed_in|shared)(\.modules_to_save\.[^.]+)?\.weight$", key):
            return int(tensor.shape[0]), key
    config = os.path.join(directory, "config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            return None
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
        if isinstance(text.get("vocab_size"), int):
            return int(text["vocab_size"]), "config.json vocab_size"
    return None


def _tokenizer_size(directory) -> Optional[int]:
    """1 + the largest id of tokenizer.json (its model's vocabulary and its added tokens); None without one."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    ids = []
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids.extend(v for v in vocab.values() if isinstance(v, int))
    elif isinstance(vocab, list):
        ids.append(len(vocab) - 1)
    ids.extend(t.get("id") for t in data.get("added_tokens") or [] if isinstance(t.get("id"), int))
    return max(ids) + 1 if ids else None


def _check_tokenizer(directory, tensors, findings):
    size = _tokenizer_size(directory)
    rows = _embedding_rows(directory, tensors)
    if size is None or rows is None:
        return
    if size > rows[0]:
        findings.append(_finding("tokenizer-beyond-embeddings", f"the tokenizer saved here has ids up to {size - 1}, "
                                 f"the embedding ({rows[1]}) has {rows[0]} rows: resize_token_embeddings was not "
                                 "saved with it (or the tokenizer was extended after the save)", "tokenizer.json"))


def _reload(directory, adapter, tolerance, findings, facts):
    """Load the checkpoint the way a user would, and compare its logits with the manifest's reference."""
    import torch

    found, _ = manifest.read(directory)
    reference = (found or {}).get("reference")
    try:
        model, info = _load(directory, adapter)
    except _Unavailable as exc:
        findings.append(_finding("reload-unavailable", str(exc)))
        return
    except Exception as exc:
        findings.append(_finding("reload-failed", f"{type(exc).__name__}: {str(exc)[:300]}"))
        return
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    if missing or unexpected:
        findings.append(_finding("reload-missing-weights", f"the loader reports {len(missing)} missing (newly "
                                 f"initialised: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}) and "
                                 f"{len(unexpected)} unexpected weights ({', '.join(unexpected[:4])})"))
    if not reference or not os.path.isfile(os.path.join(directory, reference.get("file", ""))):
        findings.append(_finding("reload-unavailable", "no reference logits with this checkpoint (the monitor saves "
                                 f"{manifest.REFERENCE_NAME} at each save): the reload was checked for missing "
                                 "weights only"))
        return
    from safetensors.torch import load_file

    saved = load_file(os.path.join(directory, reference["file"]))
    with torch.no_grad():
        logits = model.eval()(input_ids=saved["input_ids"]).logits.float()
    gap = float((logits - saved["logits"].float()).abs().max()) if logits.shape == saved["logits"].shape else float("inf")
    facts["reload"] = {"max_abs_diff": gap, "identical": gap == 0.0, "tolerance": tolerance}
    if not gap <= tolerance:
        findings.append(_finding("reload-logits-differ", f"logits on the reference input differ by up to {gap:.3g} "
                                 f"(tolerance {tolerance:g}): the checkpoint does not give back the model that was "
                                 "saved", manifest.REFERENCE_NAME))


class _Unavailable(Exception):
    pass


def _model_class(directory):
    """The class ``config.json`` names (``architectures[0]``) when transformers has it, else AutoModelForCausalLM."""
    import transformers

    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as handle:
            names = json.load(handle).get("architectures") or []
    except (OSError, ValueError):
        names = []
    found = getattr(transformers, names[0], None) if names else None
    return found if isinstance(found, type) and hasattr(found, "from_pretrained") else transformers.AutoModelForCausalLM


def _load(directory, adapter):
    from transformers import AutoModelForCausalLM

    if adapter is None:
        return _model_class(directory).from_pretrained(directory, output_loading_info=True)
    from peft import PeftModel

    base_path = str(adapter.get("base_model_name_or_path") or "")
    if not os.path.isdir(base_path):
        raise _Unavailable(f"--reload of an adapter needs its base model; {base_path!r} is not a local directory "
                           "(the doctor works offline)")
    base = AutoModelForCausalLM.from_pretrained(base_path)
    from .verify import read_weights

    tensors, _, _ = read_weights(directory)
    rows = _embedding_rows(directory, tensors)
    if rows and rows[1] != "config.json vocab_size" and rows[0] != base.get_input_embeddings().weight.shape[0]:
        base.resize_token_embeddings(rows[0])  # the run resized its embeddings before get_peft_model
    model = PeftModel.from_pretrained(base, directory)
    return model, {}
