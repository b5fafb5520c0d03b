"""resize_embeddings_frozen_under_zero3: frozen input embeddings, ``resize_token_embeddings`` under ZeRO-3 (2 CPU ranks).

One ``torchrun --nproc_per_node=2`` launch (gloo, ``ds_workers/resize_zero3_ranks.py``) runs the scenario twice
in the same ranks: without the shim, then with ``ftshims.apply(only=[the shim])`` (``--noop-shim`` is passed on
to the ranks, where the shim acts). Each run: a tiny untied Llama loaded with ``from_pretrained`` while a ZeRO-3
``HfDeepSpeedConfig`` is alive (partitioned under ``zero.Init``), input embeddings frozen, 8 rows added, one
DeepSpeed step with an SGD over the parameters that require grad.

Without the shim, in range (transformers >= 4.43.4): the frozen input embeddings are trainable after the resize,
the optimizer gets them and the step changes them. With it: still frozen, out of the optimizer, unchanged; the
LM head (trainable) stays trainable; the loss before the step is the same bits both ways. Without DeepSpeed
(one process) the shim passes the call straight through: no flag is read, flags and values bit-identical.

The ranks build DeepSpeed's shared-memory comm op (JIT, g++) once per ``TORCH_EXTENSIONS_DIR`` (here
``<sys.prefix>/torch_extensions`` unless set, as tests/deepspeed does); the launch takes ~25 s with it built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import dslaunch

from ftshims.report import APPLIED, NOT_NEEDED

SHIM = "resize_embeddings_frozen_under_zero3"
WORKER = Path(__file__).parent / "ds_workers" / "resize_zero3_ranks.py"
LAUNCH_TIMEOUT_S = 600


def _in_range() -> bool:
    from ftshims.probing import in_affected_range

    return in_affected_range(SHIM)[0]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, request):
    """``[rank0 result, rank1 result]``, each ``{"off": ..., "on": ..., "status": ..., "acted": ...}``."""
    dslaunch.require_deepspeed()
    out = tmp_path_factory.mktemp("ds_resize_z3")
    script = [str(WORKER), "--out", str(out)]
    for shim_id in request.config.getoption("--noop-shim"):
        script += ["--noop-shim", shim_id]
    text = dslaunch.run(dslaunch.argv(script), dslaunch.rank_env(), out, LAUNCH_TIMEOUT_S)
    per_rank = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert len(per_rank) == 2, text[-2000:]
    return per_rank


def _summary(run) -> str:
    return (f"input requires_grad {run['input_before']} -> {run['input_after']}, in optimizer "
            f"{run['embed_in_optimizer']}, embedding changed by the step {run['embed_changed']} "
            f"(max {run['embed_max_change']:.3g})")


@pytest.mark.slow
def test_frozen_input_embeddings_stay_frozen_through_a_zero3_resize(ranks, evidence):
    affected = _in_range()
    for rank in ranks:
        for mode in ("off", "on"):
            run = rank[mode]
            assert run["zero_init"] is True and run["vocab"] == 136, run  # partitioned, and the resize took effect
            assert run["input_before"] is False and run["output_before"] is True, run
    assert {r["status"] for r in ranks} == {APPLIED if affected else NOT_NEEDED}
    without, with_shim = ranks[0]["off"], ranks[0]["on"]
    bug = lambda run: run["input_after"] or run["embed_in_optimizer"] or run["embed_changed"]  # noqa: E731
    # Without the shim: thawed, handed to the optimizer and trained, where the registry says the bug exists.
    for rank in ranks:
        assert bug(rank["off"]) == affected, _summary(rank["off"])
        if affected:
            assert rank["off"]["input_after"] and rank["off"]["embed_in_optimizer"] and rank["off"]["embed_changed"]
    # With it: frozen, out of the optimizer, bit-identical after the step; the trainable head stays trainable.
    for rank in ranks:
        assert not bug(rank["on"]), _summary(rank["on"])
        assert rank["on"]["embed_max_change"] == 0.0
        assert rank["on"]["output_after"] is True and rank["off"]["output_after"] is True
        # same model, same batch: the forward before the step is the same bits with and without the shim
        assert rank["on"]["loss"] == rank["off"]["loss"]
    evidence.record_raw(SHIM, "zero3_two_ranks_frozen_input_embeddings", affected, bug(without), bug(with_shim),
                        ranks[0]["status"], without=_summary(without), with_shim=_summary(with_shim))


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_without_deepspeed_the_call_passes_straight_through(evidence, monkeypatch, frozen):
    """One process, no ZeRO-3: the wrapper reads no flag (the snapshot is never taken), and the resized model's
    flags and values are the same bits as without ftshims."""
    import torch

    import ftshims
    from ftshims import tiny
    from ftshims.shims import resize_embeddings_frozen_under_zero3 as shim

    def resized():
        model = tiny.tiny_llama(tie_word_embeddings=False)
        if frozen:
            model.get_input_embeddings().requires_grad_(False)
        torch.manual_seed(123)  # the new rows are sampled from torch's global generator
        with tiny.quiet():
            model.resize_token_embeddings(model.config.vocab_size + 8)
        return {n: (p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}

    snapshots = []
    monkeypatch.setattr(shim, "_flags", lambda model: snapshots.append(model) or {})
    off = resized()
    with ftshims.applied(only=[SHIM]) as report:
        status = report[SHIM].status
        on = resized()
    assert snapshots == [], "the wrapper looked at the flags without ZeRO-3"
    assert off.keys() == on.keys()
    assert all(off[n][0] == on[n][0] and torch.equal(off[n][1], on[n][1]) for n in off)
    # transformers < 4.36 makes resized embeddings trainable outside ZeRO-3 too (resize_embeddings_keeps_frozen's
    # bug, not applied here): there the flag is upstream's, the same with and without this shim (checked above)
    from ftshims.probing import in_affected_range

    if not in_affected_range("resize_embeddings_keeps_frozen")[0]:
        assert on["model.embed_tokens.weight"][0] is (not frozen)
    assert on["model.embed_tokens.weight"][1].shape[0] == 136
    evidence.record_raw(SHIM, f"no_deepspeed_one_process_{'frozen' if frozen else 'trainable'}", _in_range(), False,
                        False, status, expect_bug=False,
                        without=f"embed requires_grad {off['model.embed_tokens.weight'][0]}",
                        with_shim=f"embed requires_grad {on['model.embed_tokens.weight'][0]}, identical values")
