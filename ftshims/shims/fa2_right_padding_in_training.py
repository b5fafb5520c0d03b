"""Training forwards on right-padded batches raise a generation-only error under flash_attention_2.

Why: with ``attn_implementation="flash_attention_2"`` the base models of
Mistral, Mixtral, Qwen2, Qwen2-MoE, Starcoder2, Phi-3, Qwen3, Qwen3-MoE,
PhiMoE and JetMoe, and the text decoders of Qwen2-VL and Qwen2.5-VL, run a
check meant for batched generation in *every* forward::

    if attention_mask is not None and <flash> and use_cache:          # 4.36-4.47
    if attention_mask is not None and past_key_values is not None:    # 4.48+
        if attention_mask[:, -1].sum().item() != batch_size:
            raise ValueError("You are attempting to perform batched generation with padding_side='right' ...")

``use_cache`` defaults to ``config.use_cache`` (True in every released config),
and from 4.48 the forward creates a ``DynamicCache`` whenever ``use_cache`` is
true, so the first training step on a right-padded batch (SFT with
``padding_side="right"``, DPO/ORPO concatenation, generated completions, all
right-padded) raises, although training with right padding is correct under
flash attention: the kernel unpads each row. The cache is never used in a
training forward. trl#1018, trl#1217, transformers#28586; TRL worked around it
in its own trainers by passing ``use_cache=False`` (trl#1290, trl#1477), which
is what every user is told to do. transformers 4.53 dropped the check with the
masking_utils rewrite, except in Qwen2-MoE and PhiMoE, which keep it until 5.0.

Where the check is (``FAMILIES``, read in the released wheels 4.36.0-4.57.6
and 5.0.0): Mistral 4.36-4.52; Mixtral 4.36-4.41 and 4.48-4.52; Qwen2 4.37-4.41
and 4.49-4.52; Qwen2-MoE 4.40-4.41 and 4.48-4.57; Starcoder2 4.39-4.41 and
4.48-4.52; Phi-3 4.41 and 4.48-4.52; Qwen3 and Qwen3-MoE 4.51-4.52; PhiMoE
4.48-4.57; JetMoe 4.41.0-4.56.1 (``JetMoeModel.forward``, ``... and use_cache``;
gone in 4.56.2, not in 4.56.0 as the advisory first said); Qwen2-VL 4.48-4.52 and
Qwen2.5-VL 4.49-4.52 (``_update_causal_mask`` of ``Qwen2VLModel`` /
``Qwen2_5_VLModel``, the decoder, in 4.48-4.51, of ``*TextModel`` in 4.52;
4.45-4.47 Qwen2-VL has no check). None in 5.0.

The fix: wrap ``forward`` of those base models, on those versions, and run it with
``use_cache=False`` exactly when upstream would raise for a training forward:

* the model is in ``train()`` mode, its attention implementation is
  ``flash_attention_2`` (as the config and, 4.36-4.47, the model's own
  ``_use_flash_attention_2`` / ``_attn_implementation`` say),
* the caller passed neither ``use_cache`` nor ``past_key_values`` (``generate()``
  always passes ``use_cache``, and a cache from its first step on 4.48+; a
  caller asking for a cache gets upstream's behaviour) and ``config.use_cache``
  is true,
* gradient checkpointing is off (upstream turns ``use_cache`` off itself then,
  before the check, from 4.36.2), and
* the 2D ``attention_mask`` has padding in its last column (upstream's own
  test: otherwise nothing raises and the call is left exactly as it was).

Everything else passes through unchanged: eval-mode forwards and generation
(in eval or train mode) still raise upstream's error on right padding, where a
cache would really be built from right-padded keys. Not covered: eval-mode
forwards that only compute a loss (``Trainer.evaluate``, a frozen reference
model's log-probs) also raise upstream, but cannot be told apart from a manual
prefill, for which the check is right; pass ``use_cache=False`` there. Also not
covered: 4.34.x, whose Mistral check ignores ``use_cache``. (JetMoe, Qwen2-VL and
Qwen2.5-VL since ftshims 0.2.0.)

Flash attention needs a GPU: the CPU tests run transformers' real flash
attention code with the pure-PyTorch stand-in kernels of
:mod:`ftshims.shims.flash_attn_packing` in place of flash-attn. Under
``torch.compile`` the wrapper passes through (the padding test reads values).

Follow-ups: none that apply. The fix carried is TRL's (trl#1290: use_cache=False for training forwards);
upstream transformers fixed it differently: 4.53.0 (the masking_utils rewrite) dropped the check for most
families and 5.0.0 for Qwen2-MoE and PhiMoE (FAMILIES above, read in the wheels), while this shim keeps the
check for generation. TRL's trainers still pass use_cache=False (trl 1.16.0 dpo_trainer.py); no regression
report against the workaround found.
"""

from __future__ import annotations

from typing import Optional

from .._util import acted, attributes_set, compiling, method_binder
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

_BREAK_4_42_TO_4_47 = ",!=4.42.*,!=4.43.*,!=4.44.*,!=4.45.*,!=4.46.*,!=4.47.*"

# model_type -> (modeling module, ((decoder class, transformers versions whose code has the check in it), ...)).
# Read in the released wheels 4.36.0-4.57.6 and 5.0.0 (see the shim's report for the lines). Qwen2-VL and
# Qwen2.5-VL moved their decoder to *TextModel in 4.52 (the *Model name became the whole VLM there).
FAMILIES = {
    "mistral": ("transformers.models.mistral.modeling_mistral", (("MistralModel", ">=4.36,<4.53"),)),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", (("MixtralModel", ">=4.36,<4.53" + _BREAK_4_42_TO_4_47),)),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", (("Qwen2Model", ">=4.37,<4.53" + _BREAK_4_42_TO_4_47 + ",!=4.48.*"),)),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", (("Qwen2MoeModel", ">=4.40,<5.0" + _BREAK_4_42_TO_4_47),)),
    "starcoder2": ("transformers.models.starcoder2.modeling_starcoder2", (("Starcoder2Model", ">=4.39,<4.53" + _BREAK_4_42_TO_4_47),)),
    "phi3": ("transformers.models.phi3.modeling_phi3", (("Phi3Model", ">=4.41,<4.53" + _BREAK_4_42_TO_4_47),)),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", (("Qwen3Model", ">=4.51,<4.53"),)),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", (("Qwen3MoeModel", ">=4.51,<4.53"),)),
    "phimoe": ("transformers.models.phimoe.modeling_phimoe", (("PhimoeModel", ">=4.48,<5.0"),)),
    # JetMoeModel.forward, `... and use_cache`, 4.41.0 (line 1098) through 4.56.1 (941); gone in 4.56.2
    "jetmoe": ("transformers.models.jetmoe.modeling_jetmoe", (("JetMoeModel", ">=4.41,<4.56.2"),)),
    # _update_causal_mask, `past_key_values is not None` (forward: DynamicCache() when use_cache): 4.48.0 (1174)-4.52.4
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl",
                 (("Qwen2VLModel", ">=4.48,<4.52"), ("Qwen2VLTextModel", ">=4.52,<4.53"))),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                   (("Qwen2_5_VLModel", ">=4.49,<4.52"), ("Qwen2_5_VLTextModel", ">=4.52,<4.53"))),
}
# (module, class, versions) for every class that has the check somewhere: the targets.
CHECKED = tuple((module, cls, checked) for module, classes in FAMILIES.values() for cls, checked in classes)

PARAMS = ("attention_mask", "past_key_values", "use_cache")

SPEC = ShimSpec(
    id="fa2_right_padding_in_training",
    since="0.2.0",
    unpinned="Qwen2-VL (4.48-4.51) and Qwen2.5-VL (4.49-4.51) carry the check in Qwen2(_5)VLModel.forward, and no "
    "stack pins 4.48-4.51; 4.52 moved it to the *TextModel classes, tested on t4_52; the check's code was read in the "
    "4.48.0 and 4.51.3 wheels",
    title="Training forwards on right-padded batches raise the 'batched generation with padding_side=right' error "
    "under flash_attention_2",
    symptom="the first training step on a right-padded batch fails with `ValueError: You are attempting to perform "
    "batched generation with padding_side='right' ... Flash Attention version of <Model>` (Mistral, Mixtral, Qwen2, "
    "Qwen2-MoE, Starcoder2, Phi-3, Qwen3, Qwen3-MoE, PhiMoE, JetMoe, Qwen2-VL, Qwen2.5-VL)",
    why="A check meant for cached generation runs in every forward whenever use_cache is true, the config default, "
    "so training on right-padded batches under flash attention raises although it is correct (the kernel unpads). "
    "The shim runs such training forwards with use_cache=False, as TRL's own trainers do (4.53 dropped the check "
    "for most families).",
    stand_in="a pure-PyTorch stand-in for flash-attn's kernels (CPU)",
    needs_any=("flash-attn",),
    requires={"transformers": ">=4.36,<5.0"},
    fixed_in={"transformers": "5.0.0"},
    refs=(
        "https://github.com/huggingface/trl/issues/1018",
        "https://github.com/huggingface/trl/issues/1217",
        "https://github.com/huggingface/transformers/issues/28586",
        "https://github.com/huggingface/trl/pull/1290",
        "https://github.com/huggingface/trl/issues/3034",
    ),
    backports=("https://github.com/huggingface/trl/pull/1290",),
    follow_ups_checked="upstream transformers fixed it differently: 4.53.0 (the masking_utils rewrite) dropped the "
    "check for most families and 5.0.0 for Qwen2-MoE and PhiMoE (FAMILIES above, read in the wheels), while this "
    "shim keeps the check for generation. TRL's trainers still pass use_cache=False (trl 1.16.0 dpo_trainer.py); no "
    "regression report against the workaround found.",
    targets=tuple(
        Target(module, f"{cls}.forward", params=PARAMS, when=checked) for module, cls, checked in CHECKED
    ),
    modules=("transformers",),
)

FLASH = "flash_attention_2"  # upstream compares with exactly this name (not flash_attention_3)


def is_flash(model) -> bool:
    """Whether ``model`` (a base model) runs flash_attention_2 by every flag its version reads: the config,
    and 4.36's ``_use_flash_attention_2`` / 4.37-4.47's ``_attn_implementation`` set at init."""
    if getattr(model.config, "_attn_implementation", None) != FLASH:
        return False
    own = vars(model)
    if "_use_flash_attention_2" in own and own["_use_flash_attention_2"] is not True:
        return False
    return own.get("_attn_implementation", FLASH) == FLASH


def _right_padded(call) -> bool:
    """Upstream's test: the 2D mask's last column holds padding (``mask[:, -1].sum() != batch``)."""
    import torch

    mask = call.get("attention_mask")
    if not torch.is_tensor(mask) or mask.ndim != 2:
        return False
    inputs = call.get("input_ids")
    if inputs is None:
        inputs = call.get("inputs_embeds")
    batch = inputs.shape[0] if torch.is_tensor(inputs) else mask.shape[0]
    return int(mask[:, -1].sum()) != batch


def _wrapper(bind, checkpointing_resets_first: bool):
    def forward(wrapped, instance, args, kwargs):
        if not instance.training or compiling():
            return wrapped(*args, **kwargs)
        call = bind(args, kwargs)
        if call is None or call.get("use_cache") is not None or call.get("past_key_values") is not None:
            return wrapped(*args, **kwargs)  # generation, or a caller who asked for a cache
        if not getattr(instance.config, "use_cache", False) or not is_flash(instance):
            return wrapped(*args, **kwargs)
        if checkpointing_resets_first and getattr(instance, "gradient_checkpointing", False):
            return wrapped(*args, **kwargs)  # upstream sets use_cache=False itself before the check
        if not _right_padded(call):
            return wrapped(*args, **kwargs)  # nothing would raise: the call stays exactly as it was
        call["use_cache"] = False
        acted(SPEC.id, "right-padded training forwards run without a cache")
        return wrapped(**call)

    return forward


def install(patcher, options) -> None:
    from ..patching import require_params
    from ..spec import TargetMissing
    from ..versions import in_range, installed_version

    version = installed_version("transformers")
    # 4.36.0 and 4.36.1 check before the gradient-checkpointing reset; 4.36.2 and later after it.
    checkpointing_resets_first = in_range(version, ">=4.36.2")
    wanted = [(module, cls) for module, cls, checked in CHECKED if in_range(version, checked)]
    if not wanted:
        raise TargetMissing(f"transformers {version}: no family with the check")
    for module_name, class_name in wanted:

        def part(module, module_name=module_name, class_name=class_name):
            cls = vars(module).get(class_name)
            if cls is None:
                raise TargetMissing(f"{module_name}.{class_name} not found")
            require_params(cls.forward, PARAMS, f"{module_name}.{class_name}.forward")
            patcher.wrap(cls, "forward", _wrapper(method_binder(cls.forward), checkpointing_resets_first))

        patcher.when_imported(module_name, part)


def has_check(family: str) -> bool:
    """Whether the installed transformers' ``family`` base model has the check (per ``FAMILIES``)."""
    from ..versions import in_range, installed_version

    version = installed_version("transformers")
    return family in FAMILIES and any(in_range(version, checked) for _, checked in FAMILIES[family][1])


# ---------------------------------------------------------------------------
# Reproduction

_MOE = dict(num_experts_per_tok=2)
# family -> (config class, config fields beyond tiny.TINY_LLAMA). Sliding windows off: the stand-in has none.
CONFIGS = {
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mixtral": ("MixtralConfig", dict(sliding_window=None, num_local_experts=4, **_MOE)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(use_sliding_window=False, num_experts=4, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, **_MOE)),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=None)),
    "phi3": ("Phi3Config", dict(sliding_window=None)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=False, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(use_sliding_window=False, head_dim=16, num_experts=4,
                                         moe_intermediate_size=32, **_MOE)),
    "phimoe": ("PhimoeConfig", dict(sliding_window=None, num_local_experts=4, **_MOE)),
    # JetMoe: 2 key/value heads x 2 experts per token = TINY_LLAMA's 4 query heads of 16 channels
    "jetmoe": ("JetMoeConfig", dict(kv_channels=16, num_local_experts=4, **_MOE)),
    # Qwen2-VL / Qwen2.5-VL: the whole VLM (a one-block vision tower), trained on text rows; M-RoPE sections of the
    # 16-channel heads. Text fields at the top level: 4.48-4.51 configs are flat, 4.52+ build text_config from them.
    "qwen2_vl": ("Qwen2VLConfig", dict(use_sliding_window=False, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(use_sliding_window=False,
                                            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})),
}
# Families whose causal LM is a vision-language model: built from the config class's *ForConditionalGeneration.
VLM_VISION = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=1, in_channels=3, out_hidden_size=64)
VLM = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}

MESSAGE = "batched generation with padding_side='right'"
LENGTH, REAL = 8, 5  # two rows of 8 tokens; the padded row has 5 real ones


def family_available(family: str) -> bool:
    import transformers

    return hasattr(transformers, CONFIGS[family][0])


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0):
    """A tiny random causal LM of ``family`` in fp32, ``train()`` mode (dropout 0 in these configs)."""
    from .. import tiny

    if not family_available(family):
        raise ProbeUnsupported(f"this transformers has no {CONFIGS[family][0]}")
    config_class, fields = CONFIGS[family]
    fields = dict(tiny.TINY_LLAMA, **fields)
    if family in VLM:
        return _tiny_vlm(family, config_class, fields, attn, seed).train()
    try:
        model = tiny.causal_lm(config_class, attn=attn, seed=seed, **fields)
    except ValueError:  # a family without sdpa on this version (Phi-3 before 4.44): the same weights, eager
        model = tiny.causal_lm(config_class, attn="eager", seed=seed, **fields)
    return model.train()


def batch(padding: str = "right", seed: int = 0):
    """Two rows: one full, one with ``REAL`` real tokens padded on the ``padding`` side (``"none"``: no padding).
    Labels are the inputs, -100 on padding and on each row's first real token."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, REAL:] = 0
    elif padding == "left":
        mask[1, : LENGTH - REAL] = 0
    elif padding != "none":
        raise ValueError(f"padding must be 'right', 'left' or 'none', not {padding!r}")
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    # a row's first real token is predicted from the padding before it (left padding), whose output
    # differs by attention implementation and means nothing: not a target, like position 0 of a row
    labels[torch.arange(2), (mask == 0).long().argmin(-1)] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _tiny_vlm(family, config_class, fields, attn, seed):
    import torch
    import transformers

    from .. import tiny

    config = getattr(transformers, config_class)(**fields, vision_config=dict(VLM_VISION), image_token_id=120,
                                                 video_token_id=121, vision_start_token_id=122)
    torch.manual_seed(seed)
    with tiny.quiet():
        return getattr(transformers, VLM[family])._from_config(config, attn_implementation=attn)


def decoder(model):
    """The module whose ``forward`` has the check: the causal LM's decoder (``get_decoder()``: JetMoe's
    ``base_model_prefix`` names no attribute), for a 4.52+ VLM its ``language_model``."""
    get = getattr(model, "get_decoder", None)
    found = get() if callable(get) else model.base_model
    return getattr(found, "language_model", found)


def _attention(layer):
    return getattr(layer, "self_attn", None) or layer.self_attention  # JetMoe calls it self_attention


def make_flash(model):
    """Switch a tiny model built with sdpa/eager to transformers' flash_attention_2 code path, as
    ``from_pretrained(attn_implementation="flash_attention_2")`` would (which refuses without flash-attn):
    4.36-4.47, JetMoe, Qwen2-VL and Qwen2-MoE/PhiMoE choose an attention class at init (swapped here), 4.48+
    dispatch by the config's name at call time. Run it under :func:`stand_in`."""
    import sys

    base = decoder(model)
    modeling = sys.modules[type(base).__module__]
    current = type(_attention(base.layers[0]))
    # the text decoder's table (Qwen2-VL also has one for its vision tower): the one holding the current class
    classes = next((v for k, v in vars(modeling).items()
                    if k.endswith("_ATTENTION_CLASSES") and isinstance(v, dict) and current in v.values()), None)
    flash_class = classes.get(FLASH) if classes else None
    if flash_class is not None:
        for layer in base.layers:
            _attention(layer).__class__ = flash_class
            _attention(layer)._flash_attn_uses_top_left_mask = False
    for config in {id(c): c for c in (model.config, base.config)}.values():  # 4.52 VLMs: the text_config too
        if hasattr(config, "_attn_implementation_internal") and flash_class is not None:
            config._attn_implementation_internal = FLASH
        else:
            config._attn_implementation = FLASH
    own = vars(base)
    if "_use_flash_attention_2" in own:  # 4.36
        base._use_flash_attention_2 = True
    if "_attn_implementation" in own:  # 4.37-4.47
        base._attn_implementation = FLASH
    return model


# Module globals a modeling file binds from flash-attn at import (only when flash-attn is installed).
_KERNEL_NAMES = ("flash_attn_func", "flash_attn_varlen_func", "index_first_axis", "pad_input", "unpad_input",
                 "_flash_supports_window_size", "_flash_attention_forward")


def stand_in(model):
    """Context manager: ``model``'s flash-attention code runs flash_attn_packing's pure-PyTorch kernels.

    4.42+: ``modeling_flash_attention_utils`` gets them (``flash_attn_packing.reference_flash``), and the
    family's modeling file gets its ``_flash_attention_forward``, which it imports only when flash-attn is
    installed; 4.36-4.41: the modeling file calls the kernels itself. Everything is restored after.
    """
    import contextlib
    import importlib
    import inspect
    import re
    import sys

    from . import flash_attn_packing as reference

    @contextlib.contextmanager
    def scope():
        modeling = sys.modules[type(decoder(model)).__module__]
        source = inspect.getsource(modeling)
        try:
            utils = importlib.import_module("transformers.modeling_flash_attention_utils")
        except ImportError:  # 4.36-4.41
            utils = None
        values = {
            "flash_attn_func": reference.reference_flash_attn_func,
            "flash_attn_varlen_func": reference.reference_flash_attn_varlen_func,
            "index_first_axis": lambda tensor, indices: tensor[indices],
            "pad_input": reference._reference_pad,
            # flash-attn <2.6 returned four values, which 4.36-4.41 unpack
            "unpad_input": lambda hidden, mask: reference._reference_unpad(hidden, mask)[:4],
            "_flash_supports_window_size": False,
            "_flash_attention_forward": getattr(utils, "_flash_attention_forward", None),
        }
        used = {name: values[name] for name in _KERNEL_NAMES
                if values[name] is not None and re.search(rf"\b{name}\b", source)}
        with attributes_set(modeling, used), (
                reference.reference_flash() if utils is not None else contextlib.nullcontext()):
            yield

    return scope()


def reference_loss(family: str, padding: str):
    """Loss of the batch with sdpa attention (no cache), and the model's weights to reuse."""
    import torch

    model = tiny_model(family, "sdpa")
    torch.manual_seed(0)  # PhiMoE's router samples in training: the same draws for both runs
    with torch.no_grad():
        loss = float(model(**batch(padding), use_cache=False).loss)
    return loss, model


def default_family() -> str:
    """The first family whose code has the check in the installed transformers (Mistral up to 4.52,
    Qwen2-MoE on 4.53-4.57), else Mistral."""
    return next((family for family in CONFIGS if has_check(family) and family_available(family)), "mistral")


def probe(family: Optional[str] = None, padding: str = "right") -> Observation:
    """A training forward and backward of a tiny ``family`` model (default: :func:`default_family`) through
    transformers' flash_attention_2 code (stand-in kernels on CPU) on a batch padded on the ``padding``
    side, called as a Trainer does (no ``use_cache``): does it raise the generation-only ValueError, and
    does its loss equal sdpa's?"""
    import math

    import torch

    from .. import tiny
    from ..versions import older_than, installed_version

    if older_than(installed_version("transformers"), "4.36"):
        # 4.34 raises whenever the mask holds padding, use_cache or not (not fixable this way); 4.35 only
        # with a cache passed; neither lets a tiny model pick its attention implementation
        raise ProbeUnsupported("transformers <4.36: no attn_implementation; 4.34's check ignores use_cache")
    family = family or default_family()
    expected, model = reference_loss(family, padding)
    make_flash(model)
    model.train()
    torch.manual_seed(0)
    with tiny.quiet(), stand_in(model):
        try:
            out = model(**batch(padding))
        except ValueError as exc:
            if MESSAGE not in str(exc):
                raise
            return Observation(True, f"{family}/{padding} padding: training forward raised ValueError: "
                                     f"{str(exc).split('. ')[0]}")
        out.loss.backward()
    loss = float(out.loss.detach())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = math.isfinite(loss) and bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads)
    gap = abs(loss - expected)
    if not finite or gap > 1e-5:
        return Observation(True, f"{family}/{padding} padding: loss {loss:.6f} vs sdpa {expected:.6f} "
                                 f"(finite loss and gradients: {finite})")
    return Observation(False, f"{family}/{padding} padding: training forward ran, loss {loss:.6f} = sdpa "
                              f"{expected:.6f} (|diff| {gap:.1e}), gradients finite")
