"""Packed examples attend to each other under eager/sdpa attention: keep them apart where the masks are built.

Why: a packed row holds several examples; their ``position_ids`` restart at 0
where each example begins. Under eager, sdpa (and flex) attention transformers only
keeps the examples apart when it builds a packed-sequence mask itself, which it does
only from 4.53.1 (``find_packed_sequence_indices``, PR #39194), and only when
no 2D ``attention_mask`` is passed *and* no cache exists. So the examples
silently attend to each other (measured logit difference 0.41 on a tiny
Llama, 0.03-1.6 across the families of ``_packing.TINY_CONFIGS``; the loss is
trained on contaminated context):

* on every version below 4.53.1 (no detection for eager/sdpa at all);
* when an all-ones 2D mask is passed beside packed position ids (TRL 0.19–0.23.0
  with non-flash attention, LLaMA-Factory ``packing``, many custom collators):
  detection is disabled on 4.53.1–5.24 (PR #46634, closed unmerged);
* when the model's default ``use_cache=True`` creates a cache: plain ``Trainer``
  + ``DataCollatorWithFlattening`` on 4.53.1–4.57 (5.x ``Trainer`` sets
  ``config.use_cache = False``; direct calls on 5.24 are still affected);
* where a base model does not hand its position ids to the mask builders at all
  (GPT-OSS 4.56–5.24, Granite-4 hybrid 5.x), even with no mask and no cache;
* for chunked attention (Llama 4) before 5.24, even with no mask and no cache:
  chunks were counted from the row start, not from each example's start.

The fix, 4.53+ (the mask layer): wrap ``masking_utils._preprocess_mask_arguments``,
which every causal, sliding-window and chunked mask builder calls first. When
upstream found no packed rows, the attention takes a mask function (eager, sdpa,
flex), the queries are the whole sequence (no past in the cache) and the
``position_ids`` restart at 0 between real tokens, it returns the segment ids as
upstream's own ``packed_sequence_mask``; upstream's builders then make every
layer type's mask (full, sliding, chunked) per example, with the 2D padding, as
they do with no mask and no cache. Before 5.24 the chunked mask function is also
remapped by the position ids (as 5.24 does). Base models in
``_packing.POSITIONS_NOT_PASSED`` hand their packed position ids to the builders
they call. Families whose base model still builds its own mask in these releases
(Qwen2-MoE 4.53–4.57) keep the per-family route below.

The fix, 4.37–4.52 (no shared mask builder): wrap the decoder base model's
``forward`` (``LlamaModel.forward`` and the other families in ``_packing.FAMILIES``).
When the attention is eager or sdpa, ``position_ids`` restart at 0 between real
tokens, no 4D mask and no cache were passed, replace the mask by an additive
(0 / ``finfo(dtype).min``) 4D block-causal mask in the model's dtype that keeps
the 2D padding, and call with ``use_cache=False``. Versions whose mask code would
not take that mask as-is get a pass-through wrapper on it, active only for this
mask object: ``_prepare_4d_causal_attention_mask(_for_sdpa)`` (4.37–4.41; it wants
the binary form, and its sdpa variant crashes on any 4D mask in 4.40–4.41) and
``_update_causal_mask`` on 4.38–4.40 (llama/gemma 4.38 and gemma/cohere
4.39–4.40 ignore a 4D mask; llama 4.39–4.40 reads it as binary).

Applies to transformers >=4.37 (unfixed upstream). Below 4.37 transformers
accepts no custom 4D mask, so the bug cannot be fixed from outside: the shim
reports "not needed" there and the doctor carries an advisory instead.
Left alone: unpacked rows (a left-padded generation batch included), flash
attention (flash_attn_packing), caches holding a past (generation), 4D masks;
on 4.37–4.52 also families not listed and sliding-window models whose example
is longer than the window (one 4D mask cannot express it; said once in the log).
Under ``torch.compile`` nothing data-dependent can be decided: the mask layer
then acts beside a 2D mask only (upstream materialises that mask in a trace anyway,
so an unpacked row gets the same mask), with no cache or an empty one outside
``no_grad``. One difference remains there: 5.24's builders remap a packed row's mask by
its position ids, so in a compiled, left-padded batch whose position ids restart after
the padding (generate()'s style) the padding queries see other keys; every real
token's output stays bit-identical. Recurrent layers of hybrid models are packing_recurrent_state's.
"""

from __future__ import annotations

import contextvars
import logging
from typing import NamedTuple

from .._util import acted, compiling, method_binder, warn_once
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

log = logging.getLogger("ftshims")
_WARNED = set()  # model classes told once that a packed batch was left alone

SPEC = ShimSpec(
    id="packing_block_mask",
    since="0.2.0",
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
        Target("transformers.masking_utils", "_preprocess_mask_arguments", params=("attention_mask", "position_ids"),
               when=">=4.53"),
        Target("transformers.models.llama.modeling_llama", "LlamaModel.forward", params=("attention_mask", "position_ids"),
               when="<4.53"),
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


# ---------------------------------------------------------------------------
# 4.53+: the mask layer (transformers.masking_utils)

# The position ids a packed chunked-attention mask is remapped by, handed from _preprocess_mask_arguments to the
# chunked_causal_mask_function it is followed by inside create_chunked_causal_mask (4.53-5.23; eager only).
_CHUNK_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("ftshims_packed_chunk_positions", default=None)
# The packed position ids of a base model that does not hand its position_ids to the mask builders
# (_packing.POSITIONS_NOT_PASSED), set while its forward runs (eager only).
_HANDED_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("ftshims_packed_positions", default=None)


def _mask_layer(patcher, module) -> None:
    """Wrap ``masking_utils._preprocess_mask_arguments`` (every causal, sliding-window and chunked mask builder
    calls it first), and on releases without ``remap_positions_for_packed_sequence`` (<5.24) the chunked mask
    function, so that a chunk starts where each packed example starts."""
    import inspect

    from ..spec import TargetMissing

    original = vars(module).get("_preprocess_mask_arguments")
    if not callable(original):
        raise TargetMissing("transformers.masking_utils._preprocess_mask_arguments not found")
    names = tuple(inspect.signature(original).parameters)
    embeds = next((n for n in ("inputs_embeds", "input_embeds") if n in names), None)
    cache = next((n for n in ("cache", "past_key_values") if n in names), None)
    if embeds is None or cache is None or not {"config", "attention_mask", "position_ids"} <= set(names):
        raise TargetMissing(f"transformers.masking_utils._preprocess_mask_arguments{tuple(names)} changed")
    # 4.53-4.57 return (early_exit, mask, packed, kv_length, kv_offset); 5.x insert q_length and q_offset
    layout = _Layout(embeds, cache, "cache_position" in names)
    remaps = callable(vars(module).get("remap_positions_for_packed_sequence"))

    def preprocess(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if result[0]:
            return result  # a 4D mask given, or an attention that needs none
        call = dict(zip(names, args))
        call.update(kwargs)
        packed = result[2]
        if packed is None:
            packed = _packed_sequence_mask(call, result, layout)
            if packed is not None:
                result = result[:2] + (packed,) + result[3:]
                acted(SPEC.id, "block masks built")
        if not remaps and not compiling():
            _CHUNK_POSITIONS.set(_rows(call.get("position_ids"), packed) if packed is not None else None)
        return result

    patcher.wrap(module, "_preprocess_mask_arguments", preprocess)
    chunked = vars(module).get("chunked_causal_mask_function")
    if not remaps and callable(chunked):
        patcher.wrap(module, "chunked_causal_mask_function", _chunked_by_position)


class _Layout(NamedTuple):
    embeds: str
    cache: str
    short: bool  # the 4.53-4.57 five-tuple (no q_length/q_offset)


# Decoders whose masks come from masking_utils but whose attention is not only what the mask says, so that a
# per-example mask does not isolate the examples and made the zoo gate's packed gap larger (stays out; the doctor's
# packing finding still names packing on them): BLT's byte patches (its local and global transformers see patch
# positions, not the packed examples' tokens; 5.24: gap 4.2 -> 5.63) and Doge's dynamic-mask attention (4.57:
# 0.229 -> 0.475). Matched on the model type's first word (blt_local_encoder, blt_global_transformer ...).
NOT_BY_THE_MASK_LAYER = ("blt", "doge")


def _packed_sequence_mask(call, result, layout):
    """Segment ids ``[batch, length]`` for masking_utils' packed-sequence mask function, or None to leave the
    mask as upstream builds it.

    Upstream detects packed rows only with no 2D mask and no cache. This does it with a 2D mask and/or an
    empty cache too, when the queries are the whole sequence (no past: kv_length == q_length, no offsets), the
    attention takes a mask function, and the position ids restart between real tokens (padding next to a
    restart is not packing: a left-padded generation batch stays as it is). Under ``torch.compile`` no value
    can be read: it then acts only beside a 2D mask (upstream materialises that mask in a trace anyway, so a
    row of one example gets the same mask; on 5.24 the padding queries of a generate()-style left-padded row
    excepted, see the module docstring), with no cache or an empty one outside no_grad (training).
    """
    import torch

    config = call.get("config")
    if getattr(config, "_attn_implementation", None) not in _packing.MASK_FUNCTION_ATTNS:
        return None
    if str(getattr(config, "model_type", "")).split("_", 1)[0] in NOT_BY_THE_MASK_LAYER:
        return None
    embeds = call.get(layout.embeds)
    position_ids = call.get("position_ids")
    if not torch.is_tensor(embeds) or not torch.is_tensor(position_ids) or position_ids.ndim != 2:
        return None
    batch, length = embeds.shape[0], embeds.shape[1]
    if position_ids.shape[-1] != length or position_ids.shape[0] not in (1, batch):
        return None
    mask = result[1]
    if mask is not None and (not torch.is_tensor(mask) or mask.ndim != 2 or mask.shape != (batch, length)):
        return None
    if layout.short:
        kv_length, kv_offset, q_offset = result[3], result[4], 0
    else:
        kv_length, kv_offset, q_offset = result[4], result[6], result[5]
    for offset in (kv_offset, q_offset):
        if torch.is_tensor(offset):
            if compiling() or int(offset) != 0:
                return None
        elif offset != 0:
            return None
    if not isinstance(kv_length, int) or kv_length != length:
        return None  # a past in the cache, or a static cache longer than the queries
    cache = call.get(layout.cache)
    position_ids = position_ids.expand(batch, -1)
    if compiling():
        if mask is None or (cache is not None and not torch.is_grad_enabled()):
            return None
        return _packing.segments(position_ids, mask, always=True)[0]
    found = _packing.segments(position_ids, mask)
    return None if found is None else found[0]


def _rows(position_ids, packed):
    return None if position_ids is None else position_ids.expand(packed.shape[0], -1)


def _chunked_by_position(wrapped, instance, args, kwargs):
    """``chunked_causal_mask_function`` whose chunks start where each packed example starts (<5.24 counts
    chunks from the row start; 5.24 remaps every mask function of a packed row by its position ids)."""
    function = wrapped(*args, **kwargs)
    if compiling():
        return function
    positions = _CHUNK_POSITIONS.get()
    _CHUNK_POSITIONS.set(None)
    if positions is None:
        return function

    def by_position(batch_idx, head_idx, q_idx, kv_idx):
        return function(batch_idx, head_idx, positions[batch_idx, q_idx], positions[batch_idx, kv_idx])

    return by_position


def _handing_down_positions(patcher, module, class_name):
    """For a base model that builds its masks without handing them its position_ids: while its forward
    runs on a packed batch (eager), hand them to the mask builders it calls (the names in its module)."""
    from ..spec import TargetMissing

    builders = [name for name in _packing.MASK_BUILDERS if callable(vars(module).get(name))]
    if not builders:
        return  # its masks do not come from masking_utils in this release (4.x hybrids): nothing to hand down to
    cls = vars(module).get(class_name)
    if cls is None:
        raise TargetMissing(f"{module.__name__}.{class_name} not found")
    bind = method_binder(cls.forward)

    def forward(wrapped, instance, args, kwargs):
        if compiling() or getattr(instance.config, "_attn_implementation", None) not in _packing.MASK_FUNCTION_ATTNS:
            return wrapped(*args, **kwargs)
        call = bind(args, kwargs) or {}
        position_ids, mask = call.get("position_ids"), call.get("attention_mask")
        if mask is not None and getattr(mask, "ndim", None) != 2:
            return wrapped(*args, **kwargs)
        if _packing.segments(position_ids, mask) is None:
            return wrapped(*args, **kwargs)
        token = _HANDED_POSITIONS.set(position_ids)
        try:
            return wrapped(*args, **kwargs)
        finally:
            _HANDED_POSITIONS.reset(token)

    def builder_for(function):
        # position_ids is the 6th parameter on 4.53-5.x (after cache_position) and the 5th once cache_position is
        # gone: a call passing that many arguments positionally already gives it (5.1's Granite-4 hybrid passes
        # five positionally, cache_position included), so the slot is read from the builder's own signature.
        slot = _parameter_slot(function, "position_ids")
        if slot is None:
            raise TargetMissing(f"{module.__name__}.{function.__name__} takes no position_ids")

        def builder(wrapped, instance, args, kwargs):
            handed = _HANDED_POSITIONS.get() if not compiling() else None
            if handed is not None and len(args) <= slot and kwargs.get("position_ids") is None:
                kwargs = dict(kwargs, position_ids=handed)
            return wrapped(*args, **kwargs)

        return builder

    wrappers = {name: builder_for(vars(module)[name]) for name in builders}
    patcher.wrap(cls, "forward", forward)
    for name, builder in wrappers.items():
        patcher.wrap(module, name, builder)


def _parameter_slot(function, name):
    """The 0-based position of parameter ``name`` in ``function``'s signature, or None where it has none."""
    import inspect

    names = list(inspect.signature(function).parameters)
    return names.index(name) if name in names else None


def _outside_mask_layer(cls) -> bool:
    """A family whose base model still builds its own mask (Qwen2-MoE on 4.53-4.57): the family route."""
    return _packing.mask_helper(cls) != "create_causal_mask"


def install(patcher, options) -> None:
    era = _packing.mask_layer_era()
    for model_type in _packing.FAMILIES:
        _packing.install_family(patcher, model_type, _forward, wanted=_outside_mask_layer if era else None)
    if not era:
        return
    patcher.when_imported("transformers.masking_utils", lambda module: _mask_layer(patcher, module))
    for module_name, class_name in _packing.POSITIONS_NOT_PASSED.values():
        patcher.when_imported(module_name, lambda module, name=class_name: _handing_down_positions(patcher, module, name))


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
