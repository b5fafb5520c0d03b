"""TRL's fused/chunked LM head crashes on a PEFT ``trainable_token_indices`` head: ``'TrainableTokensWrapper' object
has no attribute 'bias'``.

Why: PEFT's ``trainable_token_indices`` (train only the rows of new tokens, PEFT's documented recipe for added chat
tokens) wraps the input embedding in a ``TrainableTokensWrapper``, and the LM head too when it is named
(``{"lm_head": [...]}``) or tied to the embedding (a plain list on a ``tie_word_embeddings`` model). While its token
adapter is active the wrapper answers only ``weight`` (the base weight with the trained rows, differentiable) and raises
``AttributeError`` for every other attribute it does not hold itself. TRL's memory-efficient LM heads read
``lm_head.weight`` and ``lm_head.bias`` and project the hidden states themselves: ``add_fused_lm_head`` in every SFT,
DPO, KTO, GRPO and RLOO trainer from TRL 1.15.0, and SFT's ``_patch_chunked_ce_lm_head`` (``loss_type="chunked_nll"``,
from 1.4.0; the default from 1.7.0). So ``SFTTrainer`` dies at its first step (read for the other trainers, which
install the same head). TRL refuses LoRA on the head (``BaseTunerLayer``); ``TrainableTokensWrapper`` is not one.

The fix: the wrapper also answers ``bias``, with the bias its own forward uses. An active, unmerged token adapter
computes ``F.linear(x, merged_weight)`` on a Linear head (no bias) and ``F.embedding`` on an embedding: ``None``; a
merged adapter runs the base layer, whose ``bias`` it returns. The fused head then computes the model's own logits:
SFT's loss equals the PeftModel's own loss on the same batch (4.1708 on a tiny Llama, head or tied embedding wrapped),
and the trained rows move. Wrappers with adapters disabled already answered from the base layer (unchanged); every
other attribute still raises as before.

Applies to peft >=0.15.0 (the first with trainable tokens; ``_hasattr_wrapped`` answers only ``weight`` in 0.15.2 to
0.21.2, read) with trl >=1.4.0 (the first TRL whose SFT head reads ``lm_head.bias``, read in 1.4.0, 1.6.0, 1.7.0,
1.9.0, 1.12.0, 1.14.0 and 1.16.0; run: the crash and the fix on trl 1.16.0 + peft 0.21.2 (transformers 4.57.6 and
5.25.0) and trl 1.4.0 + peft 0.19.1 with ``loss_type="chunked_nll"``). Unfixed in peft 0.21.2 and trl 1.16.0. Left alone: every other PEFT wrapper and
attribute; ``modules_to_save`` heads (a full copy, already fine).
"""

from __future__ import annotations

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

SPEC = ShimSpec(
    id="trl_fused_head_trainable_tokens",
    since="0.3.0",
    title="TRL's fused LM head crashes on a PEFT trainable_token_indices head ('TrainableTokensWrapper' has no 'bias')",
    symptom="SFTTrainer (and DPO/KTO/GRPO/RLOO) with PEFT trainable_token_indices on lm_head, or on the embedding of a "
    "tied model: AttributeError: 'TrainableTokensWrapper' object has no attribute 'bias' at the first step",
    why="TRL's fused and chunked LM heads read lm_head.bias; PEFT's TrainableTokensWrapper answers only weight while "
    "its token adapter is active. The shim makes it answer bias with the bias its own forward uses (None unmerged).",
    requires={"peft": ">=0.15.0", "trl": ">=1.4.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/trl/issues/7063",
        "https://github.com/huggingface/trl/pull/5575",
    ),
    targets=(
        Target("peft.utils.other", "TrainableTokensWrapper._hasattr_wrapped", params=("name", "modules")),
        Target("peft.utils.other", "TrainableTokensWrapper._getattr_wrapped", params=("name", "modules")),
    ),
    modules=("peft.utils.other",),
)


def _name(args, kwargs):
    return args[0] if args else kwargs.get("name")


def _modules(args, kwargs):
    return args[1] if len(args) > 1 else kwargs.get("modules")


def _hasattr_wrapped(wrapped, instance, args, kwargs):
    if _name(args, kwargs) == "bias" and "token_adapter" in (_modules(args, kwargs) or {}):
        return True
    return wrapped(*args, **kwargs)


def forward_bias(token_adapter):
    """The bias ``TrainableTokensLayer.forward`` applies: the base layer's once merged, none while unmerged (it calls
    ``F.linear(x, merged_weight)`` / ``F.embedding``)."""
    if getattr(token_adapter, "merged", False):
        return getattr(token_adapter.base_layer, "bias", None)
    return None


def _getattr_wrapped(wrapped, instance, args, kwargs):
    modules = _modules(args, kwargs) or {}
    if _name(args, kwargs) == "bias" and "token_adapter" in modules:
        acted(SPEC.id, "bias answered for a trainable-tokens head")
        return forward_bias(modules["token_adapter"])
    return wrapped(*args, **kwargs)


def install(patcher, options) -> None:
    import sys

    from ..spec import TargetMissing

    wrapper = sys.modules["peft.utils.other"].TrainableTokensWrapper
    for name in ("_hasattr_wrapped", "_getattr_wrapped"):
        if name not in vars(wrapper):  # inherited only: the wrapper no longer answers `weight` itself
            raise TargetMissing(f"peft.utils.other.TrainableTokensWrapper.{name} is not defined on the class")
    patcher.wrap(wrapper, "_hasattr_wrapped", _hasattr_wrapped)
    patcher.wrap(wrapper, "_getattr_wrapped", _getattr_wrapped)


# ---------------------------------------------------------------------------
# Reproduction

CASES = ("lm_head", "tied_embedding", "modules_to_save")


def sft_trainer(case: str = "lm_head"):
    """A TRL ``SFTTrainer`` (its default loss) on a tiny Llama with LoRA on q_proj plus ``case``: trainable token rows
    5-7 of the untied ``lm_head``, of the tied embedding, or a full ``modules_to_save`` copy of the head (control)."""
    import sys
    import tempfile
    import warnings

    from .. import tiny

    try:
        from datasets import Dataset
        from peft import LoraConfig
        from trl import SFTConfig, SFTTrainer
    except (ImportError, RuntimeError) as exc:
        raise ProbeUnsupported(f"TRL's SFTTrainer or PEFT cannot be imported here ({exc})") from None
    import torch

    import dataclasses

    from packaging.version import Version

    from ..versions import installed_version

    if "trainable_token_indices" not in {f.name for f in dataclasses.fields(LoraConfig)}:
        raise ProbeUnsupported("this PEFT has no trainable_token_indices (added in 0.15.0)")
    trl_version = Version(installed_version("trl") or "0")
    # SFT's chunked head is opt-in on TRL 1.4-1.6 (loss_type="chunked_nll"), the default from 1.7.0
    loss = {"loss_type": "chunked_nll"} if Version("1.4.0") <= trl_version < Version("1.7.0") else {}
    extra = {"lm_head": {"trainable_token_indices": {"lm_head": [5, 6, 7]}},
             "tied_embedding": {"trainable_token_indices": [5, 6, 7]},
             "modules_to_save": {"modules_to_save": ["lm_head"]}}[case]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM", **extra)
    model = tiny.tiny_llama(tie_word_embeddings=case == "tied_embedding")
    generator = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(8, 128, (8,), generator=generator).tolist() + [5, 6, 7]} for _ in range(8)]
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, 128)]
    tokenizer = tiny.word_tokenizer(words, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    out = tempfile.mkdtemp()
    with tiny.quiet(), _packing.quiet_datasets(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            args = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
                             report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
                             logging_steps=1, seed=0, dataset_num_proc=None, **loss)
            trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), peft_config=config,
                                 processing_class=tokenizer)
        except (AttributeError, TypeError, ValueError) as exc:  # e.g. peft 0.17 cannot wrap a Linear lm_head
            raise ProbeUnsupported(f"this PEFT/TRL cannot set up {case} ({type(exc).__name__}: {exc})") from None
    for name in ("PrinterCallback", "ProgressCallback"):  # the logs a Trainer prints on stdout
        trainer.remove_callback(getattr(sys.modules["transformers.trainer_callback"], name))
    return trainer


def probe(case: str = "lm_head") -> Observation:
    """SFTTrainer's loss on one batch against the PeftModel's own loss, then two training steps: does it train, with
    the same loss, and do the head's trained rows move?"""
    import torch

    trainer = sft_trainer(case)
    model = trainer.model
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    head = {n: p.detach().clone() for n, p in model.named_parameters()
            if p.requires_grad and ("trainable_tokens" in n or "modules_to_save" in n)}
    try:
        model.eval()
        with torch.no_grad():
            own = float(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
            sft = float(trainer.compute_loss(model, dict(batch)))
        model.train()
        trainer.train()
    except AttributeError as exc:
        return Observation(True, f"{case}: SFTTrainer fails: AttributeError: {exc}")
    moved = sorted(n.split(".")[-2] for n, p in model.named_parameters() if n in head and not torch.equal(p, head[n]))
    detail = f"{case}: model's own loss {own:.5f}, SFTTrainer loss {sft:.5f}; trained head parameters moved: {moved}"
    return Observation(abs(own - sft) > 1e-4 * max(1.0, abs(own)) or not moved, detail)
