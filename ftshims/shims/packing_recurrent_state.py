"""Packed examples leak into each other through the recurrent state of hybrid models' linear-attention and Mamba layers.

Why: a hybrid decoder (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid: gated delta
rule; Bamba, Granite-4 hybrid, Falcon-H1, Nemotron-H, Zamba2, Jamba: Mamba/Mamba2;
LFM2: short convolutions) runs its recurrent layers along the whole row. An
attention mask cannot stop them: the convolution reaches the last tokens of the
previous example and the recurrent state carries everything before it. So a
packed example's logits differ from the example run alone even when the
attention layers keep the examples apart (tiny Qwen3.5 with no mask and
``use_cache=False`` on 5.24: max logit difference 0.03, where transformers' own
packed-sequence mask already isolates the attention layers).

What upstream does: the layers pass example boundaries on to the optimised
kernels when the *caller* hands them over: ``cu_seq_lens_q`` becomes the
``cu_seqlens`` of flash-linear-attention's ``chunk_gated_delta_rule`` and
``seq_idx`` goes to causal-conv1d / mamba-ssm (5.24: ``Qwen3_5GatedDeltaNet.forward``,
``BambaMixer.forward``; ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
return_seq_idx=True)`` produces both). The PyTorch fallbacks cannot use them:
5.24 raises ``ValueError`` ("can't keep packed sequences apart without
flash-linear-attention", ``integrations/hub_kernels.py``) when they are given,
and with position ids alone (TRL's ``bfd``/padding-free up to 1.9, DataCollatorWithFlattening's
default) every path leaks silently. (TRL 1.16's padding-free collator adds ``cu_seq_lens_q/k`` and ``seq_idx``:
without the kernels' packages that call raises upstream's ValueError, which this shim leaves as it is.)

The fix: wrap the hybrid's base model ``forward`` (``_packing.RECURRENT``). When its
``position_ids`` restart at 0 between real tokens (the same detection as
``packing_block_mask``), no cache was passed in and the call carries no
boundaries of its own (``seq_idx``, ``cu_seq_lens_q``), the recurrent layers run
once per packed example (each row split where its examples start; padding stays
with the example before it), with no cache, so every example starts from a zero
state and a zero-padded convolution, exactly as when it runs alone. This works
with every kernel the layer dispatches to (the same layer code runs, on shorter
inputs); it costs one layer call per example instead of one per batch. Its
attention layers are kept apart by ``packing_block_mask``.

Applies to transformers >=4.53, to the models whose attention masks come from
``masking_utils`` (where ``packing_block_mask`` keeps their attention apart:
LFM2 from 4.56, Qwen3-Next from 4.57, the others from 5.x). On 4.53-4.57 Bamba,
Jamba, Granite-4 hybrid, Zamba2 and Falcon-H1 build their own attention masks:
they are left alone (a note in the shim's status) and the doctor says no shim
covers them there. Left alone, said once in the log, or in the notes: calls that
carry upstream's own boundaries (upstream then keeps them apart with the
optimised kernels, or raises), explicit caches (generation), layers whose
output is not one tensor, and everything inside a ``torch.compile`` trace (the
segments are data-dependent): a compiled hybrid model keeps leaking, which the
doctor's packing finding says, naming the model. Recurrent models not in the
table (RecurrentGemma, xLSTM, MiniMax's lightning attention...) are not
covered either (Zamba v1: no tiny model builds from its config here to test it on).
"""

from __future__ import annotations

import contextvars
import logging

from .._util import acted, compiling, method_binder, warn_once
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

log = logging.getLogger("ftshims")
_WARNED = set()

# The first release that ships each family's recurrent layer (read in the wheels of every minor release 4.53-5.25);
# the others are in 4.53.0 already. Outside it the target does not exist and is not checked (the drift canary).
_ADDED = {"lfm2": "4.54.0", "qwen3_next": "4.57.0", "lfm2_moe": "5.0.0", "qwen3_5": "5.2.0", "qwen3_5_moe": "5.2.0",
          "olmo_hybrid": "5.3.0", "nemotron_h": "5.3.0"}

SPEC = ShimSpec(
    id="packing_recurrent_state",
    since="0.2.0",
    title="Packed examples leak through the recurrent layers of hybrid models",
    symptom="packing a hybrid model (Qwen3.5, Qwen3-Next, Bamba, Granite-4 hybrid, LFM2, ...): the linear-attention, "
    "Mamba and short-convolution layers carry state from one packed example into the next, whatever the mask",
    why="An attention mask cannot separate packed examples inside recurrent layers. Upstream passes example "
    "boundaries only to the optimised kernels, and only when the caller supplies them; the shim runs the recurrent "
    "layers once per packed example, with a fresh state.",
    requires={"transformers": ">=4.53"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/pull/39194",
        "https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/integrations/hub_kernels.py",
        "https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models/qwen3_5/modeling_qwen3_5.py",
    ),
    targets=tuple(
        Target(_packing.modeling_module(model_type), f"{layers[0]}.forward", params=("hidden_states",),
               when=f">={_ADDED.get(model_type, '4.53.0')}")
        for model_type, (base, layers) in _packing.RECURRENT.items()
    ),
    modules=("transformers",),
)

# The packed examples of the hybrid base model whose forward runs now: (batch, length, spans per row).
_SPANS: contextvars.ContextVar = contextvars.ContextVar("ftshims_packed_spans", default=None)
_CACHES = ("cache", "cache_params", "past_key_values")
_BOUNDARIES = ("seq_idx", "cu_seq_lens_q", "cu_seqlens")


def _spans(segment_ids, real):
    """Per row, the ``(start, end)`` of each packed example (padding stays with the example before it)."""
    rows = []
    for row in segment_ids.tolist():
        starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
        rows.append(list(zip(starts, starts[1:] + [len(row)])))
    return rows


def _text_positions(position_ids):
    """2D position ids, or the text row of Qwen3.5's ``(4, batch, length)`` form; else None."""
    if getattr(position_ids, "ndim", None) == 2:
        return position_ids
    if getattr(position_ids, "ndim", None) == 3 and position_ids.shape[0] == 4:
        return position_ids[0]
    return None


def _base_forward(bind):
    def forward(wrapped, instance, args, kwargs):
        if compiling():
            return wrapped(*args, **kwargs)
        call = bind(args, kwargs)
        if call is None or any(call.get(name) is not None for name in _CACHES + _BOUNDARIES):
            return wrapped(*args, **kwargs)  # generation, or boundaries the caller hands to upstream's kernels
        mask = call.get("attention_mask")
        if mask is not None and getattr(mask, "ndim", None) != 2:
            return wrapped(*args, **kwargs)
        position_ids = _text_positions(call.get("position_ids"))
        found = _packing.segments(position_ids, mask) if position_ids is not None else None
        if found is None:
            return wrapped(*args, **kwargs)
        segment_ids, _ = found
        token = _SPANS.set((segment_ids.shape[0], segment_ids.shape[1], _spans(*found)))
        try:
            return wrapped(*args, **kwargs)
        finally:
            _SPANS.reset(token)

    return forward


def _layer_forward(bind, name):
    def forward(wrapped, instance, args, kwargs):
        if compiling():
            return wrapped(*args, **kwargs)
        packed = _SPANS.get()
        call = bind(args, kwargs) if packed is not None else None
        if call is None:
            return wrapped(*args, **kwargs)
        batch, length, rows = packed
        hidden = call.get("hidden_states")
        if getattr(hidden, "shape", None) is None or tuple(hidden.shape[:2]) != (batch, length):
            return wrapped(*args, **kwargs)
        for key in _CACHES:
            if key in call:
                call[key] = None  # each example starts from a zero state; a packed row has no state to continue
        outputs = []
        for row, spans in enumerate(rows):
            parts = []
            for start, end in spans:
                part = wrapped(**_slice(call, batch, length, row, start, end))
                if not _is_tensor(part) or tuple(part.shape[:2]) != (1, end - start):
                    warn_once(_WARNED, name, lambda: log.warning(
                        "packing_recurrent_state left %s alone: its output is not one tensor per token", name))
                    return wrapped(*args, **kwargs)
                parts.append(part)
            outputs.append(parts[0] if len(parts) == 1 else _cat(parts, 1))
        acted(SPEC.id, "recurrent layers run per example")
        return outputs[0] if len(outputs) == 1 else _cat(outputs, 0)

    return forward


def _is_tensor(value) -> bool:
    import torch

    return torch.is_tensor(value)


def _cat(parts, dim):
    import torch

    return torch.cat(parts, dim=dim)


def _slice(call, batch, length, row, start, end):
    """The layer call for one example: per-token tensors cut to its span, cache positions counted from 0."""
    import torch

    sub = {}
    for key, value in call.items():
        if torch.is_tensor(value) and value.ndim >= 2 and tuple(value.shape[:2]) == (batch, length):
            value = value[row : row + 1, start:end]
        elif key == "cache_position" and torch.is_tensor(value) and value.ndim == 1:
            value = torch.arange(end - start, device=value.device, dtype=value.dtype)
        sub[key] = value
    return sub


def install(patcher, options) -> None:
    from ..patching import require_params
    from ..spec import TargetMissing

    def part(module, base_name, layer_names):
        if not callable(vars(module).get("create_causal_mask")):
            # Its attention masks are its own in this release (Bamba, Jamba, Granite-4 hybrid, Zamba2, Falcon-H1 on
            # 4.53-4.57): no shim keeps the attention apart, so splitting the recurrent layers alone proves nothing.
            raise TargetMissing(f"{module.__name__} builds its own attention masks here (no masking_utils): packed "
                                "examples leak through its attention too, which no shim isolates; left alone")
        base = vars(module).get(base_name)
        if base is None:
            raise TargetMissing(f"{module.__name__}.{base_name} not found")
        require_params(base.forward, ("position_ids",), f"{module.__name__}.{base_name}.forward")
        layers = []
        for layer_name in layer_names:
            cls = vars(module).get(layer_name)
            if cls is None:
                raise TargetMissing(f"{module.__name__}.{layer_name} not found")
            require_params(cls.forward, ("hidden_states",), f"{module.__name__}.{layer_name}.forward")
            layers.append(cls)
        patcher.wrap(base, "forward", _base_forward(method_binder(base.forward)))
        for cls in layers:
            patcher.wrap(cls, "forward", _layer_forward(method_binder(cls.forward), cls.__name__))

    for model_type, (base_name, layer_names) in _packing.RECURRENT.items():
        patcher.when_imported(
            _packing.modeling_module(model_type),
            lambda module, base_name=base_name, layer_names=layer_names: part(module, base_name, layer_names),
        )


# ---------------------------------------------------------------------------
# Reproduction


def _default_family():
    """The first hybrid of this transformers whose attention masks come from masking_utils: Qwen3.5 (5.x),
    Qwen3-Next (4.57), LFM2 (4.56)."""
    import importlib

    for family in ("qwen3_5", "qwen3_next", "lfm2"):
        if _packing.family_available(family):
            if hasattr(importlib.import_module(_packing.modeling_module(family)), "create_causal_mask"):
                return family
    raise ProbeUnsupported(f"transformers {_packing.transformers_version()} has no hybrid model whose attention "
                           "masks come from masking_utils")


def probe(family=None, mask: str = "ones", use_cache=None, attn: str = "sdpa") -> Observation:
    """Two examples (5 and 7 tokens) packed in one row of a tiny hybrid ``family`` (default: this stack's
    first of Qwen3.5, Qwen3-Next, LFM2), train() mode: do the packed logits equal each example run alone? The
    attention layers are kept apart by packing_block_mask (applied here in both runs), so what is left is
    the recurrent layers' leak."""
    import ftshims

    family = family or _default_family()
    if family not in _packing.RECURRENT:
        raise ValueError(f"family must be one of {', '.join(_packing.RECURRENT)}, not {family!r}")
    if not _packing.family_available(family):
        raise ProbeUnsupported(f"transformers {_packing.transformers_version()} has no {family} model")
    from .. import tiny

    with tiny.quiet():
        model = _packing.tiny_decoder(family, attn)
        examples = _packing.example_pair()
        batch = _packing.packed_batch(examples, mask="none" if mask == "none" else "ones", pad_row=mask == "padded")
        call = {} if use_cache is None else {"use_cache": use_cache}
        with ftshims.applied(only=["packing_block_mask"]):
            gap = _packing.segment_logit_gap(model, examples, batch, **call)
    if gap > 1e-4:
        return Observation(True, f"packed examples leak through the recurrent layers: max logit difference {gap:.3g}")
    return Observation(False, f"packed examples isolated: max logit difference {gap:.2g}")
