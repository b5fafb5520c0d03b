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
