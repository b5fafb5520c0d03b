"""TRL's fused/chunked LM head skips the logit transforms of RecurrentGemma (soft cap) and Inkling (µP divisor).

Why: TRL's memory-efficient heads run only the backbone and project the hidden states through
``get_output_embeddings().weight`` themselves, applying a fixed list of logit transforms read from the text config
when the head is installed: ``logit_scale`` / ``output_multiplier`` (and from 1.15 ``lm_head_multiplier``,
``logits_scaling``), then ``final_logit_softcapping``. That is ``add_fused_lm_head`` in every SFT, DPO, KTO, GRPO and
RLOO trainer from TRL 1.15.0, and SFT's ``_patch_chunked_ce_lm_head`` (``loss_type="chunked_nll"``, from 1.4.0; the
default from 1.7.0). A model whose own forward transforms its logits under another name is trained on a different
objective, silently:

* RecurrentGemma caps its logits with ``config.logits_soft_cap`` (``tanh(z / cap) * cap``, default 30): a tiny model
  with a trained head's logit range scores 29.55 by its own loss, 50.15 in ``SFTTrainer`` (TRL 1.16.0);
* Inkling divides the hidden states by ``logits_mup_width_multiplier`` (default 24) before a bias-free head: own loss
  4.217, ``SFTTrainer`` 9.493.

For GRPO/RLOO the sampler uses the real model, so the importance ratios compare two different distributions.

The fix: wrap the two installers (``add_fused_lm_head``, every module-level alias of it in ``trl``, and
``_patch_chunked_ce_lm_head``). While one runs on such a model, its text config also carries the transform in TRL's
vocabulary, and loses it again when the installer returns (TRL reads these values once, at install): RecurrentGemma's
``logits_soft_cap`` as ``final_logit_softcapping`` (the same ``tanh`` cap, applied after the scale as the model
does), Inkling's divisor as ``logit_scale = 1 / logits_mup_width_multiplier`` (equal for a bias-free head). The fused
loss then equals the model's own (1e-6 relative); the model's forward, generation and saved config are unchanged.

Applies to trl >=1.4.0 (read: 1.4.0, 1.6.0, 1.7.0, 1.9.0, 1.12.0, 1.14.0, 1.15.0, 1.16.0; unfixed in 1.16.0). Left
alone: every other model; a config that already sets TRL's name (``final_logit_softcapping`` / ``logit_scale`` and
the 1.15+ aliases); an Inkling whose ``unpadded_vocab_size`` slices the vocabulary or whose head has a bias (TRL cannot
express either: the shim logs once and the advisory ``trl_fused_lm_head_unsupported_logits`` names them, with the
models whose forward masks image-token logits, Chameleon and Emu3).
"""

from __future__ import annotations

import logging

from .._util import acted, warn_once
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

log = logging.getLogger("ftshims")
_WARNED = set()

# TRL's names for a logit multiplier (read in this order by 1.15+; 1.4-1.14 read the first one or two).
TRL_SCALE_NAMES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")

SPEC = ShimSpec(
    id="trl_fused_head_logit_transforms",
    since="0.3.0",
    title="TRL's fused/chunked LM head skips RecurrentGemma's soft cap and Inkling's µP logit divisor",
    symptom="SFTTrainer (and DPO/KTO/GRPO/RLOO) on RecurrentGemma or Inkling trains a different objective from the "
    "model's own loss (tiny RecurrentGemma: 50.15 instead of 29.55; Inkling: 9.49 instead of 4.22); GRPO/RLOO ratios "
    "compare the sampler's distribution with another one",
    why="TRL's memory-efficient LM heads re-implement the head with a fixed list of config names for logit transforms; "
    "RecurrentGemma's logits_soft_cap and Inkling's logits_mup_width_multiplier are not on it. The shim hands them to "
    "TRL under its own names while the head is installed.",
    requires={"trl": ">=1.4.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/trl/pull/6744",
        "https://github.com/huggingface/trl/pull/5575",
        "https://github.com/huggingface/trl/issues/7063",
    ),
    targets=(
        Target("trl.trainer.utils", "add_fused_lm_head", params=("model",), when=">=1.15.0"),
        Target("trl.trainer.sft_trainer", "_patch_chunked_ce_lm_head", params=("model",), when=">=1.4.0,<1.15.0"),
    ),
    modules=("trl",),
)


def translation(model):
    """``({trl_name: value}, None)`` to expose on the text config while TRL installs its head, ``({}, reason)`` when
    the model's transform cannot be expressed in TRL's names, ``({}, None)`` when there is nothing to do."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if model_type == "recurrent_gemma":
        cap = getattr(text, "logits_soft_cap", None)
        if cap is None or getattr(text, "final_logit_softcapping", None) is not None:
            return {}, None
        return {"final_logit_softcapping": float(cap)}, None
    if model_type.startswith("inkling"):
        divisor = getattr(text, "logits_mup_width_multiplier", None)
        if divisor in (None, 1, 1.0) or any(getattr(text, name, None) is not None for name in TRL_SCALE_NAMES):
            return {}, None  # nothing to divide, or a multiplier TRL already reads (the shim does not combine them)
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        unpadded = getattr(text, "unpadded_vocab_size", None)
        vocab = getattr(text, "vocab_size", None)
        if getattr(head, "bias", None) is not None:
            return {}, "its LM head has a bias, so dividing the logits is not dividing the hidden states"
        if unpadded is not None and vocab is not None and unpadded < vocab:
            return {}, f"its logits are sliced to unpadded_vocab_size={unpadded} of {vocab}, which TRL cannot express"
        return {"logit_scale": 1.0 / float(divisor)}, None
    return {}, None


def _text_config(model):
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _installer(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    try:
        values, reason = translation(model)
        text = _text_config(model) if values else None
    except Exception as exc:  # noqa: BLE001 - a model we cannot read: TRL's head as TRL installs it
        log.debug("trl_fused_head_logit_transforms left %s alone: %s", type(model).__name__, exc)
        return wrapped(*args, **kwargs)
    if reason:
        name = type(model).__name__
        warn_once(_WARNED, name, lambda: log.warning(
            "trl_fused_head_logit_transforms cannot give TRL's fused LM head the logits of %s: %s (see the advisory "
            "trl_fused_lm_head_unsupported_logits)", name, reason))
    if not values:
        return wrapped(*args, **kwargs)
    saved = {name: vars(text)[name] for name in values if name in vars(text)}
    for name, value in values.items():
        setattr(text, name, value)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        for name in values:
            if name in saved:
                setattr(text, name, saved[name])
            else:
                delattr(text, name)
    acted(SPEC.id, "fused LM heads given the model's logit transform")
    return result


def install(patcher, options) -> None:
    import sys

    from packaging.version import Version

    from ..spec import TargetMissing
    from ..versions import installed_version

    if Version(installed_version("trl") or "0") >= Version("1.15.0"):
        utils = sys.modules.get("trl.trainer.utils")

        def install_fused(module):
            original = vars(module).get("add_fused_lm_head")
            if not callable(original):
                raise TargetMissing("trl.trainer.utils.add_fused_lm_head is missing")
            patcher.wrap_aliases(original, _installer, packages=("trl",))

        if utils is not None:
            install_fused(utils)
        else:
            patcher.when_imported("trl.trainer.utils", install_fused)
        return

    def install_chunked(module):
        if not callable(vars(module).get("_patch_chunked_ce_lm_head")):
            raise TargetMissing("trl.trainer.sft_trainer._patch_chunked_ce_lm_head is missing")
        patcher.wrap(module, "_patch_chunked_ce_lm_head", _installer)

    patcher.when_imported("trl.trainer.sft_trainer", install_chunked)


# ---------------------------------------------------------------------------
# Reproduction

MODELS = ("recurrent_gemma", "inkling", "llama")


def tiny_model(name: str):
    """A tiny random causal LM whose LM head is scaled x30 (logits in a trained model's range, so the transforms
    matter)."""
    import torch
    import transformers

    from .. import tiny

    if name == "recurrent_gemma":
        if not hasattr(transformers, "RecurrentGemmaConfig"):
            raise ProbeUnsupported("this transformers has no RecurrentGemma")
        model = tiny.causal_lm("RecurrentGemmaConfig", vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, lru_width=32,
                               attention_window_size=16, block_types=["recurrent", "attention"], logits_soft_cap=30.0)
    elif name == "inkling":
        try:
            from transformers.models.inkling.configuration_inkling import InklingTextConfig
            from transformers.models.inkling.modeling_inkling import InklingForCausalLM
        except ImportError:
            raise ProbeUnsupported("this transformers has no Inkling") from None
        torch.manual_seed(0)
        model = InklingForCausalLM(InklingTextConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2, head_dim=8))
    elif name == "llama":
        model = tiny.tiny_llama()
    else:
        raise ValueError(f"model must be one of {MODELS}, not {name!r}")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    return model


def probe(model: str = "recurrent_gemma") -> Observation:
    """One batch through ``SFTTrainer.compute_loss`` (TRL's fused/chunked head) and through the model's own forward:
    the same loss?"""
    import tempfile
    import warnings

    import torch
    from packaging.version import Version

    from .. import tiny
    from ..versions import installed_version

    try:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer
    except (ImportError, RuntimeError) as exc:
        raise ProbeUnsupported(f"TRL's SFTTrainer cannot be imported here ({exc})") from None
    trl_version = Version(installed_version("trl") or "0")
    loss = {"loss_type": "chunked_nll"} if Version("1.4.0") <= trl_version < Version("1.7.0") else {}
    lm = tiny_model(model)
    generator = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(4, 128, (8,), generator=generator).tolist()} for _ in range(4)]
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, 128)]
    tokenizer = tiny.word_tokenizer(words, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    with tempfile.TemporaryDirectory() as out, tiny.quiet(), _packing.quiet_datasets(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            args = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
                             bf16=False, save_strategy="no", disable_tqdm=True, dataset_num_proc=None, **loss)
        except TypeError as exc:
            raise ProbeUnsupported(f"this TRL's SFTConfig takes other arguments ({exc})") from None
        try:
            trainer = SFTTrainer(model=lm, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
        except (TypeError, ValueError) as exc:
            raise ProbeUnsupported(f"this TRL's SFTTrainer cannot be set up this way ({exc})") from None
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        trainer.model.eval()
        with torch.no_grad():
            # without labels every TRL head falls back to the model's own forward (1.4-1.14 patch it for labels)
            logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
            own = float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                          batch["labels"][:, 1:].flatten(), ignore_index=-100))
            try:
                sft = float(trainer.compute_loss(trainer.model, dict(batch)))
            except AttributeError as exc:  # TRL 1.4's chunked head reads outputs.past_key_values (RecurrentGemma)
                raise ProbeUnsupported(f"TRL {trl_version}'s SFT head fails on {model} for another reason: "
                                       f"{exc}") from None
    detail = f"{model}: model's own loss {own:.5f}, SFTTrainer loss {sft:.5f}"
    return Observation(abs(own - sft) > 1e-4 * max(1.0, abs(own)), detail)
