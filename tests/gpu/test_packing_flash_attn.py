"""Packing under the real flash-attention kernels (FA2 / FA3): needs CUDA and flash_attn.

Run with `pytest -m gpu tests/gpu`. Same scenarios as tests/shims/test_flash_attn_packing.py (which
drives the same transformers code on CPU with a pure-torch kernel), in bf16 on the GPU, plus the
eager/sdpa shim on CUDA in bf16.
"""

import importlib.util

import pytest

torch = pytest.importorskip("torch")

from tests.shimcheck import assert_bug_and_fix  # noqa: E402

from ftshims.shims import _packing  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
HAS_FA2 = importlib.util.find_spec("flash_attn") is not None
HAS_FA3 = importlib.util.find_spec("flash_attn_interface") is not None
VERSION = _packing.transformers_version()
ROWS_BROKEN = VERSION.release[:2] >= (4, 53)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA"),
    pytest.mark.skipif(VERSION.release[:2] < (4, 44), reason="flash_attn_packing covers transformers >=4.44"),
]
SCENARIOS = [("ones", 1, False), ("ones", 2, ROWS_BROKEN), ("none", 2, ROWS_BROKEN), ("padded", 1, True)]
IDS = ["ones/1row", "ones/2rows", "none/2rows", "padded"]


@pytest.mark.skipif(not HAS_FA2, reason="needs flash_attn (FA2)")
@pytest.mark.parametrize("mask, rows, broken", SCENARIOS, ids=IDS)
def test_fa2_packed_rows_isolated(evidence, mask, rows, broken):
    assert_bug_and_fix(
        "flash_attn_packing", evidence, f"fa2/{mask}/{rows}", expect_bug=broken,
        kernel="flash", implementation="flash_attention_2", mask=mask, rows=rows,
    )


@pytest.mark.skipif(not HAS_FA3, reason="needs flash_attn_interface (FA3, Hopper)")
@pytest.mark.skipif(VERSION.release[:2] < (4, 53), reason="flash_attention_3 is wired in transformers >=4.53")
@pytest.mark.parametrize("mask, rows, broken", SCENARIOS, ids=IDS)
def test_fa3_packed_rows_isolated(evidence, mask, rows, broken):
    assert_bug_and_fix(
        "flash_attn_packing", evidence, f"fa3/{mask}/{rows}", expect_bug=broken,
        kernel="flash", implementation="flash_attention_3", mask=mask, rows=rows,
    )


@pytest.mark.skipif(not HAS_FA2, reason="needs flash_attn (FA2)")
def test_fa2_packed_loss_matches_separate_examples():
    """Real kernel, train() mode, bf16: packed loss*10 == 4*loss_A + 6*loss_B within bf16 tolerance."""
    import ftshims
    from ftshims import tiny

    model = tiny.tiny_llama(attn="flash_attention_2").to(device="cuda", dtype=torch.bfloat16).train()
    examples = [e.cuda() for e in _packing.example_pair()]
    batch = {k: v.cuda().expand(2, -1).contiguous() for k, v in _packing.packed_batch(examples, mask="none").items()}
    with ftshims.applied(only=["flash_attn_packing"]):
        packed = model(**batch).loss
    counts = [len(e) - 1 for e in examples]
    separate = [model(input_ids=e[None], labels=e[None], use_cache=False).loss for e in examples]
    weighted = sum(n * loss for n, loss in zip(counts, separate)) / sum(counts)
    torch.testing.assert_close(packed.float(), weighted.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_block_mask_on_cuda_bf16(attn):
    """packing_block_mask on the GPU in bf16 (sdpa may dispatch to its flash/efficient kernels there)."""
    import ftshims
    from ftshims import tiny

    model = tiny.tiny_llama(attn=attn).to(device="cuda", dtype=torch.bfloat16).train()
    examples = _packing.example_pair()
    batch = _packing.packed_batch(examples, mask="ones", pad_row=True)
    assert _packing.segment_logit_gap(model, examples, batch) > 0.1
    with ftshims.applied(only=["packing_block_mask"]):
        gap = _packing.segment_logit_gap(model, examples, batch)
    assert gap < 3e-2, gap
