"""Gemma (v1) configs with ``hidden_act="gelu"`` run exact GELU again on transformers 4.48.0-5.17.x.

Why: Gemma was trained with the tanh approximation of GELU, and its released configs (google/gemma-2b,
-7b and the fine-tunes saved from them) say ``hidden_act="gelu"``, which ``ACT2FN`` builds as the exact
(erf) GELU. transformers 4.39-4.47 (PR #29402) ran the MLP with ``gelu_pytorch_tanh`` unless
``config.hidden_activation`` said otherwise. 4.48.0's modular rewrite (PR #35235: ``GemmaMLP(LlamaMLP)``)
builds ``self.act_fn = ACT2FN[config.hidden_act]`` again and never reads ``hidden_activation``, so these
configs run exact GELU on weights trained with tanh GELU: up to 4.7e-4 per activation, every MLP output and
the logits shift, and a fine-tune fits the wrong activation. No error or warning. transformers 5.18.0
restores the conversion in ``GemmaConfig.__post_init__`` (``configuration_gemma.py`` lines 87-97, comment
"#35235 dropped this conversion (which is needed per #29402)"): ``hidden_act == "gelu"`` becomes
``"gelu_pytorch_tanh"`` with a warning, so ``GemmaMLP`` builds ``GELUTanh``. ``GemmaMLP`` itself is the same
in every release from 4.48.0 to 5.25.0 (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, read in the
4.48.0, 4.48.3, 4.49.0, 4.50.3, 4.51.3, 4.53.3, 4.54.1, 4.55.4, 4.56.2, 5.0.0, 5.5.4, 5.10.4, 5.17.0,
5.18.0 and 5.25.0 wheels), and ``activations.py`` is identical in 5.17.0 and 5.18.0.

Where: transformers >=4.48.0,<5.18.0 (4.47.1 still has #29402's logic; 5.18.0 has the conversion). Every
model whose language model is ``modeling_gemma.GemmaModel``: Gemma, PaliGemma 1 (its ``text_config`` is a
GemmaConfig), ColPali. Gemma2/3/3n, RecurrentGemma, T5Gemma and VaultGemma have MLP classes of their own
built from ``hidden_activation``: not affected, not touched. 4.38.x also runs exact GELU for "gelu" (before
#29402): that is ``gemma_4_38_norm_and_activation``'s, whose range does not meet this one.

The fix: wrap ``GemmaMLP.forward`` of ``transformers.models.gemma.modeling_gemma``. When the module's config
says ``hidden_act="gelu"`` and its ``act_fn`` is the exact GELU that ``ACT2FN["gelu"]`` built from it, the
call computes ``down_proj(ACT2FN["gelu_pytorch_tanh"](gate_proj(x)) * up_proj(x))``: 5.18.0's forward with
the activation 5.18.0 builds for that config (one shared activation instance, ``F.gelu(approximate="tanh")``,
the same operations: bit-identical to 5.18.0 on the same input and weights). The config is not changed (5.18
rewrites ``hidden_act`` at construction; a saved fine-tune here keeps "gelu"). Like 5.18.0, and unlike
4.39-4.47, ``hidden_activation`` is not read: a config with ``hidden_activation="gelu"`` (4.39's way to keep
exact GELU) gets tanh GELU too, as on 5.18+.

Pass-through, bit-identical: any other ``hidden_act`` (the default ``gelu_pytorch_tanh``, a deliberate
``relu``), an ``act_fn`` someone replaced (not the exact GELU class), a call with arguments other than ``x``,
every other model, and a ``GemmaMLP.forward`` already replaced by other code when the shim is installed (a
fused kernel such as Liger's: left to it, the shim skipped with that reason). The decision reads config strings and types only,
so under ``torch.compile`` it is taken at trace time.

Follow-ups: the fix carried is 5.18.0's GemmaConfig conversion (no PR number found; cited by its release file).
transformers 5.19.0, 5.20.0, 5.24.0 and 5.25.0: GemmaConfig.__post_init__ maps 'gelu' the same way and GemmaMLP
is unchanged (5.25.0 configuration_gemma.py lines 87-96, modeling_gemma.py 84-97).
"""

from __future__ import annotations

import logging
import sys

from .._util import acted, compiling, warn_once
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

MODULE = "transformers.models.gemma.modeling_gemma"
RELEASE_5_18 = "https://github.com/huggingface/transformers/blob/v5.18.0/src/transformers/models/gemma/configuration_gemma.py"

SPEC = ShimSpec(
    id="gemma_hidden_act_gelu_regression",
    since="0.2.0",
    title="Gemma (v1) configs with hidden_act='gelu' run exact GELU instead of tanh GELU (transformers 4.48-5.17)",
    symptom="a Gemma / PaliGemma-1 model whose config says hidden_act='gelu' (the released Gemma configs) runs the "
    "exact erf GELU in every MLP on transformers 4.48.0-5.17.x, not the tanh approximation it was trained with: "
    "MLP outputs and logits shift (up to 4.7e-4 per activation), silently; 4.39-4.47 and 5.18+ run tanh GELU",
    why="transformers 4.48's modular Gemma builds the MLP activation from hidden_act again, and the released Gemma "
    "configs say 'gelu' (exact GELU) although Gemma was trained with tanh GELU; 5.18.0 maps 'gelu' to "
    "'gelu_pytorch_tanh' in GemmaConfig. The shim runs such MLPs with 5.18's activation.",
    requires={"transformers": ">=4.48.0,<5.18.0"},
    fixed_in={"transformers": "5.18.0"},
    refs=(
        "https://github.com/huggingface/transformers/pull/35235",
        "https://github.com/huggingface/transformers/pull/29402",
        RELEASE_5_18,
    ),
    backports=(RELEASE_5_18,),
    follow_ups_checked="transformers 5.19.0, 5.20.0, 5.24.0 and 5.25.0: GemmaConfig.__post_init__ maps 'gelu' the "
    "same way and GemmaMLP is unchanged (5.25.0 configuration_gemma.py lines 87-96, modeling_gemma.py 84-97)",
    targets=(Target(MODULE, "GemmaMLP.forward", params=("x",)),),
    modules=(MODULE,),
)

log = logging.getLogger("ftshims")

_LOGGED: set = set()
EXACT, TANH = "gelu", "gelu_pytorch_tanh"  # the config value upstream maps, and what 5.18.0 maps it to


def _shared():
    # One activation instance per name, shared with the 4.38 shim (ACT2FN builds a new module per lookup).
    from . import gemma_4_38_norm_and_activation as gemma_4_38

    return gemma_4_38


def _mlp_forward(wrapped, instance, args, kwargs):
    shared = _shared()
    x = shared._only_x(args, kwargs)
    config = getattr(instance, "config", None)
    if x is None or getattr(config, "hidden_act", None) != EXACT:
        return wrapped(*args, **kwargs)
    exact, tanh = shared._activation(EXACT), shared._activation(TANH)
    if exact is None or tanh is None or type(getattr(instance, "act_fn", None)) is not type(exact):
        return wrapped(*args, **kwargs)  # an act_fn someone replaced: theirs, as upstream runs it
    if not compiling():  # no Python side effects in a compile trace (compiling() also primes acted/warn_once's check)
        acted(SPEC.id, "Gemma MLP calls run with tanh GELU (hidden_act='gelu', as transformers 5.18+)")
        warn_once(_LOGGED, "gelu", lambda: log.info(
            "ftshims %s: Gemma config hidden_act='gelu' runs tanh-approximate GELU, as transformers 5.18+ does "
            "(4.48-5.17 run exact GELU on weights trained with tanh GELU)", SPEC.id))
    # transformers 5.18.0 GemmaMLP.forward (modeling_gemma.py lines 95-97) with act_fn = ACT2FN["gelu_pytorch_tanh"]
    return instance.down_proj(tanh(instance.gate_proj(x)) * instance.up_proj(x))


def install(patcher, options) -> None:
    from ..foreign import foreign_origin
    from ..spec import TargetMissing

    module = sys.modules[MODULE]
    _shared()._prepare_activations()  # built outside any compile trace; a trace only reads the cache
    cls = vars(module).get("GemmaMLP")
    if cls is None or "forward" not in vars(cls):
        raise TargetMissing(f"{MODULE}.GemmaMLP.forward not found")
    origin = foreign_origin(cls, vars(cls)["forward"], ("transformers",))
    if origin:
        # The wrapper computes the MLP itself when it acts, which would silently drop another library's
        # replacement (a fused kernel): leave it to that library.
        raise TargetMissing(f"GemmaMLP.forward was replaced by {origin}; left to it")
    patcher.wrap(cls, "forward", _mlp_forward)


# ---------------------------------------------------------------------------
# Reproduction

# case -> (model, dtype, hidden_act). "gelu" is the released configs' value; "gelu_pytorch_tanh" the
# GemmaConfig default (healthy on every version).
SCENARIOS = {
    "gelu_fp32": ("gemma", "float32", EXACT),
    "gelu_bf16": ("gemma", "bfloat16", EXACT),
    "paligemma_gelu": ("paligemma", "float32", EXACT),
    "tanh_config": ("gemma", "float32", TANH),
}

# Exact and tanh GELU differ by up to 4.7e-4 per gate value; on the tiny model (gate pre-activations of order 1)
# every MLP output moves by ~1e-3 (fp32). Equal formulas give exactly 0 (same operations, same inputs).
THRESHOLD = 1e-5


def tiny_paligemma(hidden_act: str = EXACT, seed: int = 0):
    """A tiny random PaliGemmaForConditionalGeneration (fp32, eval) whose text_config says ``hidden_act``."""
    import torch
    import transformers

    if not hasattr(transformers, "PaliGemmaConfig"):
        raise ProbeUnsupported("this transformers has no PaliGemma")
    text = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "hidden_act": hidden_act,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 16, "patch_size": 8}
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=127,
                                          projection_dim=64)
    torch.manual_seed(seed)
    with torch.no_grad():
        model = transformers.PaliGemmaForConditionalGeneration(config)
        for name, p in model.named_parameters():
            if "mlp" in name and p.dim() == 2:
                p.normal_(0, 0.2)  # gate pre-activations of order 1, where exact and tanh GELU differ
    return model.eval()


def mlp_gap(model, input_ids) -> float:
    """Max |GemmaMLP output - the same MLP with tanh GELU (5.18.0's forward)| over every GemmaMLP of ``model``,
    each on the input it received in one forward of ``input_ids``."""
    import torch

    seen = [0.0]

    def hook(module, inputs, output):
        x = inputs[0]
        expected = module.down_proj(torch.nn.functional.gelu(module.gate_proj(x), approximate="tanh") * module.up_proj(x))
        seen[0] = max(seen[0], (output.float() - expected.float()).abs().max().item())

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "GemmaMLP"]
    if not handles:
        raise ProbeUnsupported("the model has no GemmaMLP")
    try:
        with torch.no_grad():
            # the all-ones mask: PaliGemma before 4.45 reads attention_mask unconditionally in a text-only forward
            model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    finally:
        for handle in handles:
            handle.remove()
    return seen[0]


def probe(case: str = "gelu_fp32") -> Observation:
    """Tiny Gemma (or PaliGemma-1): does every GemmaMLP compute tanh GELU, as transformers 5.18.0 does for its
    config? ``gelu_fp32`` / ``gelu_bf16``: GemmaForCausalLM with ``hidden_act="gelu"`` (the released configs);
    ``paligemma_gelu``: PaliGemma whose text_config says "gelu" (text-only forward: the language model's MLPs);
    ``tanh_config``: ``hidden_act="gelu_pytorch_tanh"`` (healthy on every version)."""
    from .. import tiny
    from ..versions import in_range, installed_version

    if case not in SCENARIOS:
        raise ValueError(f"unknown case {case!r}")
    if in_range(installed_version("transformers"), ">=4.38.0,<4.39.0"):
        # exact GELU here comes before PR #29402: gemma_4_38_norm_and_activation's bug and fix, not this one's
        raise ProbeUnsupported("transformers 4.38.x: exact GELU predates PR #29402 (gemma_4_38_norm_and_activation)")
    model_kind, dtype, hidden_act = SCENARIOS[case]
    with tiny.quiet():
        if model_kind == "paligemma":
            model = tiny_paligemma(hidden_act)
        else:
            model = _shared().tiny_gemma(dtype, hidden_act)
        input_ids = tiny.batch(batch_size=2, seq_len=12, vocab_size=120)["input_ids"]
        gap = mlp_gap(model, input_ids)
        config = getattr(model.config, "text_config", model.config)
        act = type(next(m for m in model.modules() if type(m).__name__ == "GemmaMLP").act_fn).__name__
    detail = (f"{case}: {model_kind} {dtype}, hidden_act={hidden_act!r} (config now {config.hidden_act!r}, act_fn "
              f"{act}): max |GemmaMLP - tanh-GELU MLP (5.18.0)| {gap:.3g}")
    return Observation(gap > THRESHOLD, detail)
