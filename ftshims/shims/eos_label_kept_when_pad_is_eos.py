"""Causal-LM collation masks every EOS label when the pad token is the EOS token (opt-in fix).

Why: ``DataCollatorForLanguageModeling(mlm=False)`` builds ``labels = input_ids`` and then masks *by value*:
``labels[labels == tokenizer.pad_token_id] = -100`` (transformers 4.30.2 to 5.24.0, every release read). With
the common ``tokenizer.pad_token = tokenizer.eos_token`` (Llama, Mistral, Qwen-chat setups, and TRL <0.16.1's
SFTTrainer sets it itself when the tokenizer has no pad token and uses this collator by default) every real EOS
label becomes -100 together with the padding, so the model is never trained to emit EOS and generates until
``max_new_tokens``. No warning. Reports: transformers#23530 (open since 2023), transformers#22794, trl#976; TRL
0.16.1 replaced the collator in SFTTrainer with its own, which masks padding by position (trl#3200).

The fix masks padding *by position*, as TRL 0.16.1's collator does: after the original ``torch_call``, labels
at real (non-padding) positions whose token is the pad = EOS id get their token back. Real positions come from
the batch's ``attention_mask``; a batch without one (lists of ids collated by ``_torch_collate_batch``) uses
each example's length and the tokenizer's padding side. Everything else the collator did stays as it was, and
subclasses that call ``super().torch_call`` (TRL's ``DataCollatorForCompletionOnlyLM``) mask their prompt
after it, as before.

Opt-in (``kind="opt-in"``): which labels are trained is a training decision, some recipes rely on the masked
EOS (upstream transformers has kept this behaviour for years), and turning it on changes the loss of every run
that has pad = EOS. ``ftshims.apply(include=["eos_label_kept_when_pad_is_eos"])`` turns it on; the advisory
``trl_sft_eos_label_masked_when_pad_is_eos`` and the setup lint's ``pad-is-eos`` say when a run has the bug.

Applies to transformers >=4.30 (the lowest release read). Passes through when ``mlm=True``, when the pad id is
not the EOS id (or either is unset), and when the real positions cannot be told (no attention mask and examples
that are not sequences of ids). Fallback: if ``DataCollatorForLanguageModeling.torch_call`` is missing the shim
is skipped.

Follow-ups: none. The rule this shim carries over is TRL's (trl#3200, 0.16.1): padding masked by position.
TRL's DataCollatorForLanguageModeling read in 0.16.1, 0.23.1, 1.0.0, 1.9.0 and 1.16.0: labels are still
padded with -100 by position, never masked by value; transformers' collator still masks by value in 5.25.0.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._util import acted
from ..spec import OPT_IN, Observation, ShimSpec, Target

SPEC = ShimSpec(
    id="eos_label_kept_when_pad_is_eos",
    since="0.1.0",
    title="DataCollatorForLanguageModeling(mlm=False) masks every EOS label when pad = EOS",
    symptom="with tokenizer.pad_token = tokenizer.eos_token every EOS label is -100, so the model never learns to "
    "stop and generates until max_new_tokens",
    why="the causal-LM collator masks padding by value (labels == pad_token_id), which with pad = EOS also masks "
    "every real EOS. Opt-in because it changes which labels a run trains: it masks padding by position instead, "
    "as TRL 0.16.1's own collator does.",
    requires={"transformers": ">=4.30.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/23530",
        "https://github.com/huggingface/transformers/issues/22794",
        "https://github.com/huggingface/trl/issues/976",
        "https://github.com/huggingface/trl/pull/3200",
    ),
    backports=("https://github.com/huggingface/trl/pull/3200",),
    follow_ups_checked="TRL's DataCollatorForLanguageModeling read in 0.16.1, 0.23.1, 1.0.0, 1.9.0 and 1.16.0: "
    "labels are still padded with -100 by position, never masked by value; transformers' collator still masks by "
    "value in 5.25.0.",
    targets=(Target("transformers.data.data_collator", "DataCollatorForLanguageModeling.torch_call"),),
    modules=("transformers.data.data_collator",),
    kind=OPT_IN,
)


def _real_positions(batch, examples, padding_side: str):
    """Boolean ``[rows, length]`` mask of the non-padding positions, or None when it cannot be told."""
    import torch

    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == input_ids.shape:
        return mask.bool()
    lengths = []
    for example in examples:
        ids = example.get("input_ids") if isinstance(example, Mapping) else example
        try:
            lengths.append(len(ids))
        except TypeError:
            return None
    if len(lengths) != input_ids.shape[0]:
        return None
    width = input_ids.shape[1]
    columns = torch.arange(width, device=input_ids.device).expand(len(lengths), width)
    lengths_t = torch.tensor(lengths, device=input_ids.device).unsqueeze(1)
    return columns >= width - lengths_t if padding_side == "left" else columns < lengths_t


def _torch_call(wrapped, instance, args, kwargs):
    import torch

    batch = wrapped(*args, **kwargs)
    tokenizer = getattr(instance, "tokenizer", None)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if getattr(instance, "mlm", True) or pad_id is None or pad_id != getattr(tokenizer, "eos_token_id", None):
        return batch
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    input_ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if labels is None or input_ids is None or labels.shape != input_ids.shape:
        return batch
    examples = args[0] if args else kwargs.get("examples", ())
    real = _real_positions(batch, examples, getattr(tokenizer, "padding_side", "right"))
    if real is None:
        return batch
    restore = real & (input_ids == pad_id) & (labels == -100)
    count = int(restore.sum())
    if count:
        batch["labels"] = torch.where(restore, input_ids, labels)
        acted(SPEC.id, "EOS labels kept", count)
    return batch


def install(patcher, options) -> None:
    patcher.wrap_method("transformers.data.data_collator", "DataCollatorForLanguageModeling.torch_call", _torch_call)


# ---------------------------------------------------------------------------
# Reproduction

_WORDS = ["<unk>", "<s>", "</s>", "<mask>", "a", "b", "c", "d", "e", "f", "g"]


def tokenizer(padding_side: str = "right", pad_is_eos: bool = True):
    """A WordLevel tokenizer; pad = eos = ``</s>`` unless ``pad_is_eos`` is False (then pad = ``<unk>``)."""
    from ..tiny import word_tokenizer

    tok = word_tokenizer(_WORDS, bos_token="<s>", eos_token="</s>", pad_token="</s>" if pad_is_eos else "<unk>",
                         mask_token="<mask>")
    tok.padding_side = padding_side
    return tok


TEXTS = ("<s> a b c </s>", "<s> d e </s>")


def probe(features: str = "dicts", padding_side: str = "right", pad_is_eos: bool = True) -> Observation:
    """Collate two examples of different lengths that end in EOS with DataCollatorForLanguageModeling(mlm=False):
    is an EOS at a real position labelled -100, and is the padding still -100?"""
    from transformers import DataCollatorForLanguageModeling

    tok = tokenizer(padding_side, pad_is_eos)
    collator = DataCollatorForLanguageModeling(tokenizer=tok, mlm=False)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    examples = [{"input_ids": i} for i in ids] if features == "dicts" else ids
    batch = collator(examples)
    labels, input_ids = batch["labels"], batch["input_ids"]
    real = _real_positions({"input_ids": input_ids}, ids, padding_side)
    eos_id = tok.eos_token_id
    eos_real = real & (input_ids == eos_id)
    masked_eos = int((labels[eos_real] == -100).sum())
    padding_labelled = int((labels[~real] != -100).sum())
    detail = (f"{features}, {padding_side} padding, pad {'=' if pad_is_eos else '!='} eos: {masked_eos} of "
              f"{int(eos_real.sum())} real EOS labels are -100; {padding_labelled} of {int((~real).sum())} padding "
              f"labels are not -100")
    return Observation(masked_eos > 0 or padding_labelled > 0, detail)
