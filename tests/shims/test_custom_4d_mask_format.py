"""custom_4d_mask_format: a block-causal 4D mask in any form (additive, binary, bool) is applied as meant."""

import pytest
import torch
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims.report import NOT_NEEDED
from ftshims.shims import _packing

SHIM = "custom_4d_mask_format"
VERSION = _packing.transformers_version()
V = VERSION.release[:2]
IN_RANGE = V >= (4, 37)

below_437 = pytest.mark.skipif(not IN_RANGE, reason=f"transformers {VERSION} accepts no custom 4D attention mask (4.37+)")


def broken_without_shim(family: str, attn: str, form: str) -> bool:
    """What the installed transformers does with a 4D mask in ``form``, read from its source
    and measured on the pinned stacks (llama and mistral)."""
    on_helpers = V < (4, 42) and family != "llama"  # mistral: _prepare_4d_causal_attention_mask until 4.41
    if on_helpers:
        if form == "additive":
            return True  # 1 - mask: every position masked
        if V >= (4, 40) and attn == "sdpa":
            return True  # the sdpa helper has no 4D branch: ValueError
        return form == "bool" and attn == "eager"  # 1.0 - bool raises under eager; sdpa casts first
    if V == (4, 37):
        return form == "additive" or (form == "bool" and attn == "eager")
    if V == (4, 38):
        return True  # llama's _update_causal_mask ignores 4D masks (transformers#29525)
    if V < (4, 41):
        return form == "additive"  # llama 4.39–4.40 reads 4D masks as binary: additive is inverted
    if V < (4, 44):
        return form != "additive"  # "Custom 4D attention mask should be passed in inverted form"
    if form == "binary":
        return True  # added as a 0/1 bias: nothing masked, not even the future
    return form == "bool" and attn == "eager"  # added as 0/1 under eager; sdpa takes bool masks


@below_437
@pytest.mark.parametrize("form", ["additive", "binary", "bool"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_4d_mask_forms(evidence, family, attn, form):
    if not _packing.family_available(family):
        pytest.skip(f"transformers {VERSION} has no {family}")
    expect = broken_without_shim(family, attn, form)
    assert_bug_and_fix(SHIM, evidence, f"{family}/{attn}/{form}", expect_bug=expect, family=family, attn=attn, form=form)


@below_437
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_masks_read_correctly_are_passed_on_untouched(attn):
    """Where the model reads the mask right, the shim hands it the very same tensor."""
    model = _packing.tiny_decoder("llama", attn)
    examples = _packing.example_pair()
    batch = {k: v for k, v in _packing.packed_batch(examples, mask="none").items() if k != "labels"}
    seg, real = _packing.segments(batch["position_ids"])
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    try:
        for form in ("additive", "binary", "bool"):
            mask = _packing.to_form(_packing.allowed_pairs(seg, real), form, torch.float32)
            seen.clear()
            with ftshims.applied(only=[SHIM]), torch.no_grad():
                model(**batch, attention_mask=mask, use_cache=False)
            passed = seen[0]
            if broken_without_shim("llama", attn, form):
                assert passed is not mask and passed.dtype == torch.float32 and passed.max() == 0
            elif not _packing.needs_passthrough(type(model.model)):
                assert passed is mask or (passed.data_ptr() == mask.data_ptr()), form
    finally:
        hook.remove()


@below_437
def test_unknown_value_ranges_are_left_alone():
    mask = torch.full((1, 1, 4, 4), 0.5)
    assert _packing.read_form(mask) is None
    assert _packing.read_form(torch.zeros(1, 1, 4, 4)) == "additive"
    assert _packing.read_form(torch.ones(1, 1, 4, 4)) == "binary"
    assert _packing.read_form(torch.ones(1, 1, 4, 4, dtype=torch.bool)) == "bool"
    assert _packing.read_form(torch.tensor([[[[0.0, -1e9]]]])) == "additive"


@pytest.mark.skipif(IN_RANGE, reason="checks the gate below transformers 4.37")
def test_not_applied_below_437():
    report = ftshims.apply(only=[SHIM])
    assert report[SHIM].status == NOT_NEEDED and ">=4.37" in report[SHIM].reason
