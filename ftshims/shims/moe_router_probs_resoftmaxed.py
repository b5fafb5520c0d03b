"""MoE routers return probabilities as ``router_logits`` and the load-balancing loss softmaxes them again (5.0-5.5).

Why: the 5.0 MoE refactor moved routing into ``*TopKRouter`` modules whose ``forward`` computes
``router_logits = F.linear(h, weight)`` and then reassigns ``router_logits = softmax(router_logits)`` before
returning it as element 0. That element is what the output recorder collects as ``outputs.router_logits`` and what
``load_balancing_loss_func`` receives, and that function applies softmax itself: the auxiliary loss is computed on
softmax(softmax(logits)), pushed towards uniform. The aux loss value is wrong and the balancing gradient on the
router weights is mostly lost (a tiny MiniMax, padded batch, 5.0.0: aux 2.0095 where the raw logits give 2.0451;
the router gradient off by 0.0070 where its largest entry is 0.0090); ``outputs.router_logits`` handed to user or
TRL code are probabilities, not logits. 4.57 returned the gate's raw logits. transformers#45120, fixed by PR #45131
(merged, 5.6.0: the softmax goes to a separate ``router_probs``; element 0 is the raw logits again). PRs #45111,
#45132 and #43542 proposed the same and were closed; #45346 only adds tests.

The fix: the shim wraps the ``forward`` of each affected router class and returns ``log(p)`` (clamped at the
dtype's smallest normal number) as element 0 instead of ``p``. log-probabilities are the raw logits minus the
row's logsumexp, so softmax(log p) = p: ``load_balancing_loss_func`` sees the router's probabilities once, as with
the raw logits of 5.6+, and its gradient reaches the router weights exactly (the softmax Jacobian annihilates the
per-row constant). Elements 1 and 2 (the top-k weights and indices the MoE block uses) are untouched, so the forward
pass, the language-model loss and generation are bit-identical; only the recorded router output (log-probabilities,
equal to 5.6's logits up to a per-row constant) and the aux loss computed from it change. Routers that return
logits (GPT-OSS, MiniMax-M2, ERNIE-4.5-MoE, Phi-MoE from 5.2, Jamba, DBRX, ...) are not wrapped.

Families (read in the wheels, ``router_logits = softmax(router_logits ...)`` followed by
``return router_logits, router_scores, router_indices``): Mixtral, MiniMax, OLMoE, FlexOlmo, Qwen2-MoE, Qwen3-MoE,
Qwen3-Next, Qwen3-VL-MoE (text), Qwen3-Omni-MoE (thinker text, talker text and ``Qwen3OmniMoeTextTopKRouter``) in
5.0.0-5.5.4, and Qwen3.5-MoE from 5.2.0 (where it appears). 5.6.0 and later (read 5.6.0, 5.6.2, 5.7.0, 5.9.0, 5.24.0,
5.25.0) return raw logits; DBRX's local softmax is not returned (not affected). On 5.0.0-5.1.0, FlexOlmo, Qwen3-Next
and the Qwen3-Omni thinker record their router logits from the wrong module (no or garbage aux loss): the shim
``moe_router_logits_not_recorded`` records them from the router, after which this shim's output is what is recorded.
On 5.0.0-5.1.0 transformers' output recorder leaves each recorded router's ``forward`` bound on the instance after
the first forward with ``output_router_logits``; a model run that way before ``ftshims.apply()`` keeps that binding
and is not reached (apply first, as the start-up hook does). The shim stays out for a router class whose ``forward``
was replaced by another library (a fused kernel may return
logits already), and for an output that is not the 3-tuple read.

Follow-ups: #45346 (open) adds only tests; 5.6.2, 5.7.0, 5.9.0, 5.24.0 and 5.25.0 keep the routers' router_probs/raw
router_logits split of #45131 and load_balancing_loss_func's single softmax.
"""

from __future__ import annotations

import logging

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

log = logging.getLogger("ftshims")

_M = "transformers.models.{0}.modeling_{0}"

# (modeling module, router class, transformers versions that have it)
ROUTERS = (
    (_M.format("mixtral"), "MixtralTopKRouter", None),
    (_M.format("minimax"), "MiniMaxTopKRouter", None),
    (_M.format("olmoe"), "OlmoeTopKRouter", None),
    (_M.format("flex_olmo"), "FlexOlmoTopKRouter", None),
    (_M.format("qwen2_moe"), "Qwen2MoeTopKRouter", None),
    (_M.format("qwen3_moe"), "Qwen3MoeTopKRouter", None),
    (_M.format("qwen3_next"), "Qwen3NextTopKRouter", None),
    (_M.format("qwen3_vl_moe"), "Qwen3VLMoeTextTopKRouter", None),
    (_M.format("qwen3_omni_moe"), "Qwen3OmniMoeTextTopKRouter", None),
    (_M.format("qwen3_omni_moe"), "Qwen3OmniMoeThinkerTextTopKRouter", None),
    (_M.format("qwen3_omni_moe"), "Qwen3OmniMoeTalkerTextTopKRouter", None),
    (_M.format("qwen3_5_moe"), "Qwen3_5MoeTopKRouter", ">=5.2.0"),
)

PARAMS = ("hidden_states",)

SPEC = ShimSpec(
    id="moe_router_probs_resoftmaxed",
    since="0.3.0",
    title="MoE routers return softmax probabilities as router_logits and load_balancing_loss_func softmaxes them "
    "again (Mixtral, Qwen2/3-MoE, OLMoE, MiniMax, FlexOlmo, Qwen3-Next/VL/Omni/3.5-MoE)",
    symptom="output_router_logits=True on transformers 5.0-5.5: the load-balancing aux loss is computed on "
    "softmax(softmax(logits)), its value is wrong and its gradient on the router weights is mostly lost; "
    "outputs.router_logits are probabilities; silently",
    why="The 5.0 routers reassign router_logits = softmax(router_logits) and return it; the loss softmaxes again. "
    "The shim returns log(p) instead of p as the router's first output: softmax(log p) = p, so the loss and its "
    "gradient are those of the raw logits (5.6+), and the MoE block's routing is untouched.",
    requires={"transformers": ">=5.0.0,<5.6.0"},
    fixed_in={"transformers": "5.6.0"},
    refs=(
        "https://github.com/huggingface/transformers/issues/45120",
        "https://github.com/huggingface/transformers/pull/45131",
        "https://github.com/huggingface/transformers/pull/45111",
        "https://github.com/huggingface/transformers/pull/45132",
        "https://github.com/huggingface/transformers/pull/43542",
        "https://github.com/huggingface/transformers/pull/45346",
    ),
    backports=("https://github.com/huggingface/transformers/pull/45131",),
    unpinned="the Qwen3.5-MoE router target (5.2.0+) has no pinned stack inside 5.2-5.5: the early-5.x stack is "
    "5.1.0, inside the ranges of all three early-5.x MoE/custom-init shims (moe_router_logits_not_recorded ends "
    "before 5.2). Its forward is Qwen3-Next's router line for line (softmax, top-k, renormalised; read in the 5.5.4 "
    "wheel), whose fix the probe measures on 5.1.0; the drift canary checks the target in the tracked releases",
    follow_ups_checked="#45346 (open) adds only tests; 5.6.2, 5.7.0, 5.9.0, 5.24.0 and 5.25.0 keep the routers' "
    "router_probs/raw router_logits split of #45131 and load_balancing_loss_func's single softmax",
    targets=tuple(Target(module, f"{cls}.forward", params=PARAMS, when=when) for module, cls, when in ROUTERS),
    modules=("transformers",),
)


def log_probabilities(probs):
    """``log(p)``, clamped at the dtype's smallest normal number (an underflowed 0 gives a finite, zero-gradient
    entry instead of -inf and a NaN gradient)."""
    import torch

    return probs.clamp_min(torch.finfo(probs.dtype).tiny).log()


def _router_forward(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    if type(out) is not tuple or len(out) != 3:
        return out
    acted(SPEC.id, "router probabilities returned as log-probabilities")
    return (log_probabilities(out[0]),) + out[1:]


def install(patcher, options) -> None:
    from ..foreign import foreign_origin
    from ..patching import require_params
    from ..versions import in_range, installed_version

    version = installed_version("transformers")
    for module_name, class_name, when in ROUTERS:
        if when is not None and not in_range(version, when):
            continue

        def part(module, module_name=module_name, class_name=class_name):
            cls = vars(module).get(class_name)
            if cls is None or "forward" not in vars(cls):
                raise TargetMissing(f"{module_name}.{class_name}.forward not found")
            require_params(cls.forward, PARAMS, f"{module_name}.{class_name}.forward")
            origin = foreign_origin(cls, vars(cls)["forward"], ("transformers",))
            if origin:
                raise TargetMissing(f"{class_name}.forward was replaced by {origin}; left to it")
            patcher.wrap(cls, "forward", _router_forward)

        patcher.when_imported(module_name, part)


# ---------------------------------------------------------------------------
# Reproduction: the aux loss and its router gradient against the same loss on the raw router logits

TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=99, num_experts=8,
            num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01, output_router_logits=True,
            shared_expert_intermediate_size=32, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=None)

FAMILIES = ("minimax", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo", "qwen3_next", "minimax_m2")


def build(family: str):
    """A tiny causal MoE of ``family`` with non-uniform routers (weights ~ N(0, 1), like a trained router)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .. import tiny

    overrides = dict(TINY)
    if family == "qwen3_next":
        overrides["layer_types"] = ["linear_attention", "full_attention"]
    else:
        overrides.pop("layer_types")
    torch.manual_seed(0)
    with tiny.quiet():
        config = AutoConfig.for_model(family, **overrides)
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for weight in router_weights(model).values():
            weight.normal_(0.0, 1.0)
    return model.train()


def router_weights(model):
    """``{module name: weight}`` of the router linears: a 2-D weight (num experts x hidden) on a module named
    ``gate`` or ``router`` (4.57's ``nn.Linear`` gates and 5.x's ``*TopKRouter`` modules alike)."""
    config = model.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.rsplit(".", 1)[-1] in ("gate", "router") and weight is not None and weight.dim() == 2 \
                and weight.shape == (experts, config.hidden_size):
            found[name] = weight
    return found


def reference_aux_loss(loss_func, logits, experts, top_k, attention_mask):
    """``load_balancing_loss_func`` of the model's module on ``logits``, with the attention mask where it takes one
    (Mixtral before 4.38 takes three arguments and averages over padding too, as its model then does)."""
    import inspect

    if "attention_mask" in inspect.signature(loss_func).parameters:
        return loss_func(logits, experts, top_k, attention_mask)
    return loss_func(logits, experts, top_k)


def aux_against_raw_logits(model, input_ids, attention_mask):
    """``(aux as computed, aux from the raw router logits, grads as computed, grads from raw logits)`` for the
    router weights; the raw logits are recomputed from each router's input (its linear, no softmax)."""
    import sys

    import torch
    import torch.nn.functional as F

    modules = dict(model.named_modules())
    weights = router_weights(model)
    raw = []
    hooks = [modules[name].register_forward_pre_hook(
        lambda mod, args, w=w: raw.append(F.linear(args[0].reshape(-1, w.shape[1]), w,
                                                   getattr(mod, "bias", None)))) for name, w in weights.items()]
    try:
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_router_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    if not torch.is_tensor(out.aux_loss):
        raise ProbeUnsupported(f"{type(model).__name__} computes no aux loss here (aux_loss={out.aux_loss!r})")
    config = model.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    loss_func = sys.modules[type(model).__module__].load_balancing_loss_func
    reference = reference_aux_loss(loss_func, tuple(raw), experts, config.num_experts_per_tok, attention_mask)
    params = list(weights.values())
    grads = torch.autograd.grad(out.aux_loss, params, retain_graph=True)
    reference_grads = torch.autograd.grad(reference, params)
    return out.aux_loss.detach(), reference.detach(), grads, reference_grads


def probe(family: str = "minimax") -> Observation:
    """A padded batch through a tiny MoE with output_router_logits=True: are the aux loss and its gradient on the
    router weights those of the raw router logits?"""
    import torch
    import transformers
    from packaging.version import Version

    version = Version(transformers.__version__)
    if family in ("flex_olmo", "qwen3_next") and Version("5.0.0") <= version < Version("5.2.0"):
        raise ProbeUnsupported(f"{family} records no router logits before 5.2 (moe_router_logits_not_recorded)")
    try:
        model = build(family)
    except (ValueError, KeyError) as exc:
        raise ProbeUnsupported(f"{family} is not in transformers {transformers.__version__} "
                               f"({type(exc).__name__})") from None
    torch.manual_seed(1)
    input_ids = torch.randint(3, 99, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding
    aux, reference, grads, reference_grads = aux_against_raw_logits(model, input_ids, attention_mask)
    grad_gap = max(float((g - r).abs().max()) for g, r in zip(grads, reference_grads))
    grad_top = max(float(r.abs().max()) for r in reference_grads)
    bug = not torch.allclose(aux, reference, rtol=1e-5, atol=1e-6) or grad_gap > 1e-5 * max(grad_top, 1e-3)
    detail = (f"{family}: aux loss {float(aux):.4f}, from the raw router logits {float(reference):.4f}; router "
              f"weight grad max |diff| {grad_gap:.2e} (largest entry {grad_top:.2e})")
    return Observation(bug, detail)
