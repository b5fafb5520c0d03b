"""ftshims inside DeepSpeed ZeRO-2/3 (issue 29): two CPU ranks (gloo) under ``torchrun``, the HF ``Trainer`` with
``deepspeed=<config dict>``, compared with one process (no DeepSpeed) on the same global batch.

Three launches start together (see ``ranks.py`` for the scenarios, all in one job per launch, one Trainer after
the other): two ranks with ftshims from the start-up hook (``FTSHIMS_AUTO=1``), two ranks without ftshims,
and one process with ftshims. Each launch runs in its own process group, has a timeout, and is killed with
its ranks if it fails or times out. DeepSpeed JIT-builds its shared-memory comm op with g++ the first time
(about 70 s on 2 cores, kept in ``TORCH_EXTENSIONS_DIR``, here ``<sys.prefix>/torch_extensions`` unless set);
with the op built the module takes about 70 s on 2 cores (load 2-3).

Skips when deepspeed is not installed, except on a stack (``FTSHIMS_STACK``) whose pins include deepspeed:
there a missing deepspeed or start-up hook is a failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import dslaunch

WORKER = Path(__file__).with_name("ranks.py")
LORA_SHIM = "lora_reentrant_checkpointing"
COUNT_SHIM = "num_items_in_batch_overcount"
EMPTY_GROUP_SHIM = "deepspeed_empty_param_group"
RESIZE_SHIM = "resize_embeddings_frozen_under_zero3"
LAUNCH_TIMEOUT_S = 600
# Measured on the default stack (2 cores): two ranks vs one process, same global batch, fp32 —
# per-step loss <= 9.6e-7, LoRA weights after 4 AdamW steps <= 1.9e-6, eval loss <= 4.8e-7.
LOSS_TOL = 1e-5
WEIGHT_TOL = 2e-5

LAUNCHES = {
    # name: (ranks, FTSHIMS_AUTO, scenarios)
    "zero_with": (2, "1", "lora_z2,lora_z3,resize_z3,ga_z2,lora_empty_group,bad_config"),
    "zero_without": (2, None, "lora_z2,lora_z3,resize_z3,ga_z2,lora_empty_group"),
    "single_with": (1, "1", "lora_z3,resize_z3,ga_z2,lora_empty_group"),
}


def _pth_installed() -> bool:
    import site
    import sysconfig

    dirs = set(site.getsitepackages()) | {sysconfig.get_path("purelib")}
    return any((Path(d) / "ftshims-auto.pth").exists() for d in dirs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pytestconfig):
    """``{launch: [rank0, rank1]}``: each rank's JSON (see ranks.py)."""
    dslaunch.require_deepspeed()
    dslaunch.require(_pth_installed(), "ftshims-auto.pth is not installed in this environment")
    root = tmp_path_factory.mktemp("zero")
    noop = pytestconfig.getoption("--noop-shim")
    launches = {}
    for name, (ranks, auto, scenarios) in LAUNCHES.items():
        script = [str(WORKER), "--out", str(root / name), "--scenarios", scenarios]
        launches[name] = (dslaunch.argv(script, ranks), dslaunch.rank_env(auto, noop))
    done = dslaunch.run_all(launches, root, LAUNCH_TIMEOUT_S)
    results = {}
    for name, (code, log) in done.items():
        assert code == 0, f"{name} exited {code}:\n{log[-4000:]}"
        results[name] = [json.loads(p.read_text()) for p in sorted((root / name).glob("rank*.json"))]
        assert len(results[name]) == LAUNCHES[name][0], (name, log[-2000:])
    return results


def _in_range(shim_id: str) -> bool:
    from ftshims.probing import in_affected_range

    return in_affected_range(shim_id)[0]


def _registered(shim_id: str) -> bool:
    from ftshims.shims import SHIM_IDS

    return shim_id in SHIM_IDS


def _gap(a: dict, b: dict) -> float:
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


def _step_losses(calls_by_rank, accumulation=1):
    """The optimizer steps' losses: each micro step's loss averaged over the ranks, summed over accumulation.
    (With average_tokens_across_devices each rank's loss is its token-loss sum / all ranks' count x ranks.)"""
    micro = [sum(calls[i]["loss"] for calls in calls_by_rank) / len(calls_by_rank) for i in range(len(calls_by_rank[0]))]
    return [sum(micro[i:i + accumulation]) for i in range(0, len(micro), accumulation)]


def _trainable_name(name: str) -> str:
    """A trained parameter's name as PEFT saves it (no adapter name, the modules_to_save copy as the module)."""
    return name.replace(".modules_to_save.default", "").replace(".default.weight", ".weight")


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["lora_z2", "lora_z3"])
def test_lora_under_reentrant_checkpointing_trains_and_matches_one_process(runs, scenario, evidence):
    """ZeRO-2, and ZeRO-3 with the optimizer offloaded: LoRA (q/v) + lm_head and the norms in modules_to_save +
    the Trainer's reentrant checkpointing. Without ftshims (in range) no LoRA tensor moves; with the start-up
    hook every one trains, and the per-step losses, the LoRA weights and the eval loss equal one process's."""
    single = runs["single_with"][0]["lora_z3"]  # no DeepSpeed in one process: lora_z2 and lora_z3 are one run there
    with_ranks = [rank[scenario] for rank in runs["zero_with"]]
    without = runs["zero_without"][0][scenario]
    affected = _in_range(LORA_SHIM)
    assert "error" not in without and "error" not in with_ranks[0], (without.get("error"), with_ranks[0].get("error"))
    if affected:  # the scenario is the silent form of the bug: the run goes on, the adapters stay at their start
        assert without["moved"] == 0 and _gap(without["end"], without["start"]) == 0.0, without["moved"]
    else:
        assert without["moved"] == without["total"] == 8
    rank0 = with_ranks[0]
    assert rank0["moved"] == rank0["total"] == 8, f"{scenario}: {rank0['moved']}/8 LoRA tensors trained"
    assert _gap(rank0["start"], single["start"]) == 0.0
    assert _step_losses(rank0["calls"]) == pytest.approx(_step_losses(single["calls"]), abs=LOSS_TOL)
    gap = _gap(rank0["end"], single["end"])
    assert gap < WEIGHT_TOL, f"{scenario}: LoRA weights differ from one process's by {gap:.2e}"
    assert _gap(with_ranks[0]["end"], with_ranks[1]["end"]) == 0.0, "the ranks hold different LoRA weights"
    assert rank0["eval_loss"] == pytest.approx(single["eval_loss"], abs=LOSS_TOL)
    statuses = runs["zero_with"][0]["statuses"]
    if affected:
        assert statuses[LORA_SHIM] == "applied" and runs["zero_with"][0]["acted"].get(LORA_SHIM)
    evidence.record_raw(LORA_SHIM, f"DeepSpeed {scenario} Trainer, 2 ranks (silent form)", affected,
                        without["moved"] == 0, rank0["moved"] == 0, statuses[LORA_SHIM],
                        without=f"{without['moved']}/8 LoRA tensors moved",
                        with_shim=f"{rank0['moved']}/8 moved; losses vs one process within {LOSS_TOL}")


@pytest.mark.slow
def test_zero3_save_model_writes_the_complete_trained_adapter(runs):
    """ZeRO-3 ``Trainer.save_model`` of a PEFT adapter with modules_to_save: every tensor has its full shape
    (not a partition), equals the trained (gathered) value and one process's save, and the adapter reloaded in
    one process gives the eval loss the ZeRO-3 run measured (``Trainer.evaluate``; its loss is divided by
    num_items_in_batch too: without num_items_in_batch_overcount it is the true loss x 18/20, each eval batch
    scoring 18 labels and counting 20; measured 4.437 for 4.930)."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from ftshims import tiny
    from tests.deepspeed import ranks

    run = runs["zero_with"][0]["lora_z3"]
    single = runs["single_with"][0]["lora_z3"]
    saved = {k: torch.tensor(v["values"]) for k, v in run["saved"].items()}
    reference = load_file(os.path.join(single["saved_to"], "adapter_model.safetensors"))
    assert saved.keys() == reference.keys(), sorted(set(saved) ^ set(reference))
    assert {k: list(v.shape) for k, v in saved.items()} == {k: list(v.shape) for k, v in reference.items()}
    assert all(v.numel() > 0 for v in saved.values())
    trained = {_trainable_name(k): torch.tensor(v) for k, v in run["trained_for_save"].items()
               if "original_module" not in k}
    assert set(saved) <= set(trained), sorted(set(saved) - set(trained))
    for key, value in saved.items():
        assert torch.equal(value, trained[key]), f"{key}: the saved tensor is not the trained one"
        assert float((value - reference[key]).abs().max()) < WEIGHT_TOL, key
    base = tiny.tiny_llama(attn="sdpa")  # the base every run started from (seed 0)
    model = PeftModel.from_pretrained(base, run["saved_to"]).eval()
    rows = ranks.lm_rows(4, seed=2)
    batch = {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}
    with torch.no_grad(), tiny.quiet():
        loss = float(model(**batch).loss)
    assert loss == pytest.approx(run["eval_loss"], abs=LOSS_TOL), (loss, run["eval_loss"])


@pytest.mark.slow
def test_resize_under_zero3_initialises_new_rows_as_one_process(runs):
    """The model built under zero.Init (from_pretrained with the Trainer's ZeRO-3 config alive), 8 rows added:
    the new input and output embedding rows (mean resizing, the same seed) equal one process's on every rank."""
    import torch

    zero = [rank["resize_z3"] for rank in runs["zero_with"]]
    single = runs["single_with"][0]["resize_z3"]
    assert zero[0]["zero_init"] is True and single["zero_init"] is False
    assert zero[0]["vocab_size"] == single["vocab_size"] == 136 and zero[0]["embed_shape"] == [136, 64]
    for key in ("embed_new_rows", "head_new_rows"):
        new = torch.tensor(zero[0][key])
        assert new.shape == (8, 64) and float(new.std()) > 0
        assert torch.allclose(new, torch.tensor(single[key]), atol=1e-6, rtol=0), key
        assert torch.equal(new, torch.tensor(zero[1][key])), f"{key}: the ranks added different rows"
    # one process: the frozen embeddings stay frozen through the resize and the steps (transformers#26865, 4.36)
    assert single["requires_grad_after_resize"] is False and single["requires_grad_after_train"] is False
    assert single["embed_unchanged"] is True


@pytest.mark.slow
def test_resize_under_zero3_keeps_frozen_embeddings_frozen(runs, evidence):
    """Under ZeRO-3 _get_resized_embeddings swaps the new Parameter into the old module (`old_embeddings.weight =
    new_embeddings.weight`, transformers >= 4.43.4) and _resize_token_embeddings then copies requires_grad from
    that new, trainable Parameter: without ftshims the frozen input embeddings become trainable and train; with
    them (resize_embeddings_frozen_under_zero3) they stay frozen and unchanged through the two ZeRO-3 steps."""
    from ftshims.probing import in_affected_range

    affected = in_affected_range(RESIZE_SHIM)[0]
    with_shims = [rank["resize_z3"] for rank in runs["zero_with"]]
    without = [rank["resize_z3"] for rank in runs["zero_without"]]
    for run in with_shims:
        assert run["zero_init"] is True
        assert run["requires_grad_after_resize"] is False, "the frozen input embeddings are trainable after the resize"
        assert run["requires_grad_after_train"] is False and run["embed_unchanged"] is True, "the frozen embeddings trained"
    thawed = lambda run: run["requires_grad_after_resize"] or not run["embed_unchanged"]  # noqa: E731
    for run in without:  # the bug, reproduced on every rank where the registry says it exists
        assert run["zero_init"] is True
        assert thawed(run) == affected, run["requires_grad_after_resize"]
        if affected:
            assert run["requires_grad_after_train"] is True and run["embed_unchanged"] is False, "did not train"
    # the new rows do not depend on ftshims (same seed, same mean resizing)
    assert without[0]["embed_new_rows"] == with_shims[0]["embed_new_rows"]
    status = runs["zero_with"][0]["statuses"][RESIZE_SHIM]
    say = lambda run: (f"requires_grad after resize {run['requires_grad_after_resize']}, after 2 steps "  # noqa: E731
                       f"{run['requires_grad_after_train']}, embedding unchanged {run['embed_unchanged']}")
    evidence.record_raw(RESIZE_SHIM, "trainer_zero3_two_ranks_resize_frozen_embeddings", affected, thawed(without[0]),
                        thawed(with_shims[0]), status, without=say(without[0]), with_shim=say(with_shims[0]))


@pytest.mark.slow
def test_gradient_accumulation_counts_and_losses_equal_one_process(runs, evidence):
    """ZeRO-2, 2 accumulation steps, rows with prompts and padding: each micro step's num_items_in_batch is the
    number of labels the shifted loss scores in the whole global batch (with ftshims, where the count shim is in
    range; all labels without it), and the step losses equal one process's with the same global batch."""
    zero = [rank["ga_z2"] for rank in runs["zero_with"]]
    without = runs["zero_without"][0]["ga_z2"]
    single = runs["single_with"][0]["ga_z2"]
    scored, labels = zero[0]["scored_per_step"], zero[0]["labels_per_step"]
    assert scored == [28, 32] and labels == [30, 35]  # the data: 2 rows without a prompt per step count one extra
    expect = lambda per_step: [per_step[i // 2] for i in range(4)]  # noqa: E731  (4 micro steps, 2 per step)
    for calls in zero[0]["calls"]:  # every rank's micro steps (gathered)
        assert [c["num_items_in_batch"] for c in calls] == expect(scored), calls
    assert [c["num_items_in_batch"] for c in single["calls"][0]] == expect(scored)
    in_range = _in_range(COUNT_SHIM)
    counts_without = [c["num_items_in_batch"] for c in without["calls"][0]]
    assert counts_without == expect(labels if in_range else scored), counts_without
    # the same global batch: in each micro step the two ranks together score what one process scores
    assert [sum(calls[i]["scored"] for calls in zero[0]["calls"]) for i in range(4)] == [c["scored"] for c in single["calls"][0]]
    assert zero[0]["calls"] == zero[1]["calls"]
    losses, reference = _step_losses(zero[0]["calls"], 2), _step_losses(single["calls"], 2)
    assert losses == pytest.approx(reference, abs=LOSS_TOL), (losses, reference)
    if in_range:
        first = _step_losses(without["calls"], 2)[0]
        # the first step (same weights): the overcounted loss is the scored one scaled by scored/labels
        assert first == pytest.approx(losses[0] * scored[0] / labels[0], rel=1e-5), (first, losses[0])
    statuses = runs["zero_with"][0]["statuses"]
    evidence.record_raw(COUNT_SHIM, "DeepSpeed ZeRO-2 Trainer, 2 ranks, 2 accumulation steps", in_range,
                        counts_without != expect(scored), False, statuses[COUNT_SHIM],
                        without=f"num_items_in_batch {counts_without} for {scored} scored labels per step",
                        with_shim=f"num_items_in_batch {expect(scored)}; step losses vs one process within {LOSS_TOL}")


@pytest.mark.slow
def test_empty_no_decay_group_under_zero_trains_with_the_trainer_s_optimizer(runs):
    """LoRA + lm_head only (the Trainer's no-decay group empty), ZeRO-2, the Trainer's own AdamW: torch >= 2.10's
    scheduler raises at the first step under ZeRO without a fix; with ftshims it trains and matches one process."""
    if not _registered(EMPTY_GROUP_SHIM):
        pytest.skip(f"{EMPTY_GROUP_SHIM} is not registered in this checkout")
    with_run = runs["zero_with"][0]["lora_empty_group"]
    without = runs["zero_without"][0]["lora_empty_group"]
    single = runs["single_with"][0]["lora_empty_group"]
    if _in_range(EMPTY_GROUP_SHIM):
        assert "zip() argument 2 is longer than argument 1" in without.get("error", ""), without.get("error")
    assert "error" not in with_run, with_run.get("error")
    assert with_run["moved"] == with_run["total"] == 8
    assert _step_losses(with_run["calls"]) == pytest.approx(_step_losses(single["calls"]), abs=LOSS_TOL)
    assert _gap(with_run["end"], single["end"]) < WEIGHT_TOL


@pytest.mark.slow
def test_a_config_the_lint_rejects_stays_a_clear_error_before_the_run(runs, tmp_path):
    """A zero_optimization key DeepSpeed does not have: the lint reports it as an error, and the run with ftshims
    on every rank still stops with DeepSpeed's own ValidationError naming the key, before any step."""
    from ftshims.lint import Inputs, run
    from tests.deepspeed import ranks

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ranks.ds_config(2, **{ranks.BAD_KEY: True})))
    findings = run(Inputs(deepspeed=str(path)))
    bad = [f for f in findings if f["key"] == f"zero_optimization.{ranks.BAD_KEY}"]
    assert bad and bad[0]["rule"] == "ds-unknown-key" and bad[0]["severity"] == "error", findings
    assert "overlap_comm" in bad[0]["message"]
    for rank in runs["zero_with"]:
        result = rank["bad_config"]
        assert result["error_type"] == "ValidationError", result
        assert ranks.BAD_KEY in result["error"] and "Extra inputs are not permitted" in result["error"], result
        assert result["steps_before_error"] == 0


@pytest.mark.slow
def test_every_rank_applies_the_same_shims_through_the_start_up_hook(runs):
    ranks_ = runs["zero_with"]
    assert [r["auto"] for r in ranks_] == ["1", "1"] and [r["rank"] for r in ranks_] == [0, 1]
    assert ranks_[0]["statuses"] == ranks_[1]["statuses"]
    assert ranks_[0]["statuses"] == runs["single_with"][0]["statuses"], "one process and the ranks differ"
    assert [r["auto"] for r in runs["zero_without"]] == [None, None]
    assert all(not r["acted"] for r in runs["zero_without"]), "a shim acted in the run without ftshims"
