"""The skip defence (``policy={"nonfinite_loss": "skip", "nonfinite_grad": "skip"}``), proven on one NaN-poisoned
micro-batch at step K (``dist/skip_ranks.py``: gradient accumulation 2, the second micro-batch of step 3, on rank
0 only where there are two):

* one process, DDP and FSDP2 (2 CPU ranks, gloo): with the policy the weights after step K equal those after step K-1
  exactly, the run goes on (the weights move again at K+1) and ends finite; without it they end NaN. The
  learning-rate schedule holds at the skipped step (accelerate reports the step as skipped, as for an fp16
  overflow): step K+1 uses the rate planned for step K. The skip is recorded in the JSONL, the summary, the report.
* DeepSpeed ZeRO-2 (2 CPU ranks): the engine skips a step whose global gradient norm is not finite itself (even
  without the policy); with the policy the monitor records that skip once, as DeepSpeed's (never twice). With
  ``compute_grad_norm=false`` DeepSpeed checks nothing in fp32 and the NaN update is applied; the policy turns
  its overflow check on, and the step is skipped.
* ``max_skips`` consecutive skips raise ``MonitorError``; a custom loop's ``optimizer.step()`` is left out too.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests import dslaunch

from .runs import default_stack_only

SCRIPT = Path(__file__).parent / "dist" / "skip_ranks.py"
K = 3


def _worker():
    spec = importlib.util.spec_from_file_location("skip_ranks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _planned_lrs(steps=6, lr=1e-3):
    return [lr * (1 - s / steps) for s in range(steps)]  # the Trainer's linear schedule, no warmup


def _assert_skipped(result, by="monitor"):
    assert result["error"] is None, result["error"]
    assert result["equal_after_k"], "the weights after the skipped step must equal those before it"
    assert result["moved_after_k"] and result["final_finite"], result
    assert [(s["step"], s["by"]) for s in result["skipped"]] == [(K, by)], result["skipped"]


def _assert_schedule_held(skipped, plain):
    """The learning rates the Trainer logged: the skip run's are the plain run's with the skipped step's rate held
    once (the schedule did not advance), so the last one is the plain run's next to last. transformers >= 4.3x logs
    the rate a step used (held at step K + 1), older ones the rate after the scheduler's step (held at step K)."""
    assert len(set(plain)) == len(plain), plain
    assert any(skipped == pytest.approx(plain[:at] + plain[at - 1:-1]) for at in (K - 1, K)), (skipped, plain)


def _assert_poisoned(result):
    assert result["error"] is None, result["error"]
    assert not result["equal_after_k"] and not result["final_finite"], result
    assert result["skipped"] == []


def test_one_process_skip_keeps_the_weights_of_the_step_before(tmp_path):
    """Every stack: how the Trainer and accelerate hold the schedule at a skipped step is theirs, per release."""
    import ftshims

    ftshims.apply()
    worker = _worker()
    plain = worker.run("single", "plain", str(tmp_path))
    skip = worker.run("single", "skip", str(tmp_path), worker.SKIP)
    _assert_poisoned(plain)
    _assert_skipped(skip)
    assert skip["skipped"][0]["reasons"] == ["nonfinite_loss"] and skip["codes"] == ["nonfinite_loss"]
    _assert_schedule_held(skip["lrs"], plain["lrs"])
    records = [json.loads(line) for line in open(tmp_path / "single-skip.jsonl", encoding="utf-8")]
    assert [(r["step"], r["by"]) for r in records if r["type"] == "skip"] == [(K, "monitor")]
    summary = records[-1]
    assert summary["type"] == "summary" and summary["skipped"] == [K] and "1 update skipped (step 3)" in summary["text"]
    from ftshims.monitor import report

    text = report.summary_text(report.load([str(tmp_path / "single-skip.jsonl")]))
    assert "1 update(s) skipped (policy skip): step 3 (nonfinite_loss; by monitor)" in text


@default_stack_only
def test_max_skips_consecutive_skips_raise(tmp_path):
    """A NaN in every step from step 2 on: two skips, then MonitorError; the weights stay those of step 1."""
    from transformers import TrainerCallback

    import ftshims
    from ftshims import tiny
    from ftshims.monitor import MonitorError

    from .runs import corpus, rows_dataset, train

    ftshims.apply()
    model = tiny.tiny_llama()
    switch = {"on": False}
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * float("nan") if switch["on"] else out)
    kept = {}

    class From2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            switch["on"] = state.global_step + 1 >= 2

        def on_step_end(self, args, state, control, model=None, **kwargs):
            kept[state.global_step] = [p.detach().clone() for p in model.parameters()]

    result = train(model, rows_dataset(corpus(n=64, seq=16)), max_steps=6, callbacks=[From2()],
                   monitor={"policy": {"nonfinite_loss": "skip"}, "max_skips": 2})
    assert isinstance(result.error, MonitorError), result.error
    assert "2 consecutive updates skipped" in str(result.error) and "weights of step 1" in str(result.error)
    assert [s["step"] for s in result.callback.monitor.skipped] == [2, 3]
    assert all(torch.equal(a, b) for a, b in zip(kept[2], kept[1]))
    assert all(torch.equal(a, p.detach()) for a, p in zip(kept[1], model.parameters()))  # step 3 left out too


@default_stack_only
def test_custom_loop_skip_leaves_the_optimizer_step_out():
    from ftshims import tiny
    from ftshims.monitor import Monitor

    model = tiny.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, optimizer, policy={"nonfinite_grad": "skip"}, off=["loss_count_mismatch"])
    # a scheduler built after the monitor wraps the monitor's optimizer.step (torch reads step.__func__)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 10)
    batch = tiny.batch(batch_size=2, seq_len=8)
    weight = model.model.layers[0].mlp.down_proj.weight
    skipped = []
    for step in range(1, 4):
        loss = model(**batch).loss
        loss.backward()
        mon.after_backward(loss)
        if step == 2:
            weight.grad[0, 0] = float("nan")  # a finite loss, one non-finite gradient element
        before = weight.detach().clone()
        optimizer.step()
        skipped.append(mon.last_step_skipped)
        assert torch.equal(before, weight.detach()) is (step == 2)
        if step == 2:
            assert all(p.grad is None for p in model.parameters())  # the poisoned gradients were dropped
        mon.after_step()
        if not mon.last_step_skipped:  # the custom loop's way to hold the schedule
            schedule.step()
        optimizer.zero_grad()
    mon.close()
    assert schedule.last_epoch == 2  # 3 steps, one skipped
    assert skipped == [False, True, False] and [s["reasons"] for s in mon.skipped] == [["nonfinite_grad"]]
    assert [f.code for f in mon.findings] == ["nonfinite_grad"]
    optimizer.step()  # after close() the monitor's wrapper (inside the scheduler's) passes the call through
    assert not mon.last_step_skipped


def test_skip_policy_is_checked_when_given():
    import ftshims.monitor

    with pytest.raises(ValueError, match=r"'skip' drops a step's update.*'labels_all_ignored' takes 'warn' or 'raise'"):
        ftshims.monitor.callback(policy={"labels_all_ignored": "skip"})
    with pytest.raises(ValueError, match=r"got 'skip'.*allowed: warn, raise"):
        ftshims.monitor.callback(policy="skip")
    with pytest.raises(ValueError, match=r"max_skips.*expected a positive int"):
        ftshims.monitor.callback(policy={"nonfinite_loss": "skip"}, max_skips=0)
    with pytest.raises(ValueError, match=r"needs the optimizer"):
        from ftshims import tiny
        from ftshims.monitor import Monitor

        Monitor(tiny.tiny_llama(), policy={"nonfinite_loss": "skip"})


def _launch(tmp_path, engine):
    env = dslaunch.rank_env(clear_prefix=True)
    dslaunch.run(dslaunch.argv([str(SCRIPT), str(tmp_path), engine]), env, tmp_path, 600, name="torchrun")
    return [json.loads((tmp_path / f"{engine}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@default_stack_only
def test_ddp_and_fsdp2_two_ranks_agree_to_skip(tmp_path):
    """The NaN is in rank 0's micro-batch only; the gradients are all-reduced and the ranks' flags too: both skip.
    DDP through the Trainer, FSDP2 in a custom loop."""
    for rank, results in enumerate(_launch(tmp_path, "ddp")):
        _assert_poisoned(results["plain"])
        _assert_skipped(results["skip"])
        # every rank records what any rank saw: rank 0 the NaN loss, rank 1 (finite loss) the all-reduced NaN gradient
        reasons = results["skip"]["skipped"][0]["reasons"]
        assert reasons == ["nonfinite_loss", "nonfinite_grad"], (rank, reasons)
        _assert_schedule_held(results["skip"]["lrs"], results["plain"]["lrs"])
        # FSDP2 (DTensor weights and gradients), a custom loop stepping its scheduler on mon.last_step_skipped
        _assert_poisoned(results["fsdp2-plain"])
        _assert_skipped(results["fsdp2-skip"])
        assert results["fsdp2-skip"]["lrs"] == pytest.approx(_planned_lrs()[:K] + _planned_lrs()[K - 1:-1])


@pytest.mark.slow
@default_stack_only  # one DeepSpeed release (0.19.8) on the stacks that pin it: once is enough
def test_deepspeed_zero2_its_own_skip_recorded_once(tmp_path):
    dslaunch.require_deepspeed()
    for rank, results in enumerate(_launch(tmp_path, "zero2")):
        plain, skip = results["plain"], results["skip"]
        # DeepSpeed skips a step whose global gradient norm is not finite by itself: no NaN even without the policy
        assert plain["equal_after_k"] and plain["final_finite"] and plain["skipped"] == [], (rank, plain)
        _assert_skipped(skip, by="deepspeed")  # recorded once, as DeepSpeed's
        assert [r["by"] for r in skip["skip_records"]] == ["deepspeed"]
        # compute_grad_norm=false: DeepSpeed checks nothing in fp32; the policy turns its overflow check on
        _assert_poisoned(results["nonorm-plain"])
        _assert_skipped(results["nonorm-skip"], by="deepspeed")
        assert any("check_grad_overflow" in note for note in results["nonorm-skip"]["engine_notes"])
        assert skip["lrs"] == pytest.approx(results["nonorm-skip"]["lrs"])  # the schedule held as DeepSpeed does
