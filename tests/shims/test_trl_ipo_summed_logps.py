"""trl_ipo_summed_logps: TRL 0.7.5-0.7.10 DPOTrainer(loss_type="ipo") feeds the IPO loss per-token averaged
log-probs, as TRL 0.7.11 does; every other loss type stays bit-identical."""

import logging

import pytest
import torch
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.probing import in_affected_range
from ftshims.spec import ProbeUnsupported

SHIM = "trl_ipo_summed_logps"
shim_module = registry.get(SHIM).module


def test_ipo_loss_uses_averaged_logps(evidence):
    """Completions of 2-7 tokens: without the shim the IPO loss sees sums, with it per-token averages."""
    assert_bug_and_fix(SHIM, evidence, "loss_type ipo, completions of 2-7 tokens", loss_type="ipo")


def test_sigmoid_keeps_summed_logps(evidence):
    assert_bug_and_fix(SHIM, evidence, "loss_type sigmoid (DPO): sums, untouched", expect_bug=False,
                       loss_type="sigmoid")


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    try:
        trainer = shim_module.trainer("ipo", str(tmp_path_factory.mktemp("dpo")))
    except ProbeUnsupported as exc:
        pytest.skip(str(exc))
    trainer.model.eval()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(shim_module.ROWS))])
    return trainer, batch


def _run(trainer, batch):
    with torch.no_grad():
        chosen, rejected = trainer.concatenated_forward(trainer.model, batch)[:2]
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    return chosen, rejected, loss, metrics


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "kto_pair"])
def test_other_loss_types_bit_identical(dpo, loss_type, monkeypatch):
    trainer, batch = dpo
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    plain = _run(trainer, batch)
    with ftshims.applied(only=[SHIM]):
        shimmed = _run(trainer, batch)
    for a, b in zip(plain[:3], shimmed[:3]):
        assert torch.equal(a, b)
    assert {k: float(v) for k, v in plain[3].items()} == {k: float(v) for k, v in shimmed[3].items()}


def test_ipo_logps_are_exactly_what_0_7_11_computes(dpo):
    """0.7.11 passes average_log_prob=True to the same get_batch_logps: bit-identical to that, not just close."""
    trainer, batch = dpo
    cat = trainer.concatenated_inputs(batch, is_encoder_decoder=False, label_pad_token_id=trainer.label_pad_token_id,
                                      padding_value=trainer.padding_value, device=trainer.accelerator.device)
    with torch.no_grad():
        logits = trainer.model(cat["concatenated_input_ids"], attention_mask=cat["concatenated_attention_mask"]).logits
        expected = trainer.get_batch_logps(logits, cat["concatenated_labels"], average_log_prob=True,
                                           is_encoder_decoder=False, label_pad_token_id=trainer.label_pad_token_id)
    n = batch["chosen_labels"].shape[0]
    with ftshims.applied(only=[SHIM]):
        chosen, rejected = _run(trainer, batch)[:2]
        assert shim_module._AVERAGE.get() is False  # the flag lives only inside concatenated_forward
        with torch.no_grad():  # a direct call outside concatenated_forward is not touched
            direct = trainer.get_batch_logps(logits, cat["concatenated_labels"], average_log_prob=False,
                                             is_encoder_decoder=False, label_pad_token_id=trainer.label_pad_token_id)
    assert torch.equal(chosen, expected[:n]) and torch.equal(rejected, expected[n:])
    assert not torch.allclose(direct, expected)


def test_subclass_overriding_get_batch_logps_is_left_alone(dpo, monkeypatch, caplog):
    """A subclass that reduces log-probs itself gets what TRL passes it (False), and one warning."""
    trainer, batch = dpo
    base = type(trainer)
    seen = []

    class OwnLogps(base):
        @staticmethod
        def get_batch_logps(logits, labels, average_log_prob=False, **kwargs):
            seen.append(average_log_prob)
            return base.get_batch_logps(logits, labels, average_log_prob=average_log_prob, **kwargs)

    plain = _run(trainer, batch)
    monkeypatch.setattr(trainer, "__class__", OwnLogps)
    with ftshims.applied(only=[SHIM]), caplog.at_level(logging.WARNING, logger="ftshims"):
        shimmed = _run(trainer, batch)
    assert seen and not any(seen)
    assert torch.equal(plain[0], shimmed[0]) and torch.equal(plain[1], shimmed[1])
    assert any("overrides get_batch_logps" in r.getMessage() for r in caplog.records)


def test_completion_without_scored_label_is_not_nan(dpo):
    """A completion whose labels are all masked (max_prompt_length >= max_length truncates responses away) sums to 0;
    0.7.11's average is 0/0 = NaN and makes the loss and every gradient NaN. The shim divides by clamp(count, 1)
    as TRL 0.29.0 does (trl#1033): that row stays 0, every other row keeps 0.7.11's average bit for bit."""
    trainer, batch = dpo
    batch = dict(batch, chosen_labels=batch["chosen_labels"].clone())
    batch["chosen_labels"][0] = trainer.label_pad_token_id
    plain = _run(trainer, batch)
    assert plain[0][0] == 0 and torch.isfinite(plain[2])  # summed: 0, finite (the bug is the other rows' scale)
    with ftshims.applied(only=[SHIM]):
        chosen, rejected, loss, _ = _run(trainer, batch)
        trainer.model.zero_grad()
        trainer.get_batch_loss_metrics(trainer.model, batch)[0].backward()
    assert chosen[0] == 0 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)
    cat = trainer.concatenated_inputs(batch, is_encoder_decoder=False, label_pad_token_id=trainer.label_pad_token_id,
                                      padding_value=trainer.padding_value, device=trainer.accelerator.device)
    with torch.no_grad():
        logits = trainer.model(cat["concatenated_input_ids"], attention_mask=cat["concatenated_attention_mask"]).logits
        expected = trainer.get_batch_logps(logits, cat["concatenated_labels"], average_log_prob=True,
                                           is_encoder_decoder=False, label_pad_token_id=trainer.label_pad_token_id)
    n = batch["chosen_labels"].shape[0]
    assert torch.isnan(expected[0])  # 0.7.11's formula on this batch
    assert torch.equal(chosen[1:], expected[1:n]) and torch.equal(rejected, expected[n:])
