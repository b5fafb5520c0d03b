"""flash_attn_packing on CPU: transformers' real flash-attention code path (unpad, position_ids and
cu_seq_lens branches) with a pure-torch varlen kernel in place of flash-attn. The real kernels run in
tests/gpu/test_packing_flash_attn.py when CUDA and flash_attn are present."""

import pytest
import torch
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.report import NOT_NEEDED
from ftshims.shims import _packing

SHIM = "flash_attn_packing"
module = registry.get(SHIM).module
VERSION = _packing.transformers_version()
IN_RANGE = VERSION.release[:2] >= (4, 44)
ROWS_BROKEN = VERSION.release[:2] >= (4, 53)  # _is_packed_sequence: batch size 1 only

in_range = pytest.mark.skipif(not IN_RANGE, reason=f"transformers {VERSION}: no position_ids varlen path before 4.44")


@in_range
@pytest.mark.parametrize(
    "mask, rows, broken",
    [
        ("ones", 1, False),  # transformers drops an all-ones mask for flash and detects one packed row itself
        ("ones", 2, ROWS_BROKEN),
        ("none", 2, ROWS_BROKEN),
        ("padded", 1, True),  # a mask with padding wins: each row's real tokens become one sequence
    ],
    ids=["ones/1row", "ones/2rows", "none/2rows", "padded"],
)
def test_packed_rows_isolated_under_flash_attention_code(evidence, mask, rows, broken):
    assert_bug_and_fix(SHIM, evidence, f"reference/{mask}/{rows}", expect_bug=broken, kernel="reference", mask=mask, rows=rows)


@in_range
def test_varlen_kwargs_make_padding_tokens_their_own_sequences():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    seg, real = _packing.segments(pos, mask)
    out = module.varlen_kwargs(seg, real)
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 11, 12]
    assert out["cu_seq_lens_q"].dtype == torch.int32 and out["max_length_q"] == 4


@in_range
def test_non_flash_models_untouched():
    model = _packing.tiny_decoder("llama", "sdpa")
    examples = _packing.example_pair()
    batch = {k: v for k, v in _packing.packed_batch(examples, mask="ones").items() if k != "labels"}
    with torch.no_grad():
        before = model(**batch).logits
        with ftshims.applied(only=[SHIM]):
            after = model(**batch).logits
    assert torch.equal(before, after)  # sdpa: packing_block_mask's business, not this shim's


@in_range
def test_reference_kernel_matches_sdpa():
    # the stand-in kernel must compute what sdpa computes for an unpacked batch, or the test above proves nothing
    model = _packing.tiny_decoder("llama", "sdpa")
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with module.reference_flash():
            flash_model = module.reference_flash_model()
            flash_model.load_state_dict(model.state_dict())
            got = flash_model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(IN_RANGE, reason="checks the gate below transformers 4.44")
def test_not_applied_below_444():
    # <4.44 only isolates through the sample-id _get_unpad_data patch: not covered, reported by the doctor
    report = ftshims.apply(only=[SHIM])
    assert report[SHIM].status == NOT_NEEDED and ">=4.44" in report[SHIM].reason
