"""Packed examples attend to each other under eager/sdpa attention: give them a block-causal mask.

Why: a packed row holds several examples; their ``position_ids`` restart at 0
where each example begins. Under eager and sdpa attention transformers only
keeps the examples apart when it builds a block mask itself, which it does
only from 4.53.1 (``find_packed_sequence_indices``, PR #39194), and only when
no 2D ``attention_mask`` is passed *and* no cache exists. So the examples
silently attend to each other (measured logit difference 0.41 on a tiny
Llama; the loss is trained on contaminated context):

* on every version below 4.53.1 (no detection for eager/sdpa at all);
* when an all-ones 2D mask is passed beside packed position ids (TRL 0.19–0.23.0
  with non-flash attention, many custom collators): detection is disabled on
  4.53.1–5.24 (PR #46634, closed unmerged);
* when the model's default ``use_cache=True`` creates a cache: plain ``Trainer``
  + ``DataCollatorWithFlattening`` on 4.53.1–4.57 (5.x ``Trainer`` sets
  ``config.use_cache = False``; direct calls on 5.24 are still affected).

The fix: wrap the decoder base model's ``forward`` (``LlamaModel.forward`` and
the other families in ``_packing.FAMILIES``). When the attention is eager or
sdpa, ``position_ids`` restart at 0 between real tokens, no 4D mask and no
cache were passed, replace the mask by an additive (0 / ``finfo(dtype).min``)
4D block-causal mask in the model's dtype that keeps the 2D padding, and call
with ``use_cache=False``. Versions whose mask code would not take that mask
as-is get a pass-through wrapper on it, active only for this mask object:
``_prepare_4d_causal_attention_mask(_for_sdpa)`` (4.37–4.41; it wants the
binary form, and its sdpa variant crashes on any 4D mask in 4.40–4.41) and
``_update_causal_mask`` on 4.38–4.40 (llama/gemma 4.38 and gemma/cohere
4.39–4.40 ignore a 4D mask; llama 4.39–4.40 reads it as binary).

Applies to transformers >=4.37 (unfixed upstream). Below 4.37 transformers
accepts no custom 4D mask, so the bug cannot be fixed from outside: the shim
reports "not needed" there and the doctor carries an advisory instead.
Fallbacks: families not listed, flash/flex attention, sliding-window models
whose example is longer than the window, explicit caches (generation) and
left-padded batches are left alone; a family whose class or parameters are
missing is skipped (recorded in the shim's notes).
"""

from __future__ import annotations

import logging

from .._util import acted, compiling, warn_once
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

log = logging.getLogger("ftshims")
_WARNED = set()  # model classes told once that a packed batch was left alone

SPEC = ShimSpec(
    id="packing_block_mask",
    since="0.1.0",
    title="Packed examples attend to each other under eager/sdpa attention",
    symptom="packing with per-example position_ids trains on contaminated context: logits of a packed example differ "
    "from the example run alone (all-ones mask, default use_cache, or transformers <4.53.1)",
    why='Under eager and sdpa attention packed examples stay apart only when transformers builds a block mask itself (4.53.1+, no 2D mask, no cache); otherwise they attend to each other. The shim builds the block mask from the packed position_ids.',
    requires={"transformers": ">=4.37"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/pull/39194",
        "https://github.com/huggingface/transformers/pull/46634",
        "https://github.com/huggingface/transformers/issues/29525",
    ),
    targets=(
        Target("transformers.models.llama.modeling_llama", "LlamaModel.forward", params=("attention_mask", "position_ids")),
        Target("transformers.models.llama.modeling_llama", "LlamaModel._update_causal_mask", when=">=4.38,<4.41"),
        Target("transformers.models.llama.modeling_llama", "_prepare_4d_causal_attention_mask", when=">=4.37,<4.38"),
    ),
    modules=("transformers",),
)


def _forward(wrapped, instance, call, family):
    config = instance.config
    if getattr(config, "_attn_implementation", None) not in _packing.EAGER_LIKE:
        return wrapped(**call)
    position_ids = call.get("position_ids")
    mask = call.get("attention_mask")
    if position_ids is None or (mask is not None and getattr(mask, "ndim", None) != 2):
        return wrapped(**call)  # nothing to detect, or a 4D mask the caller built
    if call.get(_packing.cache_key(call)) is not None:
        return wrapped(**call)  # an explicit cache: generation, not packing
    window = _packing.window_of(config)
    if compiling():
        # No look at the values inside a trace: the block mask is built from position_ids
        # whatever they hold (one example per row gives the plain causal mask with padding),
        # as transformers' own packed-sequence detection does when tracing. Sliding windows
        # (a length check) and the mask code of 4.37-4.43 (see _packing.traces_4d_mask) need
        # Python-side decisions: those models are left as they are under compile.
        if window is not None or not family.traces_4d:
            return wrapped(**call)
        segment_ids, real = _packing.segments(position_ids, mask, always=True)
        allowed = _packing.allowed_pairs(segment_ids, real)
        call["attention_mask"] = _packing.to_form(allowed, _packing.ADDITIVE, _packing.embed_dtype(instance, call))
        call["use_cache"] = False
        return wrapped(**call)
    found = _packing.segments(position_ids, mask)
    if found is None:
        return wrapped(**call)
    segment_ids, real = found
    if window is not None and max(_packing.segment_lengths(segment_ids, real)) > window:
        name = type(instance).__name__
        warn_once(_WARNED, name, lambda: log.warning(
            "packing_block_mask left a packed batch of %s alone: an example is longer than the "
            "sliding window (%d), which one 4D mask cannot express", name, window,
        ))
        return wrapped(**call)
    allowed = _packing.allowed_pairs(segment_ids, real)
    block = _packing.to_form(allowed, _packing.ADDITIVE, _packing.embed_dtype(instance, call))
    call["attention_mask"] = block
    call["use_cache"] = False
    acted(SPEC.id, "block masks built")
    with _packing.handing_down(block):
        return wrapped(**call)


def install(patcher, options) -> None:
    for model_type in _packing.FAMILIES:
        _packing.install_family(patcher, model_type, _forward)


# ---------------------------------------------------------------------------
# Reproduction


def probe(attn: str = "sdpa", mask: str = "ones", use_cache=None, family: str = "llama", path: str = "model") -> Observation:
    """Two examples (5 and 7 tokens) packed in one row with per-example position_ids, train() mode:
    do the packed logits equal each example run alone?

    mask: ``"ones"`` (all-ones 2D mask: the adversarial case), ``"none"`` (no
    mask), ``"padded"`` (all-ones packed row plus a second, right-padded row).
    use_cache: passed to the call when not None (None = the model's default).
    path: ``"model"`` (a direct call) or ``"trainer"`` (``Trainer`` +
    ``DataCollatorWithFlattening``: the real dataloader and ``compute_loss``).
    """
    if not _packing.family_available(family):
        raise ProbeUnsupported(f"this transformers has no {family} model")
    if attn == "sdpa" and _packing.transformers_version().release[:2] < (4, 36):
        raise ProbeUnsupported("no sdpa attention before transformers 4.36")
    from .. import tiny

    with tiny.quiet():
        model = _packing.tiny_decoder(family, attn)
        examples = _packing.example_pair()
        if path == "trainer":
            gap = trainer_flattening_gap(model, examples)
        elif path == "model":
            batch = _packing.packed_batch(examples, mask="none" if mask == "none" else "ones", pad_row=mask == "padded")
            call = {} if use_cache is None else {"use_cache": use_cache}
            gap = _packing.segment_logit_gap(model, examples, batch, **call)
        else:
            raise ValueError(f"path must be 'model' or 'trainer', not {path!r}")
    if gap > 1e-4:
        return Observation(True, f"packed examples attend to each other: max logit difference {gap:.3g}")
    return Observation(False, f"packed examples isolated: max logit difference {gap:.2g}")


def trainer_flattening_gap(model, examples) -> float:
    """``Trainer`` + ``DataCollatorWithFlattening``: one batch from the real train dataloader
    through ``compute_loss``; max logit difference to each collated example run alone."""
    import tempfile

    import torch

    try:
        from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments
    except ImportError:
        raise ProbeUnsupported("this transformers has no DataCollatorWithFlattening (added in 4.44)") from None
    import datasets

    dataset = datasets.Dataset.from_list([{"input_ids": e.tolist()} for e in examples])
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=len(examples), report_to=[], save_strategy="no", logging_strategy="no"
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=DataCollatorWithFlattening())
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        with torch.no_grad():
            _, outputs = trainer.compute_loss(model, batch, return_outputs=True)
    return collated_gap(model, batch, outputs["logits"])


def collated_gap(model, batch, logits) -> float:
    """Max |logits - each collated example run alone| for a flattened batch (one row, position_ids)."""
    import torch

    ids, pos = batch["input_ids"][0], batch["position_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
    gap = 0.0
    with torch.no_grad():
        for begin, end in zip(starts[:-1], starts[1:]):
            alone = model(input_ids=ids[begin:end][None], use_cache=False).logits[0]
            gap = max(gap, (logits[0, begin:end] - alone).abs().max().item())
    return gap
