import pytest
from tests.shimcheck import assert_bug_and_fix

SHIM = "lora_reentrant_checkpointing"


@pytest.mark.parametrize("use_reentrant", [None, True, False], ids=["default", "reentrant", "non_reentrant"])
@pytest.mark.parametrize("order", ["peft_first", "checkpointing_first"])
def test_lora_grads_with_checkpointing(evidence, order, use_reentrant):
    # Only Trainer's order (PEFT first) with reentrant checkpointing loses the gradients;
    # the other cases prove the shim changes nothing where there is no bug.
    broken = order == "peft_first" and use_reentrant is not False
    assert_bug_and_fix(SHIM, evidence, f"{order}/{use_reentrant}", expect_bug=broken, order=order, use_reentrant=use_reentrant)


def _trainer_step(tmp_path):
    """One real Trainer step with gradient_checkpointing=True on a PeftModel.

    Returns (error or None, changed trainable names, changed frozen names, lora_B names).
    """
    import torch
    from transformers import Trainer, TrainingArguments

    from ftshims import tiny

    model = tiny.lora(tiny.tiny_llama())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    rows = tiny.batch(batch_size=4)
    dataset = [{k: v[i] for k, v in rows.items()} for i in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
        gradient_checkpointing=True, report_to=[], save_strategy="no", logging_strategy="no",
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    try:
        with tiny.quiet():
            trainer.train()
    except RuntimeError as exc:
        return str(exc), set(), set(), set()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    lora_b = {n for n in trainable if "lora_B" in n}
    return None, changed & trainable, changed - trainable, lora_b


def test_real_trainer_step(evidence, tmp_path):
    from ftshims import probing
    import ftshims

    error_without, *_ = _trainer_step(tmp_path)
    with ftshims.applied(only=[SHIM]) as report:
        error_with, changed_trainable, changed_frozen, lora_b = _trainer_step(tmp_path)
    affected, _ = probing.in_affected_range(SHIM)
    if affected:
        assert error_without and "does not require grad" in error_without, "negative control: Trainer step should fail"
    else:
        assert error_without is None, error_without
    assert error_with is None, error_with
    assert lora_b and lora_b <= changed_trainable, "every lora_B weight must move after one step"
    assert not changed_frozen, f"frozen weights moved: {sorted(changed_frozen)[:5]}"
    evidence.record_raw(SHIM, "Trainer(gradient_checkpointing=True) step on PeftModel", affected,
                        error_without is not None, error_with is not None, report[SHIM].status,
                        without=error_without or "step ran", with_shim=f"step ran, {len(lora_b)} lora_B weights moved")


# --- sub-models with their own input embeddings (5.0.0 hooks them all, #41993) ------------------------------------

def _lora_grads(model, targets, forward):
    """LoRA on ``targets``, reentrant checkpointing in Trainer's order, one backward: {lora name: got a grad}, or the
    error the backward raised."""
    import torch
    from peft import LoraConfig, get_peft_model

    from ftshims import tiny

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    with tiny.quiet():
        model.gradient_checkpointing_enable()
        model.train()
        try:
            forward(model).loss.backward()
        except RuntimeError as exc:
            return str(exc)
    return {n: p.grad is not None for n, p in model.named_parameters() if "lora_" in n}


def _tiny_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))


def _bart_forward(model):
    import torch

    ids = torch.tensor([[5, 6, 7, 8, 9, 2]])
    return model(input_ids=ids, labels=ids)


@pytest.fixture
def affected():
    from ftshims import probing

    if not probing.in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")


def test_bart_encoder_and_decoder_embed_with_their_own_modules(affected):
    """BART's encoder and decoder each embed with a module of their own (sharing the weight with ``shared``, which
    get_input_embeddings() returns and no forward calls): hooking only ``shared`` left every LoRA weight without a
    gradient (ftshims 0.1.0: the same error as without the shim)."""
    import ftshims

    plain = _lora_grads(_tiny_bart(), ["q_proj", "v_proj"], _bart_forward)
    assert isinstance(plain, str) and "does not require grad" in plain
    with ftshims.applied(only=[SHIM]):
        grads = _lora_grads(_tiny_bart(), ["q_proj", "v_proj"], _bart_forward)
    assert isinstance(grads, dict) and grads and all(grads.values()), grads


def test_frozen_sub_model_gets_no_hook(affected):
    """LoRA in the decoder only: the encoder trains nothing, so its embeddings get no input-grad hook (a hook there
    would only make a frozen tower keep its graph, ms-swift#10214)."""
    import ftshims

    model = _tiny_bart()
    with ftshims.applied(only=[SHIM]):
        grads = _lora_grads(model, r"model\.decoder\.layers\.\d+\.self_attn\.(q_proj|v_proj)", _bart_forward)
    assert isinstance(grads, dict) and grads and all(grads.values()), grads
    assert getattr(model.model.encoder, "_require_grads_hook", None) is None
    assert getattr(model.model.decoder, "_require_grads_hook", None) is not None


def test_vlm_vision_tower_lora_gets_gradients(affected):
    """A tiny LLaVA with LoRA in the vision tower and the language model: with only the text embeddings hooked, the
    vision tower's LoRA got no gradient, silently (the text LoRA trained)."""
    import torch
    import transformers
    from packaging.version import Version

    import ftshims

    if Version(transformers.__version__) < Version("4.48") or not hasattr(transformers, "LlavaForConditionalGeneration"):
        pytest.skip("LLaVA with processor-expanded image tokens: transformers >=4.48")
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    def build():
        torch.manual_seed(0)
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=16, patch_size=8, projection_dim=32)
        text = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
        return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=63,
                                                         vision_feature_layer=-1))

    def forward(model):
        ids = torch.tensor([[1] + [63] * 4 + [5, 6, 7, 8]])  # 4 image tokens: (16 / 8) ** 2 patches
        return model(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16), labels=ids)

    with ftshims.applied(only=[SHIM]):
        grads = _lora_grads(build(), ["q_proj", "v_proj"], forward)
    assert isinstance(grads, dict), grads
    vision = {n: g for n, g in grads.items() if "vision_tower" in n}
    text = {n: g for n, g in grads.items() if "vision_tower" not in n}
    assert vision and all(vision.values()), vision
    assert text and all(text.values()), text
