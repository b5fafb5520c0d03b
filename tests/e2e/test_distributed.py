"""Shims in every process: the ranks of torch's own distributed engines (gloo, CPU), ``accelerate launch``,
and spawned DataLoader workers.

The engines run ``dist/train_ranks.py`` (see its docstring): one process alone (the reference), two
torchrun ranks that train with DDP, then with FSDP2 (``fully_shard``: DTensor parameters), then run a
``Trainer`` step, and two ranks started by ``accelerate launch`` with an FSDP config. ftshims comes
only from the start-up hook (``FTSHIMS_AUTO=1``): the script never calls ``apply()``. The three
launches start together: the module takes 56 s on the default stack (2 cores, load 4; 45 s of CPU), 107 s
at load 10, and 118 s on the torch 2.15 stack (t5_24) at load 10.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = Path(__file__).parent / "dist" / "train_ranks.py"
ENGINES = ("ddp", "fsdp2")
# What a CPU user writes for FSDP2 (accelerate config): `accelerate launch` accepts it on a machine without GPUs.
FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 2
num_machines: 1
machine_rank: 0
use_cpu: true
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""


def _env(**extra):
    env = dict(os.environ)
    env.pop("FTSHIMS_DISABLE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def _require_hook():
    if not _pth_installed():
        if os.environ.get("FTSHIMS_STACK"):
            pytest.fail("ftshims-auto.pth is not installed in this test environment (nox installs the package)")
        pytest.skip("ftshims-auto.pth not installed here (pip install . or python -m ftshims.hook install)")


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``{"single": [rank0], "torchrun": [rank0, rank1], "accelerate": [rank0, rank1]}``: each rank's JSON."""
    _require_hook()
    pytest.importorskip("accelerate")
    root = tmp_path_factory.mktemp("dist")
    (root / "fsdp.yaml").write_text(FSDP_CONFIG)
    script = [str(TRAIN_SCRIPT), "--out"]
    commands = {
        "single": [sys.executable, *script, str(root / "single"), "--engine", "single"],
        # --standalone: c10d rendezvous on a free localhost port chosen by torchrun itself (no port race)
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                     *script, str(root / "torchrun"), "--engine", "ddp,fsdp2,trainer"],
        # --main_process_port 0: accelerate picks a free port
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(root / "fsdp.yaml"),
                       "--main_process_port", "0", *script, str(root / "accelerate"), "--engine", "accelerate"],
    }
    logs = {name: open(root / f"{name}.log", "w") for name in commands}
    # each launch in its own process group, so that a kill reaches the ranks a launcher started
    procs = {name: subprocess.Popen(argv, env=_env(FTSHIMS_AUTO="1"), stdout=logs[name], stderr=subprocess.STDOUT,
                                    cwd=root, start_new_session=True) for name, argv in commands.items()}
    codes = {}
    try:
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=900)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes[name] = proc.wait()
    finally:  # a failed wait leaves no launch running
        for name, proc in procs.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            logs[name].close()
    results = {}
    for name, code in codes.items():
        log = (root / f"{name}.log").read_text(errors="replace")
        assert code == 0, f"{name} exited {code}:\n{log[-4000:]}"
        results[name] = [json.loads(path.read_text()) for path in sorted((root / name).glob("rank*.json"))]
        assert len(results[name]) == (1 if name == "single" else 2), (name, log[-2000:])
    return results


def _in_range(shim_id: str) -> bool:
    from ftshims.probing import in_affected_range

    return in_affected_range(shim_id)[0]


def _max_gap(a: dict, b: dict) -> float:
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


@pytest.mark.slow
def test_every_rank_applies_the_same_shims_through_the_start_up_hook(launches):
    for name in ("torchrun", "accelerate"):
        ranks = launches[name]
        assert [r["auto"] for r in ranks] == ["1", "1"] and [r["rank"] for r in ranks] == [0, 1]
        assert ranks[0]["statuses"] == ranks[1]["statuses"], f"{name}: the ranks applied different shims"
        assert "applied" in ranks[0]["statuses"].values(), f"{name}: the start-up hook applied nothing"
    single, ranks = launches["single"][0], launches["torchrun"]
    for rank in ranks:
        for shim_id in ("lora_reentrant_checkpointing", "num_items_in_batch_overcount"):
            if _in_range(shim_id):
                assert rank["statuses"][shim_id] == "applied" and rank["acted"].get(shim_id), (shim_id, rank["acted"])
    assert single["statuses"]["lora_reentrant_checkpointing"] == ranks[0]["statuses"]["lora_reentrant_checkpointing"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_lora_under_reentrant_checkpointing_trains_and_matches_one_process(launches, engine):
    """LoRA + reentrant checkpointing + lm_head in modules_to_save (the silent form of the bug): the LoRA
    weights train, and the per-step losses and the weights equal the single process's."""
    single = launches["single"][0]
    rank0 = launches["torchrun"][0][engine]
    if _in_range("lora_reentrant_checkpointing"):  # the scenario has the bug: without ftshims nothing trains
        assert _max_gap(single["without_shims"]["lora"], single["without_shims"]["lora_start"]) == 0.0
    for name, values in rank0["lora"].items():
        assert values != rank0["lora_start"][name], f"{engine}: {name} did not train"
    assert rank0["losses"] == pytest.approx(single["single"]["losses"], abs=2e-6), (rank0["losses"], single["single"]["losses"])
    gap = _max_gap(rank0["lora"], single["single"]["lora"])
    assert gap < 1e-5, f"{engine}: LoRA weights differ from the single process's by {gap:.2e}"
    if engine == "fsdp2":
        assert rank0["dtensor_parameters"] is True, "fully_shard leaves DTensor parameters"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ("single",) + ENGINES)
def test_each_packed_example_scores_as_if_alone(launches, engine):
    source = launches["single"][0] if engine == "single" else launches["torchrun"][0]
    rows = source[engine]["packed"]
    assert len(rows) == 2 and all(len(r["packed"]) == 2 for r in rows)
    for row in rows:
        assert row["packed"] == pytest.approx(row["alone"], abs=1e-5), row


@pytest.mark.slow
def test_num_items_in_batch_is_every_rank_s_scored_labels(launches):
    """Trainer + average_tokens_across_devices on two ranks: the count the loss is divided by is the number of
    labels the shifted loss scores on both ranks together (position 0 of each row is never scored)."""
    trainer = launches["torchrun"][0]["trainer"]
    ranks, scored = trainer["ranks"], trainer["scored_labels_all_ranks"]
    assert [r["num_processes"] for r in ranks] == [2, 2]
    assert sorted(r["local_scored"] for r in ranks) == [5, 7] and sum(r["local_scored"] for r in ranks) == scored == 12
    assert [r["num_items_in_batch"] for r in ranks] == [scored, scored], ranks


@pytest.mark.slow
def test_accelerate_launch_with_an_fsdp_config_on_cpu(launches):
    """Where accelerate stops: with an FSDP config and no GPU, `accelerate launch` starts the two processes
    (multi_gpu_launcher), but exports no ACCELERATE_USE_CPU, and in each process AcceleratorState finds no
    accelerator: DistributedType.NO, one process, no FSDP plugin, the model left unwrapped (two independent
    runs). With ACCELERATE_USE_CPU=true it is MULTI_CPU and DDP: accelerate sets FSDP only for accelerator
    devices (accelerate/state.py). If this fails, accelerate supports FSDP on CPU: check the engine like above."""
    ranks = launches["accelerate"]
    for rank in ranks:
        facts = rank["accelerate"]
        assert (facts["distributed_type"], facts["num_processes"], facts["fsdp_plugin"], facts["dtensor_parameters"]) == (
            "DistributedType.NO", 1, False, False), facts
        assert facts["use_fsdp_env"] == "true" and rank["world"] == 2


def _pth_installed() -> bool:
    import site
    import sysconfig

    dirs = set(site.getsitepackages()) | {sysconfig.get_path("purelib")}
    return any((Path(d) / "ftshims-auto.pth").exists() for d in dirs)


@pytest.mark.slow
def test_spawned_dataloader_worker_applies_the_same_shims(tmp_path):
    _require_hook()
    (tmp_path / "probe_dataset.py").write_text(textwrap.dedent(
        """
        import torch

        class ShimStatusDataset(torch.utils.data.Dataset):
            def __len__(self):
                return 1

            def __getitem__(self, index):
                import ftshims
                from ftshims import registry
                registry.import_shim_modules()
                return {e.id: e.status for e in ftshims.status()}

        def first(rows):
            return rows[0]
        """
    ))
    script = textwrap.dedent(
        """
        import json, os
        import torch
        import ftshims
        from ftshims import registry
        ftshims.apply(exclude=["resize_embeddings_keeps_frozen"], propagate=True)
        registry.import_shim_modules()
        parent = {e.id: e.status for e in ftshims.status()}
        from probe_dataset import ShimStatusDataset, first
        loader = torch.utils.data.DataLoader(ShimStatusDataset(), num_workers=1, multiprocessing_context="spawn",
                                             collate_fn=first)
        worker = next(iter(loader))
        print(json.dumps({"parent": parent, "worker": worker, "auto": os.environ.get("FTSHIMS_AUTO")}))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads(data["auto"]) == {"exclude": ["resize_embeddings_keeps_frozen"]}
    assert data["worker"] == data["parent"], "the spawned worker applied the same shims with the same options"
    assert data["worker"]["resize_embeddings_keeps_frozen"] == "disabled"


def test_hook_file_matches_the_shipped_one():
    from ftshims import hook

    assert (ROOT / "ftshims-auto.pth").read_text() == hook.LINE
