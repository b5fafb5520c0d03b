"""The resume parity gate (issue 36): a run stopped at checkpoint K and resumed in a new process equals the run
that trained its N steps in one go, per case and engine, with ``ftshims.apply()`` (what users get).

Per case (tests/resume/worker.py) and engine the gate compares, on every rank: each micro step's loss after K
(the Trainer's own value, unrounded) and a fingerprint of its input ids; the learning rate of every param group at
the start of every optimizer step after K; the final global step; and every parameter's final value (gathered
from FSDP2's DTensors and ZeRO-3's partitions). The expectation is **bit-identical** (``==`` on floats,
``torch.equal`` on tensors: same process layout, same kernels, CPU). Every Trainer runs under the monitor with
every detector on, and a healthy run must have no finding. Where a resume cannot be exact the
expectation says so and why:

* ``refused``: a shim of ftshims raises :class:`ftshims.checkpoint.ResumeNotExact` before the first step (a
  ``save_only_model`` checkpoint; a dataset without length past one pass); the gate asserts the refusal
  (``refused upstream``: the engine's own loader refuses first, DeepSpeed for ``save_only_model``);
* ``differs``: a declared difference with its advisory (random data transforms in a mid-epoch resume, whose RNG
  the Trainer restores after fetching the first batch / whose worker seeds were drawn at the epoch's start):
  the gate asserts that it still differs, so that an upstream fix shows up here.

Engines (``FTSHIMS_RESUME_ENGINES``, default all): ``single`` (one process), ``ddp`` (2 ranks, gloo, the
Trainer), ``fsdp2`` (2 ranks: a loop over ``fully_shard`` with torch.distributed.checkpoint, fsdp2_loop.py: the
Trainer cannot run FSDP without an accelerator), ``zero2`` / ``zero3`` (DeepSpeed on CPU, the Trainer). Two
launches per group of engines (``LAUNCHES``): the uninterrupted runs of every case (writing the checkpoints),
then the resumes, each one process per rank for all its engines and cases.

CPU stand-in notes: DDP on 4.57.6 needs the worker's ``cpu_rank_locations`` (transformers loads the optimizer
with ``map_location=args.device``, ``cpu:0`` on a multi-process CPU run, which torch cannot restore; on GPUs it is
``cuda:N``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import dslaunch

from .conftest import TABLE

WORKER = Path(__file__).with_name("worker.py")
LAUNCH_TIMEOUT_S = 600
ENGINES = ("single", "ddp", "fsdp2", "zero2", "zero3")
IDENTICAL = ("identical", None)
RNG_AFTER_FETCH = "trainer_resume_random_data_mid_epoch"

# case -> (expected outcome, the catalogue entry behind it). The same on every engine unless ENGINE_EXPECTED says.
EXPECTED = {
    "full_resized_tied": IDENTICAL,
    "lora_mts_resized": IDENTICAL,
    "ga_mid_epoch": IDENTICAL,
    "ga_epoch_end": IDENTICAL,
    "workers_mid_epoch": IDENTICAL,
    "workers_random_epoch_end": IDENTICAL,
    "random_collate_mid_epoch": ("differs", RNG_AFTER_FETCH),
    "workers_random_mid_epoch": ("differs", RNG_AFTER_FETCH),
    "iterable_multipass": ("refused", "resume_iterable_dataset_wrapped_pass_replays"),
    "sft_packing": IDENTICAL,
    "save_only_model": ("refused", "resume_save_only_model_restarts_lr_schedule"),
}
# the cases each engine runs (the 2-rank engines leave out the declared single-process RNG cases: what they show
# does not depend on the engine, and each case costs a Trainer per launch)
ENGINE_CASES = {
    "single": tuple(EXPECTED),
    **{engine: tuple(c for c in EXPECTED if c not in ("random_collate_mid_epoch", "workers_random_mid_epoch"))
       for engine in ENGINES[1:]},
}
ENGINE_CASES["fsdp2"] = ("full_resized_tied", "lora_mts_resized", "ga_mid_epoch")  # fsdp2_loop.CASES: no Trainer
# DeepSpeed refuses a save_only_model checkpoint by itself, before ftshims' guard is reached: its loader finds no
# global_step* folder (transformers' deepspeed_load_checkpoint: "Can't find a valid checkpoint at ...")
ENGINE_EXPECTED = {(engine, "save_only_model"): ("refused upstream", "DeepSpeed's checkpoint loader")
                   for engine in ("zero2", "zero3")}


def selected_engines():
    chosen = [e.strip() for e in os.environ.get("FTSHIMS_RESUME_ENGINES", ",".join(ENGINES)).split(",") if e.strip()]
    unknown = sorted(set(chosen) - set(ENGINES))
    if unknown:
        raise ValueError(f"FTSHIMS_RESUME_ENGINES: unknown engine(s) {unknown}; engines: {', '.join(ENGINES)}")
    return chosen


# engines that share a launch (one after the other in the same ranks): a launch costs more than a case on 2 cores
LAUNCHES = (("single",), ("ddp", "fsdp2"), ("zero2", "zero3"))


def _launch(engines, phase, out, cases):
    script = [str(WORKER), "--engine", ",".join(engines), "--phase", phase, "--out", str(out), "--cases", ",".join(cases)]
    ranks = 1 if engines == ("single",) else 2
    env = dslaunch.rank_env()
    return dslaunch.argv(script, ranks), env


_RUNS = {}


def engine_runs(engine, tmp_path_factory):
    """``{case: {"full": [rank results], "resume": [...], "weights": (full, resume) paths}}`` for ``engine``."""
    if engine in _RUNS:
        if isinstance(_RUNS[engine], BaseException):  # one failed launch fails every case of the engine, launched once
            raise _RUNS[engine]
        return _RUNS[engine]
    if engine in ("zero2", "zero3"):
        dslaunch.require_deepspeed()
    group = tuple(e for e in next(g for g in LAUNCHES if engine in g) if e in selected_engines())
    root = tmp_path_factory.mktemp("resume-" + "-".join(group))
    cases = list(dict.fromkeys(c for e in group for c in ENGINE_CASES[e]))
    try:
        for phase in ("full", "resume"):
            command, env = _launch(group, phase, root, cases)
            dslaunch.run(command, env, root, LAUNCH_TIMEOUT_S, name=f"{'-'.join(group)}-{phase}")
    except AssertionError as exc:
        for each in group:
            _RUNS[each] = exc
        raise
    ranks = 1 if group == ("single",) else 2
    for each in group:
        found = {}
        for case in ENGINE_CASES[each]:
            folder = root / each / case
            found[case] = {phase: [json.loads((folder / f"{phase}.rank{r}.json").read_text()) for r in range(ranks)]
                           for phase in ("full", "resume")}
            found[case]["weights"] = (folder / "full.weights.pt", folder / "resume.weights.pt")
        _RUNS[each] = found
    return _RUNS[engine]


def compare(run):
    """What differs between the resumed run and the uninterrupted one after checkpoint K: a list of sentences."""
    import torch

    problems = []
    for full, resumed in zip(run["full"], run["resume"]):
        rank, k = full["rank"], full["k"]
        if "error" in full:
            problems.append(f"rank {rank}: the uninterrupted run raised {full['error']}")
            continue
        if "error" in resumed:
            problems.append(f"rank {rank}: the resume raised {resumed['error']}")
            continue
        after = [c for c in full["calls"] if c["step"] > k]
        if [c["ids"] for c in after] != [c["ids"] for c in resumed["calls"]]:
            problems.append(f"rank {rank}: other batches after step {k}")
        lost = [(a["step"], a["loss"], b["loss"]) for a, b in zip(after, resumed["calls"]) if a["loss"] != b["loss"]]
        if lost or len(after) != len(resumed["calls"]):
            gap = max((abs(a - b) for _, a, b in lost), default=float("nan"))
            problems.append(f"rank {rank}: {len(lost)} of {len(after)} micro-step losses differ (max {gap:.3g}), "
                            f"{len(resumed['calls'])} micro steps resumed")
        lrs = {s: v for s, v in full["lrs"].items() if int(s) > k}
        if lrs != resumed["lrs"]:
            problems.append(f"rank {rank}: learning rates differ: {resumed['lrs']} vs {lrs}")
        if full["global_step"] != resumed["global_step"]:
            problems.append(f"rank {rank}: global step {resumed['global_step']} vs {full['global_step']}")
    if not problems:
        full_w, resumed_w = (torch.load(p, weights_only=True) for p in run["weights"])
        if full_w.keys() != resumed_w.keys():
            problems.append(f"parameters differ: {sorted(set(full_w) ^ set(resumed_w))}")
        else:
            moved = [n for n in full_w if not torch.equal(full_w[n], resumed_w[n])]
            if moved:
                gap = max(float((full_w[n] - resumed_w[n]).abs().max()) for n in moved)
                problems.append(f"{len(moved)} of {len(full_w)} final parameters differ (max {gap:.3g})")
    return problems


CASES = [(engine, case) for engine in selected_engines() for case in ENGINE_CASES[engine]]


@pytest.mark.slow
@pytest.mark.parametrize("engine,case", CASES, ids=[f"{e}-{c}" for e, c in CASES])
def test_resume_parity(engine, case, tmp_path_factory):
    run = engine_runs(engine, tmp_path_factory)[case]
    outcome, entry = ENGINE_EXPECTED.get((engine, case), EXPECTED[case])
    full0, resumed0 = run["full"][0], run["resume"][0]
    assert "error" not in full0, full0.get("traceback", full0.get("error"))
    if engine != "fsdp2":  # the monitor verified every save (fsdp2_loop.py has no Trainer)
        checks = [c for r in run["full"] + run["resume"] for c in r.get("findings", []) if c.startswith("checkpoint_")]
        assert checks == [], f"{engine} {case}: the monitor found a save that differs from memory: {checks}"
        assert full0["manifest"], f"{engine} {case}: no ftshims-manifest.json beside checkpoint-{full0['k']}"
        # every run here is healthy and every detector is on: any finding is the monitor's false positive
        found = {f"{phase} rank {r['rank']}": r["findings"] for phase in ("full", "resume") for r in run[phase]
                 if r.get("findings")}
        assert found == {}, f"{engine} {case}: the monitor reported findings on a healthy run: {found}"
    if outcome in ("refused", "refused upstream"):
        errors = [r.get("error", "") for r in run["resume"]]
        start = "ResumeNotExact: ftshims: refusing to resume" if outcome == "refused" else \
            "ValueError: Can't find a valid checkpoint at"
        assert all(e.startswith(start) for e in errors), errors
        assert all(r["calls"] == [] for r in run["resume"]), "a step ran before the refusal"
        TABLE[(case, engine)] = f"{outcome} ({entry})"
        return
    problems = compare(run)
    if outcome == "identical":
        assert problems == [], f"{engine} {case}: the resumed run differs from the uninterrupted one: {problems}"
        TABLE[(case, engine)] = "identical"
    else:
        assert problems, f"{engine} {case}: declared as differing ({entry}), yet the resume is now exact: " \
                         f"remove the declaration"
        TABLE[(case, engine)] = f"differs ({entry})"


def test_engines_setting_is_checked(monkeypatch):
    monkeypatch.setenv("FTSHIMS_RESUME_ENGINES", "single,zero4")
    with pytest.raises(ValueError, match="zero4"):
        selected_engines()
