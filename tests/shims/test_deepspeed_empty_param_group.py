"""deepspeed_empty_param_group: LoRA + the Trainer's own optimizer under DeepSpeed ZeRO-2/3 (2 ranks, CPU).

One ``torchrun --nproc_per_node=2`` launch (gloo) runs every DeepSpeed scenario in sequence
(``ds_workers/empty_group_ranks.py``); the shim is applied inside the ranks by ``ftshims.apply``, where it acts
(``--noop-shim`` is passed on to them). The reference for "trains correctly" is the same run in the same engine
with the empty group left out by hand (a ``create_optimizer`` override, the workaround users write): it must be
bit-identical, loss by loss and weight by weight, because the shim's whole effect is to remove, a step earlier,
the group the engine removes anyway. (A single-process run on the same global batch only matches to rounding:
ZeRO reduces gradients across ranks in another order; it would test DeepSpeed, not the shim.)

Without the shim, on a stack in range (transformers < 5.1, deepspeed, torch >= 2.10): ``ValueError: zip()
argument 2 is longer than argument 1`` at the first scheduler step, ZeRO-2 and ZeRO-3. Negative controls:
a full fine-tune (both groups non-empty) under ZeRO-2, and ZeRO-3 with the optimizer offloaded (accelerate
swaps the Trainer's AdamW for DeepSpeedCPUAdam, so the Trainer's scheduler never sees the trimmed optimizer and
nothing crashes), are bit-identical with and without the shim; without DeepSpeed (one process) the shim leaves
the empty group in place and the losses are bit-identical.

The ranks build DeepSpeed's shared-memory comm op (JIT, g++) once per ``TORCH_EXTENSIONS_DIR`` (nox sets a
shared one; torch's default is ``~/.cache/torch_extensions``): ~40 s the first time, then cached.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests import dslaunch

from ftshims.report import APPLIED, NOT_NEEDED

SHIM = "deepspeed_empty_param_group"
WORKER = Path(__file__).parent / "ds_workers" / "empty_group_ranks.py"
CRASH = "zip() argument 2 is longer than argument 1"

# name -> STAGE,OFFLOAD,MODEL,GROUPS,SHIM (see the worker's docstring)
SCENARIOS = {
    "z2_off": "2,none,lora,trainer,off",
    "z2_on": "2,none,lora,trainer,on",
    "z2_hand": "2,none,lora,hand,off",
    "z3_off": "3,none,lora,trainer,off",
    "z3_on": "3,none,lora,trainer,on",
    "z3_hand": "3,none,lora,hand,off",
    "z3_offload_off": "3,cpu,lora,trainer,off",
    "z3_offload_on": "3,cpu,lora,trainer,on",
    "full_z2_off": "2,none,full,trainer,off",
    "full_z2_on": "2,none,full,trainer,on",
}


def _in_range() -> bool:
    from ftshims.probing import in_affected_range

    return in_affected_range(SHIM)[0]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, request):
    """``{scenario: [rank0 result, rank1 result]}`` from one two-rank launch."""
    dslaunch.require_deepspeed()
    out = tmp_path_factory.mktemp("ds_empty_group")
    script = [str(WORKER), "--out", str(out)]
    for name, spec in SCENARIOS.items():
        script += ["--scenario", f"{name}={spec}"]
    for shim_id in request.config.getoption("--noop-shim"):
        script += ["--noop-shim", shim_id]
    text = dslaunch.run(dslaunch.argv(script), dslaunch.rank_env(), out, 600)
    per_rank = [json.loads(path.read_text())["results"] for path in sorted(out.glob("rank*.json"))]
    assert len(per_rank) == 2, text[-2000:]
    return {name: [rank[name] for rank in per_rank] for name in SCENARIOS}


def _crashed(run) -> bool:
    return any(CRASH in (r.get("error") or {}).get("message", "") for r in run)


def _summary(run) -> str:
    error = run[0].get("error")
    if error:
        return f"{error['type']}: {error['message']} at {error['where'].rsplit('/', 1)[-1]}"
    return "losses " + ", ".join(f"{x:.6f}" for x in run[0]["losses"]) + f"; lr {run[0]['logged_lrs']}"


def _same_run(a, b) -> bool:
    """Bit-identical: every rank's loss of every forward, and the trained weights."""
    return all(x["losses"] == y["losses"] and x.get("weights") == y.get("weights") for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_with_the_trainers_optimizer_trains_under_zero(ranks, evidence, stage):
    without, with_shim, hand = ranks[f"z{stage}_off"], ranks[f"z{stage}_on"], ranks[f"z{stage}_hand"]
    affected = _in_range()
    for run in (without, with_shim, hand):
        for rank in run:
            unexpected = rank.get("error") and CRASH not in rank["error"]["message"]
            assert not unexpected, rank["error"]
    assert {r["shim_status"] for r in with_shim} == {APPLIED if affected else NOT_NEEDED}
    # The reference: the user's workaround (the empty group left out by hand) trains, 3 steps, on both ranks.
    assert all("error" not in r and len(r["losses"]) == 3 for r in hand), _summary(hand)
    # Without the shim: the crash exactly where the registry says the bug exists, a normal run elsewhere.
    assert _crashed(without) == affected, f"without the shim ({'in' if affected else 'outside'} range): " \
        f"{_summary(without)}"
    if affected:
        assert all(r["error"]["where"].endswith("_update_lr") for r in without), without[0]["error"]
        assert [(r["engine_groups"], r["scheduler_lrs"]) for r in without] == [(1, 2)] * 2  # the mismatch
    # With it: trains, and is bit-identical to the workaround (losses of every forward on each rank, weights).
    assert not _crashed(with_shim), _summary(with_shim)
    assert [(r["engine_groups"], r["scheduler_lrs"]) for r in with_shim] == [(1, 1)] * 2
    assert _same_run(with_shim, hand), (_summary(with_shim), _summary(hand))
    assert with_shim[0]["logged_lrs"] == hand[0]["logged_lrs"]
    evidence.record_raw(SHIM, f"lora_trainer_optimizer_zero{stage}", affected, _crashed(without),
                        _crashed(with_shim), with_shim[0]["shim_status"],
                        without=_summary(without), with_shim=_summary(with_shim))


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["full_z2", "z3_offload"])
def test_runs_without_the_crash_are_bit_identical(ranks, evidence, pair):
    """Both groups non-empty (full fine-tune, ZeRO-2), or the optimizer offloaded (ZeRO-3: accelerate builds a
    DeepSpeedCPUAdam from the Trainer's AdamW, whose groups the scheduler keeps): no crash without the shim,
    and the same bits with it."""
    without, with_shim = ranks[f"{pair}_off"], ranks[f"{pair}_on"]
    for run in (without, with_shim):
        assert all("error" not in r and len(r["losses"]) == 3 for r in run), _summary(run)
    assert _same_run(without, with_shim), (_summary(without), _summary(with_shim))
    assert without[0]["logged_lrs"] == with_shim[0]["logged_lrs"]
    evidence.record_raw(SHIM, f"{pair}_no_crash", _in_range(), False, False, with_shim[0]["shim_status"],
                        expect_bug=False, without=_summary(without), with_shim=_summary(with_shim))


def test_without_deepspeed_the_empty_group_stays_and_nothing_changes(evidence):
    """One process, no DeepSpeed: torch keeps an empty group without complaint; the shim must not touch it."""
    import torch
    from transformers import Trainer, TrainingArguments

    import ftshims
    from ftshims import tiny

    def train():
        model = tiny.lora(tiny.tiny_llama(attn="eager", seed=0))
        g = torch.Generator().manual_seed(1)
        rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 128, (6, 8), generator=g).tolist()]
        with tempfile.TemporaryDirectory() as out, tiny.quiet():
            args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, learning_rate=5e-2,
                                     weight_decay=0.1, logging_steps=1, report_to=[], save_strategy="no",
                                     disable_tqdm=True, seed=0)  # no use_cpu: 4.30-4.33 lack it (CPU-only here)
            trainer = Trainer(model=model, args=args, train_dataset=rows)
            trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        weights = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        return [len(g["params"]) for g in trainer.optimizer.param_groups], losses, weights

    groups_off, losses_off, weights_off = train()
    with ftshims.applied(only=[SHIM]) as report:
        status = report[SHIM].status
        groups_on, losses_on, weights_on = train()
    assert groups_off == groups_on and groups_off[1] == 0, (groups_off, groups_on)
    assert losses_off == losses_on
    assert all(torch.equal(a, b) for a, b in zip(weights_off, weights_on))
    evidence.record_raw(SHIM, "no_deepspeed_one_process", _in_range(), False, False, status, expect_bug=False,
                        without=f"groups {groups_off}, losses {losses_off}",
                        with_shim=f"groups {groups_on}, losses {losses_on}")
