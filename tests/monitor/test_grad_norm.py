"""The monitor's gradient norm is the one before clipping: what the Trainer itself logs as ``grad_norm``.

accelerate 1.16 computes the Trainer's norm with ``torch.nn.utils.get_total_norm`` and
``clip_grads_with_norm_`` instead of ``torch.nn.utils.clip_grad_norm_``; a monitor that only wrapped
the latter then measured the gradients after clipping: 0.99999 at every step where the Trainer logs
1.86, 2.10, 2.72 (transformers 5.25 + accelerate 1.16, ``max_grad_norm=1.0``), so ``grad_norm_spike``
could never fire. The monitor now takes the value ``Accelerator.clip_grad_norm_`` returns (and the
``total_norm`` handed to ``clip_grads_with_norm_``). These tests run on every stack: each accelerate
release in the matrix is one more case; DDP (a Trainer) and FSDP2 (custom loops, DTensor gradients) on two
ranks: the last test (``dist/norm_ranks.py``, default stack). DeepSpeed ZeRO-2/3: ``test_deepspeed.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from ftshims import tiny

from .runs import corpus, default_stack_only, rows_dataset, train

LR = 1e-2  # large enough that every step's norm is above 1: clipping to 1.0 changes it


def _norms(path):
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    monitor = {r["step"]: r["grad_norm"] for r in records if r["type"] == "step"}
    logged = {r["step"]: r["grad_norm"] for r in records if r["type"] == "log" and "grad_norm" in r}
    return monitor, logged


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_trainer_grad_norm_is_the_one_the_trainer_logs(tmp_path, max_grad_norm):
    log = tmp_path / "run.jsonl"
    result = train(tiny.tiny_llama(), rows_dataset(corpus(n=32, seq=16)), monitor={"log": str(log)},
                   max_steps=3, learning_rate=LR, max_grad_norm=max_grad_norm)
    assert result.error is None, result.error
    monitor, logged = _norms(log)
    assert sorted(monitor) == [1, 2, 3], monitor
    assert all(value is not None and value > 1.0 for value in monitor.values()), monitor  # clipping would show
    if logged or max_grad_norm > 0:  # transformers 4 logs no grad_norm without clipping
        assert logged.keys() == monitor.keys(), (logged, monitor)
        for step in monitor:
            assert monitor[step] == pytest.approx(logged[step], rel=1e-6), (step, monitor, logged)
    else:
        reference = _reference_norms(3)
        for step in monitor:
            assert monitor[step] == pytest.approx(reference[step - 1], rel=1e-5), (monitor, reference)


def _reference_norms(steps):
    """The same run without the monitor, clipping off: the norm of every gradient before the update."""
    import tempfile

    from transformers import Trainer, TrainerCallback

    from .runs import training_args

    norms = []

    class Norm(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            norms.append(float(torch.linalg.vector_norm(torch.stack(
                [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]))))

    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        trainer = Trainer(model=tiny.tiny_llama(), args=training_args(out, max_steps=steps, learning_rate=LR, max_grad_norm=0.0),
                          train_dataset=rows_dataset(corpus(n=32, seq=16)), callbacks=[Norm()])
        trainer.train()
    return norms


def _assert_pre_clipping(tmp_path, clip):
    """A custom loop, 3 steps, ``clip(model)`` returning the norm it clipped by: the monitor's per-step norms
    (its JSONL) are the norms ``clip`` returned, each above the clipping threshold."""
    from ftshims.monitor import Monitor

    model = tiny.tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    log = tmp_path / "loop.jsonl"
    monitor = Monitor(model, optimizer, log=str(log), off=["loss_count_mismatch"])
    returned = []
    batch = tiny.batch(batch_size=2, seq_len=8)
    for _ in range(3):
        loss = model(**batch).loss
        loss.backward()
        monitor.after_backward(loss)
        returned.append(float(clip(model)))
        optimizer.step()  # the optimizer's step pre-hook takes the step's norm (and reads it: CPU)
        monitor.after_step()
        optimizer.zero_grad()
    monitor.close()
    norms, _ = _norms(log)
    assert all(n > 1.0 for n in returned), returned
    assert [norms[step] for step in (1, 2, 3)] == pytest.approx(returned, rel=1e-6), (norms, returned)


def test_custom_loop_two_part_clipping_api(tmp_path):
    """torch >= 2.6: ``get_total_norm`` then ``clip_grads_with_norm_`` (what accelerate 1.16 does inside)."""
    if not hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        pytest.skip("torch < 2.6 has no clip_grads_with_norm_")

    def clip(model):
        params = [p for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, total)
        return total

    _assert_pre_clipping(tmp_path, clip)


def test_custom_loop_accelerator_clip_grad_norm(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    accelerator = accelerate.Accelerator(cpu=True)
    try:
        _assert_pre_clipping(tmp_path, lambda model: accelerator.clip_grad_norm_(model.parameters(), 1.0))
    finally:
        AcceleratorState._reset_state()  # the next Trainer builds its own


def test_custom_loop_torch_clip_grad_norm(tmp_path):
    _assert_pre_clipping(tmp_path, lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))


@pytest.mark.slow
@default_stack_only
def test_ddp_trainer_and_fsdp2_loops_two_ranks(tmp_path):
    """torchrun, 2 ranks, gloo (``dist/norm_ranks.py``): under FSDP2 (DTensor gradients) the monitor's norm is the
    global norm each way a loop clips (before: ``get_total_norm`` + ``clip_grads_with_norm_`` gave 0.99999 where
    the norm was 2.69); a DDP Trainer's monitor norm is the ``grad_norm`` it logs, on every rank."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTSHIMS_")}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    script = Path(__file__).parent / "dist" / "norm_ranks.py"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path)]
    with open(tmp_path / "launch.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the ranks go too
            code = proc.wait()
    assert code == 0, (tmp_path / "launch.log").read_text(errors="replace")[-4000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == {"fsdp2-clip", "fsdp2-twopart", "fsdp2-none", "ddp-trainer"}, results
        for name, run in results.items():
            assert run["codes"] == [], (name, run)
            assert len(run["monitor"]) == len(run["reference"]) > 0, (name, run)
            assert run["monitor"] == pytest.approx(run["reference"], rel=1e-6), (rank, name, run)
            assert max(run["reference"]) > 1.0, (name, run)  # above the clipping threshold: clipping would show
        assert results["ddp-trainer"]["distributed_type"].endswith("MULTI_CPU")
