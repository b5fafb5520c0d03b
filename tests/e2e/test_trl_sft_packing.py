"""The real path: trl.SFTTrainer(packing=True) with eager/sdpa, one batch from its train dataloader
through compute_loss, compared with each example run alone. No single shim owns this path: on
TRL 0.19.1 + transformers 4.53.3 it needs trl_padding_free_position_ids (the collator drops the
boundaries) *and* packing_block_mask (TRL 0.19 leaves use_cache on, so transformers skips its own
packed-sequence detection)."""

import dataclasses

import pytest

import ftshims
from ftshims.shims import _packing
from ftshims.versions import installed_version, in_range

PACKING_SHIMS = ["packing_block_mask", "custom_4d_mask_format", "trl_padding_free_position_ids"]
TRL = installed_version("trl")
TRANSFORMERS = installed_version("transformers")


def _needs_isolating_packer():
    try:
        from trl import SFTConfig
    except ImportError:
        pytest.skip(f"TRL {TRL} has no SFTConfig")

    if "packing_strategy" not in {f.name for f in dataclasses.fields(SFTConfig)}:
        pytest.skip(f"TRL {TRL} packs with ConstantLengthDataset/pack_examples only (contaminating by design; "
                    "see tests/shims/test_packing_contamination_warning.py)")


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sft_packing_isolates_examples(attn):
    _needs_isolating_packer()
    gap_without, batch_without = _packing.sft_packing_gap(attn)
    # TRL 0.19–0.23.0 emit no position_ids for eager/sdpa; 0.23.1+ (bfd, position_ids, no mask,
    # use_cache=False from 0.22) are isolated by transformers >=4.53.1 itself.
    broken = in_range(TRL, "<0.23.1") or in_range(TRANSFORMERS, "<4.53.1")
    assert (gap_without > 1e-2) == broken, (gap_without, sorted(batch_without))
    with ftshims.applied(only=PACKING_SHIMS):
        gap_with, batch_with = _packing.sft_packing_gap(attn)
    assert gap_with < 1e-5, (gap_with, sorted(batch_with))
    assert "position_ids" in batch_with


@pytest.mark.slow
def test_sft_wrapped_strategy_stays_contaminated_but_warns():
    _needs_isolating_packer()
    from ftshims.shims.packing_contamination_warning import PackingContaminationWarning

    with ftshims.applied(only=PACKING_SHIMS + ["packing_contamination_warning"]):
        with pytest.warns(PackingContaminationWarning, match="attend to each other"):
            gap, _ = _packing.sft_packing_gap("sdpa", strategy="wrapped")
    assert gap > 1e-2  # nothing can isolate examples whose boundaries were thrown away
