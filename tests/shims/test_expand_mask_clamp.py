"""expand_mask_clamp: fp16 NaN from fully-masked (left-padding) rows, in every mask era.

Expectations per family were measured on the pinned stacks (CPU, eager, fp16,
q/k forced to scores of about -280, 3 of 8 tokens left-padded); the OPT and
GPT-2 boundaries between the 4.46.3 and 4.53.3 stacks come from the released
sources (OPT's score clamp is gone in 4.49.0, GPT-2 builds Llama-style masks
from 4.52.0).
"""

import sys

import pytest
from packaging.version import Version
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims.spec import ProbeUnsupported
from ftshims.versions import installed_version

SHIM = "expand_mask_clamp"
TRANSFORMERS = Version(installed_version("transformers"))

# family -> first transformers version whose eager fp16 attention produces the NaN
FIRST_BROKEN = {
    "llama": "4.31",  # 4.30 clamped the scores (PR #24561)
    "mistral": "0",  # every release that has Mistral (4.34+)
    "bart": "0",  # every release tested (4.30.2+)
    "opt": "4.49",  # OPTAttention clamped the scores up to 4.48
    "gpt2": "4.52",  # its own causal mask left future tokens finite up to 4.51
}


def expect_nan(family: str, attn: str) -> bool:
    # CPU SDPA adds the mask in fp32 inside the kernel: no overflow, never a NaN here.
    return attn == "eager" and TRANSFORMERS >= Version(FIRST_BROKEN[family])


def _shim():
    from ftshims.shims import expand_mask_clamp

    return expand_mask_clamp


def _build(*args, **kwargs):
    try:
        return _shim().build(*args, **kwargs)
    except ProbeUnsupported as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize(
    "family,attn",
    [
        ("llama", "eager"),
        ("llama", "sdpa"),
        ("mistral", "eager"),
        ("bart", "eager"),
        ("opt", "eager"),
        ("gpt2", "eager"),
    ],
)
def test_fp16_left_padding_nan(evidence, family, attn):
    assert_bug_and_fix(SHIM, evidence, f"{family}/{attn}/fp16", expect_bug=expect_nan(family, attn), family=family, attn=attn)


def test_default_probe_reproduces_on_every_stack(evidence):
    # what the doctor runs: Llama (BART on 4.30, where Llama still clamped its scores)
    assert_bug_and_fix(SHIM, evidence, "default", expect_bug=True)


@pytest.mark.parametrize(
    "family,attn,forced",
    [("llama", "eager", True), ("llama", "eager", False), ("llama", "sdpa", True), ("opt", "eager", True), ("gpt2", "eager", True)],
)
def test_fp16_real_positions_match_unpadded_run(family, attn, forced):
    # BART is left out: it has no position_ids argument, so left padding shifts its learned positions.
    import torch

    shim = _shim()
    ftshims.apply(only=[SHIM])
    model = _build(family, attn=attn, dtype="float16", forced=forced)
    ids, mask, position_ids = shim.padded_batch(family)
    padded = shim.forward(model, ids, mask, position_ids)[:, shim.PAD :]
    real = ids[:, shim.PAD :]
    alone = shim.forward(model, real, torch.ones_like(real), torch.arange(real.shape[1])[None])
    assert not torch.isnan(padded).any()
    torch.testing.assert_close(padded, alone, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family,attn", [("llama", "eager"), ("llama", "sdpa"), ("bart", "eager"), ("gpt2", "eager")])
def test_healthy_dtypes_are_bit_identical(family, attn, dtype):
    import torch

    shim = _shim()
    model = _build(family, attn=attn, dtype=dtype, forced=True)
    ids, mask, position_ids = shim.padded_batch(family)
    without = shim.forward(model, ids, mask, position_ids)
    report = ftshims.apply(only=[SHIM])
    assert report[SHIM].status == "applied"
    with_shim = shim.forward(model, ids, mask, position_ids)
    assert torch.equal(without, with_shim), (without - with_shim).abs().max()


def test_naive_clamp_is_not_enough():
    """The mask is already >= finfo.min; the overflow happens when the score is added to it."""
    import torch

    lowest = torch.finfo(torch.float16).min
    scores = torch.full((1, 1, 2, 3), -140.0, dtype=torch.float16)
    mask = torch.tensor([[[[lowest, lowest, lowest], [0.0, 0.0, lowest]]]], dtype=torch.float16)  # row 0 fully masked

    def attend(m):
        return torch.softmax((scores + m).float(), dim=-1)

    assert torch.isnan(attend(mask.clamp(min=lowest))[0, 0, 0]).all()  # the blog's clamp: still NaN
    repaired = _shim().repair_mask(mask)
    assert not torch.isnan(attend(repaired)).any()
    assert torch.equal(repaired[0, 0, 1], mask[0, 0, 1])  # a row with something to attend to is unchanged


def test_repair_mask_semantics():
    import torch

    repair = _shim().repair_mask
    lowest = torch.finfo(torch.float16).min
    # 4.31-4.35 added the causal and padding masks: -inf appears, and must be clamped back to finfo.min
    summed = torch.tensor([[[[lowest, float("-inf"), float("-inf")], [lowest, 0.0, lowest]]]], dtype=torch.float16)
    fixed = repair(summed)
    assert torch.equal(fixed[0, 0, 0], torch.zeros(3, dtype=torch.float16))
    assert torch.equal(fixed[0, 0, 1], summed[0, 0, 1])
    assert fixed.min() >= lowest
    # boolean masks (True = attend), only for fp16 compute
    boolean = torch.tensor([[[[False, False], [True, False]]]])
    assert torch.equal(repair(boolean, torch.float16), torch.tensor([[[[True, True], [True, False]]]]))
    assert repair(boolean, torch.bfloat16) is boolean
    # healthy dtypes and non-4D inputs are returned as the same object
    for other in (summed.to(torch.bfloat16), summed.float(), summed[0], None):
        assert repair(other) is other


def _patched():
    return ftshims.status()[SHIM].patched


def test_each_era_hooks_its_own_mask_path():
    """Llama and a non-Llama family are repaired through the hook of their era, found by feature."""
    _build("llama", attn="eager")
    _build("bart", attn="eager")
    if TRANSFORMERS >= Version("4.53"):
        _build("opt", attn="eager")
    ftshims.apply(only=[SHIM])
    patched = _patched()
    expected = []
    if TRANSFORMERS < Version("4.35"):
        expected += ["LlamaModel._prepare_decoder_attention_mask", "BartDecoder._prepare_decoder_attention_mask"]
    if Version("4.35") <= TRANSFORMERS < Version("4.58"):
        expected += ["AttentionMaskConverter.to_4d"]  # BART's helpers (4.35-4.57)
    if Version("4.38") <= TRANSFORMERS < Version("4.53"):
        expected += ["LlamaModel._update_causal_mask"]
    if Version("4.53") <= TRANSFORMERS < Version("5.0"):
        expected += ["OPTDecoder._update_causal_mask"]  # legacy path next to masking_utils
    if TRANSFORMERS >= Version("4.53"):
        expected += ["['eager']", "['sdpa']"]
    for name in expected:
        assert any(name in slot for slot in patched), f"{name} not patched; patched: {patched}"
    if TRANSFORMERS >= Version("5.24"):
        assert "transformers.modeling_attn_mask_utils" not in sys.modules
        assert not any("to_4d" in slot for slot in patched)


def test_revert_restores_every_original():
    _build("llama", attn="eager")
    _build("bart", attn="eager")
    import transformers  # noqa: F401

    owners = []
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.") and module is not None:
            for obj in list(vars(module).values()):
                if isinstance(obj, type) and obj.__module__ == name:
                    for method in ("_prepare_decoder_attention_mask", "_update_causal_mask", "to_4d"):
                        if method in vars(obj):
                            owners.append((obj, method, vars(obj)[method]))
    masking = sys.modules.get("transformers.masking_utils")
    mapping = dict(type(masking.ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping) if masking else {}
    assert owners or masking  # 5.24: only the masking_utils registry is left
    ftshims.apply(only=[SHIM])
    assert all(vars(obj)[method] is not original for obj, method, original in owners)
    if masking:
        live = type(masking.ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping
        assert live["eager"] is not mapping["eager"] and live["sdpa"] is not mapping["sdpa"]
    ftshims.revert(only=[SHIM])
    assert all(vars(obj)[method] is original for obj, method, original in owners)
    if masking:
        assert type(masking.ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping == mapping
        assert all(v is mapping[k] for k, v in type(masking.ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping.items())
