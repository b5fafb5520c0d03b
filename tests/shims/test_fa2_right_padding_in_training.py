"""fa2_right_padding_in_training on CPU: transformers' real flash_attention_2 code path (the check, the
unpadding, the layers) with flash_attn_packing's pure-PyTorch kernels in place of flash-attn."""

import pytest
import torch
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry, tiny
from ftshims.report import NOT_NEEDED
from ftshims.shims import flash_attn_packing
from ftshims.versions import in_range, installed_version

SHIM = "fa2_right_padding_in_training"
module = registry.get(SHIM).module
VERSION = installed_version("transformers")
IN_RANGE = in_range(VERSION, module.SPEC.requires["transformers"])

FAMILIES = list(module.CONFIGS)
PRESENT = [f for f in FAMILIES if module.family_available(f)]
CHECKED = [f for f in PRESENT if module.has_check(f)]

in_range_only = pytest.mark.skipif(not IN_RANGE, reason=f"transformers {VERSION} is outside the shim's range")


@pytest.fixture(params=CHECKED or ["none"])
def family(request):
    """Each family whose installed modeling code has the check (tests that need one ask for ``family``)."""
    if request.param == "none":
        pytest.skip(f"no family has the check in transformers {VERSION}")
    return request.param


def _present(family):
    if family not in PRESENT:
        pytest.skip(f"transformers {VERSION} has no {family}")


@pytest.mark.parametrize("family", FAMILIES)
def test_right_padded_training_forward(evidence, family):
    """Bug: ValueError on the right-padded training batch (where the family's code has the check).
    Fixed: the forward runs, with finite loss and gradients, and its loss equals sdpa's."""
    _present(family)
    assert_bug_and_fix(SHIM, evidence, f"{family}/right", expect_bug=module.has_check(family), family=family, padding="right")


@pytest.mark.parametrize("padding", ["left", "none"])
@pytest.mark.parametrize("family", ["mistral", "qwen2_moe"])
def test_left_or_no_padding_is_healthy(evidence, family, padding):
    _present(family)
    assert_bug_and_fix(SHIM, evidence, f"{family}/{padding}", expect_bug=False, family=family, padding=padding)


def _flash_model(family):
    _present(family)
    return module.make_flash(module.tiny_model(family))


def _generate(model, inputs):
    return model.generate(**{k: v for k, v in inputs.items() if k != "labels"}, max_new_tokens=2, do_sample=False,
                          pad_token_id=0)


@in_range_only
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_right_padded_generation_still_raises(family, mode):
    """Generation is where upstream's check is right: with the shim applied, right-padded generate()
    (in eval mode, and in train mode: generate passes use_cache / a cache itself) still raises."""
    model = _flash_model(family)
    getattr(model, mode)()
    with ftshims.applied(only=[SHIM]) as report, module.stand_in(model), torch.no_grad():
        assert report[SHIM].active
        with pytest.raises(ValueError, match="padding_side='right'"):
            _generate(model, module.batch("right"))
        assert not ftshims.status()[SHIM].actions


@in_range_only
def test_eval_forward_and_explicit_cache_pass_through(family):
    """Eval-mode forwards and training forwards that ask for a cache keep upstream's behaviour."""
    model = _flash_model(family)
    inputs = module.batch("right")
    with ftshims.applied(only=[SHIM]), module.stand_in(model), torch.no_grad():
        model.eval()
        with pytest.raises(ValueError, match="padding_side='right'"):
            model(**inputs)
        model.train()
        with pytest.raises(ValueError, match="padding_side='right'"):
            model(**inputs, use_cache=True)
        assert model(**inputs, use_cache=False).loss is not None  # the user's own workaround, untouched
        assert not ftshims.status()[SHIM].actions


@in_range_only
def test_gradient_checkpointing_left_to_upstream(family):
    """With gradient checkpointing upstream turns use_cache off before the check (4.36.2+): no action."""
    model = _flash_model(family)
    if not model.supports_gradient_checkpointing:
        pytest.skip(f"{type(model).__name__} does not support gradient checkpointing in transformers {VERSION}")
    model.gradient_checkpointing_enable()
    with ftshims.applied(only=[SHIM]), module.stand_in(model), tiny.quiet():
        model(**module.batch("right")).loss.backward()
        assert not ftshims.status()[SHIM].actions


@in_range_only
def test_calls_that_would_not_raise_are_untouched(family):
    """Left padding under flash, and right padding under sdpa: outputs (cache included) as without the shim."""
    flash = _flash_model(family)
    sdpa = module.tiny_model(family)
    cases = [(flash, module.batch("left")), (sdpa, module.batch("right"))]

    def run():
        outputs = []
        for model, inputs in cases:
            torch.manual_seed(0)  # PhiMoE's router draws random numbers in training
            outputs.append(model(**inputs))
        return outputs

    with module.stand_in(flash), torch.no_grad():
        before = run()
        with ftshims.applied(only=[SHIM]):
            after = run()
            assert not ftshims.status()[SHIM].actions
    for old, new in zip(before, after):
        assert torch.equal(old.logits, new.logits)
        assert type(old.past_key_values) is type(new.past_key_values)  # a cache where upstream returns one


@in_range_only
def test_fixed_forward_counts_and_uses_the_flash_code(family, monkeypatch):
    """The fixed forward runs transformers' flash path (the stand-in varlen kernel, once per layer), and
    the shim counts what it did."""
    calls = []
    kernel = flash_attn_packing.reference_flash_attn_varlen_func
    monkeypatch.setattr(flash_attn_packing, "reference_flash_attn_varlen_func",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    model = _flash_model(family)
    with ftshims.applied(only=[SHIM]), module.stand_in(model):
        out = model(**module.batch("right"))
        actions = ftshims.status()[SHIM].actions
    assert out.past_key_values is None  # run without a cache
    assert len(calls) == model.config.num_hidden_layers
    assert actions == {"right-padded training forwards run without a cache": 1}


@pytest.mark.skipif(IN_RANGE, reason="checks the gate outside the shim's range")
def test_not_applied_outside_range():
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].status == NOT_NEEDED
