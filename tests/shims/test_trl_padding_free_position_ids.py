"""trl_padding_free_position_ids: TRL 0.19–0.23.0's padding-free collator keeps example boundaries
for every attention implementation (per-example position_ids, no target across a boundary)."""

import dataclasses

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry

SHIM = "trl_padding_free_position_ids"
probe_module = registry.get(SHIM).module


@pytest.mark.parametrize(
    "attn, packed",
    [("sdpa", True), ("eager", True), ("eager", False), ("flash_attention_2", True)],
    ids=["sdpa/packed", "eager/packed", "eager/padding_free", "fa2/packed"],
)
def test_collated_batch_keeps_example_boundaries(evidence, attn, packed):
    # eager/sdpa: no position_ids at all (0.19–0.23.0); flash_attention_2: position_ids but the
    # label of each example's first token still targets it from the previous example.
    assert_bug_and_fix(SHIM, evidence, f"{attn}/{'packed' if packed else 'padding_free'}", expect_bug=True, attn=attn, packed=packed)


def test_users_collator_is_not_modified():
    try:
        collator = probe_module.collator_for("sdpa")
    except Exception as exc:  # ProbeUnsupported: no padding-free collator in this TRL
        pytest.skip(str(exc))
    before = dataclasses.asdict(collator)
    from ftshims.shims import _packing

    features = [{"input_ids": e.tolist()} for e in _packing.example_pair()]
    with ftshims.applied(only=[SHIM]):
        batch = collator(features)
    assert dataclasses.asdict(collator) == before
    assert "position_ids" in batch and "attention_mask" not in batch


def test_non_padding_free_batches_unchanged():
    try:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    except ImportError:
        pytest.skip("no DataCollatorForLanguageModeling in trl.trainer.sft_trainer")
    if not dataclasses.is_dataclass(DataCollatorForLanguageModeling) or "padding_free" not in {
        f.name for f in dataclasses.fields(DataCollatorForLanguageModeling)
    }:
        pytest.skip("this TRL has no padding-free collator of its own (TRL <0.19)")
    import torch

    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    plain = collator(features)
    with ftshims.applied(only=[SHIM]):
        shimmed = collator(features)
    assert plain.keys() == shimmed.keys()
    assert all(torch.equal(plain[k], shimmed[k]) for k in plain)
