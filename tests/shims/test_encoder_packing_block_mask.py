"""encoder_packing_block_mask: padding-free (packed) rows through BERT-family encoders give each example the hidden
states it gets alone (transformers 5.x: the BERT/RoBERTa line before 5.25, ModernBERT, DistilBERT, ALBERT, MPNet and
DeBERTa-v2 on every release up to 5.25.0)."""

import pytest
from tests.shimcheck import assert_bug_and_fix, applied_or_skip

import ftshims
from ftshims import registry

SHIM = "encoder_packing_block_mask"
probe_module = registry.get(SHIM).module
ACTION = "packed encoder masks built"


def _fixed_upstream(family: str) -> bool:
    """5.25.0 keeps the BERT/RoBERTa line's packed examples apart itself: healthy there, the shim a no-op."""
    import transformers
    from packaging.version import Version

    return family in probe_module.FIXED_IN_5_25 and Version(transformers.__version__) >= Version("5.25.0")


@pytest.mark.parametrize("family,attn", [
    ("modernbert", "sdpa"), ("modernbert", "eager"), ("distilbert", "sdpa"), ("albert", "sdpa"),
    ("deberta-v2", "eager"), ("mpnet", "eager"), ("bert", "sdpa"), ("bert", "eager"), ("roberta", "sdpa"),
    ("electra", "eager"), ("xlm-roberta", "sdpa"),
])
def test_packed_examples_get_what_they_get_alone(evidence, family, attn):
    assert_bug_and_fix(SHIM, evidence, f"{family} ({attn}), two examples (5 + 7 tokens) in one padding-free row",
                       expect_bug=not _fixed_upstream(family), family=family, attn=attn)


def _skip_outside_the_range():
    """Before anything else: outside the shim's range (4.x) some of these encoders take no position_ids at all."""
    applied_or_skip(SHIM).__exit__(None, None, None)


def _hidden(model, **call):
    import torch

    with torch.no_grad():
        return model(**call).last_hidden_state


@pytest.mark.parametrize("family", ["modernbert", "distilbert", "deberta-v2", "bert"])
def test_calls_it_must_not_touch_are_bit_identical(family):
    """Do no harm: a padded batch (attention mask), a padding-free row of one example, positions numbered from 2
    (RoBERTa style, one example) and a call with no position ids run exactly as without the shim, with no action."""
    import torch

    _skip_outside_the_range()
    model, start = probe_module.build(family, "sdpa")
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    calls = [
        dict(input_ids=ids, attention_mask=mask),
        dict(input_ids=ids, attention_mask=mask, position_ids=torch.arange(7)[None].expand(2, -1) + start),
        dict(input_ids=ids[:1], position_ids=torch.arange(7)[None] + start),
        dict(input_ids=ids[:1], position_ids=torch.arange(7)[None] + 2 + start),
        dict(input_ids=ids),
    ]
    plain = [_hidden(model, **call) for call in calls]
    context = applied_or_skip(SHIM)
    try:
        shimmed = [_hidden(model, **call) for call in calls]
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    assert all(torch.equal(a, b) for a, b in zip(plain, shimmed))
    assert actions == {}


def test_packed_masked_lm_loss_equals_the_examples_alone():
    """End to end: DataCollatorWithFlattening's batch of two examples through DistilBertForMaskedLM: the per-token
    logits of the packed row are those of each example alone (to float summation order), and the shim counts one
    mask per forward."""
    import torch
    import transformers

    from ftshims import tiny

    _skip_outside_the_range()
    from transformers import DataCollatorWithFlattening
    torch.manual_seed(0)
    with tiny.quiet():
        model = transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
            vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0)).eval()
    features = [{"input_ids": [1, 5, 6, 7, 2]}, {"input_ids": [1, 9, 10, 11, 12, 13, 2]}]
    batch = DataCollatorWithFlattening()(features)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([f["input_ids"]])).logits[0] for f in features]
    context = applied_or_skip(SHIM)
    try:
        with torch.no_grad():
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        actions = ftshims.status()[SHIM].actions
    finally:
        context.__exit__(None, None, None)
    gap = max(float((packed[:5] - alone[0]).abs().max()), float((packed[5:] - alone[1]).abs().max()))
    assert gap < probe_module.TOLERANCE, gap
    assert actions == {ACTION: 1}


def test_under_torch_compile_it_stays_out():
    """Nothing can be read in a trace: a compiled padding-free call runs as upstream's, without a graph break
    (fullgraph), with the shim applied."""
    import torch

    _skip_outside_the_range()
    model, start = probe_module.build("distilbert", "sdpa")
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None] + start
    torch._dynamo.reset()
    try:
        plain = _hidden(torch.compile(model, fullgraph=True, backend="eager"), input_ids=ids, position_ids=positions)
        torch._dynamo.reset()
        context = applied_or_skip(SHIM)
        try:
            shimmed = _hidden(torch.compile(model, fullgraph=True, backend="eager"), input_ids=ids,
                              position_ids=positions)
        finally:
            context.__exit__(None, None, None)
    finally:
        torch._dynamo.reset()
    assert torch.equal(plain, shimmed)
