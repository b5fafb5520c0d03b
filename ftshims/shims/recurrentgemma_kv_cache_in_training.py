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

When: transformers >=4.40.0 (the model's first release) ,<5.4.0 (``_update_cache`` read in 4.40.2, 4.57.6, 5.1.0 and
5.3.0: the same code; gone in 5.4.0). The shim wraps ``RecurrentGemmaSdpaAttention._update_cache``: in training mode
with gradients enabled it lets upstream's no-grad update run as it is (the cache buffers get exactly what they got)
and hands the attention the same key/value values, rebuilt in the graph: the keys and values written at
``cache_position`` into a copy of upstream's window (a prefill no longer than ``attention_window_size``), or the last
``attention_window_size`` of them (a longer prefill, as upstream slices). The forward is bit-identical in every case,
and ``k_proj`` / ``v_proj`` get the gradients of what the forward computed. Evaluation, ``torch.no_grad()`` and
``generate()`` are untouched.

Not the fix the dossier proposed (``use_cache=False`` for training forwards, what upstream does under gradient
checkpointing): on 4.x a model-wide ``use_cache=False`` leaves the recurrent blocks' graph-attached state from one
step to the next, and the second training step raises "Trying to backward through the graph a second time"
(measured on 4.57.6; 5.0.0 clears it, PR #43203); and for a sequence longer than the attention window the uncached
path computes other values than the cached one (neither equals 5.4's, measured with the same weights on 5.25.0:
last-token logits equal the cached path's, the loss 4.214 against 4.274 cached and 4.250 uncached on 4.57.6). That
long-sequence difference is upstream's, and the shim keeps the cached path's values.

Follow-ups: 5.4.0 (read in the wheel) moved the attention onto the shared DynamicCache, without the no-grad update;
5.16.1 and 5.25.0 (run) give k_proj/v_proj gradients in every mode. The shim does not port that change: it keeps the
old cache path's values and puts them back in the graph (for prefills longer than the window, 5.4's forward differs
from that path, and so do its gradients).
"""

from __future__ import annotations

import sys

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

MODULE = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"
# 5.4.0 fixed it (the DynamicCache move); no PR number found
FIXED_CODE = ("https://github.com/huggingface/transformers/blob/v5.4.0/src/transformers/models/recurrent_gemma/"
              "modeling_recurrent_gemma.py")
FOLLOW_UPS = (
    '5.4.0 (read in the wheel) moved the attention onto the shared DynamicCache, without the no-grad upda'
    'te; 5.16.1 and 5.25.0 (run) give k_proj/v_proj gradients in every mode. The shim does not port that '
    "change: it keeps the old cache path's values and puts them back in the graph (for prefills longer th"
    "an the window, 5.4's forward differs from that path, and so do its gradients)."
)

SPEC = ShimSpec(
    id="recurrentgemma_kv_cache_in_training",
    since="0.3.0",
    title="RecurrentGemma k_proj/v_proj get no gradient in a training forward with the default use_cache=True",
    symptom="RecurrentGemma trained with the config's default use_cache=True (Trainer, plain loops): the attention "
    "layers' k_proj and v_proj get grad None (never trained, LoRA on them inert) while q_proj trains; on 4.x a later "
    "step with use_cache=False raises 'Trying to backward through the graph a second time'",
    why="RecurrentGemma's attention takes its prefill keys and values from a @torch.no_grad() cache update whenever "
    "use_cache is on, which is the config default, so they leave the graph. In training forwards the shim hands the "
    "attention the same keys and values, in the graph.",
    requires={"transformers": ">=4.40.0,<5.4.0"},
    fixed_in={"transformers": "5.4.0"},
    refs=(
        FIXED_CODE,
        "https://github.com/huggingface/transformers/pull/30143",
        "https://github.com/huggingface/transformers/pull/43203",
    ),
    backports=(FIXED_CODE,),
    follow_ups_checked=FOLLOW_UPS,
    targets=(Target(MODULE, "RecurrentGemmaSdpaAttention._update_cache", params=("key_states", "value_states")),),
    modules=(MODULE,),
)


def _update_cache(wrapped, instance, args, kwargs):
    import torch

    if not instance.training or not torch.is_grad_enabled() or len(args) != 2:
        return wrapped(*args, **kwargs)
    key_states, value_states = args
    cache_position = kwargs.get("cache_position")
    window = getattr(instance.config, "attention_window_size", None)
    if not torch.is_tensor(cache_position) or not isinstance(window, int) \
            or not (key_states.requires_grad or value_states.requires_grad):
        return wrapped(*args, **kwargs)
    k_out, v_out = wrapped(*args, **kwargs)  # upstream's values and cache buffers, outside the graph
    if cache_position.shape[0] > window:
        keys, values = key_states[:, :, -window:, :], value_states[:, :, -window:, :]
    else:
        position = cache_position.clamp(0, window - 1)
        keys, values = k_out.clone(), v_out.clone()
        keys[:, :, position] = key_states.to(keys.dtype)
        values[:, :, position] = value_states.to(values.dtype)
    acted(SPEC.id, "training attention keys/values kept in the graph")
    return keys, values


def install(patcher, options) -> None:
    module = sys.modules[MODULE]
    cls = vars(module).get("RecurrentGemmaSdpaAttention")
    if cls is None or not callable(getattr(cls, "_update_cache", None)):
        raise TargetMissing(f"{MODULE}.RecurrentGemmaSdpaAttention._update_cache not found")
    patcher.wrap(cls, "_update_cache", _update_cache)


# ---------------------------------------------------------------------------
# Reproduction

def tiny_recurrent_gemma(attention_window_size: int = 16):
    import torch
    import transformers

    from .. import tiny

    config = transformers.RecurrentGemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=32, attention_window_size=attention_window_size,
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
    import transformers

    if not hasattr(transformers, "RecurrentGemmaConfig"):
        raise ProbeUnsupported("no RecurrentGemma in this transformers (4.40+)")
    _, grads = training_step(tiny_recurrent_gemma())
    missing = [name for name, grad in grads.items() if grad is None]
    norms = ", ".join(f"|grad {n}| {'None' if g is None else f'{float(g.norm()):.4g}'}" for n, g in grads.items())
    return Observation(bool(missing), f"default use_cache, training step: {norms}")
