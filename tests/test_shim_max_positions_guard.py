"""max_positions_guard: inputs longer than max_position_embeddings, per family and era, and each policy."""

import warnings

import pytest
from packaging.version import Version
from shimcheck import assert_bug_and_fix

import ftshims
from ftshims.versions import installed_version

SHIM = "max_positions_guard"
TRANSFORMERS = Version(installed_version("transformers"))
BUFFER_BUG = Version("4.38.0") <= TRANSFORMERS < Version("4.39")


def _shim():
    from ftshims.shims import max_positions_guard

    return max_positions_guard


def _apply(**options):
    report = ftshims.apply(only=[SHIM], options={SHIM: options} if options else None)
    assert report[SHIM].status == "applied", report[SHIM].reason
    return report


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("family", ["gpt2", "opt", "bart", "llama"])
def test_long_input(evidence, family, mask):
    # learned positions: IndexError inside the forward without the shim, a clear ValueError before any kernel with it;
    # RoPE (llama): silent extrapolation (4.38.x: IndexError / size mismatch) without, a warning (and a run) with it.
    assert_bug_and_fix(SHIM, evidence, f"{family}/L40>16/{'mask' if mask else 'no_mask'}", family=family, mask=mask)


@pytest.mark.parametrize("family", ["gpt2", "opt", "bart", "llama"])
def test_truncate_policy(evidence, family):
    assert_bug_and_fix(SHIM, evidence, f"{family}/truncate", options={"policy": "truncate"}, family=family)


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_truncate_cuts_inputs_masks_and_labels(family):
    import torch

    shim = _shim()
    _apply(policy="truncate")
    model = shim.build(family)
    output, error, warned, _ = shim.run(model, shim.LONG, mask=True, labels=True)
    assert error is None, error
    assert output.logits.shape[1] == shim.MAX_POSITIONS
    assert torch.isfinite(output.loss)
    assert len(warned) == 1 and issubclass(warned[0].category, shim.PositionLimitWarning)
    # the kept prefix is exactly what a 16-token call computes
    alone, _, _, _ = shim.run(model, shim.MAX_POSITIONS, mask=True, labels=False)
    assert torch.equal(output.logits, alone.logits)


@pytest.mark.parametrize("family", ["gpt2", "opt", "bart"])
def test_error_message_names_model_length_limit_and_remedies(family):
    shim = _shim()
    _apply()
    model = shim.build(family)
    _, error, _, kernels = shim.run(model, shim.LONG)
    assert isinstance(error, ValueError), error
    text = str(error)
    for part in (model.config.model_type, "40 positions", "16 learned position embeddings", "IndexError",
                 "truncation=True", "'truncate'", shim.ENV_POLICY):
        assert part in text, (part, text)
    assert kernels == 0


def test_rope_warns_once_per_model_and_never_errors():
    shim = _shim()
    _apply()
    first, second = shim.build("llama"), shim.build("llama", seed=1)
    counts = []
    for model in (first, first, second):
        output, error, warned, _ = shim.run(model, shim.LONG)
        assert error is None, error
        assert output.logits.shape[1] == shim.LONG
        counts.append(len(warned))
    assert counts == [1, 0, 1]


def test_long_rope_input_stays_causal():
    """The long input really works (4.38.x: regrown causal_mask buffer): its prefix equals the short input's output."""
    import torch

    shim = _shim()
    _apply()
    model = shim.build("llama")
    long_out, error, _, _ = shim.run(model, shim.LONG, mask=True)
    assert error is None, error
    short_out, _, _, _ = shim.run(model, shim.MAX_POSITIONS, mask=True)
    torch.testing.assert_close(long_out.logits[:, : shim.MAX_POSITIONS], short_out.logits, atol=1e-5, rtol=1e-5)
    if BUFFER_BUG:
        assert model.model.causal_mask.shape[-1] >= shim.LONG


def test_warn_policy_on_learned_positions_warns_then_fails_as_upstream():
    shim = _shim()
    _apply(policy="warn")
    model = shim.build("gpt2")
    _, error, warned, kernels = shim.run(model, shim.LONG)
    assert len(warned) == 1
    assert isinstance(error, IndexError) and kernels > 0  # the call went ahead, unchanged


def test_error_policy_applies_to_rope_models():
    shim = _shim()
    _apply(policy="error")
    _, error, _, kernels = shim.run(shim.build("llama"), shim.LONG)
    assert isinstance(error, ValueError) and "llama" in str(error) and kernels == 0


def test_env_var_sets_policy_and_option_wins(monkeypatch):
    shim = _shim()
    monkeypatch.setenv(shim.ENV_POLICY, "truncate")
    _apply()
    output, error, _, _ = shim.run(shim.build("gpt2"), shim.LONG)
    assert error is None and output.logits.shape[1] == shim.MAX_POSITIONS
    ftshims.revert(only=[SHIM])
    _apply(policy="error")
    _, error, _, _ = shim.run(shim.build("gpt2"), shim.LONG)
    assert isinstance(error, ValueError)


def test_invalid_policy_is_reported_not_applied(monkeypatch):
    report = ftshims.apply(only=[SHIM], options={SHIM: {"policy": "clip"}})
    assert report[SHIM].status == "failed" and "auto, error, warn, truncate" in report[SHIM].reason
    monkeypatch.setenv(_shim().ENV_POLICY, "nope")
    report = ftshims.apply(only=[SHIM])
    assert report[SHIM].status == "failed" and _shim().ENV_POLICY in report[SHIM].reason


@pytest.mark.parametrize("family", ["gpt2", "opt", "bart", "llama"])
def test_inputs_within_the_limit_are_untouched(family):
    import torch

    shim = _shim()
    model = shim.build(family)
    before, error, _, _ = shim.run(model, shim.MAX_POSITIONS)
    assert error is None
    _apply()
    after, error, warned, _ = shim.run(model, shim.MAX_POSITIONS)
    assert error is None and not warned
    assert torch.equal(before.logits, after.logits)


def test_left_padded_opt_batch_that_fits_is_not_rejected():
    """OPT takes its positions from the attention mask: 20 tokens of which 6 are padding need only 14 positions."""
    import torch

    shim = _shim()
    model = shim.build("opt")
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :6] = 0
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits  # upstream runs it
        _apply()
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)


def test_packed_position_ids_that_fit():
    """Two packed sequences of 12 (24 tokens, positions < 16): accepted where GPT-2 can run them (5.x), a clear
    ValueError where its square ``attn.bias`` buffer caps the token count (<= 4.57: upstream fails with a size
    mismatch)."""
    import torch

    shim = _shim()
    model = shim.build("gpt2")
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(12).repeat(2)[None]
    with torch.no_grad():
        try:
            before = model(input_ids=ids, position_ids=position_ids).logits
        except RuntimeError:
            before = None
        _apply()
        if before is None:
            with pytest.raises(ValueError, match="24 positions"):
                model(input_ids=ids, position_ids=position_ids)
        else:
            assert torch.equal(before, model(input_ids=ids, position_ids=position_ids).logits)


def test_cached_tokens_count_towards_the_limit():
    import torch

    shim = _shim()
    model = shim.build("gpt2")
    ids = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        past = model(input_ids=ids, use_cache=True).past_key_values
        with pytest.raises(IndexError):  # upstream: 10 cached + 10 new > 16
            model(input_ids=ids, past_key_values=past, use_cache=True)
        past = model(input_ids=ids, use_cache=True).past_key_values
        _apply()
        with pytest.raises(ValueError, match="after 10 cached"):
            model(input_ids=ids, past_key_values=past, use_cache=True)


def test_encoder_decoder_checks_the_encoder_side():
    import torch
    import transformers

    shim = _shim()
    config = transformers.BartConfig(**shim.FAMILIES["bart"][1])
    model = transformers.BartForConditionalGeneration(config).eval()
    ids = torch.randint(3, 100, (1, shim.LONG))
    decoder_ids = ids[:, :8]
    with torch.no_grad():
        with pytest.raises(IndexError):
            model(input_ids=ids, decoder_input_ids=decoder_ids)
        _apply()
        with pytest.raises(ValueError, match=r"\(encoder side\)"):
            model(input_ids=ids, decoder_input_ids=decoder_ids)
        with pytest.raises(ValueError, match=r"\(decoder side\)"):
            model(input_ids=decoder_ids, decoder_input_ids=ids)
        model(input_ids=ids[:, :16], decoder_input_ids=decoder_ids)  # both sides fit


def test_revert_restores_pretrainedmodel_call():
    import torch
    from transformers.modeling_utils import PreTrainedModel

    assert "__call__" not in vars(PreTrainedModel)
    _apply()
    assert "__call__" in vars(PreTrainedModel)
    ftshims.revert(only=[SHIM])
    assert "__call__" not in vars(PreTrainedModel)
    assert PreTrainedModel.__call__ is torch.nn.Module.__call__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no guard left: the long GPT-2 input fails as upstream
        _, error, _, _ = _shim().run(_shim().build("gpt2"), _shim().LONG)
    assert isinstance(error, IndexError)
