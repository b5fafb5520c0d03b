"""max_positions_guard: inputs longer than max_position_embeddings, per family and era, and each policy."""

import warnings

import pytest
from packaging.version import Version
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims.versions import installed_version

SHIM = "max_positions_guard"
TRANSFORMERS = Version(installed_version("transformers"))


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
    # RoPE (llama): silent extrapolation without, a warning (and a run) with it.
    long = _shim().LONG
    assert_bug_and_fix(SHIM, evidence, f"{family}/L{long}>16/{'mask' if mask else 'no_mask'}", family=family, mask=mask)


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
    for part in (model.config.model_type, f"{shim.LONG} positions", "16 learned position embeddings", "IndexError",
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
    """The long input really runs under the warning: its prefix equals the short input's output."""
    import torch

    shim = _shim()
    _apply()
    model = shim.build("llama")
    long_out, error, _, _ = shim.run(model, shim.LONG, mask=True)
    assert error is None, error
    short_out, _, _, _ = shim.run(model, shim.MAX_POSITIONS, mask=True)
    torch.testing.assert_close(long_out.logits[:, : shim.MAX_POSITIONS], short_out.logits, atol=1e-5, rtol=1e-5)


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


def test_invalid_policy_is_a_value_error_at_apply_time(monkeypatch):
    # Checked by apply() before anything is installed, not at the (possibly deferred) install.
    with pytest.raises(ValueError, match="auto, error, warn, truncate"):
        ftshims.apply(only=[SHIM], options={SHIM: {"policy": "clip"}})
    assert not ftshims.status()[SHIM].active
    monkeypatch.setenv(_shim().ENV_POLICY, "nope")
    with pytest.raises(ValueError, match=_shim().ENV_POLICY):
        ftshims.apply(only=[SHIM])
    assert not ftshims.status()[SHIM].active


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


# ---------------------------------------------------------------------------
# the bound comes from the tower input_ids pass through (multi-tower and encoder-decoder models)


def _same_with_and_without(build, call):
    """The call gives the same result (or the same exception type) with and without the default shims."""
    import torch

    def run():
        torch.manual_seed(0)
        model = build().eval()
        try:
            with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return call(model), None, [str(w.message) for w in caught if "max_position" in str(w.message)]
        except Exception as exc:  # compared below
            return None, type(exc).__name__, []

    plain = run()
    ftshims.apply()
    try:
        shimmed = run()
    finally:
        ftshims.revert()
    assert plain[1] == shimmed[1], (plain[1], shimmed[1])  # the same outcome either way
    if plain[1] is not None:  # e.g. 4.46 LLaVA without a processor config: upstream itself fails this call
        pytest.skip(f"this transformers fails the call by itself ({plain[1]}), with or without ftshims")
    assert not shimmed[2], shimmed[2]
    assert torch.equal(plain[0], shimmed[0])


def _clip_configs():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "CLIPConfig"):
        pytest.skip("no CLIP in this transformers")
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=77, projection_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=8, projection_dim=16)  # 16 patches + CLS = 17 learned positions
    return transformers, text, vision


def test_clip_text_longer_than_the_vision_table_is_not_rejected():
    import torch

    transformers, text, vision = _clip_configs()
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ids = torch.randint(3, 100, (1, 70))
    pixels = torch.randn(1, 3, 32, 32)
    _same_with_and_without(lambda: transformers.CLIPModel(config),
                           lambda m: m(input_ids=ids, pixel_values=pixels).logits_per_text)
    _same_with_and_without(lambda: transformers.CLIPTextModel(transformers.CLIPTextConfig(**text)),
                           lambda m: m(input_ids=ids).last_hidden_state)


def test_clip_text_model_still_guarded_at_its_own_limit():
    import torch

    transformers, text, _ = _clip_configs()
    model = transformers.CLIPTextModel(transformers.CLIPTextConfig(**text)).eval()
    _apply()
    with torch.no_grad(), pytest.raises(ValueError, match="77 learned position embeddings"):
        model(input_ids=torch.randint(3, 100, (1, 80)))


def test_models_whose_input_embedding_is_unknown_are_left_alone_with_a_note():
    import torch

    transformers, text, vision = _clip_configs()
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = transformers.CLIPModel(config).eval()
    try:
        model.get_input_embeddings()
        pytest.skip("this transformers knows CLIPModel's input embedding")
    except NotImplementedError:
        pass
    _apply()
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 10)), pixel_values=torch.randn(1, 3, 32, 32))

    assert any(note.startswith("CLIPModel left alone: get_input_embeddings()") for note in ftshims.status()[SHIM].notes)


def test_llava_prompt_longer_than_the_vision_table_is_not_rejected():
    import torch

    transformers, text, vision = _clip_configs()
    if not hasattr(transformers, "LlavaForConditionalGeneration"):
        pytest.skip("no LLaVA in this transformers")
    llama = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=128, model_type="llama")
    vision_config = dict(vision, model_type="clip_vision_model")
    config = transformers.LlavaConfig(text_config=llama, vision_config=vision_config, image_token_index=150,
                                      projector_hidden_act="gelu")
    ids = torch.randint(3, 100, (1, 60))
    _same_with_and_without(lambda: transformers.LlavaForConditionalGeneration(config), lambda m: m(input_ids=ids).logits)


def test_whisper_decoder_is_bounded_by_its_own_table_not_the_audio_encoder():
    import torch

    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=8,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )
    features = torch.randn(1, 8, 16)  # 16 frames -> 8 encoder positions after the stride-2 conv
    decoder_ids = torch.randint(3, 100, (1, 20))  # longer than the 8 audio positions, within the 32 text ones
    _same_with_and_without(lambda: transformers.WhisperForConditionalGeneration(config),
                           lambda m: m(input_features=features, decoder_input_ids=decoder_ids).logits)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    _apply()
    with torch.no_grad(), pytest.raises(ValueError, match=r"\(decoder side\)"):
        model(input_features=features, decoder_input_ids=torch.randint(3, 100, (1, 40)))


def test_t5_relative_positions_are_left_alone():
    import torch

    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0)
    ids = torch.randint(3, 100, (1, 600))  # far beyond any table: T5 has none
    _same_with_and_without(lambda: transformers.T5ForConditionalGeneration(config),
                           lambda m: m(input_ids=ids, decoder_input_ids=ids[:, :8]).logits)
