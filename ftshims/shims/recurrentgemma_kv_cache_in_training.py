"""RecurrentGemma's attention ``k_proj`` / ``v_proj`` get no gradient in a training forward with the cache on.

Why: RecurrentGemma's config defaults to ``use_cache=True`` and a training forward with labels does not turn it off
(the ``Trainer`` leaves it on; only gradient checkpointing does). With the cache on, the attention layers run
``RecurrentGemmaSdpaAttention._update_cache``, which is decorated ``@torch.no_grad()`` and hands back the key and
value states for the prefill from the cache buffers: k and v leave the autograd graph. The loss is the same, but
``k_proj`` and ``v_proj`` of every attention block get gradient ``None`` while ``q_proj`` trains: a full fine-tune
never updates them, and LoRA on them trains nothing, silently (tiny model, 4.57.6 and 5.0.0: |grad k_proj| None with
the default, 0.1727 with ``use_cache=False``). On 4.x a training step with the cache followed by one without also
fails with "Trying to backward through the graph a second time" (the recurrent block keeps graph-attached
``conv1d_state``). transformers 5.4.0 moved the layer onto the shared ``DynamicCache`` and the no-grad method is gone.

When: transformers >=4.40.0 (the model's first release) ,<5.4.0 (read in 4.40.2, 4.57.6, 5.1.0, 5.3.0; gone in
5.4.0). The shim wraps ``RecurrentGemmaSdpaAttention.forward``: in training mode with gradients enabled, an attention
call with the cache on runs with ``use_cache=False``, so its keys and values are the ones it computed, in the graph.
Only the attention layers: the model and its recurrent blocks keep ``use_cache`` as given, because on 4.x a
model-wide ``use_cache=False`` (what TRL's trainers set, and what upstream does under gradient checkpointing) leaves
the recurrent blocks' graph-attached state from one step to the next, and the second training step raises "Trying to
backward through the graph a second time" (measured on 4.57.6, fixed in 5.0.0 by PR #43203; not this shim's). For a
training sequence no longer than ``attention_window_size`` the forward is bit-identical (the cache path returns the
same keys in a zero-padded window buffer, masked); the loss does not change, only k_proj and v_proj get their
gradients. Longer training sequences: the cache path keeps only the last window of keys for every query (against a
mask cut to the first window's columns), the uncached path attends with the model's own sliding-window mask; that
difference is upstream's, not measured against 5.4 here. Evaluation, ``torch.no_grad()`` and ``generate()`` keep the
cache exactly as they had it.

Follow-ups: 5.4.0 (read in the wheel) moved the attention onto the shared DynamicCache, without the no-grad update; 5.16.1 and 5.25.0 (run) give k_proj/v_proj gradients in every mode. The shim does not port that change: it keeps the attention out of the old cache in training forwards, which gives the gradients 5.4.0 gives.
"""

from __future__ import annotations

import sys

from .._util import acted, method_binder
from ..spec import Observation, ShimSpec, Target, TargetMissing

MODULE = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"
# 5.4.0 fixed it (the DynamicCache move); no PR number found
FIXED_CODE = ("https://github.com/huggingface/transformers/blob/v5.4.0/src/transformers/models/recurrent_gemma/"
              "modeling_recurrent_gemma.py")
FOLLOW_UPS = ('5.4.0 (read in the wheel) moved the attention onto the shared DynamicCache, without the no-grad update; 5.16.1 and 5.25.0 (run) give k_proj/v_proj gradients in every mode. The shim does not port that change: it keeps the attention out of the old cache in training forwards, which gives the gradients 5.4.0 gives.')

SPEC = ShimSpec(
    id="recurrentgemma_kv_cache_in_training",
    since="0.3.0",
    title="RecurrentGemma k_proj/v_proj get no gradient in a training forward with the default use_cache=True",
    symptom="RecurrentGemma trained with the config's default use_cache=True (Trainer, plain loops): the attention "
    "layers' k_proj and v_proj get grad None (never trained, LoRA on them inert) while q_proj trains; on 4.x a later "
    "step with use_cache=False raises 'Trying to backward through the graph a second time'",
    why="RecurrentGemma's attention takes its prefill keys and values from a @torch.no_grad() cache update whenever "
    "use_cache is on, which is the config default, so they leave the graph. The shim turns the cache off in the "
    "attention layers for training forwards with gradients.",
    requires={"transformers": ">=4.40.0,<5.4.0"},
    fixed_in={"transformers": "5.4.0"},
    refs=(
        FIXED_CODE,
        "https://github.com/huggingface/transformers/pull/30143",
        "https://github.com/huggingface/transformers/pull/43203",
    ),
    backports=(FIXED_CODE,),
    follow_ups_checked=FOLLOW_UPS,
    targets=(Target(MODULE, "RecurrentGemmaSdpaAttention.forward", params=("use_cache",)),),
    modules=(MODULE,),
)


def _wrapper(bind):
    def forward(wrapped, instance, args, kwargs):
        import torch

        if not instance.training or not torch.is_grad_enabled():
            return wrapped(*args, **kwargs)
        call = bind(args, kwargs)
        if call is None or not call.get("use_cache"):
            return wrapped(*args, **kwargs)
        call["use_cache"] = False
        acted(SPEC.id, "training attention calls kept out of the no-grad cache")
        return wrapped(**call)

    return forward


def install(patcher, options) -> None:
    from ..patching import require_params

    module = sys.modules[MODULE]
    cls = vars(module).get("RecurrentGemmaSdpaAttention")
    if cls is None:
        raise TargetMissing(f"{MODULE}.RecurrentGemmaSdpaAttention not found")
    require_params(cls.forward, ("use_cache",), f"{MODULE}.RecurrentGemmaSdpaAttention.forward")
    patcher.wrap(cls, "forward", _wrapper(method_binder(cls.forward)))


# ---------------------------------------------------------------------------
# Reproduction

def tiny_recurrent_gemma():
    import torch
    import transformers

    from .. import tiny

    config = transformers.RecurrentGemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=32, attention_window_size=16,
        block_types=["recurrent", "recurrent", "attention"], conv1d_width=4)
    torch.manual_seed(0)
    with tiny.quiet():
        return transformers.RecurrentGemmaForCausalLM(config).train()


def ids():
    import torch

    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))


def training_step(model, **call):
    """Loss and the gradients of the attention block's projections after one forward/backward."""
    batch = ids()
    model.zero_grad()
    out = model(input_ids=batch, labels=batch, **call)
    out.loss.backward()
    attention = model.model.layers[2].temporal_block
    grads = {name: getattr(attention, name).weight.grad for name in ("q_proj", "k_proj", "v_proj")}
    return out.loss.detach(), grads


def probe() -> Observation:
    """A tiny RecurrentGemma, one training step with the config's default use_cache: do k_proj and v_proj get a
    gradient?"""
    _, grads = training_step(tiny_recurrent_gemma())
    missing = [name for name, grad in grads.items() if grad is None]
    norms = ", ".join(f"|grad {n}| {'None' if g is None else f'{float(g.norm()):.4g}'}" for n, g in grads.items())
    return Observation(bool(missing), f"default use_cache, training step: {norms}")
