"""The data and configuration checks on real Trainer runs: each mistake users make themselves gives exactly its
finding, and the same run without the mistake gives none (test_healthy.py / test_trl_healthy.py: the references).

Tiny Llama (vocabulary 128; pad 0, BOS 1, EOS 2), learnable rows of ids 3..127 (runs.corpus), a few steps each.
"""

import pytest
import torch

import ftshims
from ftshims.monitor import catalogue

from .runs import corpus, default_stack_only, in_order, rows_dataset, train

pytestmark = default_stack_only

PAD, BOS, EOS = 0, 1, 2


def _model(**overrides):
    from ftshims import tiny

    return tiny.tiny_llama(**overrides)


def _run(rows, steps=4, **kwargs):
    ftshims.apply()
    result = train(_model(**kwargs.pop("model", {})), rows_dataset(rows), max_steps=steps, trainer_class=in_order(),
                   **kwargs)
    assert result.error is None, result.error
    return result


def _padded(n=32, seq=16, end_with_eos=True, seed=0):
    """Rows of 8..seq tokens ending with EOS, right-padded with PAD to seq; labels -100 on the padding (the healthy
    form; ``end_with_eos=False``: rows that never end, no_eos_target's case)."""
    rows = corpus(n=n, seq=seq, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(8, seq + 1, (n,), generator=g)
    for i, length in enumerate(lengths.tolist()):
        if end_with_eos:
            rows["input_ids"][i, length - 1] = EOS
        rows["input_ids"][i, length:] = PAD
        rows["attention_mask"][i, length:] = 0
    rows["labels"] = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    return rows


def test_labels_already_shifted():
    rows = corpus(n=32, seq=16)
    rows["labels"][:, :-1] = rows["input_ids"][:, 1:]  # what a user writes who shifts for the model
    rows["labels"][:, -1] = -100
    finding = _run(rows).only("labels_preshifted")
    assert finding.step == 4 and finding.severity == "error"  # judged over the first data_steps (4) steps
    assert finding.detail["fraction"] == 1.0 and finding.detail["labels_compared"] == 4 * 4 * 15
    assert "learns the token after next" in finding.message and "labels = input_ids" in finding.message
    _run(corpus(n=32, seq=16)).none()  # the same rows, labels = input_ids


@pytest.mark.parametrize("mask", ["attention_mask", "all_ones"])
def test_padding_trained_on(mask):
    """Right padding, pad (0) != EOS (2), the pads left in the labels: found by the attention mask, or, when the
    mask is all ones, by the pad ids at the ends of the rows."""
    rows = _padded()
    rows["labels"] = rows["input_ids"].clone()  # labels = input_ids, padding included
    if mask == "all_ones":
        rows["attention_mask"] = torch.ones_like(rows["input_ids"])
    finding = _run(rows).only("padding_trained_on")
    scored = finding.detail["scored_labels"]
    assert finding.detail["labels_on_padding"] > 0 and 0 < finding.detail["fraction"] < 1
    assert scored == 4 * 4 * 15 and "-100" in finding.message
    _run(_padded()).none()  # the same rows, padding labelled -100


@pytest.mark.parametrize("case", ["warmup", "zero_lr", "other_optimizer"])
def test_lr_schedule_that_cannot_train(case):
    model, extra = _model(), {}
    if case == "warmup":
        extra["warmup_steps"] = 100  # the run is 6 steps
    elif case == "zero_lr":
        extra["learning_rate"] = 0.0
    else:  # the user's scheduler, built on another optimizer than the one passed
        stray = torch.optim.AdamW(_model(seed=1).parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(stray, lambda step: 1 - step / 6)
        extra["trainer_kwargs"] = {"optimizers": (torch.optim.AdamW(model.parameters(), lr=1e-3), schedule)}
    ftshims.apply()
    result = train(model, rows_dataset(corpus(n=32, seq=16)), max_steps=6, **extra)
    assert result.error is None, result.error
    finding = result.only("lr_schedule_cannot_train")
    assert finding.step == 0  # said before the first update
    if case == "warmup":
        assert finding.detail["warmup_steps"] == 100 and finding.detail["max_steps"] == 6
        assert "longer than the run" in finding.message and finding.detail["peak_lr"] < 1e-4
    elif case == "zero_lr":
        assert "learning rate is 0 at 100%" in finding.message
    else:
        assert "another optimizer" in finding.message
    train(_model(), rows_dataset(corpus(n=32, seq=16)), max_steps=6, warmup_steps=2).none()


def test_every_row_starting_with_bos_twice():
    rows = corpus(n=32, seq=16)
    rows["input_ids"][:, :2] = BOS  # a chat template that renders BOS, tokenized with add_special_tokens=True
    rows["labels"] = rows["input_ids"].clone()
    finding = _run(rows).only("bos_doubled")
    assert finding.detail["rows_doubled"] == finding.detail["rows"] == 16 and finding.detail["bos_id"] == BOS
    assert finding.explains == [c for c in ("trl_sft_double_bos_conversational",) if catalogue.exists_here(c)]
    rows["input_ids"][:, 1] = 5  # one BOS
    rows["labels"] = rows["input_ids"].clone()
    _run(rows).none()


def test_left_padded_rows_with_bos_twice():
    """The first attended position counts, not position 0."""
    rows = corpus(n=32, seq=16)
    rows["input_ids"][:, :3] = PAD
    rows["attention_mask"][:, :3] = 0
    rows["input_ids"][:, 3:5] = BOS
    rows["labels"] = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    assert _run(rows).only("bos_doubled").detail["fraction"] == 1.0


def test_half_of_the_rows_without_a_target():
    rows = corpus(n=32, seq=16)
    rows["labels"][1::2] = -100  # every other row: truncation cut its response off
    finding = _run(rows).only("rows_without_target")  # no batch is entirely without targets
    assert finding.detail == {**finding.detail, "rows": 16, "rows_without_target": 8, "fraction": 0.5}
    assert "0.5" not in finding.message and "50%" in finding.message


def test_rows_cut_at_the_maximum_length():
    rows = _padded(end_with_eos=True)
    for i in range(0, 32, 2):  # every other row fills the 16 tokens and lost its EOS to truncation
        rows["input_ids"][i] = corpus(n=32, seq=16)["input_ids"][i]
        rows["attention_mask"][i] = 1
    rows["labels"] = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    finding = _run(rows).only("rows_truncated")
    assert finding.detail["rows_cut"] == 8 and finding.detail["rows"] == 16 and finding.detail["max_length"] == 16
    healthy = _padded(end_with_eos=True)  # the longest row of each batch ends with EOS too
    _run(healthy).none()


def test_special_token_outside_the_vocabulary():
    finding = _run(corpus(n=32, seq=16), model={"eos_token_id": 500}).only("special_token_invalid")
    assert finding.step == 0 and finding.detail["invalid"] == [{"where": "config", "name": "eos_token_id", "id": 500}]


def test_loss_that_does_not_move():
    """Every row the same example, and an optimizer built on another model object: the model never changes."""
    rows = corpus(n=32, seq=16)
    rows = {k: v[:1].repeat(32, 1) for k, v in rows.items()}
    stray = torch.optim.AdamW(_model(seed=1).parameters(), lr=1e-3)
    ftshims.apply()
    result = train(_model(), rows_dataset(rows), max_steps=6, trainer_kwargs={"optimizers": (stray, None)})
    assert result.error is None, result.error
    # the cause, at train begin: the optimizer holds none of this model's parameters; then the symptom
    assert result.codes == ["trainable_not_in_optimizer", "loss_not_moving"], [f.line() for f in result.findings]
    assert result.findings[0].step == 0 and "none of them is" in result.findings[0].message
    finding = result.findings[1]
    assert finding.step == 5 and len(set(finding.detail["losses"])) == 1
    assert finding.detail["trainable_parameters"] == sum(p.numel() for p in result.trainer.model.parameters())


def _custom_loop(optimizer_lr: float, steps: int, context=None):
    """A custom loop (runs.corpus batches of 4 x 16) with the Monitor; ``context`` stands for what the Trainer
    callback hands it (``trainer_context``)."""
    import ftshims.monitor

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=optimizer_lr)
    mon = ftshims.monitor.Monitor(model, optimizer)
    if context is not None:
        mon.trainer_context = context(optimizer)
    rows = corpus(n=4 * steps, seq=16)
    for step in range(steps):
        ids = rows["input_ids"][4 * step: 4 * step + 4]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        mon.after_backward(loss)
        optimizer.step()
        mon.after_step()
        optimizer.zero_grad()
    mon.close()
    return mon.findings


def test_learning_rate_that_never_moves_or_is_zero():
    """Judged on the learning rates the monitor records per step: a schedule that is never stepped (the lr stays
    at its start while the schedule moves it), and, with no schedule known, lr 0 at most steps."""
    from types import SimpleNamespace

    def unstepped(optimizer):  # a linear decay over 12 steps whose step() nobody calls
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 12)
        return {"state": SimpleNamespace(max_steps=12), "lr_scheduler": schedule}

    ftshims.apply()
    findings = _custom_loop(1e-3, 12, unstepped)
    assert [f.code for f in findings] == ["lr_schedule_cannot_train"], [f.line() for f in findings]
    assert "is not stepped" in findings[0].message and findings[0].detail["steps"] == 12 and findings[0].step == 12
    findings = _custom_loop(0.0, 3)
    assert [f.code for f in findings] == ["lr_schedule_cannot_train"], [f.line() for f in findings]
    assert findings[0].detail["zero_steps"] == 3
    assert not _custom_loop(1e-3, 3), "a healthy custom loop"
