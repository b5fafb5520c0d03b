"""``merge_and_unload`` of a LoRA model that trained a copy of a tied embedding keeps ``tie_word_embeddings=True``.

Why: on a model with ``tie_word_embeddings=True`` (Qwen2.5-0.5B, Gemma, Llama-3.2-1B) the input embedding and
the LM head are one tensor. ``modules_to_save=["lm_head"]`` (or ``["embed_tokens"]``) gives the adapter its own
trainable *copy* of that module, so training unties them. ``merge_and_unload()`` puts the trained copy in place
and returns a model whose head and embedding really are different tensors, and whose logits are right, but its
config still says ``tie_word_embeddings=True``. ``save_pretrained`` writes that config, and
``AutoModelForCausalLM.from_pretrained`` then ties the weights again: the trained head is overwritten by the
embedding (or the trained embedding becomes the head). The reloaded merged model silently differs from the one
that was trained (max |logit difference| 1.5-2.6 on a tiny tied Llama after one step). PEFT only warned about
tied modules in the adapter (peft#2025, 0.13+); PEFT 0.19.0 fixed the merge itself: when the merged input and
output embeddings no longer share storage it sets ``config.tie_word_embeddings = False`` (read in the 0.19.0,
0.20.0 and 0.21.0 wheels; absent from 0.18.1). Reports: peft#2018, peft#2777, transformers#45127.

The fix: wrap ``LoraModel.merge_and_unload`` (defined by ``LoraModel`` up to peft 0.17, inherited from
``BaseTuner`` in 0.18; the wrapper is set on ``LoraModel`` either way, so ``PeftModel.merge_and_unload``, which
forwards to it, is covered). After the merge, exactly as PEFT 0.19 does: if the config says the embeddings are
tied and the returned model's input and output embedding weights are different tensors, set
``tie_word_embeddings=False`` on the config (and on its text config, when it has a separate one) and warn. A
model whose embeddings are still one tensor (not tied by config, or both modules untouched, or
``ensure_weight_tying=True`` on peft 0.18) is returned unchanged. ``unload()`` (no merge) is not touched: it
drops the trained copies and returns the original, still tied, model.

Applies to peft <0.19.0 (every release before the fix; LoRA adapters). Fallback: if ``LoraModel`` has no
``merge_and_unload`` the shim is skipped.

Follow-ups: none. BaseTuner._unload_and_optionally_merge read in peft 0.19.0, 0.19.1,
0.20.0 and 0.21.2: the untie check 0.19.0 added is unchanged (0.21 only changed which
modules are visited); proposals at the same place were closed unmerged (peft#2972,
untie on merge; transformers#45136 and #45156, untie on save). The shim also clears
the flag on a separate text config, which 0.19.0 does not touch.
"""

from __future__ import annotations

import warnings

from .._util import acted, user_stacklevel
from ..spec import Observation, ShimSpec, Target

SPEC = ShimSpec(
    id="peft_tied_embeddings_lost_on_merge",
    since="0.1.0",
    title="merge_and_unload keeps tie_word_embeddings=True after a trained lm_head/embed_tokens copy",
    symptom="LoRA with modules_to_save=['lm_head'] (or embed_tokens) on a tied model: merge, save and reload, and "
    "the trained head is overwritten by the embedding (reloaded logits differ from the trained model's)",
    why="modules_to_save on a tied embedding trains an untied copy, but peft <0.19 merge_and_unload keeps "
    "config.tie_word_embeddings=True, so from_pretrained re-ties the weights and the trained head is lost. "
    "The shim sets tie_word_embeddings=False when the merged embeddings are separate tensors, as peft 0.19 does.",
    requires={"peft": "<0.19.0"},
    fixed_in={"peft": "0.19.0"},
    refs=(
        "https://github.com/huggingface/peft/issues/2018",
        "https://github.com/huggingface/peft/issues/2777",
        "https://github.com/huggingface/transformers/issues/45127",
        "https://github.com/huggingface/peft/pull/2025",
        "https://github.com/huggingface/peft/releases/tag/v0.19.0",
    ),
    backports=("https://github.com/huggingface/peft/releases/tag/v0.19.0",),
    follow_ups_checked="BaseTuner._unload_and_optionally_merge read in peft 0.19.0, 0.19.1, 0.20.0 and 0.21.2: the "
    "untie check 0.19.0 added is unchanged (0.21 only changed which modules are visited); proposals at the same "
    "place were closed unmerged (peft#2972, untie on merge; transformers#45136 and #45156, untie on save).",
    targets=(Target("peft.tuners.lora", "LoraModel.merge_and_unload"),),
    modules=("peft.tuners.lora",),
)

_MESSAGE = (
    "peft_tied_embeddings_lost_on_merge: the merged model's input and output embeddings are separate tensors "
    "(a trained copy from modules_to_save), but its config said tie_word_embeddings=True, which would make "
    "from_pretrained overwrite one with the other; set tie_word_embeddings=False on the config."
)


def _configs(model):
    """The config and, for composite models, the text config that carries tie_word_embeddings."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    found = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text()
        except Exception:  # noqa: BLE001 (a config without a text config; nothing else to fix)
            text = None
        if text is not None and text is not config:
            found.append(text)
    return found


def untied_but_configured_tied(model) -> bool:
    """True when the config says the word embeddings are tied but the model's are two tensors."""
    if not any(getattr(c, "tie_word_embeddings", False) for c in _configs(model)):
        return False
    try:
        out_emb = model.get_output_embeddings()
        in_emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    out_w = getattr(out_emb, "weight", None)
    in_w = getattr(in_emb, "weight", None)
    if out_w is None or in_w is None:
        return False
    return out_w.data_ptr() != in_w.data_ptr()


def _merge_and_unload(wrapped, instance, args, kwargs):
    model = wrapped(*args, **kwargs)
    if untied_but_configured_tied(model):
        for config in _configs(model):
            if getattr(config, "tie_word_embeddings", False):
                config.tie_word_embeddings = False
        acted(SPEC.id, "merged models untied in config")
        warnings.warn(_MESSAGE, UserWarning, stacklevel=user_stacklevel())
    return model


def install(patcher, options) -> None:
    patcher.wrap_method("peft.tuners.lora", "LoraModel.merge_and_unload", _merge_and_unload)


# ---------------------------------------------------------------------------
# Reproduction


def probe(module: str = "lm_head", tied: bool = True) -> Observation:
    """Tiny Llama (``tie_word_embeddings=tied``) + LoRA with ``modules_to_save=[module]``, one SGD step,
    ``merge_and_unload``, ``save_pretrained``, ``from_pretrained``: do the reloaded logits equal the trained model's?"""
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from .. import tiny

    model = tiny.tiny_llama(tie_word_embeddings=tied)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                        modules_to_save=[module], task_type="CAUSAL_LM")
    with tiny.quiet():
        peft_model = get_peft_model(model, config)
    batch = tiny.batch()
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1.0)
    with tiny.quiet():
        peft_model(**batch).loss.backward()
    optimizer.step()
    peft_model.eval()
    ids = batch["input_ids"][:1]
    with torch.no_grad(), tiny.quiet():
        trained = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()
        with tempfile.TemporaryDirectory() as folder:
            merged.save_pretrained(folder)
            reloaded = AutoModelForCausalLM.from_pretrained(folder)
        reloaded.eval()
        again = reloaded(input_ids=ids).logits
    diff = (again - trained).abs().max().item()
    said = getattr(merged.config, "tie_word_embeddings", None)
    if diff > 1e-4:
        return Observation(True, f"reloaded merged model differs from the trained one: max |dlogit| {diff:.3g} "
                                 f"(saved config tie_word_embeddings={said})")
    return Observation(False, f"reloaded merged model matches the trained one (max |dlogit| {diff:.3g}, "
                              f"tie_word_embeddings={said})")
