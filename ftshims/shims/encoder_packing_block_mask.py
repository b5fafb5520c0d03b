"""Padding-free (packed) batches through BERT-family encoders: each example attends only to itself.

Why: ``DataCollatorWithFlattening`` (transformers' padding-free collator, TRL's ``padding_free``) puts several
examples in one row with no attention mask and ``position_ids`` that restart where each example begins. Encoders
build a bidirectional mask from the attention mask alone, so every packed example attends to all of its neighbours
under eager and sdpa attention: the outputs, losses and gradients of an embedding or masked-LM fine-tune are those
of a different text, silently (max |packed - alone| 0.008-0.018 on tiny BERT, RoBERTa, ELECTRA, XLM-R, ModernBERT,
DistilBERT, ALBERT, DeBERTa-v2 and MPNet). transformers 5.25.0 hands ``position_ids`` to
``create_bidirectional_mask`` in the BERT/RoBERTa line (bert, roberta, xlm-roberta, electra, camembert, data2vec-text
and a few others) and keeps their examples apart; it left out ModernBERT, DistilBERT, ALBERT and MPNet (their
``create_bidirectional_mask`` calls get no position ids) and DeBERTa-v2 (which builds its own mask), and no release
before 5.25 keeps any of them apart.

When: transformers >=5.0.0, where these encoders build their masks with ``masking_utils``: the BERT/RoBERTa line
before 5.25.0 (the backport), ModernBERT, DistilBERT, ALBERT, MPNet and DeBERTa-v2 on every release up to 5.25.0
(unfixed there). The shim wraps each family's base-model ``forward`` (``BertModel``, ``ModernBertModel``, ...): for a
padding-free call (``position_ids`` given, no attention mask, no cache) whose rows hold several examples
(``position_ids`` do not go up by one somewhere; that one flag is read on the host, as the decoder packing shims do,
docs/hostsync.md), the bidirectional masks the forward builds are ANDed with "same example" through
``masking_utils``' own ``and_mask_function`` and ``packed_sequence_mask_function``; DeBERTa-v2's
``DebertaV2Encoder.get_attention_mask`` result is multiplied by the same block matrix. Examples are found by
position differences, as 5.25 does, so positions numbered from 0 or from ``padding_idx + 1`` both work.

Left alone (the call exactly as it was): the BERT/RoBERTa line on 5.25.0 and later (not wrapped), calls with an
attention mask (padded batches), rows of one example, calls
whose mask builder already got ``position_ids`` (5.25's own fix) or an ``and_mask_function``, cross-attention masks,
caches, flash attention (its varlen path uses the positions itself), and everything under ``torch.compile`` (no
value can be read there: compiled padding-free encoders keep upstream's mask). Families whose release builds masks
another way (ModernBERT 5.0.0, MPNet before it used ``create_bidirectional_mask``) are skipped with a note. Before
5.0 (4.57 and earlier) each encoder builds its mask by hand: there the advisory
``encoder_packing_contamination_4x`` says what to do.
"""

from __future__ import annotations

import contextvars
import inspect
import sys

from .._util import acted, compiling, function_binder, method_binder
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

# model_type -> (modeling module, base model class). Every base model's forward takes attention_mask and
# position_ids (read 5.0.0-5.25.0); the masks are built in its module by the BUILDERS found there.
FAMILIES = {
    "bert": ("transformers.models.bert.modeling_bert", "BertModel"),
    "roberta": ("transformers.models.roberta.modeling_roberta", "RobertaModel"),
    "xlm-roberta": ("transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaModel"),
    "electra": ("transformers.models.electra.modeling_electra", "ElectraModel"),
    "camembert": ("transformers.models.camembert.modeling_camembert", "CamembertModel"),
    "data2vec-text": ("transformers.models.data2vec.modeling_data2vec_text", "Data2VecTextModel"),
    "modernbert": ("transformers.models.modernbert.modeling_modernbert", "ModernBertModel"),
    "distilbert": ("transformers.models.distilbert.modeling_distilbert", "DistilBertModel"),
    "albert": ("transformers.models.albert.modeling_albert", "AlbertModel"),
    "mpnet": ("transformers.models.mpnet.modeling_mpnet", "MPNetModel"),
    "deberta-v2": ("transformers.models.deberta_v2.modeling_deberta_v2", "DebertaV2Model"),
}
# The families 5.25.0 keeps apart itself (it hands them position_ids to create_bidirectional_mask)
FIXED_IN_5_25 = ("bert", "roberta", "xlm-roberta", "electra", "camembert", "data2vec-text")
BUILDERS = ("create_bidirectional_mask", "create_bidirectional_sliding_window_mask")
# DeBERTa-v2 builds its own [batch, 1, L, L] 0/1 mask from the 2D one
OWN_MASK = {"deberta-v2": "DebertaV2Encoder"}
PARAMS = ("attention_mask", "position_ids")

SPEC = ShimSpec(
    id="encoder_packing_block_mask",
    since="0.3.0",
    title="Padding-free (packed) batches through BERT-family encoders: the examples attend to each other",
    symptom="DataCollatorWithFlattening / padding_free batches of BERT, RoBERTa, ELECTRA, XLM-R (before 5.25), "
    "ModernBERT, DistilBERT, ALBERT, MPNet, DeBERTa-v2 (every 5.x): each packed example attends to its neighbours "
    "under eager/sdpa; outputs differ from the same examples run alone (0.008-0.018 on tiny models), silently",
    why="Encoders build a bidirectional mask from the attention mask only, and a padding-free batch has none. "
    "5.25 keeps packed examples apart for the BERT/RoBERTa line only. The shim ANDs the masks these encoders build "
    "with 'same example' (found from the position ids), as 5.25 does.",
    requires={"transformers": ">=5.0.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/pull/39194",
        "https://github.com/huggingface/transformers/issues/47496",
    ),
    targets=tuple(Target(module, f"{cls}.forward", params=PARAMS) for module, cls in FAMILIES.values()),
    modules=("transformers.masking_utils",),
)

# Segment ids [batch, length] of the padding-free call whose forward is running (set by the base-model wrapper,
# read by the mask-builder wrappers it calls).
_SEGMENTS: contextvars.ContextVar = contextvars.ContextVar("ftshims_encoder_packed_segments", default=None)


def packed_segments(position_ids):
    """Segment ids ``[batch, length]`` for rows holding several examples, else None. An example starts wherever the
    position does not follow the previous one (``p[i] != p[i-1] + 1``), as 5.25's ``find_packed_sequence_indices``
    has it: 0-based and ``padding_idx + 1``-based numbering alike. One flag is read on the host."""
    import torch

    starts = torch.zeros_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts.any()):
        return None
    return starts.long().cumsum(-1)


def _padding_free(call) -> bool:
    import torch

    position_ids = call.get("position_ids")
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.is_floating_point():
        return False
    if position_ids.shape[-1] < 2 or call.get("attention_mask") is not None:
        return False
    return call.get("past_key_values") is None and call.get("cache") is None and not call.get("use_cache")


def _forward_wrapper(bind):
    def forward(wrapped, instance, args, kwargs):
        if compiling():
            return wrapped(*args, **kwargs)
        call = bind(args, kwargs)
        if call is None or not _padding_free(call):
            return wrapped(*args, **kwargs)
        segments = packed_segments(call["position_ids"])
        if segments is None:
            return wrapped(*args, **kwargs)
        token = _SEGMENTS.set(segments)
        try:
            return wrapped(*args, **kwargs)
        finally:
            _SEGMENTS.reset(token)

    return forward


def _builder_wrapper(bind, masking_utils):
    def builder(wrapped, instance, args, kwargs):
        if compiling():
            return wrapped(*args, **kwargs)  # the forward wrapper set nothing in a trace (and ContextVar.get breaks it)
        segments = _SEGMENTS.get()
        if segments is None:
            return wrapped(*args, **kwargs)
        call = bind(args, kwargs)
        if call is None or call.get("encoder_hidden_states") is not None or call.get("position_ids") is not None \
                or call.get("and_mask_function") is not None:
            return wrapped(*args, **kwargs)  # cross-attention, 5.25's own fix, or someone else's mask function
        embeds = call.get("inputs_embeds", call.get("input_embeds"))  # 5.0-5.1 name it input_embeds
        if embeds is None or embeds.shape[1] != segments.shape[1] or segments.shape[0] not in (1, embeds.shape[0]):
            return wrapped(*args, **kwargs)
        segments = segments.expand(embeds.shape[0], -1)
        call["and_mask_function"] = masking_utils.packed_sequence_mask_function(segments)
        acted(SPEC.id, "packed encoder masks built")
        return wrapped(**call)

    return builder


def _own_mask_wrapper(wrapped, instance, args, kwargs):
    """DeBERTa-v2: its [batch, 1, L, L] 0/1 mask times "same example"."""
    mask = wrapped(*args, **kwargs)
    if compiling():
        return mask
    segments = _SEGMENTS.get()
    if segments is None or mask.dim() != 4 or mask.shape[-1] != segments.shape[-1]:
        return mask
    same = (segments[:, :, None] == segments[:, None, :])[:, None]
    acted(SPEC.id, "packed encoder masks built")
    return mask * same.to(mask.dtype)


def install(patcher, options) -> None:
    from ..patching import require_params

    from packaging.version import Version

    from ..versions import installed_version

    masking_utils = sys.modules["transformers.masking_utils"]
    if not callable(getattr(masking_utils, "packed_sequence_mask_function", None)):
        raise TargetMissing("transformers.masking_utils.packed_sequence_mask_function not found")
    # From 5.25.0 the BERT/RoBERTa line keeps packed examples apart itself: those forwards are not wrapped at all
    # (the wrapper would read its packing flag on the host every padding-free step for nothing)
    fixed_here = Version(installed_version("transformers") or "0") >= Version("5.25.0")

    for model_type, (module_name, class_name) in FAMILIES.items():
        if fixed_here and model_type in FIXED_IN_5_25:
            continue

        def part(module, model_type=model_type, module_name=module_name, class_name=class_name):
            cls = vars(module).get(class_name)
            if cls is None:
                raise TargetMissing(f"{module_name}.{class_name} not found")
            require_params(cls.forward, PARAMS, f"{module_name}.{class_name}.forward")
            own = OWN_MASK.get(model_type)
            if own is not None:
                encoder = vars(module).get(own)
                if encoder is None or not callable(getattr(encoder, "get_attention_mask", None)):
                    raise TargetMissing(f"{module_name}.{own}.get_attention_mask not found")
                patcher.wrap(encoder, "get_attention_mask", _own_mask_wrapper)
            else:
                builders = [name for name in BUILDERS if callable(vars(module).get(name))]
                if "create_bidirectional_mask" not in builders:
                    raise TargetMissing(f"{module_name} builds its masks without masking_utils in this release")
                for name in builders:
                    builder = vars(module)[name]
                    names = tuple(inspect.signature(builder).parameters)
                    bind = function_binder(builder)
                    if not ({"attention_mask", "and_mask_function"} <= set(names)
                            and {"inputs_embeds", "input_embeds"} & set(names)):
                        raise TargetMissing(f"{module_name}.{name}{tuple(names)} changed")
                    patcher.wrap(module, name, _builder_wrapper(bind, masking_utils))
            patcher.wrap(cls, "forward", _forward_wrapper(method_binder(cls.forward)))

        patcher.when_imported(module_name, part)


# ---------------------------------------------------------------------------
# Reproduction

MODERNBERT_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)


def build(family: str = "modernbert", attn: str = "sdpa"):
    """A tiny base encoder of ``family`` (dropout off) and the first position its checkpoints number from."""
    import torch
    import transformers

    from .. import tiny

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    configs = {
        "bert": lambda: (transformers.BertConfig(**common, **no_dropout), transformers.BertModel, 0),
        "roberta": lambda: (transformers.RobertaConfig(pad_token_id=1, **common, **no_dropout),
                            transformers.RobertaModel, 2),
        "xlm-roberta": lambda: (transformers.XLMRobertaConfig(pad_token_id=1, **common, **no_dropout),
                                transformers.XLMRobertaModel, 2),
        "electra": lambda: (transformers.ElectraConfig(embedding_size=32, **common, **no_dropout),
                            transformers.ElectraModel, 0),
        # one sliding-window layer (local_attention 4 < the 5 + 7 tokens) and one global layer: both masks built
        "modernbert": lambda: (transformers.ModernBertConfig(global_attn_every_n_layers=2, local_attention=4,
                                                             **MODERNBERT_IDS, **common),
                               transformers.ModernBertModel, 0),
        "distilbert": lambda: (transformers.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                                             hidden_dim=64, max_position_embeddings=64, dropout=0.0,
                                                             attention_dropout=0.0),
                               transformers.DistilBertModel, 0),
        "albert": lambda: (transformers.AlbertConfig(embedding_size=16, **common, hidden_dropout_prob=0.0,
                                                     attention_probs_dropout_prob=0.0),
                           transformers.AlbertModel, 0),
        "deberta-v2": lambda: (transformers.DebertaV2Config(**common, **no_dropout), transformers.DebertaV2Model, 0),
        "mpnet": lambda: (transformers.MPNetConfig(pad_token_id=1, **common, **no_dropout),
                          transformers.MPNetModel, 2),
    }
    config, model_class, start = configs[family]()
    config._attn_implementation = attn if (attn == "eager" or model_class._supports_sdpa) else "eager"
    torch.manual_seed(0)
    with tiny.quiet():
        return model_class(config).eval(), start


def packed_gap(model, start: int, lengths=(5, 7)) -> float:
    """max |packed - alone| of the last hidden states of examples of ``lengths`` packed in one padding-free row."""
    import torch

    generator = torch.Generator().manual_seed(0)
    examples = [torch.randint(3, 64, (1, n), generator=generator) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None] + start
    with torch.no_grad():
        packed = model(input_ids=torch.cat(examples, 1), position_ids=positions).last_hidden_state
        gaps, offset = [], 0
        for example in examples:
            n = example.shape[1]
            alone = model(input_ids=example, position_ids=positions[:, offset:offset + n]).last_hidden_state
            gaps.append(float((packed[:, offset:offset + n] - alone).abs().max()))
            offset += n
    return max(gaps)


TOLERANCE = 1e-5  # the same examples alone: differences of float summation order only (<= 3e-7 measured)


def probe(family: str = "modernbert", attn: str = "sdpa") -> Observation:
    """Two examples (5 + 7 tokens) packed in one padding-free row of a tiny ``family`` encoder: does each get the
    hidden states it gets alone?"""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release[:1] < (5,):
        raise ProbeUnsupported("before 5.0 each encoder builds its mask by hand: no shared wrap point (the advisory "
                               "encoder_packing_contamination_4x)")
    model, start = build(family, attn)
    module = sys.modules[type(model).__module__]
    if family not in OWN_MASK and not callable(vars(module).get("create_bidirectional_mask")):
        raise ProbeUnsupported(f"{family} builds its mask by hand in this release (not through masking_utils)")
    gap = packed_gap(model, start)
    detail = f"{family} ({model.config._attn_implementation}): max |packed - alone| = {gap:.3g}"
    return Observation(gap > TOLERANCE, detail)
