"""The real ``llamafactory-cli train`` on CPU, with and without ``FTSHIMS_AUTO=1``.

A tiny Llama and tokenizer saved from a config, a 16-example alpaca dataset (``dataset_info.json``
+ JSON), LoRA on every linear layer, ``template: default``, 3 steps, fp32, ``report_to: none``.
Each configuration runs twice side by side: with ftshims (the ``ftshims-auto.pth`` hook applies it
at start-up) and without. What LLaMA-Factory 0.9.5 does on these paths (line numbers of the
installed ``llamafactory`` package):

* ``packing: true`` (``data/processor/supervised.py:196-226``): several examples per row, per-example
  ``position_ids`` (l.199) but an all-ones ``attention_mask`` (l.216, l.226). Under sdpa/eager the
  packed examples then attend to each other on transformers 4.57: the bug ``packing_block_mask``
  fixes. Measured: the mask reaching the first decoder layer, and the adapter after 3 steps, which
  with ftshims equals LLaMA-Factory's own isolating ``neat_packing`` run bit for bit.
* ``neat_packing: true``: the collator builds its own block-diagonal 4D mask in the compute dtype
  (``data/collator.py:93-133``, used at l.524-525). ftshims must see a 4D mask and stay out:
  identical adapter and losses with and without it.
* gradient checkpointing: LLaMA-Factory turns it on by default (``disable_gradient_checkpointing:
  false``, ``use_reentrant_gc: true``, ``hparams/model_args.py:145-152``) and does it itself:
  ``model/model_utils/checkpointing.py:170-176`` puts its own ``gradient_checkpointing_enable`` on the
  *instance* (so the class method that ftshims' ``lora_reentrant_checkpointing`` wraps is never
  called), whose checkpoint function marks each checkpointed layer's hidden states as requiring grad
  (l.80-103); PEFT then adds ``enable_input_require_grads`` (``peft/peft_model.py:136-137``) because
  the model is already checkpointing. The neat-packing pair proves ftshims adds nothing there.
* ``disable_gradient_checkpointing: true`` + TrainingArguments' ``gradient_checkpointing: true``:
  HF ``Trainer`` calls ``PreTrainedModel.gradient_checkpointing_enable`` (``transformers/trainer.py:2447``)
  after PEFT; reentrant checkpointing and frozen embeddings: without ftshims the run dies with
  ``element 0 of tensors does not require grad``, with it every LoRA weight gets a gradient.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import clientlib

clientlib.require("llamafactory", "llamafactory")

pytestmark = pytest.mark.slow

STUBS = clientlib.HERE / "stubs"  # torchaudio stand-in, see stubs/torchaudio/__init__.py

BASE = clientlib.LLAMAFACTORY_BASE

CONFIGS = {
    "packing": {"packing": True},
    "neat_packing": {"neat_packing": True},
    "hf_checkpointing": {"disable_gradient_checkpointing": True, "gradient_checkpointing": True},
}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return clientlib.llamafactory_fixture(tmp_path_factory.mktemp("llamafactory"))


@pytest.fixture(scope="module")
def runs(fixture_dir):
    """``runs(config)`` -> ``{True: Run with ftshims, False: Run without}``, each pair run once."""
    return clientlib.llamafactory_pairs(fixture_dir, lambda config: dict(BASE, **CONFIGS[config]),
                                        lambda config, ftshims, workdir: {"extra_path": [STUBS]})


def _finished(run):
    assert run.returncode == 0, run.explain()
    assert clientlib.finite(run.losses()), run.explain()
    assert run.trainer is not None, "the probe saw no training process:\n" + run.explain()


def _ftshims_on(run):
    status = run.status()
    assert status, "no ftshims status was recorded in the training process"
    for shim in ("packing_block_mask", "lora_reentrant_checkpointing"):
        assert status[shim]["status"] == "applied", status[shim]
    return status


def _ftshims_off(run):
    assert run.active() == [], f"ftshims was active without FTSHIMS_AUTO: {run.active()}"


def _lora_grads_every_step(run):
    steps = run.trainer["steps"]
    assert len(steps) == 3, steps
    for step in steps:
        assert step["lora_parameters"] > 0 and step["lora_without_grad"] == 0, step
    # lora_B starts at 0, so only B has a non-zero gradient in step 1; from step 2 on all of them do
    assert steps[-1]["lora_with_nonzero_grad"] == steps[-1]["lora_parameters"], steps[-1]


def test_packing_examples_isolated_by_ftshims(runs):
    """``packing: true``: without ftshims packed examples see each other; with it they are isolated,
    and training matches LLaMA-Factory's own isolating ``neat_packing`` run exactly."""
    pair, neat = runs("packing"), runs("neat_packing")
    on, off = pair[True], pair[False]
    for run in (on, off):
        _finished(run)
        forwards = run.trainer["forwards"]
        assert forwards, run.trainer
        for record in forwards:
            # what LLaMA-Factory feeds the model: an all-ones 2D mask and per-example position_ids
            assert record["input_mask"] == "2d int64" and record["input_mask_values"] == [1], record
            assert max(record["examples_per_row"]) >= 2, record
            assert record["own_context_masked"] == 0, record
    _ftshims_on(on)
    _ftshims_off(off)
    assert all(r["cross_example_pairs"] == 0 for r in on.trainer["forwards"]), on.trainer["forwards"]
    assert all(r["cross_example_pairs"] > 0 for r in off.trainer["forwards"]), off.trainer["forwards"]

    reference = neat[False]  # LLaMA-Factory's own isolation, no ftshims
    _finished(reference)
    assert clientlib.identical(on.adapter(), reference.adapter()), clientlib.max_abs_diff(on.adapter(), reference.adapter())
    assert on.losses() == reference.losses()
    gap = clientlib.max_abs_diff(off.adapter(), reference.adapter())
    assert gap > 1e-3, f"contaminated packing trained the same adapter as isolated packing ({gap})"
    # ftshims' counters inside the training process: a block mask for every packed training forward
    built = on.status()["packing_block_mask"]["actions"].get("block masks built", 0)
    assert built >= len(on.trainer["steps"]), (on.status()["packing_block_mask"], on.trainer.get("summary"))
    assert "packing_block_mask" in on.trainer["summary"] and "block masks built" in on.trainer["summary"]
    print(f"\npacking: ftshims built {built} block masks; adapter gap to LLaMA-Factory's neat_packing: with ftshims 0, "
          f"without {gap:.3e}; losses with {on.losses()} without {off.losses()}; {on.trainer['summary']}")


def test_neat_packing_ftshims_stays_out(runs):
    """``neat_packing: true``: LLaMA-Factory's block-diagonal 4D mask reaches attention as it is, with
    and without ftshims: bit-identical adapters and losses."""
    pair = runs("neat_packing")
    on, off = pair[True], pair[False]
    for run in (on, off):
        _finished(run)
        for record in run.trainer["forwards"]:
            assert record["input_mask"] == "4d float32", record  # LLaMA-Factory's own block mask
            assert record["cross_example_pairs"] == 0 and record["own_context_masked"] == 0, record
    _ftshims_on(on)
    _ftshims_off(off)
    assert on.losses() == off.losses()
    assert clientlib.identical(on.adapter(), off.adapter()), clientlib.max_abs_diff(on.adapter(), off.adapter())
    # ftshims saw LLaMA-Factory's 4D mask and stayed out: no block mask built, no foreign-patch note needed
    status = on.status()
    assert status["packing_block_mask"]["actions"] == {}, status["packing_block_mask"]
    assert status["flash_attn_packing"]["actions"] == {}, status["flash_attn_packing"]
    print(f"\nneat_packing: losses {on.losses()} == {off.losses()}, adapters bit-identical; {on.trainer['summary']}")


def test_lf_gradient_checkpointing_ftshims_stays_out(runs):
    """LLaMA-Factory's own reentrant checkpointing + PEFT's input-grad hook: LoRA gets gradients with
    and without ftshims, ftshims adds no second hook, and the results are identical (neat-packing pair)."""
    pair = runs("neat_packing")
    on, off = pair[True], pair[False]
    for run in (on, off):
        _finished(run)
        begin = run.trainer["model"]["train_begin"]
        assert begin["is_gradient_checkpointing"], begin
        # LLaMA-Factory's override on the instance shadows PreTrainedModel.gradient_checkpointing_enable
        assert begin["gradient_checkpointing_enable_owner"] == "instance:llamafactory.model.model_utils.checkpointing", begin
        hooks = [h for h in begin["embedding_forward_hooks"] if h.endswith("make_inputs_require_grads")]
        assert len(hooks) == 1, begin["embedding_forward_hooks"]  # PEFT's; none added by ftshims
        _lora_grads_every_step(run)
    _ftshims_on(on)
    assert clientlib.identical(on.adapter(), off.adapter())
    # its wrapper of PreTrainedModel.gradient_checkpointing_enable was never reached: no hook, no flag changed
    assert on.status()["lora_reentrant_checkpointing"]["actions"] == {}, on.status()["lora_reentrant_checkpointing"]


def test_hf_gradient_checkpointing_fixed_by_ftshims(runs):
    """LLaMA-Factory's checkpointing off, HF's on (``gradient_checkpointing: true``): reentrant
    checkpointing after ``get_peft_model``. Without ftshims: no gradient reaches LoRA and backward
    fails; with ftshims: finite loss and every LoRA weight gets a gradient."""
    pair = runs("hf_checkpointing")
    on, off = pair[True], pair[False]
    assert off.returncode != 0 and "does not require grad" in off.log, off.explain()
    _ftshims_off(off)
    _finished(on)
    _ftshims_on(on)
    begin = on.trainer["model"]["train_begin"]
    assert begin["gradient_checkpointing_enable_owner"] == "class", begin  # HF's method, wrapped by ftshims
    assert [h for h in begin["embedding_forward_hooks"] if h.endswith("make_inputs_require_grads")], begin
    _lora_grads_every_step(on)
    acted = on.status()["lora_reentrant_checkpointing"]["actions"]
    assert acted.get("input-grad hooks installed", 0) >= 1, acted
    print(f"\nhf checkpointing: without ftshims exit {off.returncode} (does not require grad); with it losses "
          f"{on.losses()}, every LoRA weight has a gradient; {on.trainer['summary']}")


def test_monitor_inside_llamafactory(fixture_dir, tmp_path):
    """``FTSHIMS_MONITOR=1`` in a real ``llamafactory-cli train`` (with ``FTSHIMS_AUTO=1``, the healthy
    ``packing: true`` config): the start-up hook attaches the training monitor to LLaMA-Factory's own Trainer
    subclass, which writes its JSON lines (``FTSHIMS_MONITOR_LOG``) with zero findings. Its one-time packing
    check ran on the packed rows: ftshims isolated them."""
    assert clientlib.hook_installed(), "ftshims-auto.pth is not in this venv's site-packages (install ftshims non-editable)"
    workdir = tmp_path / "monitor"
    settings = dict(BASE, **CONFIGS["packing"])
    settings.update(model_name_or_path=str(fixture_dir / "model"), dataset_dir=str(fixture_dir / "data"),
                    output_dir=str(workdir / "out"))
    workdir.mkdir(parents=True)
    yaml = workdir / "train.yaml"
    yaml.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items() if v is not None))
    log = workdir / "monitor.jsonl"
    cli = Path(sys.executable).parent / "llamafactory-cli"
    run = clientlib.finish(clientlib.start("monitor", [str(cli), "train", str(yaml)], workdir, workdir / "out", True,
                                           extra_path=[STUBS], FTSHIMS_MONITOR="1", FTSHIMS_MONITOR_LOG=str(log)))
    _finished(run)
    _ftshims_on(run)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [r["type"] for r in records]
    assert kinds[0] == "header" and kinds[-1] == "summary", kinds
    assert [r["step"] for r in records if r["type"] == "step"] == [1, 2, 3], records
    assert [r for r in records if r["type"] == "finding"] == [], [r["message"] for r in records if r["type"] == "finding"]
    assert records[-1]["findings"] == [] and records[-1]["steps"] == 3
    assert records[0]["model"] == "PeftModelForCausalLM" and records[0]["fingerprint"]["hash"], records[0]
    packing = run.status()["packing_block_mask"]["actions"].get("block masks built", 0)
    # 3 training forwards and the monitor's one re-run of the packed row (the example alone needs no mask)
    assert packing == 4, run.status()["packing_block_mask"]
    print(f"\nmonitor in LLaMA-Factory: {records[-1]['text']}; {len(records)} JSON lines; block masks {packing}")
