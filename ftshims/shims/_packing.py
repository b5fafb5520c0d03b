"""Shared code of the packing shims: finding packed segments, building block masks, and
the reproductions the probes and tests share.

Not a shim (the module name starts with ``_``). Importing it imports neither
torch nor transformers; every function imports them inside.

Vocabulary:

* a *packed row* holds several examples one after the other; each example's
  ``position_ids`` restart at 0. A *segment* is one example's span.
* a *block-causal mask* lets a token attend to earlier tokens of its own
  segment only (and never to padding).
* mask *forms* of a custom 4D mask ``[batch, 1, query, key]``: ``"additive"``
  (0 = attend, ``finfo(dtype).min`` = masked, added to the scores),
  ``"binary"`` (float 1 = attend, 0 = masked) and ``"bool"`` (True = attend).
  Which one a model reads correctly depends on the transformers version and on
  the helper its modeling file builds masks with. The shims always hand the
  model an additive mask in its dtype, and where its mask code would ignore,
  misread or reject that, they wrap the code to pass the mask through
  (:func:`needs_passthrough`).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
from typing import Dict, NamedTuple, Optional, Tuple

from .._util import compiling, method_binder

log = logging.getLogger("ftshims")

# model_type -> (modeling module, decoder base-model class). Decoder-only families whose
# base model builds one causal mask for every layer. Families with per-layer masks
# (gemma2/3, cohere2, ...) or softcapping are deliberately absent: one 4D mask
# cannot describe them.
_BASE_MODELS = (
    ("llama", "LlamaModel"), ("mistral", "MistralModel"), ("mixtral", "MixtralModel"), ("qwen2", "Qwen2Model"),
    ("qwen2_moe", "Qwen2MoeModel"), ("qwen3", "Qwen3Model"), ("qwen3_moe", "Qwen3MoeModel"), ("phi3", "Phi3Model"),
    ("gemma", "GemmaModel"), ("granite", "GraniteModel"), ("olmo", "OlmoModel"), ("olmo2", "Olmo2Model"),
    ("starcoder2", "Starcoder2Model"),
)
# family -> (modeling module, base model class)
FAMILIES: Dict[str, Tuple[str, str]] = {
    family: (f"transformers.models.{family}.modeling_{family}", cls) for family, cls in _BASE_MODELS
}

EAGER_LIKE = ("eager", "sdpa")

# 4.53+: decoder base models that build their masks without handing their position_ids to masking_utils
# (read in the released modeling files), model_type -> (modeling module, base model class). The mask layer
# cannot see their packing by itself; their forward hands the packed position ids down (packing_block_mask).
POSITIONS_NOT_PASSED: Dict[str, Tuple[str, str]] = {
    "gpt_oss": ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssModel"),
    "granitemoehybrid": ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridModel"),
}
MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")

# Hybrid decoders whose recurrent layers (gated delta rule, Mamba/Mamba2, short convolutions) run along the whole
# row: model_type -> (base model class, recurrent layer classes), read in the released modeling files 4.53-5.24.
# Their state runs on from one packed example into the next whatever the attention mask says
# (packing_recurrent_state).
RECURRENT: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "qwen3_5": ("Qwen3_5TextModel", ("Qwen3_5GatedDeltaNet",)),
    "qwen3_5_moe": ("Qwen3_5MoeTextModel", ("Qwen3_5MoeGatedDeltaNet",)),
    "qwen3_next": ("Qwen3NextModel", ("Qwen3NextGatedDeltaNet",)),
    "olmo_hybrid": ("OlmoHybridModel", ("OlmoHybridGatedDeltaNet",)),
    "lfm2": ("Lfm2Model", ("Lfm2ShortConv",)),
    "lfm2_moe": ("Lfm2MoeModel", ("Lfm2MoeShortConv",)),
    "bamba": ("BambaModel", ("BambaMixer",)),
    "granitemoehybrid": ("GraniteMoeHybridModel", ("GraniteMoeHybridMambaLayer",)),
    "falcon_h1": ("FalconH1Model", ("FalconH1Mixer",)),
    "nemotron_h": ("NemotronHModel", ("NemotronHMamba2Mixer",)),
    "zamba2": ("Zamba2Model", ("Zamba2MambaMixer",)),
    "jamba": ("JambaModel", ("JambaMambaMixer",)),
}

# Recurrent models no shim separates (no tiny model here to prove it, or a layer this shim cannot split): the
# doctor's packing finding names them.
RECURRENT_UNCOVERED = ("mamba", "mamba2", "falcon_mamba", "recurrent_gemma", "zamba", "minimax", "kimi_linear", "xlstm",
                       "rwkv")


def modeling_module(model_type: str) -> str:
    return f"transformers.models.{model_type}.modeling_{model_type}"
# The attention implementations whose masks masking_utils builds from a mask function (sdpa_mask, eager_mask,
# flex_attention_mask): a packed-sequence function reaches them. Flash attention gets no such mask (the
# flash_attn_packing shim covers it).
MASK_FUNCTION_ATTNS = ("eager", "sdpa", "flex_attention")
# masking_utils (create_causal_mask & co., one mask builder for every decoder) appeared in 4.53.0
MASK_LAYER_SINCE = (4, 53)
FLASH = ("flash_attention_2", "flash_attention_3")

ADDITIVE, BINARY, BOOL = "additive", "binary", "bool"


_VERSION = []


def transformers_version():
    """The installed transformers version (read once from metadata; never imports transformers)."""
    if not _VERSION:
        from packaging.version import Version

        from ..versions import installed_version

        _VERSION.append(Version(installed_version("transformers") or "0"))
    return _VERSION[0]


# ---------------------------------------------------------------------------
# Reading the call


def takes_extra_kwargs(forward) -> bool:
    """Whether ``forward`` has a ``**kwargs`` catch-all (passed on to the attention layers from 4.47)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())


def cache_key(kwargs) -> str:
    """The name of the cache argument: ``past_key_values`` (<=4.57) or ``cache`` (5.x)."""
    return "cache" if "cache" in kwargs else "past_key_values"


def window_of(config) -> Optional[int]:
    """The model's sliding attention window, when one is active."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if isinstance(window, int) and window > 0 else None


def embed_dtype(model, kwargs):
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None:
        return embeds.dtype
    return model.get_input_embeddings().weight.dtype


# ---------------------------------------------------------------------------
# Segments and masks


def segments(position_ids, attention_mask=None, always: bool = False):
    """``(segment_ids, real)`` for a batch whose rows hold several examples, else None.

    A new segment starts wherever ``position_ids`` restart at 0 between two real
    (non-padding) tokens. ``real`` is the 2D padding mask as bool (all True when
    there is none). Padding next to a restart does not count, so the position
    ids of a left-padded generation batch (``[1, 1, 0, 1, 2]``) are not packed.
    Returns None for 1D/3D position ids, a single token, or rows with one example.

    ``always=True`` (under ``torch.compile``) skips that last, data-dependent
    test: rows of one example then get one segment each, whose block-causal
    mask is the plain causal mask with padding.
    """
    import torch

    if not torch.is_tensor(position_ids) or position_ids.ndim != 2 or position_ids.shape[-1] < 2:
        return None
    batch, length = position_ids.shape
    if attention_mask is not None:
        if not torch.is_tensor(attention_mask) or attention_mask.ndim != 2 or attention_mask.shape[-1] != length:
            return None
        real = attention_mask.to(device=position_ids.device) != 0
        if real.shape[0] != batch:
            if batch != 1:
                return None
            position_ids = position_ids.expand(real.shape[0], -1)
    else:
        real = torch.ones_like(position_ids, dtype=torch.bool)
    starts = torch.zeros_like(real)
    starts[:, 1:] = (position_ids[:, 1:] == 0) & real[:, 1:] & real[:, :-1]
    if not always and not bool(starts.any()):
        return None
    return starts.long().cumsum(-1), real


def segment_lengths(segment_ids, real):
    """Lengths of the real segments, row by row (a flat list; for window checks and bench)."""
    import torch

    lengths = []
    for row_ids, row_real in zip(segment_ids, real):
        ids = row_ids[row_real]
        if ids.numel():
            lengths.extend(torch.unique_consecutive(ids, return_counts=True)[1].tolist())
    return lengths


def allowed_pairs(segment_ids, real, window: Optional[int] = None):
    """Bool ``[batch, 1, L, L]``: query i may attend key j (same segment, j <= i, j real).

    Every query also attends itself, so that no row is fully masked (a fully
    masked row turns into NaN in half precision and spreads through the keys).
    """
    import torch

    length = segment_ids.shape[-1]
    device = segment_ids.device
    idx = torch.arange(length, device=device)
    causal = idx[None, :] <= idx[:, None]
    if window is not None:
        causal = causal & (idx[:, None] - idx[None, :] < window)
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal[None] & real[:, None, :]
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


def to_form(allowed, form: str, dtype):
    """A bool "may attend" mask in the requested form."""
    import torch

    if form == BOOL:
        return allowed
    if form == BINARY:
        return allowed.to(dtype)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def read_form(mask) -> Optional[str]:
    """Which form a user's 4D mask is in: ``bool``, ``binary`` (floats in {0, 1} with a 1),
    ``additive`` (max 0), or None (something else: left alone)."""
    import torch

    if mask.dtype == torch.bool:
        return BOOL
    if not mask.is_floating_point():
        return BINARY if bool(((mask == 0) | (mask == 1)).all()) and bool((mask == 1).any()) else None
    top = float(mask.max())
    if top == 0.0:
        return ADDITIVE
    if top == 1.0 and bool(((mask == 0) | (mask == 1)).all()):
        return BINARY
    return None


def allowed_from(mask, form: str):
    """The bool "may attend" mask of a 4D mask in ``form``."""
    if form == BOOL:
        return mask
    if form == BINARY:
        return mask != 0
    return mask == 0


# ---------------------------------------------------------------------------
# Getting an additive 4D mask to the layers, on every version >= 4.37


def mask_layer_era() -> bool:
    """Whether this transformers builds decoder masks in ``masking_utils`` (4.53+): the packing shims then fix
    packing there, once for every decoder, instead of family by family."""
    return transformers_version().release[:2] >= MASK_LAYER_SINCE


def mask_helper(model_class) -> str:
    """How a decoder base class builds its mask: ``create_causal_mask`` (>=4.53 masking_utils),
    ``update_causal_mask`` (its own ``_update_causal_mask``, 4.38+) or ``attn_mask_utils``
    (the ``_prepare_4d_causal_attention_mask*`` helpers: every family on 4.37, mistral,
    qwen2, mixtral, phi, ... until 4.41)."""
    module = sys.modules.get(model_class.__module__)
    if module is not None and hasattr(module, "create_causal_mask"):
        return "create_causal_mask"
    if hasattr(model_class, "_update_causal_mask"):
        return "update_causal_mask"
    return "attn_mask_utils"


# The additive 4D mask one of our forward wrappers is handing down right now: the
# pass-through wrappers below return exactly this object, and nothing else.
PASS_THROUGH: contextvars.ContextVar = contextvars.ContextVar("ftshims_packing_mask", default=None)

HELPERS = ("_prepare_4d_causal_attention_mask", "_prepare_4d_causal_attention_mask_for_sdpa")


def needs_passthrough(model_class) -> bool:
    """Whether this model's mask code would ignore, misread or reject an additive 4D mask.

    * ``attn_mask_utils`` (4.37–4.41): the eager helper computes ``1 - mask``
      (binary only); the sdpa helper does too on 4.37–4.39 and has no 4D branch
      at all on 4.40–4.41 (``ValueError: too many values to unpack``).
    * ``_update_causal_mask`` on 4.38–4.40: 4.38 llama/gemma and 4.39–4.40
      gemma/cohere ignore a 4D mask; 4.39–4.40 llama reads it as binary.
    * From 4.41 ``_update_causal_mask`` and from 4.53 ``create_causal_mask`` use an
      additive 4D mask as-is.
    """
    helper = mask_helper(model_class)
    if helper == "attn_mask_utils":
        return True
    return helper == "update_causal_mask" and transformers_version().release[:2] in ((4, 38), (4, 39), (4, 40))


def passthrough(wrapped, instance, args, kwargs):
    """A mask builder that returns the additive 4D mask our forward wrapper handed down, unchanged."""
    if compiling():
        # Inside a trace the forward wrappers hand nothing down (and dynamo cannot read a
        # context variable): the helper runs as upstream wrote it.
        return wrapped(*args, **kwargs)
    mask = args[0] if args else kwargs.get("attention_mask")
    if mask is not None and mask is PASS_THROUGH.get():
        return mask
    return wrapped(*args, **kwargs)


class Family(NamedTuple):
    """What the forward wrappers need to know about a decoder class, read once at install time
    (so that nothing version- or signature-related is looked up inside a ``torch.compile`` trace)."""

    extra_kwargs: bool  # forward(**kwargs) passes extra keyword arguments on (flash varlen kwargs, 4.47+)
    passthrough: bool  # its mask code needs the pass-through wrappers (see needs_passthrough)
    bool_misread: Dict[str, bool]  # attn implementation -> whether a bool 4D mask is mishandled
    traces_4d: bool  # its mask code takes a 4D mask inside a torch.compile trace (see traces_4d_mask)


def bool_misread(model_class) -> Dict[str, bool]:
    """Per attention implementation, whether this class's mask code mishandles a bool 4D mask:
    handed to torch's sdpa as a boolean mask (correct) from 4.44; 4.41–4.43 reject it; eager
    adds it as 0/1 everywhere; the pass-through versions need every mask converted."""
    if needs_passthrough(model_class):
        return {"eager": True, "sdpa": True}
    return {"eager": True, "sdpa": transformers_version().release[:2] < (4, 44)}


def traces_4d_mask(model_class) -> bool:
    """Whether a 4D mask goes through this class's mask code inside a ``torch.compile`` trace
    with ``fullgraph=True``: not with the pass-through wrappers (4.37-4.40, a context variable),
    nor on 4.41-4.43, whose ``_update_causal_mask`` checks a 4D mask's values in Python
    (``if attention_mask.max() != 0``, a data-dependent branch); from 4.44 it does."""
    return not needs_passthrough(model_class) and transformers_version().release[:2] >= (4, 44)


def install_family(patcher, model_type: str, forward_wrapper, wanted=None) -> None:
    """Wrap ``<Family>Model.forward`` when the family's modeling module is imported, and the
    mask code that would not take an additive 4D mask as-is (see :func:`needs_passthrough`).

    ``forward_wrapper(wrapped, instance, call, family)`` gets the call's
    arguments as one keyword dict (bound by :func:`ftshims._util.method_binder`) and the
    :class:`Family` facts read at install time; it returns ``wrapped(**call)``
    with whatever it changed. ``wanted(cls)``, when given, decides from the imported class
    whether to wrap it at all.
    """
    from ..patching import require_params
    from ..spec import TargetMissing

    module_name, class_name = FAMILIES[model_type]

    def part(module):
        cls = vars(module).get(class_name)
        if cls is None:
            raise TargetMissing(f"{module_name}.{class_name} not found")
        if wanted is not None and not wanted(cls):
            return
        require_params(cls.forward, ("attention_mask", "position_ids"), f"{module_name}.{class_name}.forward")
        if needs_passthrough(cls):
            if mask_helper(cls) == "update_causal_mask":
                patcher.wrap(cls, "_update_causal_mask", passthrough)
            else:
                found = [name for name in HELPERS if callable(vars(module).get(name))]
                if not found:
                    raise TargetMissing(f"{module_name}: no _update_causal_mask and no _prepare_4d_causal_attention_mask")
                for name in found:
                    patcher.wrap(module, name, passthrough)
        bind = method_binder(cls.forward)
        family = Family(takes_extra_kwargs(cls.forward), needs_passthrough(cls), bool_misread(cls), traces_4d_mask(cls))

        def adapter(wrapped, instance, args, kwargs):
            call = bind(args, kwargs)
            if call is None:
                return wrapped(*args, **kwargs)
            return forward_wrapper(wrapped, instance, call, family)

        patcher.wrap(cls, "forward", adapter)

    patcher.when_imported(module_name, part)


def handing_down(mask):
    """Context manager: mark ``mask`` as the one the pass-through wrappers let through."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        token = PASS_THROUGH.set(mask)
        try:
            yield mask
        finally:
            PASS_THROUGH.reset(token)

    return scope()


# ---------------------------------------------------------------------------
# Reproductions shared by probes, tests and the bench.


def example_pair(lengths=(5, 7), vocab_size: int = 128, seed: int = 0, low: int = 3):
    """Random examples (token ids from ``low``, avoiding the special ids) of the given lengths."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=generator) for n in lengths]


def packed_batch(examples, mask: str = "ones", pad_row: bool = False):
    """One packed row of ``examples`` with per-example position_ids and ``labels[pos == 0] = -100``.

    ``mask``: ``"ones"`` (an all-ones 2D mask beside the packed position ids:
    the adversarial case), ``"none"`` (no mask). ``pad_row`` adds a second row
    holding the first example alone, right-padded with pos 0 and a 0 mask
    (only with ``mask="ones"``: then the mask carries real padding).
    """
    import torch

    ids = torch.cat(examples)[None]
    pos = torch.cat([torch.arange(len(e)) for e in examples])[None]
    labels = ids.clone()
    labels[pos == 0] = -100
    batch = {"input_ids": ids, "position_ids": pos, "labels": labels}
    if mask == "ones" or pad_row:
        batch["attention_mask"] = torch.ones_like(ids)
    if pad_row:
        length = ids.shape[1]
        first = examples[0]
        row_ids = torch.zeros(length, dtype=ids.dtype)
        row_ids[: len(first)] = first
        row_pos = torch.zeros(length, dtype=pos.dtype)
        row_pos[: len(first)] = torch.arange(len(first))
        row_mask = (torch.arange(length) < len(first)).long()
        row_labels = torch.full((length,), -100, dtype=labels.dtype)
        row_labels[1 : len(first)] = first[1:]
        batch = {
            "input_ids": torch.stack([ids[0], row_ids]),
            "position_ids": torch.stack([pos[0], row_pos]),
            "labels": torch.stack([labels[0], row_labels]),
            "attention_mask": torch.stack([batch["attention_mask"][0], row_mask]),
        }
    return batch


def reference_logits(model, examples):
    """Each example run alone (no mask, fresh positions), logits concatenated (fp32)."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        return torch.cat([model(input_ids=e[None].to(device), use_cache=False).logits[0].float() for e in examples])


def segment_logit_gap(model, examples, batch, **call) -> float:
    """Max |packed logits - each example alone| over every row of ``batch``: a packed row holds all
    ``examples``; a row with padding (``packed_batch(pad_row=True)``) holds the first example."""
    import torch

    device = next(model.parameters()).device
    reference = reference_logits(model, examples)
    inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, **call).logits.float()
    mask = batch.get("attention_mask")
    gap = 0.0
    for row in range(logits.shape[0]):
        n = int(mask[row].sum()) if mask is not None and mask.ndim == 2 else logits.shape[1]
        gap = max(gap, (logits[row, :n] - reference[:n]).abs().max().item())
    return gap


_LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
               mamba_chunk_size=8)

# model_type -> (config class, fields over tiny.TINY_LLAMA): the tiny text decoders of the packing probes and
# tests. Sliding windows and attention chunks (4) are shorter than the examples (5 and 7 tokens), so that a
# mask which loses them shows; hybrid models get one layer of each kind. Fields a release does not know are
# kept as plain attributes by its config class.
TINY_CONFIGS: Dict[str, Tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mixtral": ("MixtralConfig", dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(use_sliding_window=False, shared_expert_intermediate_size=32, **_MOE)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=False, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(use_sliding_window=False, head_dim=16, **_MOE)),
    "phi3": ("Phi3Config", dict(sliding_window=None)),
    "gemma": ("GemmaConfig", dict(head_dim=16)),
    "granite": ("GraniteConfig", {}),
    "olmo": ("OlmoConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=None)),
    "gemma2": ("Gemma2Config", dict(sliding_window=4, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=4, head_dim=16, layer_types=["sliding_attention", "full_attention"])),
    "gemma4": ("Gemma4TextConfig", dict(sliding_window=4, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                                        vocab_size_per_layer_input=128, hidden_size_per_layer_input=8)),
    "cohere2": ("Cohere2Config", dict(sliding_window=4, head_dim=16, layer_types=["sliding_attention", "full_attention"])),
    "llama4": ("Llama4TextConfig", dict(attention_chunk_size=4, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                                        intermediate_size_mlp=128, interleave_moe_layer_step=1, no_rope_layers=[1, 0])),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
                                             num_key_value_heads=4)),
    "glm": ("GlmConfig", dict(head_dim=16)),
    "glm4": ("Glm4Config", dict(head_dim=16)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(layer_types=["linear_attention", "full_attention"], head_dim=16, **_LINEAR)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(layer_types=["linear_attention", "full_attention"], head_dim=16,
                                                 shared_expert_intermediate_size=32, **_LINEAR, **_MOE)),
    "qwen3_next": ("Qwen3NextConfig", dict(layer_types=["linear_attention", "full_attention"], head_dim=16,
                                           shared_expert_intermediate_size=32, **_LINEAR, **_MOE)),
    "olmo_hybrid": ("OlmoHybridConfig", dict(layer_types=["linear_attention", "full_attention"], **_LINEAR)),
    "lfm2": ("Lfm2Config", dict(layer_types=["conv", "full_attention"], conv_L_cache=3)),
    "lfm2_moe": ("Lfm2MoeConfig", dict(layer_types=["conv", "full_attention"], conv_L_cache=3, num_dense_layers=1, **_MOE)),
    "falcon_h1": ("FalconH1Config", dict(head_dim=16, mamba_d_ssm=128, **_MAMBA2)),
    "nemotron_h": ("NemotronHConfig", dict(layers_block_type=["mamba", "attention"], mamba_num_heads=8, mamba_head_dim=16,
                                           n_groups=1, ssm_state_size=8, conv_kernel=4, expand=2, chunk_size=8, head_dim=16)),
    "zamba2": ("Zamba2Config", dict(layers_block_type=["mamba", "hybrid"], mamba_headdim=16, mamba_ngroups=1, mamba_d_state=8,
                                    mamba_d_conv=4, mamba_expand=2, chunk_size=8, num_mem_blocks=1, hybrid_layer_ids=[1])),
    "bamba": ("BambaConfig", dict(attn_layer_indices=[1], **_MAMBA2)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(layer_types=["mamba", "attention"], num_local_experts=4,
                                                        num_experts_per_tok=2, **_MAMBA2)),
    "jamba": ("JambaConfig", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                  num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                  mamba_dt_rank=8, use_mamba_kernels=False)),
}


def tiny_decoder(family: str = "llama", attn: str = "eager", seed: int = 0):
    """A tiny random decoder of ``family`` (a :data:`TINY_CONFIGS` key) in train() mode (dropout is 0 in
    these configs). ProbeUnsupported when this transformers has no such model."""
    from .. import tiny

    if family not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {family!r}; known: {', '.join(TINY_CONFIGS)}")
    if not family_available(family):
        from ..spec import ProbeUnsupported

        raise ProbeUnsupported(f"transformers {transformers_version()} has no {family} model")
    config_class, fields = TINY_CONFIGS[family]
    overrides = {} if family == "llama" else dict(tiny.TINY_LLAMA)
    overrides.update(fields)
    model = tiny.causal_lm(config_class, attn=attn, seed=seed, **overrides)
    model.train()
    return model


def family_available(family: str) -> bool:
    """Whether this transformers ships ``family``'s modeling file and the config class of its tiny decoder."""
    import importlib.util

    module_name = FAMILIES[family][0] if family in FAMILIES else f"transformers.models.{family}.modeling_{family}"
    try:
        if importlib.util.find_spec(module_name) is None:
            return False
    except (ImportError, ValueError):
        return False
    if family not in TINY_CONFIGS:
        return True
    import transformers

    return hasattr(transformers, TINY_CONFIGS[family][0])


# ---------------------------------------------------------------------------
# The real trainer paths


def quiet_datasets():
    """Context manager: no ``datasets`` progress bars (restored after)."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        try:
            from datasets.utils import logging as ds_logging
        except ImportError:
            yield
            return
        enabled = ds_logging.is_progress_bar_enabled()
        ds_logging.disable_progress_bar()
        try:
            yield
        finally:
            if enabled:
                ds_logging.enable_progress_bar()

    return scope()


SPECIAL = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}


def tiny_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer over ``w4 .. w{vocab_size-1}`` (id = number) plus the specials, no hub."""
    from ..tiny import word_tokenizer

    words = sorted(SPECIAL, key=SPECIAL.get) + [f"w{i}" for i in range(len(SPECIAL), vocab_size)]
    return word_tokenizer(words, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def find_in_row(row, tokens) -> int:
    """Index where ``tokens`` occur in the 1D ``row``."""
    n = len(tokens)
    for start in range(len(row) - n + 1):
        if bool((row[start : start + n] == tokens).all()):
            return start
    raise AssertionError(f"{tokens.tolist()} not found in the collated row {row.tolist()}")


def sft_packing_gap(attn: str = "sdpa", strategy: Optional[str] = None, model=None) -> Tuple[float, dict]:
    """``trl.SFTTrainer(packing=True)`` on two short texts (5 and 7 words): one batch from the real
    train dataloader through ``compute_loss``; max logit difference of each packed example to the
    example run alone. Returns ``(gap, batch)``.

    strategy: ``packing_strategy`` (TRL >= 0.19), None for TRL's default.
    """
    import dataclasses
    import tempfile
    import warnings

    import torch

    import datasets
    from trl import SFTConfig, SFTTrainer

    from .. import tiny

    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    if "packing_strategy" not in fields:
        from ..spec import ProbeUnsupported

        raise ProbeUnsupported("this TRL packs with ConstantLengthDataset/pack_examples (contaminating by design)")
    examples = example_pair(low=len(SPECIAL))
    texts = [" ".join(f"w{int(t)}" for t in e) for e in examples]
    tokenizer = tiny_tokenizer()
    model = model if model is not None else tiny_decoder("llama", attn)
    config = dict(packing=True, max_length=32, per_device_train_batch_size=2, report_to=[], save_strategy="no")
    config.update(logging_strategy="no", bf16=False, fp16=False)
    if strategy is not None:
        config["packing_strategy"] = strategy
    if "loss_type" in fields:
        # TRL 1.x's "chunked_nll" (the default of some releases) patches the model to return no logits; the
        # same loss computed as "nll" keeps them, and attention (what this measures) is the same either way
        config["loss_type"] = "nll"
    with tiny.quiet(), quiet_datasets(), tempfile.TemporaryDirectory() as out:
        warnings.filterwarnings("always", message="ftshims:")  # ours stay audible inside quiet()
        args = SFTConfig(output_dir=out, **{k: v for k, v in config.items() if k in fields})
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list([{"text": t} for t in texts]),
            processing_class=tokenizer,
        )
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        model.train()
        with torch.no_grad():
            _, outputs = trainer.compute_loss(model, batch, return_outputs=True)
            logits = outputs["logits"]
            row = batch["input_ids"][0]
            gap = 0.0
            for example in examples:
                tokens = torch.cat([example, torch.tensor([SPECIAL["<eos>"]])])
                start = find_in_row(row, tokens)
                alone = model(input_ids=tokens[None].to(row.device), use_cache=False).logits[0]
                gap = max(gap, (logits[0, start : start + len(tokens)] - alone).abs().max().item())
    return gap, batch
