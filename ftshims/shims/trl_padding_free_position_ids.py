"""TRL's padding-free collator drops the packed examples' boundaries unless the model uses flash_attention_2.

Why: TRL 0.19–0.23.0 build ``DataCollatorForLanguageModeling(padding_free=True,
return_position_ids=<attn is flash_attention_2/3>)`` for ``SFTTrainer(packing=True)``
with the default isolating strategy (``"ffd"`` in 0.19, ``"bfd"`` from 0.20) and for
``padding_free=True``. With eager or sdpa attention the collator then flattens
the examples into one row with an all-ones ``attention_mask`` and *no*
``position_ids``: the model numbers the tokens 0..n-1 across example
boundaries and every example attends to the ones before it (logit difference
0.43 on TRL 0.19.1 + transformers 4.53.3). The labels also keep a target across
each boundary (the last token of one example is trained to predict the first
token of the next). TRL only warns that flash attention is "recommended".
TRL 0.23.1 fixed both: a padding-free batch always carries per-example
``position_ids``, no mask, and ``labels[position_ids == 0] = -100``.

The fix: wrap ``trl.trainer.sft_trainer.DataCollatorForLanguageModeling.torch_call``.
For a padding-free collator it runs the original with ``return_position_ids=True``
(on a copy of the collator; the user's object is not modified), drops the
all-ones ``attention_mask`` of the flattened row and sets
``labels[position_ids == 0] = -100``: exactly what TRL 0.23.1 emits. The model
then sees per-example ``position_ids``: transformers >=4.53.1 isolates the
examples itself when no cache is used (TRL 0.22+ passes ``use_cache=False``),
and the ``packing_block_mask`` shim does it for every other case.

Applies to trl >=0.19,<0.23.1. Fallback: a collator whose class lacks
``padding_free``/``return_position_ids`` is skipped (target missing).

Follow-ups: https://github.com/huggingface/trl/blob/v1.16.0/trl/trainer/sft_trainer.py
(padding-free batches also carry cu_seq_lens_q/k, max_length_q/k and seq_idx for varlen and
linear-attention kernels) — not carried: a later addition for those kernels, not part of
0.23.1's fix; the shim emits 0.23.1's batch, and linear-attention models were not isolated by
0.23.1-1.15 either. Otherwise none: DataCollatorForLanguageModeling.torch_call read in trl
0.23.1, 0.24.0-0.29.1 (identical), 1.0.0, 1.4.0, 1.9.0 and 1.16.0: per-example position_ids,
no attention_mask and labels[position_ids == 0] = -100 for padding-free batches are
unchanged; 1.0-1.4 truncate in the collator (dropped in 1.9) and 1.11 adds position_ids
beside the mask for return_position_ids without padding-free, neither a padding-free change.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from .._util import acted, warn_once
from ..spec import FollowUp, Observation, ProbeUnsupported, ShimSpec, Target

log = logging.getLogger("ftshims")

SPEC = ShimSpec(
    id="trl_padding_free_position_ids",
    since="0.1.0",
    title="TRL padding-free/packed batches lose example boundaries without flash attention",
    symptom="SFTTrainer(packing=True) or padding_free=True with eager/sdpa: the collated row has an all-ones mask and "
    "no position_ids, so packed examples attend to each other and labels cross example boundaries",
    why='TRL 0.19-0.23.0 padding-free collators (SFTTrainer packing with eager/sdpa) flatten examples into one row with no position_ids, so examples attend to each other. The shim emits per-example position_ids, which the packing shims then isolate.',
    requires={"trl": ">=0.19,<0.23.1"},
    fixed_in={"trl": "0.23.1"},
    refs=(
        "https://github.com/huggingface/trl/pull/3521",
        "https://github.com/huggingface/trl/pull/3526",
        "https://github.com/huggingface/transformers/pull/46634",
        "https://github.com/huggingface/trl/releases/tag/v0.23.1",
        "https://github.com/huggingface/trl/blob/v1.16.0/trl/trainer/sft_trainer.py",
    ),
    backports=("https://github.com/huggingface/trl/releases/tag/v0.23.1",),
    follow_ups=(
        FollowUp("https://github.com/huggingface/trl/blob/v1.16.0/trl/trainer/sft_trainer.py",
                 "padding-free batches also carry cu_seq_lens_q/k, max_length_q/k and seq_idx for varlen and "
                 "linear-attention kernels", carried=False,
                 reason="a later addition for those kernels, not part of 0.23.1's fix; the shim emits 0.23.1's "
                 "batch, and linear-attention models were not isolated by 0.23.1-1.15 either"),
    ),
    follow_ups_checked="DataCollatorForLanguageModeling.torch_call read in trl 0.23.1, 0.24.0-0.29.1 (identical), "
    "1.0.0, 1.4.0, 1.9.0 and 1.16.0: per-example position_ids, no attention_mask and labels[position_ids == 0] = "
    "-100 for padding-free batches are unchanged; 1.0-1.4 truncate in the collator (dropped in 1.9) and 1.11 adds "
    "position_ids beside the mask for return_position_ids without padding-free, neither a padding-free change.",
    targets=(Target("trl.trainer.sft_trainer", "DataCollatorForLanguageModeling.torch_call"),),
    modules=("trl.trainer.sft_trainer",),
)


def _torch_call(wrapped, instance, args, kwargs):
    if not getattr(instance, "padding_free", False):
        return wrapped(*args, **kwargs)
    if instance.return_position_ids:
        output = wrapped(*args, **kwargs)
    else:
        with_positions = dataclasses.replace(instance, return_position_ids=True)
        output = wrapped.__func__(with_positions, *args, **kwargs)
    position_ids = output.get("position_ids")
    if position_ids is None:
        return output
    mask = output.get("attention_mask")
    if mask is not None and bool((mask != 0).all()):
        del output["attention_mask"]  # an all-ones mask carries no information, and hides the packing
    labels = output.get("labels")
    if labels is not None and labels.shape == position_ids.shape:
        labels[position_ids == 0] = -100
    if not instance.return_position_ids:
        acted(SPEC.id, "padding-free batches given position_ids")
        _say_once_what_trl_warns_about()
    return output


_SAID = set()


def _say_once_what_trl_warns_about() -> None:
    """TRL warns that padding-free batches without flash attention cross-contaminate: say once that
    here they do not (the warning stays: it is TRL's; this line is ours)."""
    warn_once(_SAID, "trl", _say_it)


def _say_it() -> None:
    from .. import _manager

    # read once, when the line is emitted: status() reads package metadata, too slow for every batch
    isolating = _manager.status()["packing_block_mask"].active
    log.warning(
        "trl_padding_free_position_ids: padding-free batches now carry per-example position_ids%s, so the "
        "cross-contamination TRL's padding-free warning describes for non-flash attention does not happen here",
        " and packing_block_mask isolates the examples under eager/sdpa" if isolating else
        " (packing_block_mask is not active: under eager/sdpa the examples still attend to each other)",
    )


def install(patcher, options) -> None:
    module = sys.modules["trl.trainer.sft_trainer"]
    from ..spec import TargetMissing

    cls = getattr(module, "DataCollatorForLanguageModeling", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise TargetMissing("trl.trainer.sft_trainer.DataCollatorForLanguageModeling is missing or not a dataclass")
    fields = {f.name for f in dataclasses.fields(cls)}
    if not {"padding_free", "return_position_ids"} <= fields:
        raise TargetMissing("DataCollatorForLanguageModeling has no padding_free/return_position_ids fields")
    patcher.wrap(cls, "torch_call", _torch_call)


# ---------------------------------------------------------------------------
# Reproduction


def collator_for(attn: str = "sdpa"):
    """The padding-free collator SFTTrainer(packing=True) builds for ``attn`` on the installed TRL."""
    try:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    except ImportError:
        raise ProbeUnsupported("this TRL has no padding-free DataCollatorForLanguageModeling (added in 0.19)") from None
    fields = {f.name for f in dataclasses.fields(DataCollatorForLanguageModeling)}
    if "padding_free" not in fields:
        raise ProbeUnsupported("this TRL's DataCollatorForLanguageModeling has no padding_free")
    kwargs = {"pad_token_id": 0, "padding_free": True}
    if "return_position_ids" in fields:  # TRL 0.19–0.23.0: SFTTrainer passes attn == flash_attention_2
        kwargs["return_position_ids"] = attn.startswith("flash_attention")
    return DataCollatorForLanguageModeling(**kwargs)


def packed_examples(examples, seq_length: int = 32):
    """``examples`` packed by the installed TRL's own isolating strategy (ffd/bfd) into rows of ``seq_length``."""
    import inspect

    import datasets
    from trl.data_utils import pack_dataset

    dataset = datasets.Dataset.from_list([{"input_ids": e.tolist()} for e in examples])
    params = inspect.signature(pack_dataset).parameters
    if "strategy" not in params:
        raise ProbeUnsupported("this TRL's pack_dataset has no isolating strategy")
    strategy = params["strategy"].default  # "ffd" on 0.19, "bfd" from 0.20: the isolating default
    if strategy not in ("ffd", "bfd"):
        raise ProbeUnsupported(f"this TRL's default packing strategy is {strategy!r}")
    return list(pack_dataset(dataset, seq_length, strategy=strategy))


def probe(attn: str = "sdpa", packed: bool = True) -> Observation:
    """Collate two examples (5 and 7 tokens) the way SFTTrainer does for ``attn``:
    does the batch keep the example boundary (per-example position_ids, no target across it)?

    packed: True feeds one row packed by TRL's ffd/bfd ``pack_dataset``
    (``SFTTrainer(packing=True)``); False feeds the two examples unpacked
    (``padding_free=True`` without packing).
    """
    from . import _packing

    collator = collator_for(attn)
    examples = _packing.example_pair()
    features = packed_examples(examples) if packed else [{"input_ids": e.tolist()} for e in examples]
    batch = collator(features)
    ids = batch["input_ids"][0]
    # where the examples start inside the collated row (ffd/bfd may reorder them)
    starts = sorted(_find(ids, e) for e in examples)
    pos = batch.get("position_ids")
    problems = []
    if pos is None:
        problems.append("no position_ids")
    else:
        restarts = (pos[0] == 0).nonzero().flatten().tolist()
        if restarts[: len(starts)] != starts:
            problems.append(f"position_ids restart at {restarts}, examples start at {starts}")
    labels = batch["labels"][0]
    crossing = [s for s in starts[1:] if int(labels[s]) != -100]
    if crossing:
        problems.append(f"labels target the first token of an example at {crossing}")
    mask = batch.get("attention_mask")
    if pos is None and mask is not None and bool((mask != 0).all()):
        problems.append("an all-ones attention_mask")
    if problems:
        return Observation(True, "example boundary lost in the collated batch: " + "; ".join(problems))
    return Observation(False, f"per-example position_ids restart at {starts}, no target across the boundary")


def _find(row, example) -> int:
    n = len(example)
    for start in range(len(row) - n + 1):
        if bool((row[start : start + n] == example).all()):
            return start
    raise AssertionError("example not found in the collated row")
