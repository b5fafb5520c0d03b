"""Gemma on transformers 4.38.x: exact GELU instead of the tanh approximation, and RMSNorm rounded halfway.

Why: Gemma was trained with the tanh-approximate GELU and computes its RMSNorm
``x_normed * (1 + w)`` in float32 before casting back. transformers 4.38.0-4.38.2
(``models/gemma/modeling_gemma.py``) got both wrong:

* ``GemmaMLP`` builds ``self.act_fn = ACT2FN[config.hidden_act]`` (4.38.0/4.38.1
  line 165, 4.38.2 line 171), and the released Gemma configs (and 4.38's
  ``GemmaConfig`` default) say ``hidden_act="gelu"``: the *exact* erf GELU.
* ``GemmaRMSNorm.forward`` is ``self._norm(x.float()).type_as(x) * (1 + self.weight)``
  (lines 87-89 in all three): in a bf16/fp16 model the normalised value is
  rounded to 8 (11) bits first, and ``1 + w`` is computed in bf16/fp16 too, so
  a norm weight near zero (Gemma stores the offset from 1) is rounded to
  multiples of 2**-7 (bf16).

Both differ from the reference implementation and silently change every
activation of a bf16 fine-tune or evaluation. transformers PR #29402
("Gemma bug fixes - Approx GELU, Layernorms, Sqrt(hd)", merged for 4.39.0;
gemma_pytorch PR #37 is the same GELU fix in Google's reference code) fixed
them: 4.39.0 lines 89-94 compute ``output = self._norm(x.float());
output = output * (1.0 + self.weight.float()); return output.type_as(x)``, and
lines 175-186 pick ``config.hidden_activation`` when a config sets it, else
``gelu_pytorch_tanh`` (with a warning).

The fix, on transformers >=4.38.0,<4.39.0 only, two wrapped methods of
``transformers.models.gemma.modeling_gemma`` (nothing else; no other model
uses these classes in 4.38.x):

* ``GemmaRMSNorm.forward``: when the input or the weight is bf16/fp16, returns
  4.39.0's formula (float32 throughout, one cast at the end; the output has the
  input's dtype, as in 4.39). float32 and float64 norms pass through: for
  float32 both formulas are the same operations (bit-identical), and float64
  has no rounding problem (4.39 would even compute it in float32).
* ``GemmaMLP.forward``: when the module's config sets ``hidden_activation``
  (4.39's field; 4.38 ignores it, but newer Hub configs carry it), that
  activation is used, as 4.39 does; when it does not and ``hidden_act`` is
  ``"gelu"`` (the released configs), ``gelu_pytorch_tanh`` is used, as 4.39
  does. The forward is 4.38's own ``down_proj(act(gate_proj(x)) * up_proj(x))``
  with that activation. Where 4.39 differs from this: 4.39 also turns any other
  ``hidden_act`` (``"relu"``, ...) without ``hidden_activation`` into tanh GELU;
  the shim leaves such a deliberate custom choice alone, since it is not the
  bug (transformers 5.x settled on exactly this rule: only ``"gelu"`` is mapped
  to the tanh approximation). Set ``config.hidden_activation = "gelu"`` to
  keep the exact GELU, as 4.39's warning says.

Pass-through (4.38 behaviour, bit-identical): a module whose ``act_fn`` is not
the one 4.38 built from ``config.hidden_act`` (someone replaced it), a
``hidden_activation`` that ``ACT2FN`` does not know, a call with arguments other
than ``x``, and a ``forward`` already replaced by other code when the shim is
installed (a foreign patch such as a fused kernel: left alone, with a note).
The wrappers decide from dtypes and config strings only, so under
``torch.compile`` the decision is taken at trace time.

Not included: PR #29402 also rounds the embedding normaliser ``sqrt(hidden_size)``
to the model dtype (4.39.0 lines 901-904). That multiplication sits inline in
``GemmaModel.forward`` and cannot be reproduced bit-exactly without rewriting
the whole forward, so 4.38.x + this shim still scales bf16 embeddings by
``sqrt(h)`` rather than by its bf16 rounding (for 3072: 55.43 instead of 55.5).

Follow-ups: #35235 (4.48.0's modular rewrite makes GemmaMLP read hidden_act again: exact GELU for
hidden_act='gelu' on 4.48.0-5.17.x) — not carried: outside this shim's range (4.38.x); the doctor's
advisory gemma_hidden_act_gelu_exact_regression covers those versions (and the shim
gemma_hidden_act_gelu_regression fixes them). https://github.com/huggingface/transformers/blob/v5.18.0/src/transformers/models/gemma/configuration_gemma.py
(5.18.0's GemmaConfig maps hidden_act='gelu' to 'gelu_pytorch_tanh' and leaves other values alone) —
carried: it is the rule this shim applies when hidden_activation is unset. GemmaRMSNorm read in
4.39.0-4.39.3, 4.40.0, 4.49.0, 4.53.3, 4.56.2, 4.57.6, 5.0.0, 5.9.0, 5.16.1, 5.24.0 and 5.25.0: the
float32 norm #29402 added is unchanged.
"""

from __future__ import annotations

import logging
import sys

from .._util import acted, warn_once
from ..spec import FollowUp, Observation, ProbeUnsupported, ShimSpec, Target

MODULE = "transformers.models.gemma.modeling_gemma"

SPEC = ShimSpec(
    id="gemma_4_38_norm_and_activation",
    since="0.1.0",
    title="Gemma on transformers 4.38.x runs exact GELU and rounds RMSNorm to bf16/fp16 before (1 + w)",
    symptom="a bf16/fp16 Gemma on transformers 4.38.0-4.38.2 rounds every RMSNorm output (and 1 + weight) to the "
    "model dtype before the multiply, and a config with hidden_act='gelu' (the released Gemma configs) runs exact "
    "GELU instead of the tanh approximation the model was trained with: logits differ from 4.39+",
    why="transformers 4.38.x computes Gemma's RMSNorm (1 + w) product in the model dtype and uses exact GELU for "
    "the released configs (hidden_act='gelu'); Gemma was trained with a float32 norm and tanh GELU. The shim "
    "computes the norm in float32 and picks the activation as 4.39.0 does.",
    requires={"transformers": ">=4.38.0,<4.39.0"},
    fixed_in={"transformers": "4.39.0"},
    refs=(
        "https://github.com/huggingface/transformers/pull/29402",
        "https://github.com/huggingface/transformers/pull/29995",
        "https://github.com/google/gemma_pytorch/pull/37",
        "https://github.com/vllm-project/vllm/issues/3411",
        "https://github.com/huggingface/transformers/pull/35235",
        "https://github.com/huggingface/transformers/blob/v5.18.0/src/transformers/models/gemma/configuration_gemma.py",
    ),
    backports=("https://github.com/huggingface/transformers/pull/29402",),
    follow_ups=(
        FollowUp("https://github.com/huggingface/transformers/pull/35235", "4.48.0's modular rewrite makes GemmaMLP "
                 "read hidden_act again: exact GELU for hidden_act='gelu' on 4.48.0-5.17.x", carried=False,
                 reason="outside this shim's range (4.38.x); the doctor's advisory "
                 "gemma_hidden_act_gelu_exact_regression covers those versions"),
        FollowUp("https://github.com/huggingface/transformers/blob/v5.18.0/src/transformers/models/gemma/"
                 "configuration_gemma.py", "5.18.0's GemmaConfig maps hidden_act='gelu' to 'gelu_pytorch_tanh' and "
                 "leaves other values alone", carried=True),
    ),
    follow_ups_checked="GemmaRMSNorm read in 4.39.0-4.39.3, 4.40.0, 4.49.0, 4.53.3, 4.56.2, 4.57.6, 5.0.0, 5.9.0, "
    "5.16.1, 5.24.0 and 5.25.0: the float32 norm #29402 added is unchanged.",
    targets=(
        Target(MODULE, "GemmaRMSNorm.forward", params=("x",)),
        Target(MODULE, "GemmaMLP.forward", params=("x",)),
    ),
    modules=(MODULE,),
)

log = logging.getLogger("ftshims")

_WARNED: set = set()
_HALF = None
# One activation module per ACT2FN name: ACT2FN[...] builds a new module on every lookup.
_ACTS: dict = {}


def _half_dtypes():
    global _HALF
    if _HALF is None:
        import torch

        _HALF = (torch.bfloat16, torch.float16)
    return _HALF


def _activation(name):
    """``ACT2FN[name]`` (one shared instance per name), or None when ACT2FN does not know it."""
    act = _ACTS.get(name)
    if act is None:
        from transformers.activations import ACT2FN

        try:
            act = ACT2FN[name]
        except KeyError:
            return None
        _ACTS[name] = act
    return act


def _prepare_activations() -> None:
    # Built once at install, outside any torch.compile trace: a trace then only reads the cache.
    for name in ("gelu", "gelu_pytorch_tanh"):
        _activation(name)


def wanted_activation(config):
    """The ACT2FN name 4.39 would use for this config, or None where the shim keeps 4.38's choice."""
    explicit = getattr(config, "hidden_activation", None)
    if explicit is not None:
        # 4.39 honours an explicit hidden_activation (newer Hub configs carry it; 4.38 ignores it).
        return explicit if isinstance(explicit, str) else None
    if getattr(config, "hidden_act", None) == "gelu":
        return "gelu_pytorch_tanh"  # 4.39's default when hidden_activation is unset
    return None  # a deliberate custom hidden_act: not the bug, left as 4.38 has it


def _only_x(args, kwargs):
    """The ``x`` of a ``forward(x)`` call, or None for any other call shape."""
    if len(args) == 1 and not kwargs:
        return args[0]
    if not args and len(kwargs) == 1 and "x" in kwargs:
        return kwargs["x"]
    return None


def _norm_forward(wrapped, instance, args, kwargs):
    x = _only_x(args, kwargs)
    half = _half_dtypes()
    weight = getattr(instance, "weight", None)
    if x is None or weight is None or (x.dtype not in half and weight.dtype not in half):
        return wrapped(*args, **kwargs)  # float32 / float64: 4.38 is already right (bit-identical for float32)
    acted(SPEC.id, "Gemma RMSNorm calls computed in float32")  # acted/warn_once do nothing inside a compile trace
    # transformers 4.39.0 GemmaRMSNorm.forward, lines 90-94
    output = instance._norm(x.float())
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def _mlp_forward(wrapped, instance, args, kwargs):
    x = _only_x(args, kwargs)
    config = getattr(instance, "config", None)
    name = wanted_activation(config) if config is not None and x is not None else None
    if name is None:
        return wrapped(*args, **kwargs)
    act = _activation(name)
    hidden_act = getattr(config, "hidden_act", None)
    built = _activation(hidden_act) if isinstance(hidden_act, str) else None
    current = getattr(instance, "act_fn", None)
    if act is None or built is None or type(current) is not type(built) or type(current) is type(act):
        # unknown name, an act_fn someone replaced, or already the wanted activation: 4.38 as is
        return wrapped(*args, **kwargs)
    acted(SPEC.id, "Gemma MLP calls run with the config's 4.39 activation")
    warn_once(_WARNED, name, lambda: log.warning(
        "ftshims %s: Gemma config hidden_act=%r runs %s on transformers 4.38.x; using %r as transformers "
        "4.39+ does (set config.hidden_activation to choose explicitly)",
        SPEC.id, config.hidden_act, type(current).__name__, name,
    ))
    # transformers 4.38.x GemmaMLP.forward with the activation 4.39.0 (lines 175-186) picks
    return instance.down_proj(act(instance.gate_proj(x)) * instance.up_proj(x))


def install(patcher, options) -> None:
    from ..foreign import foreign_origin
    from ..spec import TargetMissing

    module = sys.modules[MODULE]
    _prepare_activations()
    wrapped_any = False
    for class_name, wrapper in (("GemmaRMSNorm", _norm_forward), ("GemmaMLP", _mlp_forward)):
        cls = vars(module).get(class_name)
        if cls is None or "forward" not in vars(cls):
            raise TargetMissing(f"{MODULE}.{class_name}.forward not found")
        origin = foreign_origin(cls, vars(cls)["forward"], ("transformers",))
        if origin:
            # Both wrappers compute the module's output themselves when they act, which would silently drop
            # another library's replacement (a fused kernel): leave that class to it.
            note = f"{class_name}.forward was replaced by {origin}; left to it"
            patcher.notes.append(note)
            log.info("%s: %s", SPEC.id, note)
            continue
        patcher.wrap(cls, "forward", wrapper)
        wrapped_any = True
    if not wrapped_any:
        raise TargetMissing("GemmaRMSNorm.forward and GemmaMLP.forward are both replaced by other code")


# ---------------------------------------------------------------------------
# Reproduction

# The released Gemma config says hidden_act="gelu"; the "norm" scenarios use the tanh approximation in the
# config itself so that only the norm differs.
SCENARIOS = {
    "norm_bf16": {"dtype": "bfloat16", "hidden_act": "gelu_pytorch_tanh", "norm": True, "mlp": False},
    "norm_fp16": {"dtype": "float16", "hidden_act": "gelu_pytorch_tanh", "norm": True, "mlp": False},
    "activation": {"dtype": "float32", "hidden_act": "gelu", "norm": False, "mlp": True},
    "both": {"dtype": "bfloat16", "hidden_act": "gelu", "norm": True, "mlp": True},
    "fp32_tanh_config": {"dtype": "float32", "hidden_act": "gelu_pytorch_tanh", "norm": True, "mlp": True},
}

# Where the installed code already follows 4.39 (or the shim is on), the reference below does the same
# tensor operations and every difference is exactly 0 (measured on 4.38.2+shim, 4.40.2, 4.57.6). With the
# bug, bf16/fp16 rounding of the norm output and of (1 + w), or exact-vs-tanh GELU (up to ~5e-4 per gate
# value), moves the logits of this model by 2.6e-3 (float32, activation only) to 0.19 (bfloat16). 1e-5
# separates the two by two orders of magnitude either way, and tolerates an activation implementation
# that rounds differently by a few float32 ulps.
THRESHOLD = 1e-5


def tiny_gemma(dtype: str = "bfloat16", hidden_act: str = "gelu", seed: int = 0, **overrides):
    """A tiny random GemmaForCausalLM with non-zero norm weights (trained Gemma norms are far from 0)."""
    import torch
    import transformers

    from .. import tiny

    if not hasattr(transformers, "GemmaConfig"):
        raise ProbeUnsupported("this transformers has no Gemma (added in 4.38.0)")
    fields = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": hidden_act,
        "initializer_range": 0.2,  # gate pre-activations of order 1, where exact and tanh GELU differ
    }
    fields.update(overrides)
    model = tiny.causal_lm("GemmaConfig", attn="eager", seed=seed, **fields)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "GemmaRMSNorm":
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.5)
    return model.to(getattr(torch, dtype)).eval()


def reference_norm(module, x):
    """transformers 4.39.0 GemmaRMSNorm.forward (lines 86-94), written out."""
    import torch

    xf = x.float()
    output = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)
    output = output * (1.0 + module.weight.float())
    return output.type_as(x)


def reference_mlp(module, x):
    """transformers 4.39.0 GemmaMLP for a config without hidden_activation: tanh-approximate GELU."""
    import torch

    gate = torch.nn.functional.gelu(module.gate_proj(x), approximate="tanh")
    return module.down_proj(gate * module.up_proj(x))


def logits_against_reference(model, input_ids, norm: bool = True, mlp: bool = True):
    """(max |logits - reference logits|, max |norm output - reference|, max |MLP output - reference|).

    The reference run is the same model with every GemmaRMSNorm (``norm``) and
    GemmaMLP (``mlp``) output replaced, by a forward hook, with 4.39.0's formula
    applied to that module's input; the per-module numbers compare each module's
    own output with the formula on the same input.
    """
    import torch

    seen = {"norm": 0.0, "mlp": 0.0}

    def observe(kind, ref):
        def hook(module, inputs, output):
            diff = (output.float() - ref(module, inputs[0]).float()).abs().max().item()
            seen[kind] = max(seen[kind], diff)

        return hook

    def replace(ref):
        return lambda module, inputs, output: ref(module, inputs[0])

    def run(make):
        handles = []
        for module in model.modules():
            name = type(module).__name__
            if norm and name == "GemmaRMSNorm":
                handles.append(module.register_forward_hook(make("norm", reference_norm)))
            elif mlp and name == "GemmaMLP":
                handles.append(module.register_forward_hook(make("mlp", reference_mlp)))
        try:
            with torch.no_grad():
                return model(input_ids=input_ids).logits.float()
        finally:
            for handle in handles:
                handle.remove()

    logits = run(observe)
    reference = run(lambda kind, ref: replace(ref))
    return (logits - reference).abs().max().item(), seen["norm"], seen["mlp"]


def probe(case: str = "norm_bf16") -> Observation:
    """Tiny Gemma: do the logits (and each RMSNorm / MLP output) equal 4.39.0's formulas?

    The default (the doctor's ``--probe``) is the norm: a bug of 4.38.x only. The activation part is back on
    4.48-5.17 for ``hidden_act="gelu"`` configs, where ``gemma_hidden_act_gelu_regression`` (5.18's rule)
    fixes it, not this shim: probed here by default, it would show as present-and-unpatched on those stacks.

    ``norm_bf16`` / ``norm_fp16``: the model in that dtype, tanh GELU in the
    config, norms compared. ``activation``: float32, ``hidden_act="gelu"`` as
    in the released configs, MLPs compared. ``both``: bfloat16 and
    ``hidden_act="gelu"``, both compared. ``fp32_tanh_config``: float32 with a
    tanh config, both compared (healthy on every version).
    """
    from .. import tiny

    if case not in SCENARIOS:
        raise ValueError(f"unknown case {case!r}")
    setup = SCENARIOS[case]
    with tiny.quiet():
        model = tiny_gemma(setup["dtype"], setup["hidden_act"])
        input_ids = tiny.batch(batch_size=2, seq_len=16, vocab_size=128)["input_ids"]
        logit_diff, norm_diff, mlp_diff = logits_against_reference(model, input_ids, setup["norm"], setup["mlp"])
    parts = [f"max |logits - 4.39 reference| {logit_diff:.3g}"]
    if setup["norm"]:
        parts.append(f"max |RMSNorm - 4.39 formula| {norm_diff:.3g}")
    if setup["mlp"]:
        parts.append(f"max |MLP - tanh-GELU MLP| {mlp_diff:.3g}")
    where = f"({case}: {setup['dtype']}, hidden_act={setup['hidden_act']!r})"
    bug = max(logit_diff, norm_diff, mlp_diff) > THRESHOLD
    return Observation(bug, ", ".join(parts) + " " + where)
