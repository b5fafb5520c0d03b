"""PEFT prompt tuning, p-tuning and prefix tuning mix padding-free packed examples (and drop the soft prompt).

Why: a padding-free batch (``DataCollatorWithFlattening``, TRL ``padding_free``/BFD packing) holds several examples
in one row; its per-example ``position_ids`` (restarting at 0) are the only record of where each example begins. A
PEFT prompt-learning model loses that record before the base model runs:

* prompt tuning and p-tuning (``PeftModelForCausalLM.forward``) drop ``position_ids`` ("Position ids are not
  supported ...") and prepend the virtual tokens to the row once: the examples attend to each other, count their
  positions from the row start, and only the first one follows the soft prompt;
* prefix tuning passes the prefix as ``past_key_values`` (offsetting ``position_ids`` by the number of virtual tokens
  from peft 0.19; dropping them before): transformers detects packed rows only without a cache, so no block mask is
  built and the examples attend to each other.

ftshims' packing shims cannot see it either (the positions are gone, or a cache is there). On a tiny Llama with 4
trained-looking virtual tokens the second of two packed examples differs from the same example alone by 0.24 (prompt
tuning), 0.22 (p-tuning) and 0.25 (prefix tuning) in its logits, on transformers 4.57.6, 5.16.1 and 5.25.0, sdpa and
eager, peft 0.20.0 and 0.21.2; LoRA is exact.

The fix: wrap ``PeftModelForCausalLM.forward``. When the active adapter is prompt tuning, p-tuning or prefix tuning,
the call's ``position_ids`` restart at 0 between real tokens (a packed row: ``_packing.segments``), the base model's
attention is eager or sdpa and the caller passed no cache, a forward pre-hook on the base model is registered for the
duration of the call. It replaces what PEFT hands the base model by what each example alone would get:

* prompt/p-tuning (``inputs_embeds`` = V virtual tokens + the row): ``position_ids`` ``[0..V-1, V + packed
  positions]`` and an additive 4D mask in which the virtual tokens attend causally to each other, and every token to
  all V virtual tokens and to the earlier tokens of its own example (the 2D padding kept);
* prefix tuning (a cache holding the V prefix entries): ``position_ids`` ``V + packed positions`` and an additive 4D
  mask ``[queries, V + length]`` in which every token sees the whole prefix and the earlier tokens of its example.

Every token of a packed example then gets the logits of that example run alone with the adapter (1.8e-7 on the tiny
Llama), whatever peft did with the position ids, and the packed loss and gradients are the sums over the examples
alone. The labels are untouched (prompt/p-tuning prepend -100 for the
virtual tokens, as before).

Applies to peft >=0.7.0 (read: the same forward in 0.7.1, 0.10.0, 0.13.2, 0.15.2-0.21.2; unfixed) with transformers
>=4.53 (a 4D additive mask is passed to every decoder unchanged by ``masking_utils``; older releases read 4D masks
family by family and are not covered). Left alone, bit-identical: LoRA and every other adapter type, rows of one
example (no restart), calls with a cache of the caller's (generation), flash attention (the bug remains there: no
mask can carry "attend to the virtual tokens" into the varlen kernel; the shim logs once), 3D position ids (mRoPE),
inputs it cannot read (the call goes to PEFT unchanged), and calls under ``torch.compile`` tracing.

Cost: a prompt-learning forward that is given ``position_ids`` reads one value on the host (do they restart
within a row?): the decision cannot be made otherwise without acting on unpacked rows too, which would leave them
numerically different from upstream. Every other adapter reads nothing; the mask handed to the model is marked for
``custom_4d_mask_format``, which lets it through without reading it.
"""

from __future__ import annotations

import logging

from .._util import acted, compiling, warn_once
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

log = logging.getLogger("ftshims")
_WARNED = set()

# peft.PeftType values whose forward prepends virtual tokens (embeddings) or a prefix (cache).
EMBEDDING_TYPES = ("PROMPT_TUNING", "P_TUNING")
PREFIX_TYPES = ("PREFIX_TUNING",)

SPEC = ShimSpec(
    id="peft_prompt_learning_packing",
    since="0.3.0",
    title="PEFT prompt/p/prefix tuning with padding-free packing: packed examples attend to each other",
    symptom="prompt tuning, p-tuning or prefix tuning with a padding-free packed batch (DataCollatorWithFlattening, "
    "TRL padding_free / BFD packing): each packed example attends to the ones before it and (prompt/p-tuning) only "
    "the first follows the soft prompt; logits of the 2nd example differ from it alone by 0.09-0.12 on a tiny Llama",
    why="PEFT drops the packed position_ids for prompt/p-tuning and passes a prefix cache for prefix tuning, so neither "
    "transformers' packed-sequence mask nor ftshims' packing shims ever see the example boundaries. The shim gives the "
    "base model each example's positions and a block mask that lets every example see the virtual tokens.",
    requires={"peft": ">=0.7.0", "transformers": ">=4.53"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/peft/pull/3336",
        "https://github.com/huggingface/peft/issues/54",
        "https://github.com/huggingface/transformers/pull/39194",
    ),
    targets=(
        Target("peft.peft_model", "PeftModelForCausalLM.forward",
               params=("input_ids", "attention_mask", "inputs_embeds", "labels")),
    ),
    modules=("peft.peft_model",),
)


def _peft_type(config) -> str:
    kind = getattr(config, "peft_type", None)
    return str(getattr(kind, "value", kind) or "").upper()


def _packed_call(instance, kwargs):
    """``(kind, virtual, position_ids, segment_ids, real)`` for a call to fix, else None (or a reason string)."""
    import torch

    config = instance.active_peft_config
    kind = _peft_type(config)
    if kind not in EMBEDDING_TYPES + PREFIX_TYPES or not getattr(config, "is_prompt_learning", False):
        return None
    position_ids = kwargs.get("position_ids")
    if not torch.is_tensor(position_ids) or position_ids.ndim != 2:
        return None
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return None  # the caller's cache: generation, not a packed training row
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    mask = kwargs.get("attention_mask")
    if not torch.is_tensor(tokens) or tokens.ndim < 2 or position_ids.shape[-1] != tokens.shape[1]:
        return None
    if position_ids.shape[0] not in (1, tokens.shape[0]):
        return None
    if mask is not None and (not torch.is_tensor(mask) or mask.shape != tokens.shape[:2]):
        return None
    found = _packing.segments(position_ids.expand(tokens.shape[0], -1), mask)
    if found is None:
        return None
    attn = getattr(getattr(instance.get_base_model(), "config", None), "_attn_implementation", None)
    if attn not in _packing.EAGER_LIKE:
        return f"its attention is {attn}, into which no mask can carry the virtual tokens"
    virtual = int(getattr(config, "num_virtual_tokens", 0) or 0)  # what PEFT prepends to a causal LM's row
    if virtual <= 0:
        return None
    return kind, virtual, position_ids.expand(tokens.shape[0], -1), found[0], found[1]


def prompt_mask(segment_ids, real, virtual: int, prefix_only: bool):
    """Bool "may attend" ``[batch, 1, queries, virtual + length]``: every token sees the virtual tokens and the
    earlier tokens of its own example; with ``prefix_only=False`` the virtual tokens are queries too (prompt and
    p-tuning: they attend causally to each other)."""
    import torch

    batch, length = segment_ids.shape
    device = segment_ids.device
    rows = _packing.allowed_pairs(segment_ids, real)  # [batch, 1, length, length]
    to_virtual = torch.ones(batch, 1, length, virtual, dtype=torch.bool, device=device)
    tokens = torch.cat([to_virtual, rows], dim=-1)
    if prefix_only:
        return tokens
    idx = torch.arange(virtual, device=device)
    among = (idx[None, :] <= idx[:, None])[None, None].expand(batch, 1, virtual, virtual)
    to_tokens = torch.zeros(batch, 1, virtual, length, dtype=torch.bool, device=device)
    return torch.cat([torch.cat([among, to_tokens], dim=-1), tokens], dim=2)


def _packed_inputs(instance, kind, virtual, position_ids, segment_ids, real, kwargs):
    """``(position_ids, additive 4D mask)`` the base model gets in place of what PEFT hands it."""
    import torch

    embeds = kwargs.get("inputs_embeds")
    dtype = embeds.dtype if torch.is_tensor(embeds) else instance.get_base_model().get_input_embeddings().weight.dtype
    if kind in PREFIX_TYPES:
        positions = position_ids + virtual
    else:
        head = torch.arange(virtual, device=position_ids.device, dtype=position_ids.dtype)
        positions = torch.cat([head.expand(position_ids.shape[0], -1), position_ids + virtual], dim=-1)
    allowed = prompt_mask(segment_ids, real, virtual, prefix_only=kind in PREFIX_TYPES)
    return positions, _packing.to_form(allowed, _packing.ADDITIVE, dtype)


def _hook_for(kind, virtual, length, positions, mask):
    """A forward pre-hook on the base model that swaps in ``positions`` and ``mask`` when the call is the one PEFT
    builds for this row (prompt/p-tuning: ``inputs_embeds`` of virtual + length; prefix: a cache of the prefix)."""
    import torch

    def pre_hook(module, args, kwargs):
        if args:
            return None  # PEFT passes everything by keyword: a call we do not know
        if kind in PREFIX_TYPES:
            if kwargs.get("past_key_values") is None:
                return None
        else:
            embeds = kwargs.get("inputs_embeds")
            if not torch.is_tensor(embeds) or embeds.shape[1] != virtual + length:
                return None
        kwargs["attention_mask"] = mask
        kwargs["position_ids"] = positions
        acted(SPEC.id, "packed prompt-learning rows given per-example masks")
        return args, kwargs

    return pre_hook


def _forward(wrapped, instance, args, kwargs):
    if args or compiling():
        return wrapped(*args, **kwargs)
    try:
        found = _packed_call(instance, kwargs)
        if found is not None and not isinstance(found, str):
            kind, virtual, position_ids, segment_ids, real = found
            positions, mask = _packed_inputs(instance, kind, virtual, position_ids, segment_ids, real, kwargs)
    except Exception as exc:  # noqa: BLE001 - a call we cannot read goes to PEFT unchanged
        log.debug("peft_prompt_learning_packing left a call alone: %s", exc)
        return wrapped(*args, **kwargs)
    if found is None:
        return wrapped(*args, **kwargs)
    if isinstance(found, str):
        name = type(instance.get_base_model()).__name__
        warn_once(_WARNED, name, lambda: log.warning(
            "peft_prompt_learning_packing left a packed prompt-learning batch of %s alone: %s", name, found))
        return wrapped(*args, **kwargs)
    handle = instance.base_model.register_forward_pre_hook(
        _hook_for(kind, virtual, position_ids.shape[-1], positions, mask), with_kwargs=True)
    try:
        # the mask is built in the form every decoder of this era reads: custom_4d_mask_format lets it through
        with _packing.handing_down(mask):
            return wrapped(*args, **kwargs)
    finally:
        handle.remove()


def install(patcher, options) -> None:
    import sys

    module = sys.modules["peft.peft_model"]
    patcher.wrap(module.PeftModelForCausalLM, "forward", _forward)


# ---------------------------------------------------------------------------
# Reproduction

METHODS = ("prompt_tuning", "p_tuning", "prefix_tuning", "lora")


def adapted(method: str, attn: str = "sdpa"):
    """A tiny Llama with a PEFT adapter of ``method`` (4 virtual tokens for the prompt-learning ones), eval mode."""
    import peft

    from .. import tiny

    virtual = dict(task_type="CAUSAL_LM", num_virtual_tokens=4)
    if method == "prompt_tuning":
        config = peft.PromptTuningConfig(**virtual)
    elif method == "p_tuning":
        config = peft.PromptEncoderConfig(encoder_hidden_size=16, **virtual)
    elif method == "prefix_tuning":
        config = peft.PrefixTuningConfig(**virtual)
    elif method == "lora":
        config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    else:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    with tiny.quiet():
        model = peft.get_peft_model(tiny.tiny_llama(attn=attn), config)
    if method != "lora":
        import torch

        with torch.no_grad():  # trained-looking virtual tokens (PEFT's init is small and random)
            for name, parameter in model.named_parameters():
                if parameter.requires_grad:
                    parameter.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def packed_gap(model, examples, mask: str = "ones", pad_row: bool = False) -> float:
    """Max |logits of each packed example - the example alone| over the real tokens (logits behind any virtual
    tokens; the packed row holds every example, a padded row the first one)."""
    import torch

    batch = _packing.packed_batch(examples, mask=mask, pad_row=pad_row)
    call = {k: v for k, v in batch.items() if k != "labels"}
    length = call["input_ids"].shape[1]
    with torch.no_grad():
        logits = model(**call, use_cache=False).logits[:, -length:].float()
        alone = [model(input_ids=e[None], use_cache=False).logits[0, -len(e):].float() for e in examples]
    reference = torch.cat(alone)
    gap = 0.0
    for row in range(logits.shape[0]):
        n = int(call["attention_mask"][row].sum()) if "attention_mask" in call else length
        gap = max(gap, (logits[row, :n] - reference[:n]).abs().max().item())
    return gap


def probe(method: str = "prompt_tuning", attn: str = "sdpa", mask: str = "ones", pad_row: bool = False) -> Observation:
    """Two examples (5 and 7 tokens) packed in one row with per-example position_ids, through a PEFT adapter:
    do the packed logits equal each example run alone through the same adapter?"""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ProbeUnsupported("peft is not installed") from None
    if _packing.transformers_version().release[:2] < _packing.MASK_LAYER_SINCE:
        raise ProbeUnsupported("transformers < 4.53: the shim's range starts at the masking_utils era")
    model = adapted(method, attn)
    gap = packed_gap(model, _packing.example_pair(), mask=mask, pad_row=pad_row)
    if gap > 1e-4:
        return Observation(True, f"{method} ({attn}): packed examples mix: max logit difference {gap:.3g}")
    return Observation(False, f"{method} ({attn}): packed examples isolated: max logit difference {gap:.2g}")
