"""ALiBi Falcon under eager attention adds the ALiBi bias twice (transformers 4.45-5.24).

Why: for ALiBi Falcon models (``alibi=True``: Falcon-RW and the like) ``FalconModel`` folds ``alibi / sqrt(head_dim)``
into the 4D attention mask it hands every layer (4.45 moved the fold into ``_update_causal_mask``, where it runs
whatever the attention implementation; 5.x does it in ``FalconModel.forward``). The eager branch of
``FalconAttention.forward`` still adds ``alibi`` to the scores itself, ``(scores + alibi) * inv_norm_factor + mask``,
so the bias counts twice; the sdpa branch, which only adds the mask, is right. Eager runs for
``attn_implementation="eager"`` and for every ``output_attentions=True`` call: an eager fine-tune or evaluation of an
ALiBi Falcon sees different attention than the model was trained with (max |eager - sdpa| 0.0124 on a tiny model,
4.57.6; 0.0146 on 5.24.0), silently. 4.44 and earlier folded it only on the sdpa path (eager right); 5.25.0 rewrote
Falcon on the attention interface, ALiBi only through the mask (8.9e-8).

When: transformers >=4.45.0,<5.25.0. The shim wraps ``FalconAttention.forward``: for a call that takes the eager
branch (not sdpa, or ``output_attentions``) with ``alibi`` given, a 4D attention mask (the one the bias was folded
into) and no head mask (4.x skips the fold when a head mask is given, and then the eager add is the only one), it
passes ``alibi`` as zeros, so the scores get the bias once, from the mask, as the sdpa branch and 5.25 do. Every
other call, rotary Falcon (no ``alibi``) and the sdpa branch included, is left exactly as it was.

Follow-ups: 5.25.0's rewrite (read in the wheel) adds ALiBi through the mask only, which the shim carries for the eager branch; the same rewrite makes the rotary eager/sdpa path apply attention_dropout, which <=5.24 ignored: not carried (it changes only configs that set a dropout, not this bug). No release after 5.25.0 to read.
"""

from __future__ import annotations

import sys

from .._util import acted, method_binder
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

MODULE = "transformers.models.falcon.modeling_falcon"
PARAMS = ("alibi", "attention_mask", "output_attentions")
# 5.25.0 fixed it by rewriting Falcon on the attention interface; no PR number found
FIXED_CODE = "https://github.com/huggingface/transformers/blob/v5.25.0/src/transformers/models/falcon/modeling_falcon.py"
FOLLOW_UPS = ("5.25.0's rewrite (read in the wheel) adds ALiBi through the mask only, which the shim carries for the eager branch; the same rewrite makes the rotary eager/sdpa path apply attention_dropout, which <=5.24 ignored: not carried (it changes only configs that set a dropout, not this bug). No release after 5.25.0 to read.")

SPEC = ShimSpec(
    id="falcon_alibi_doubled_eager",
    since="0.3.0",
    title="ALiBi Falcon under eager attention (or output_attentions=True) adds the ALiBi bias twice",
    symptom="Falcon with alibi=True (Falcon-RW ...) under attn_implementation='eager' or output_attentions=True: "
    "attention scores get the ALiBi bias twice (once folded into the mask, once added by the eager branch); "
    "outputs differ from sdpa (0.012 on a tiny model)",
    why="From 4.45 FalconModel folds alibi into the 4D mask for every attention implementation, and the eager "
    "branch of FalconAttention adds it again. The shim gives the eager branch a zero alibi where the mask already "
    "carries it, as 5.25's rewrite does.",
    requires={"transformers": ">=4.45.0,<5.25.0"},
    fixed_in={"transformers": "5.25.0"},
    refs=(
        FIXED_CODE,
        "https://github.com/huggingface/transformers/issues/29067",
        "https://github.com/huggingface/transformers/issues/29946",
        "https://github.com/huggingface/transformers/pull/30123",
    ),
    backports=(FIXED_CODE,),
    follow_ups_checked=FOLLOW_UPS,
    targets=(Target(MODULE, "FalconAttention.forward", params=PARAMS),),
    modules=(MODULE,),
)


def _wrapper(bind):
    def forward(wrapped, instance, args, kwargs):
        call = bind(args, kwargs)
        if call is None:
            return wrapped(*args, **kwargs)
        alibi, mask = call.get("alibi"), call.get("attention_mask")
        if alibi is None or mask is None or getattr(mask, "dim", lambda: 0)() != 4 \
                or call.get("head_mask") is not None:
            return wrapped(*args, **kwargs)
        sdpa = getattr(instance.config, "_attn_implementation", None) == "sdpa"
        if sdpa and not call.get("output_attentions"):
            return wrapped(*args, **kwargs)  # the sdpa branch adds the mask only: right as it is
        import torch

        call["alibi"] = torch.zeros_like(alibi)  # the bias is in the mask already
        acted(SPEC.id, "eager ALiBi attention calls given the bias once")
        return wrapped(**call)

    return forward


def install(patcher, options) -> None:
    from ..patching import require_params

    module = sys.modules[MODULE]
    cls = vars(module).get("FalconAttention")
    if cls is None:
        raise TargetMissing(f"{MODULE}.FalconAttention not found")
    require_params(cls.forward, PARAMS, f"{MODULE}.FalconAttention.forward")
    patcher.wrap(cls, "forward", _wrapper(method_binder(cls.forward)))


# ---------------------------------------------------------------------------
# Reproduction

def tiny_falcon(attn: str, alibi: bool = True):
    import torch
    import transformers

    from .. import tiny

    config = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       alibi=alibi, new_decoder_architecture=False, multi_query=False,
                                       parallel_attn=True, bias=False, attention_dropout=0.0, hidden_dropout=0.0)
    config._attn_implementation = attn
    torch.manual_seed(0)
    with tiny.quiet():
        return transformers.FalconForCausalLM(config).eval()


def batch():
    """Two rows, the second left-padded by 3."""
    import torch

    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def gap(alibi: bool = True, output_attentions: bool = False) -> float:
    """max |logits(eager or output_attentions) - logits(sdpa)| over the real tokens of a padded batch."""
    import torch

    ids, mask = batch()
    reference = tiny_falcon("sdpa", alibi)
    tested = tiny_falcon("sdpa" if output_attentions else "eager", alibi)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
        got = tested(input_ids=ids, attention_mask=mask, output_attentions=output_attentions).logits
    real = mask.bool()
    return float((got - want)[real].abs().max())


def probe(output_attentions: bool = False) -> Observation:
    """A tiny ALiBi Falcon, padded batch: do eager attention (or sdpa asked for attention weights) and sdpa give the
    same logits?"""
    import transformers

    if not hasattr(transformers, "FalconConfig"):
        raise ProbeUnsupported("no Falcon in this transformers (4.33+)")
    value = gap(alibi=True, output_attentions=output_attentions)
    what = "sdpa with output_attentions=True" if output_attentions else "eager"
    return Observation(value > 1e-5, f"alibi Falcon, {what} vs sdpa: max |dlogit| over real tokens = {value:.3g}")
