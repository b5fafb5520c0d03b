"""An observer inside a training process started by a client framework (llamafactory-cli, axolotl).

Armed by ``sitecustomize`` when ``FTSHIMS_CLIENT_PROBE`` names a file; at exit (also after a crash)
every process appends one JSON line to it (a launcher such as ``accelerate launch`` and the training
process it starts each write their own; ``pid`` and ``argv`` tell them apart):

* ``status``: ``ftshims.status().to_dict()``: what ftshims did in *this* process (each entry's
  ``actions`` counts how often the shim acted, its ``notes`` any foreign patch on its targets);
  ``summary``: ``ftshims.summary()``;
* ``versions``: the client stack;
* ``model``: facts at the first ``on_train_begin`` (with ``lora_sha1``, a fingerprint of the LoRA
  weights the run starts from) and at ``on_train_end``: who owns
  ``gradient_checkpointing_enable`` (the class, or an instance attribute put there by the framework),
  the forward hooks on the input embeddings (``make_inputs_require_grads`` is
  ``enable_input_require_grads``' hook), the attention implementation;
* ``steps``: per optimizer step, how many LoRA parameters have no gradient / a non-zero gradient;
* ``forwards``: for the first forwards of the decoder, what the framework fed it (2D or 4D mask,
  where ``position_ids`` restart) and, from the mask that reaches the first decoder layer, how many
  (query, key) pairs of *different* packed examples may attend to each other
  (``cross_example_pairs``: 0 means isolated) and how many causal pairs of the *same* example are
  wrongly masked (``own_context_masked``: must be 0).

It only observes: a ``TrainerCallback`` is appended to ``transformers.trainer.DEFAULT_CALLBACKS``
(a list that every ``Trainer`` copies its callbacks from) and forward pre-hooks are registered on
the model's modules. No function or class attribute is replaced, so ftshims' foreign-patch
detection has nothing of it to see, and runs with and without ftshims are observed alike.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

OUT = os.environ["FTSHIMS_CLIENT_PROBE"]
MAX_FORWARDS = 4

DATA = {"pid": os.getpid(), "argv": sys.argv, "ftshims_auto": os.environ.get("FTSHIMS_AUTO"), "model": {}, "steps": [], "forwards": []}


def _dump() -> None:
    try:
        import ftshims

        DATA["status"] = ftshims.status().to_dict()
        DATA["summary"] = ftshims.summary()
    except Exception as exc:  # the probe must never hide the run's own outcome
        DATA["status_error"] = f"{type(exc).__name__}: {exc}"
    try:
        from importlib import metadata

        names = ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "llamafactory", "axolotl",
                 "liger-kernel", "triton")
        versions = {}
        for name in names:
            try:
                versions[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
        DATA["versions"] = versions
    except Exception:
        pass
    line = json.dumps(DATA, default=repr) + "\n"
    with open(OUT, "a") as handle:  # one short write per process; O_APPEND keeps the lines whole
        handle.write(line)


atexit.register(_dump)


def _decoder(model):
    """The decoder stack: the first module with ``embed_tokens`` and ``layers``."""
    for module in model.modules():
        if hasattr(module, "embed_tokens") and hasattr(module, "layers"):
            return module
    return None


def _base_model(model):
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _hook_names(module) -> list:
    names = []
    for hook in getattr(module, "_forward_hooks", {}).values():
        hook = getattr(hook, "__func__", hook)
        names.append(f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}")
    return names


def _model_facts(model) -> dict:
    base = _base_model(model)
    facts = {"class": type(model).__name__, "base_class": type(base).__name__}
    try:
        facts["attn_implementation"] = getattr(base.config, "_attn_implementation", None)
        facts["is_gradient_checkpointing"] = bool(getattr(base, "is_gradient_checkpointing", False))
        own = vars(base).get("gradient_checkpointing_enable")
        if own is None:
            facts["gradient_checkpointing_enable_owner"] = "class"
        else:  # a framework's override on the instance (LLaMA-Factory: MethodType(partial(...), model))
            func = getattr(own, "__func__", own)
            func = getattr(func, "func", func)
            facts["gradient_checkpointing_enable_owner"] = f"instance:{getattr(func, '__module__', '?')}"
        embeddings = base.get_input_embeddings()
        facts["embedding_forward_hooks"] = _hook_names(embeddings)
        facts["embedding_requires_grad"] = any(p.requires_grad for p in embeddings.parameters())
        facts["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    except Exception as exc:
        facts["error"] = f"{type(exc).__name__}: {exc}"
    return facts


def _segments(position_ids):
    import torch

    return torch.cumsum((position_ids == 0).long(), dim=-1)


def _allowed(mask, length: int, batch: int):
    """[batch, q, k] bool of what the first layer's attention may see."""
    import torch

    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if mask is None:
        return causal.expand(batch, length, length), "none (causal)"
    if mask.dim() == 4:
        mask = mask[:, 0]
    if mask.dtype == torch.bool:
        allowed = mask
        form = "4d bool"
    else:
        allowed = mask == 0  # additive: 0 = attend, a large negative = masked
        form = f"4d {str(mask.dtype).replace('torch.', '')}"
    allowed = allowed[..., -length:, -length:]
    return allowed.expand(batch, length, length) & causal, form


def _install_model_hooks(model) -> None:
    decoder = _decoder(model)
    if decoder is None or getattr(decoder, "_ftshims_probe", False):
        return
    decoder._ftshims_probe = True
    pad = getattr(getattr(decoder, "config", None), "pad_token_id", None)
    state = {"inputs": None}

    def on_decoder(module, args, kwargs):
        if not module.training or len(DATA["forwards"]) >= MAX_FORWARDS:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        position_ids = kwargs.get("position_ids")
        record = {
            "input_mask": None if mask is None else f"{mask.dim()}d {str(mask.dtype).replace('torch.', '')}",
            "position_ids": position_ids is not None,
        }
        if mask is not None and mask.dim() == 2:
            record["input_mask_values"] = sorted(int(v) for v in mask.unique().tolist())
        if position_ids is not None and input_ids is not None:
            real = input_ids != pad if pad is not None else input_ids == input_ids
            record["examples_per_row"] = ((position_ids == 0) & real).sum(-1).tolist()
        state["inputs"] = (input_ids, position_ids, record)

    def on_first_layer(module, args, kwargs):
        if state["inputs"] is None:
            return
        input_ids, position_ids, record = state["inputs"]
        state["inputs"] = None
        if position_ids is None or input_ids is None:
            DATA["forwards"].append(record)
            return
        batch, length = input_ids.shape
        allowed, form = _allowed(kwargs.get("attention_mask"), length, batch)
        record["layer_mask"] = form
        segment = _segments(position_ids)
        real = input_ids != pad if pad is not None else input_ids == input_ids
        pair_real = real[:, :, None] & real[:, None, :]
        same = segment[:, :, None] == segment[:, None, :]
        causal = allowed.new_ones(length, length).tril()
        record["cross_example_pairs"] = int((allowed & ~same & pair_real).sum())
        record["own_context_masked"] = int((~allowed & same & causal & pair_real).sum())
        DATA["forwards"].append(record)

    decoder.register_forward_pre_hook(on_decoder, with_kwargs=True)
    decoder.layers[0].register_forward_pre_hook(on_first_layer, with_kwargs=True)


def _lora_sha1(model) -> str:
    """A fingerprint of the LoRA weights (names and bytes): equal in two runs only if they start equal."""
    import hashlib

    digest = hashlib.sha1()
    try:
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            if "lora_" in name:
                digest.update(name.encode())
                digest.update(parameter.detach().float().cpu().numpy().tobytes())
    except Exception as exc:  # the probe must never break the run it observes (sharded parameters, say)
        return f"error: {type(exc).__name__}: {exc}"
    return digest.hexdigest()


def _make_callback(trainer_callback_module):
    class FtshimsClientProbe(trainer_callback_module.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if model is not None:
                DATA["model"].setdefault("train_begin", _model_facts(model))
                DATA["model"]["train_begin"].setdefault("lora_sha1", _lora_sha1(model))
                _install_model_hooks(model)

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if model is None:
                return
            lora = [(n, p) for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
            DATA["steps"].append(
                {
                    "step": state.global_step + 1,
                    "lora_parameters": len(lora),
                    "lora_without_grad": sum(1 for _, p in lora if p.grad is None),
                    "lora_with_nonzero_grad": sum(1 for _, p in lora if p.grad is not None and bool(p.grad.abs().sum() > 0)),
                }
            )

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if model is not None:
                DATA["model"]["train_end"] = _model_facts(model)

    return FtshimsClientProbe


def _on_trainer(module) -> None:
    import transformers.trainer_callback as trainer_callback

    callback = _make_callback(trainer_callback)
    if not any(getattr(c, "__name__", "") == callback.__name__ for c in module.DEFAULT_CALLBACKS):
        module.DEFAULT_CALLBACKS.append(callback)


try:
    import wrapt

    wrapt.register_post_import_hook(_on_trainer, "transformers.trainer")
except Exception as exc:  # no wrapt: the status part of the probe still works
    DATA["hook_error"] = f"{type(exc).__name__}: {exc}"
