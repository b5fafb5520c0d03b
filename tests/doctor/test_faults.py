"""The doctor under fault injection: every optional dependency missing, or raising on import.

Each mode runs the real ``python -m ftshims.doctor --json`` in a subprocess whose import system
refuses (or breaks) every optional package at once, and, in the "missing" mode, whose metadata
no longer knows them. The report must still come out, parse, and carry a sane exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("transformers", "peft", "trl", "accelerate", "datasets", "flash_attn", "deepspeed", "bitsandbytes",
            "triton", "liger_kernel")

BOOTSTRAP = textwrap.dedent(
    """
    import importlib.abc, importlib.metadata as md, runpy, sys
    MODE, BLOCK = sys.argv[1], set(sys.argv[2].split(","))
    DISTS = {name.replace("_", "-") for name in BLOCK} | BLOCK

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCK:
                if MODE == "missing":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                raise RuntimeError(f"injected failure while importing {name}")
            return None

    sys.meta_path.insert(0, Refuse())
    if MODE == "missing":
        real_version, real_distribution = md.version, md.distribution
        def version(name):
            if name.lower().replace("_", "-") in DISTS or name in DISTS:
                raise md.PackageNotFoundError(name)
            return real_version(name)
        def distribution(name):
            if name.lower().replace("_", "-") in DISTS or name in DISTS:
                raise md.PackageNotFoundError(name)
            return real_distribution(name)
        md.version, md.distribution = version, distribution
    sys.argv = ["ftshims.doctor", "--json", "--no-flash-attn"]
    runpy.run_module("ftshims.doctor", run_name="__main__")
    """
)


@pytest.mark.parametrize("mode", ["missing", "raising"])
def test_doctor_survives_every_optional_dependency(mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.pop("FTSHIMS_DISABLE", None)
    result = subprocess.run([sys.executable, "-c", BOOTSTRAP, mode, ",".join(OPTIONAL)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["summary"]["exit_code"] == result.returncode
    assert {"environment", "packages", "shims", "summary"} <= set(report)
    text = json.dumps(report)
    if mode == "raising":
        assert "injected failure" in text, "the import errors are reported, not swallowed"
    from ftshims import registry

    assert [row["id"] for row in report["shims"]] == list(registry.ids()), "every shim still gets a row"
    if mode == "missing":
        # nothing a shim patches is importable: nothing can be affected, nothing can stay unpatched
        assert all(row["verdict"] in ("not affected", "opt-in") or not row["affected"] for row in report["shims"])
