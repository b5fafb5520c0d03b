"""Under DeepSpeed ZeRO-3, ``resize_token_embeddings`` makes frozen input embeddings trainable again.

Why: since transformers 4.43.4 the ZeRO-3 branch of ``_get_resized_embeddings`` gives the *old* embedding
module the new, freshly built Parameter (``old_embeddings.weight = new_embeddings.weight``, 4.57.6
modeling_utils.py:3417; PR #31979 keeps the module's class, #32192 added the ZeRO-3 branch, which 4.43.4 turned
into this Parameter swap) and returns that module. ``_resize_token_embeddings`` then reads
``old_embeddings.weight.requires_grad`` (4.57.6 :3240) *after* the swap, i.e. from the new, trainable
Parameter, and applies it: the flag copy #26865 added (4.36) copies True onto a module the user froze. Without
ZeRO-3 the non-ZeRO branch assigns ``.data`` and keeps the Parameter, so the flag survives. Adding tokens and
then training with frozen embeddings under ZeRO-3 silently trains the whole embedding matrix (measured: 4.57.6,
deepspeed 0.19.8, 2 CPU ranks: ``requires_grad`` False -> True, and the embedding rows change in two steps).
The LM head is not affected (``_get_resized_lm_head`` returns a new module and the flag is read from the old one).

The fix: wrap ``PreTrainedModel.resize_token_embeddings``; when
``transformers.integrations.deepspeed.is_deepspeed_zero3_enabled()`` is true at call time, snapshot the
``requires_grad`` flags of the input and output embedding parameters before the call and give the parameters
the same flags after it (the snapshot and parameter walk of ``resize_embeddings_keeps_frozen``, imported).

Applies to transformers >=4.43.4 (read in 4.43.4, 4.44.2, 4.45.2, 4.46.0, 4.46.3, 4.48.0, 4.49.0, 4.50.0,
4.52.4, 4.53.3, 4.55.4, 4.56.0, 4.57.6, 5.0.0, 5.25.0: the same swap and the same flag read; 4.36.0-4.42.4
return a new module from the ZeRO-3 path and read the flag from the old one; 4.43.0/4.43.1 have no ZeRO-3 branch
and 4.43.2/4.43.3 assign ``.data`` there) with deepspeed installed. Not fixed upstream as of 5.25.0.

Fallback: without ZeRO-3 at call time (no ``HfDeepSpeedConfig`` alive, ZeRO-1/2, no DeepSpeed) the wrapper
calls through untouched: no flag read or written, the result bit-identical. If
``transformers.integrations.deepspeed`` cannot be imported the call also passes straight through.

Follow-ups: no upstream issue or PR about this flag loss found (searched the transformers issues for
resize_token_embeddings + ZeRO-3 + requires_grad; #41959 is a different ZeRO-3 resize failure of custom
output layers). Refs: #31979, #32192 (the code that introduced it), #26865 (the flag copy it defeats).
"""

from __future__ import annotations

import sys

from ..spec import ShimSpec, Target
from .resize_embeddings_keeps_frozen import _flags, restore_flags

SPEC = ShimSpec(
    id="resize_embeddings_frozen_under_zero3",
    since="0.3.0",
    title="resize_token_embeddings under DeepSpeed ZeRO-3 makes frozen input embeddings trainable",
    symptom="under DeepSpeed ZeRO-3 (HfDeepSpeedConfig / Trainer deepspeed config with stage 3), after "
    "resize_token_embeddings the frozen input embeddings have requires_grad=True and train",
    why="Since 4.43.4 the ZeRO-3 branch of _get_resized_embeddings swaps the new, trainable Parameter into the old "
    "embedding module, and _resize_token_embeddings then copies requires_grad from that new Parameter, so a "
    "frozen embedding becomes trainable. The shim keeps each embedding parameter's requires_grad across the "
    "resize when ZeRO-3 is enabled.",
    requires={"transformers": ">=4.43.4", "deepspeed": ">=0.9.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/pull/31979",
        "https://github.com/huggingface/transformers/pull/32192",
        "https://github.com/huggingface/transformers/pull/26865",
    ),
    targets=(Target("transformers.modeling_utils", "PreTrainedModel.resize_token_embeddings"),),
    modules=("transformers.modeling_utils",),
)


def _zero3_enabled() -> bool:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def _resize_token_embeddings(wrapped, instance, args, kwargs):
    if not _zero3_enabled():
        return wrapped(*args, **kwargs)
    before = _flags(instance)
    result = wrapped(*args, **kwargs)
    restore_flags(instance, before, SPEC.id, "requires_grad flags kept after a ZeRO-3 resize")
    return result


def install(patcher, options) -> None:
    modeling_utils = sys.modules["transformers.modeling_utils"]
    patcher.wrap(modeling_utils.PreTrainedModel, "resize_token_embeddings", _resize_token_embeddings)
