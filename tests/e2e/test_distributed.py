"""Shims in every process: torchrun ranks (gloo, CPU) and spawned DataLoader workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DDP_SCRIPT = Path(__file__).parent / "dist" / "ddp_step.py"


def _env(**extra):
    env = dict(os.environ)
    env.pop("FTSHIMS_DISABLE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


@pytest.mark.slow
def test_torchrun_two_ranks_match_single_process(tmp_path):
    import torch

    single, ddp = tmp_path / "single.json", tmp_path / "ddp.json"
    subprocess.run([sys.executable, str(DDP_SCRIPT), "--out", str(single)], check=True, env=_env(), timeout=600,
                   capture_output=True)
    result = subprocess.run(
        # --standalone: c10d rendezvous on a free localhost port chosen by torchrun itself (no port race)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DDP_SCRIPT),
         "--out", str(ddp)],
        env=_env(), timeout=600, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    one, two = json.loads(single.read_text()), json.loads(ddp.read_text())
    assert one["statuses"] == two["statuses"], "every rank applies the same shims"
    assert one["params"].keys() == two["params"].keys()
    for name in one["params"]:
        a, b = torch.tensor(one["params"][name]), torch.tensor(two["params"][name])
        assert torch.allclose(a, b, atol=1e-6), f"{name}: max diff {(a - b).abs().max():.2e}"
    from ftshims import registry
    from ftshims.probing import in_affected_range

    expected = {s.id for s in registry.shims().values() if s.spec.kind == "fix" and in_affected_range(s.id)[0]}
    expected &= {"lora_reentrant_checkpointing", "packing_block_mask"}
    applied = {k for k, v in one["statuses"].items() if v == "applied"}
    assert expected <= applied, f"shims this run needs were not applied: {expected - applied}"


def _pth_installed() -> bool:
    import site
    import sysconfig

    dirs = set(site.getsitepackages()) | {sysconfig.get_path("purelib")}
    return any((Path(d) / "ftshims-auto.pth").exists() for d in dirs)


@pytest.mark.slow
def test_spawned_dataloader_worker_applies_the_same_shims(tmp_path):
    if not _pth_installed():
        if os.environ.get("FTSHIMS_STACK"):
            pytest.fail("ftshims-auto.pth is not installed in this test environment (nox installs the package)")
        pytest.skip("ftshims-auto.pth not installed here (pip install . or python -m ftshims.hook install)")
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
