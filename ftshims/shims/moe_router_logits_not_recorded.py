"""FlexOlmo, GLM-4V-MoE, Qwen3-Next and Phi-MoE record their router logits from the wrong module on 5.0-5.1.

Why: 5.0 collects ``outputs.router_logits`` with an output recorder (``_can_record_outputs``) that hooks the module
class it names. Four MoE families name a module that is not their router's logits:

* FlexOlmo: ``OutputRecorder(nn.Linear, layer_name="mlp.gate")``, but ``mlp.gate`` is a ``FlexOlmoTopKRouter``
  (an ``nn.Module`` holding a weight), so nothing is recorded: ``load_balancing_loss_func`` returns the int 0 and
  ``output_router_logits=True`` with labels crashes (``AttributeError: 'int' object has no attribute 'to'``).
* GLM-4V-MoE: the same ``nn.Linear`` recorder (its router ``Glm4vMoeTextTopkRouter`` is no ``nn.Linear``), and
  the VL model's output class has no ``router_logits`` field: ``output_router_logits=True`` raises
  ``AttributeError: 'Glm4vMoeModelOutputWithPast' object has no attribute 'router_logits'``; past that, its aux loss
  reads ``self.num_experts`` and ``self.num_experts_per_tok``, which only 5.2.0's ``__init__`` sets.
* Qwen3-Next: ``OutputRecorder(Qwen3NextSparseMoeBlock, index=1)``, but the block returns a single tensor, which the
  recorder takes whole: the block's hidden states are recorded as router logits and the loss crashes in
  ``one_hot`` (``Class values must be smaller than num_classes``; with hidden_size <= num_experts it would be silent).
* Phi-MoE: ``PhimoeTopKRouter`` (an ``nn.Linear``) returns ``(routing_weights, selected_experts)``: the sparse
  top-k weights, not its logits, are recorded and the aux loss is computed on softmax(sparse weights), silently.

5.2.0 records each from the router (``OutputRecorder(FlexOlmoTopKRouter, index=0)``, ``(Qwen3NextTopKRouter,
index=0)``, ``Glm4vMoeTextTopkRouter``, and Phi-MoE's router returns ``router_logits =
super().forward(hidden_states)`` first). The Qwen3-Omni-MoE thinker and talker text models declare the same block
recorder as Qwen3-Next on 5.0-5.1; that multimodal model is not reached by this shim (not reproduced: no tiny build).

The fix: the shim wraps the base model's ``forward`` (the one transformers' ``check_model_inputs`` decorates:
``FlexOlmoModel``, ``Qwen3NextModel``, ``PhimoeModel``; for GLM-4V-MoE the VL model ``Glm4vMoeModel``, whose
output the aux loss reads, and ``Glm4vMoeForConditionalGeneration``, whose output the user reads) and, only when
router logits are requested
(``output_router_logits`` from the call, else the config, as the recorder decides), hooks every router module of the
model for the duration of that call, collects what 5.2.0's recorder collects (the router's first output; for
Phi-MoE the logits of its linear on the same, jittered, input: ``F.linear(hidden_states, weight)``) in call order, and
puts that tuple in ``outputs["router_logits"]`` (for GLM-4V-MoE it also sets the two expert counts 5.2.0's
``__init__`` sets, from ``config.text_config``, on a model that lacks them). The causal LM head then computes its
aux loss from it as in 5.2.
The forward itself, the language-model loss and every call without router logits are unchanged. On these versions
the FlexOlmo and Qwen3-Next routers return probabilities (5.0-5.5): ``moe_router_probs_resoftmaxed`` turns them
into log-probabilities, and the two shims together give 5.6's aux loss.

Applies to transformers >=5.0.0,<5.2.0 (read: 5.0.0 and 5.1.0 have the recorders above; 5.2.0, 5.5.4, 5.6.0 and
5.25.0 record from the router). It stays out, leaving the call as upstream makes it, when the output is a tuple
(``return_dict=False``) or no router module ran.

Follow-ups: the merged upstream change was not identified; 5.2.0's code (read in the wheel) records FlexOlmo and
Qwen3-Next from their TopKRouter (index 0) and Phi-MoE's router returns its raw logits first; 5.5.4, 5.6.0 and
5.25.0 keep that; 5.2-5.5's FlexOlmo and Qwen3-Next routers return probabilities (the shim
moe_router_probs_resoftmaxed).
"""

from __future__ import annotations

import logging

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

log = logging.getLogger("ftshims")

FIXED_CODE = ("https://github.com/huggingface/transformers/blob/v5.2.0/src/transformers/models/flex_olmo/"
              "modeling_flex_olmo.py")
FOLLOW_UPS = (
    "the merged upstream change was not identified; 5.2.0's code (read in the wheel) records FlexOlmo and"
    " Qwen3-Next from their TopKRouter (index 0) and Phi-MoE's router returns its raw logits first; "
    "5.5.4, 5.6.0 and 5.25.0 keep that; 5.2-5.5's FlexOlmo and Qwen3-Next routers return probabilities "
    "(the shim moe_router_probs_resoftmaxed)"
)

_M = "transformers.models.{0}.modeling_{0}"

# family -> (modeling module, model classes whose forward output must carry router_logits, router class, what to
# record: the router's first output, or its linear's logits)
FAMILIES = {
    "flex_olmo": (_M.format("flex_olmo"), ("FlexOlmoModel",), "FlexOlmoTopKRouter", "first"),
    "qwen3_next": (_M.format("qwen3_next"), ("Qwen3NextModel",), "Qwen3NextTopKRouter", "first"),
    "phimoe": (_M.format("phimoe"), ("PhimoeModel",), "PhimoeTopKRouter", "linear"),
    # the VL model's output feeds the aux loss; the conditional-generation output is what the user reads
    "glm4v_moe": (_M.format("glm4v_moe"), ("Glm4vMoeModel", "Glm4vMoeForConditionalGeneration"),
                  "Glm4vMoeTextTopkRouter", "first"),
}

SPEC = ShimSpec(
    id="moe_router_logits_not_recorded",
    since="0.3.0",
    title="FlexOlmo, GLM-4V-MoE, Qwen3-Next and Phi-MoE record their router logits from the wrong module: "
    "output_router_logits crashes (FlexOlmo, GLM-4V-MoE, Qwen3-Next) or computes the aux loss on the routing weights "
    "(Phi-MoE)",
    symptom="transformers 5.0-5.1, output_router_logits=True with labels: FlexOlmo raises AttributeError: 'int' "
    "object has no attribute 'to' (aux loss 0), GLM-4V-MoE an AttributeError (no router_logits), Qwen3-Next raises "
    "'Class values must be smaller than num_classes' "
    "(hidden states recorded as router logits), Phi-MoE silently computes the load-balancing loss on its sparse "
    "routing weights",
    why="The 5.0 output recorders of these families watch a module that is not the router (an nn.Linear that does "
    "not exist, the MoE block's hidden-state output) or a router that returns its routing weights first. The shim "
    "records, for the calls that ask for router logits, what 5.2's recorders record: each router's logits.",
    requires={"transformers": ">=5.0.0,<5.2.0"},
    fixed_in={"transformers": "5.2.0"},
    refs=(
        FIXED_CODE,
        "https://github.com/huggingface/transformers/issues/45120",
    ),
    backports=(FIXED_CODE,),
    follow_ups_checked=FOLLOW_UPS,
    targets=tuple(Target(module, f"{model}.forward") for module, models, _, _ in FAMILIES.values() for model in models),
    modules=("transformers",),
)


def _wants_router_logits(instance, kwargs) -> bool:
    """What ``check_model_inputs`` decides: the call's ``output_router_logits``, else the config's."""
    if "output_router_logits" in kwargs:
        return bool(kwargs["output_router_logits"])
    return bool(getattr(getattr(instance, "config", None), "output_router_logits", False))


def _record_hook(collected, what):
    def hook(module, args, output):
        if what == "linear":
            import torch.nn.functional as F

            collected.append(F.linear(args[0], module.weight, module.bias))
        else:
            collected.append(output[0] if isinstance(output, tuple) else output)

    return hook


def _glm4v_moe_expert_counts(instance) -> None:
    """5.2.0's ``Glm4vMoeForConditionalGeneration.__init__`` sets the two counts its aux loss reads; 5.0-5.1 read
    them without setting them (AttributeError once router logits are recorded)."""
    text_config = getattr(instance.config, "text_config", None)
    if text_config is None:
        return
    if not hasattr(instance, "num_experts"):
        instance.num_experts = text_config.num_local_experts
    if not hasattr(instance, "num_experts_per_tok"):
        instance.num_experts_per_tok = text_config.num_experts_per_tok


def _forward_for(router_cls, what, prepare=None):
    def forward(wrapped, instance, args, kwargs):
        if not _wants_router_logits(instance, kwargs):
            return wrapped(*args, **kwargs)
        if prepare is not None:
            prepare(instance)
        collected: list = []
        hook = _record_hook(collected, what)
        handles = [m.register_forward_hook(hook) for m in instance.modules() if isinstance(m, router_cls)]
        try:
            out = wrapped(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if not collected or isinstance(out, tuple) or not hasattr(out, "keys"):
            return out
        out["router_logits"] = tuple(collected)
        acted(SPEC.id, "router logits recorded from the routers")
        return out

    return forward


def install(patcher, options) -> None:
    for module_name, model_names, router_name, what in FAMILIES.values():

        def part(module, module_name=module_name, model_names=model_names, router_name=router_name, what=what):
            router_cls = vars(module).get(router_name)
            model_classes = [vars(module).get(name) for name in model_names]
            if router_cls is None or any(c is None or "forward" not in vars(c) for c in model_classes):
                raise TargetMissing(f"{module_name}: {', '.join(model_names)}.forward or {router_name} not found")
            for model_cls in model_classes:
                prepare = _glm4v_moe_expert_counts if model_cls.__name__ == "Glm4vMoeForConditionalGeneration" else None
                patcher.wrap(model_cls, "forward", _forward_for(router_cls, what, prepare))

        patcher.when_imported(module_name, part)


# ---------------------------------------------------------------------------
# Reproduction: the aux loss of output_router_logits=True against the loss on the routers' own logits

def build_glm4v_moe():
    """A tiny GLM-4V-MoE (text and vision towers), routers ~ N(0, 1); run text-only."""
    import torch
    from transformers.models.glm4v_moe import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    from .. import tiny

    text = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=99, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                router_aux_loss_coef=0.01, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 0, 1],
                                 "partial_rotary_factor": 0.5})
    vision = dict(hidden_size=32, depth=1, num_heads=4, intermediate_size=64, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    with tiny.quiet():
        model = Glm4vMoeForConditionalGeneration(Glm4vMoeConfig(text_config=text, vision_config=vision))
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    return model.train()


def router_outputs(model, family, input_ids, attention_mask):
    """``(model output, the router logits 5.2+ record)``: each router's first output (Phi-MoE: its linear's logits),
    collected independently of transformers' recorder."""
    import torch.nn.functional as F

    from .moe_router_probs_resoftmaxed import router_weights

    modules = dict(model.named_modules())
    collected = []

    def hook(module, args, output):
        if family == "phimoe":
            collected.append(F.linear(args[0].reshape(-1, module.weight.shape[1]), module.weight, module.bias))
        else:
            collected.append(output[0] if isinstance(output, tuple) else output)

    names = router_weights(model) if family != "glm4v_moe" else [
        name for name, m in modules.items() if type(m).__name__ == "Glm4vMoeTextTopkRouter"]
    handles = [modules[name].register_forward_hook(hook) for name in names]
    try:
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_router_logits=True)
    finally:
        for handle in handles:
            handle.remove()
    return out, tuple(collected)


def probe(family: str = "flex_olmo") -> Observation:
    """A padded batch with labels and output_router_logits=True through a tiny MoE: is the aux loss the one of the
    routers' own logits (what 5.2+ record), and does the call succeed?"""
    import sys

    import torch
    import transformers
    from packaging.version import Version

    from .moe_router_probs_resoftmaxed import build, reference_aux_loss

    if family == "glm4v_moe" and Version(transformers.__version__) < Version("5.0.0"):
        raise ProbeUnsupported("the tiny GLM-4V-MoE config is written for 5.x (rope_parameters)")
    try:
        model = build_glm4v_moe() if family == "glm4v_moe" else build(family)
    except (ValueError, KeyError, ImportError, TypeError) as exc:
        raise ProbeUnsupported(f"{family} is not in transformers {transformers.__version__} "
                               f"({type(exc).__name__})") from None
    torch.manual_seed(1)
    input_ids = torch.randint(3, 99, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    try:
        out, logits = router_outputs(model, family, input_ids, attention_mask)
    except (AttributeError, RuntimeError, IndexError) as exc:
        return Observation(True, f"{family}: output_router_logits=True with labels raises {type(exc).__name__}: "
                                 f"{str(exc)[:80]}")
    if not torch.is_tensor(out.aux_loss):
        return Observation(True, f"{family}: aux loss {out.aux_loss!r}, no router logits recorded")
    config = getattr(model.config, "text_config", model.config) if family == "glm4v_moe" else model.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    loss_func = sys.modules[type(model).__module__].load_balancing_loss_func
    reference = reference_aux_loss(loss_func, logits, experts, config.num_experts_per_tok, attention_mask)
    same = torch.allclose(out.aux_loss.detach(), reference.detach(), rtol=1e-6, atol=1e-7)
    return Observation(not same, f"{family}: aux loss {float(out.aux_loss.detach()):.4f}, from the routers' own logits "
                                 f"{float(reference.detach()):.4f} ({len(out.router_logits or ())} recorded, "
                                 f"{len(logits)} routers)")
