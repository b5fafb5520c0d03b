"""RoBERTa-family encoders read shifted position embeddings from ``DataCollatorWithFlattening``'s 0-based positions.

Why: RoBERTa, XLM-R, CamemBERT, Data2VecText, RoBERTa-PreLayerNorm, X-MOD, XLM-R-XL, MPNet, I-BERT and ESM with
absolute positions number positions from ``padding_idx + 1`` (2 for every released checkpoint: rows 0 and
``padding_idx`` of the position table are never used for a token). ``DataCollatorWithFlattening``, transformers' own
padding-free collator, numbers every flattened sequence from 0, so each token reads the position embedding two rows
too early, and the first two tokens read the reserved rows: outputs degrade silently (transformers#47496; the
sentence-transformers flattening path was fixed on its side, PR #3879). 5.15.0 (PR #47525) added
``DataCollatorWithFlattening(position_ids_start=...)`` and made flash-attention's sequence-boundary detection
shift-invariant (``position_ids == position_ids.min()``), but kept the default at 0: every release read (5.15.0,
5.16.1, 5.24.0, 5.25.0) still gives these models 0-based positions unless the user knows to pass
``position_ids_start=2``.

The fix is upstream's own opt-in, applied where it is unambiguous. The shim wraps the base model's ``forward``
(``RobertaModel``, ``XLMRobertaModel``, ... which every head calls) and, for a padding-free call (``position_ids``
given, no ``attention_mask``, no cache and no ``use_cache``: the collator's output; generation hands the base model
a cache object, empty at the prefill), adds
``padding_idx + 1`` to each row of ``position_ids`` whose smallest value is 0, when the shifted row still fits the
position table. A 0 is never a position these models produce, so such a row is 0-based; positions the model numbered
itself (``position_ids_start=2``) and every call with an attention mask are left as they are (bit-identical). The
shift is a tensor expression without a Python branch on values, so it traces under ``torch.compile(fullgraph=True)``
and reads nothing back from an accelerator (no host-device synchronisation per step; only on CPU tensors, where a
read is free, does it count the shifted rows for ``status().actions`` and skip calls with none).
From 5.15 everything else that reads ``position_ids`` in these models is shift-invariant (flash-attention boundaries at
the row minimum, packed-sequence detection by differences, MPNet's relative buckets by differences), so the result
is exactly what ``position_ids_start=padding_idx + 1`` gives. Models whose embeddings have no absolute position table
(ESM-2's rotary positions) are left alone.

Applies to transformers >=5.15.0, unfixed upstream (``fixed_in`` empty: the default is still 0 in 5.25.0). Before
5.15 the flash-attention path found sequence boundaries at ``position_ids == 0``, so shifting the positions the model
passes on would merge the flattened sequences: there is no narrow wrap point, and the advisory
``roberta_flattened_position_ids_before_5_15`` (transformers 4.44-5.14, the collator's releases) says what to do.
"""

from __future__ import annotations

from .._util import acted, compiling, method_binder
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

# model_type -> (modeling module, base model class). Read in 5.15.0-5.25.0: each forward takes attention_mask and
# position_ids and hands position_ids to its *Embeddings, whose position table uses padding_idx + 1 + n.
FAMILIES = {
    "roberta": ("transformers.models.roberta.modeling_roberta", "RobertaModel"),
    "xlm-roberta": ("transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaModel"),
    "xlm-roberta-xl": ("transformers.models.xlm_roberta_xl.modeling_xlm_roberta_xl", "XLMRobertaXLModel"),
    "camembert": ("transformers.models.camembert.modeling_camembert", "CamembertModel"),
    "data2vec-text": ("transformers.models.data2vec.modeling_data2vec_text", "Data2VecTextModel"),
    "roberta-prelayernorm": ("transformers.models.roberta_prelayernorm.modeling_roberta_prelayernorm",
                             "RobertaPreLayerNormModel"),
    "xmod": ("transformers.models.xmod.modeling_xmod", "XmodModel"),
    "mpnet": ("transformers.models.mpnet.modeling_mpnet", "MPNetModel"),
    "ibert": ("transformers.models.ibert.modeling_ibert", "IBertModel"),
    "esm": ("transformers.models.esm.modeling_esm", "EsmModel"),
}

PARAMS = ("attention_mask", "position_ids")

SPEC = ShimSpec(
    id="roberta_flattened_position_ids",
    since="0.2.0",
    title="RoBERTa-family encoders read position embeddings shifted by padding_idx + 1 from "
    "DataCollatorWithFlattening's 0-based position_ids",
    symptom="padding-free training or embedding of RoBERTa, XLM-R, CamemBERT, MPNet, ESM-1 ... with "
    "DataCollatorWithFlattening (default position_ids_start=0): every token reads the position embedding 2 rows too "
    "early and the first two read the reserved rows; outputs differ from the padded run of the same text, silently",
    why="These models number positions from padding_idx + 1, transformers' padding-free collator from 0 by default "
    "(5.15 added position_ids_start but kept 0). The shim starts 0-based rows of a padding-free call at "
    "padding_idx + 1, which is what position_ids_start=2 gives.",
    requires={"transformers": ">=5.15.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/47496",
        "https://github.com/huggingface/transformers/pull/47525",
        "https://github.com/huggingface/sentence-transformers/pull/3879",
    ),
    targets=tuple(Target(module, f"{cls}.forward", params=PARAMS) for module, cls in FAMILIES.values()),
    modules=("transformers",),
)


def position_table(model):
    """``(padding_idx, rows)`` of ``model.embeddings``' absolute position table, or None without one."""
    embeddings = getattr(model, "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    padding_idx = getattr(embeddings, "padding_idx", None)
    rows = getattr(table, "num_embeddings", None)
    if isinstance(padding_idx, int) and padding_idx >= 0 and isinstance(rows, int):
        return padding_idx, rows
    return None


def shifted(position_ids, offset: int, rows: int):
    """``position_ids`` with ``offset`` added to each row that starts at 0 and still fits ``rows`` after it."""
    low = position_ids.amin(dim=-1, keepdim=True)
    high = position_ids.amax(dim=-1, keepdim=True)
    move = (low == 0) & (high + offset < rows)
    return position_ids + move.to(position_ids.dtype) * offset, move


def _padding_free(call) -> bool:
    import torch

    position_ids = call.get("position_ids")
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.is_floating_point():
        return False
    if call.get("attention_mask") is not None:
        return False
    # generation: 5.x hands the base model a cache object (``cache`` / ``past_key_values``, empty at the prefill)
    # and 0-based position_ids of its own, but no attention mask; a padding-free batch carries none of these
    return call.get("cache") is None and call.get("past_key_values") is None and not call.get("use_cache")


def _wrapper(bind):
    def forward(wrapped, instance, args, kwargs):
        call = bind(args, kwargs)
        if call is None or not _padding_free(call):
            return wrapped(*args, **kwargs)
        table = position_table(instance)
        if table is None:
            return wrapped(*args, **kwargs)  # no absolute positions (ESM-2): nothing reads them as rows
        padding_idx, rows = table
        position_ids, move = shifted(call["position_ids"], padding_idx + 1, rows)
        if not compiling():
            if position_ids.device.type == "cpu":  # reading a host tensor synchronises nothing: count the rows
                moved = int(move.sum())
                if not moved:
                    return wrapped(*args, **kwargs)  # positions the model numbered itself: the call as it was
                acted(SPEC.id, "0-based padding-free rows started at padding_idx + 1", moved)
            else:
                # On an accelerator the rows are not read (that would be a host-device synchronisation every
                # step): a row that does not start at 0 gets + 0, the same values, as under torch.compile.
                acted(SPEC.id, "padding-free calls checked on the device (rows starting at 0 shifted)")
        call["position_ids"] = position_ids
        return wrapped(**call)

    return forward


def install(patcher, options) -> None:
    from ..patching import require_params

    for module_name, class_name in FAMILIES.values():

        def part(module, module_name=module_name, class_name=class_name):
            cls = vars(module).get(class_name)
            if cls is None:
                raise TargetMissing(f"{module_name}.{class_name} not found")
            require_params(cls.forward, PARAMS, f"{module_name}.{class_name}.forward")
            patcher.wrap(cls, "forward", _wrapper(method_binder(cls.forward)))

        patcher.when_imported(module_name, part)


# ---------------------------------------------------------------------------
# Reproduction

def build(family: str = "roberta"):
    """A tiny masked LM of ``family`` (pad 1, as the released checkpoints), dropout off."""
    import torch
    import transformers

    from .. import tiny

    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=34, pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    configs = {
        "roberta": ("RobertaConfig", "RobertaForMaskedLM"),
        "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM"),
        "camembert": ("CamembertConfig", "CamembertForMaskedLM"),
        "mpnet": ("MPNetConfig", "MPNetForMaskedLM"),
    }
    config_name, model_name = configs[family]
    torch.manual_seed(0)
    with tiny.quiet():
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**small))
    return model.eval()


EXAMPLE = [0, 5, 6, 7, 8, 9, 10, 2]  # <s> ... </s>


def probe(family: str = "roberta") -> Observation:
    """One example through DataCollatorWithFlattening (default arguments) into a tiny masked LM: are the logits
    those of the model numbering the positions itself?"""
    import torch
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.15.0"):
        raise ProbeUnsupported("before 5.15 flash attention finds the flattened sequences at position 0: no narrow "
                               "wrap point (the advisory roberta_flattened_position_ids_before_5_15)")
    from transformers import DataCollatorWithFlattening

    model = build(family)
    batch = DataCollatorWithFlattening()([{"input_ids": EXAMPLE}])
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"]).logits
        flattened = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    gap = float((flattened - own).abs().max())
    detail = (f"{family}: collator position_ids start at {int(batch['position_ids'][0, 0])}; "
              f"max |logits(flattened) - logits(model's own positions)| = {gap:.3g}")
    return Observation(gap > 0, detail)
