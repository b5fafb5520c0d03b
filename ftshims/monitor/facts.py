"""Host-side facts about the model being trained, shared by the detectors (read once, at train begin or on a finding)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import List, Optional


def base_model(model):
    """The model under a PeftModel (``get_base_model()``), else the model itself."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        try:
            return get_base()
        except (AttributeError, TypeError):  # an unusual wrapper: keep what we were given
            return model
    return model


def config(model):
    return getattr(base_model(model), "config", None) or getattr(model, "config", None)


def config_value(cfg, name: str):
    """``cfg.<name>`` (a special token id), read where transformers keeps it without a deprecation warning: a
    composite model's text config first (5.x Idefics3/SmolVLM warn on the top-level ``pad_token_id``, a property
    there), then the config itself; a property on the config's class is never called. None when neither has it."""
    if cfg is None:
        return None
    text = cfg
    if callable(getattr(cfg, "get_text_config", None)):
        try:
            text = cfg.get_text_config()
        except (ValueError, TypeError, AttributeError):  # several text configs, or an odd custom config: the top level
            text = cfg
    for candidate in (text, cfg) if text is not cfg else (cfg,):
        if isinstance(getattr(type(candidate), name, None), property):
            continue  # a deprecated accessor that logs on every first read
        value = getattr(candidate, name, None)
        if value is not None:
            return value
    return None


def attn_implementation(model) -> str:
    cfg = config(model)
    return str(getattr(cfg, "_attn_implementation", None) or "eager")


def has_adapters(model) -> bool:
    from ..shims.kbit_prep_keeps_adapters_trainable import has_adapters as adapters

    return adapters(model)


def shifts_labels(model) -> bool:
    """Whether the model's loss scores ``labels[..., 1:]`` (a decoder-only causal LM)."""
    base = base_model(model)
    if "transformers" not in sys.modules:  # then it is no transformers model: do not import it to ask
        return False
    from ..shims.num_items_in_batch_overcount import loss_shifts_labels

    if loss_shifts_labels(SimpleNamespace(model=model)):
        return True
    cfg = getattr(base, "config", None)
    if getattr(cfg, "is_encoder_decoder", False):
        return False
    return type(base).__name__.endswith("ForCausalLM")  # transformers < 4.46 has no LOSS_MAPPING to ask


def checkpointing(model) -> Optional[bool]:
    """None without gradient checkpointing; else whether it may be reentrant (``use_reentrant`` not False)."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            func = getattr(module, "_gradient_checkpointing_func", None)
            keywords = getattr(func, "keywords", None) or {}
            return keywords.get("use_reentrant", True) is not False
    return None


def special_ids(model, tokenizer) -> SimpleNamespace:
    """``eos`` (a list of ids) and ``pad`` (an id or None): from the tokenizer when given, else the config."""
    eos: List[int] = []
    pad = None
    if tokenizer is not None:
        tok = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
        if getattr(tok, "eos_token_id", None) is not None:
            eos = [int(tok.eos_token_id)]
        pad = getattr(tok, "pad_token_id", None)
    cfg = config(model)
    if not eos and cfg is not None:
        value = config_value(cfg, "eos_token_id")
        eos = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
    if pad is None and cfg is not None:
        pad = config_value(cfg, "pad_token_id")
    return SimpleNamespace(eos=eos, pad=None if pad is None else int(pad))


def embedding_rows(model) -> Optional[int]:
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    weight = getattr(embeddings, "weight", None)
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None and weight is not None and weight.dim() == 2:
        rows = weight.shape[0]
    return int(rows) if rows else None


def embedding_parameters(model) -> dict:
    """``{id(parameter): "input"/"output"}`` for the input and output embedding weights."""
    found = {}
    for which, getter in (("input", "get_input_embeddings"), ("output", "get_output_embeddings")):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            module = None
        for p in (module.parameters() if module is not None else ()):
            found.setdefault(id(p), which)
    return found


def peft_loaded() -> bool:
    return "peft" in sys.modules


def adapter_parameter_ids(model) -> Optional[set]:
    """``id()`` of every parameter a PeftModel saves with its adapter (adapter weights, modules_to_save,
    trainable tokens), by storage; None when it cannot be told (not a PeftModel, or PEFT refuses)."""
    if not peft_loaded():
        return None
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return None
    try:
        from peft.utils import get_peft_model_state_dict

        saved = get_peft_model_state_dict(model)
    except Exception:  # noqa: BLE001 - a PEFT method whose state dict cannot be built here: no judgement
        return None
    pointers = {t.data_ptr() for t in saved.values() if hasattr(t, "data_ptr")}
    return {id(p) for p in model.parameters() if p.data_ptr() in pointers}


def nonfinite_parameters(model, limit: int = 5) -> List[str]:
    import torch

    bad = []
    for name, p in model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            bad.append(name)
            if len(bad) >= limit:
                break
    return bad
