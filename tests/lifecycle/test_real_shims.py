"""Lifecycle invariants on the real registry, in the installed stack."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest

import ftshims
from ftshims import registry
from ftshims.patching import wrapper_depth

PACKAGES = ("transformers", "peft", "trl", "torch", "flash_attn")


def _import_targets():
    registry.import_shim_modules()


def _snapshot():
    """Every module global and every class attribute in the patched packages, by identity."""
    snap = {}
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.split(".", 1)[0] not in PACKAGES:
            continue
        try:
            namespace = dict(vars(module))
        except TypeError:
            continue
        for attr, value in namespace.items():
            snap[(mod_name, attr)] = value
            if inspect.isclass(value) and getattr(value, "__module__", None) == mod_name:
                for cattr, cvalue in list(vars(value).items()):
                    snap[(mod_name, attr, cattr)] = cvalue
    return snap


def test_revert_restores_every_object_by_identity():
    _import_targets()
    before = _snapshot()
    report = ftshims.apply(include=list(registry.ids()))
    patched = [e for e in report if e.patched]
    after_apply = _snapshot()
    changed = [k for k, v in before.items() if after_apply.get(k) is not v]
    if any(e.status == "applied" for e in report):
        assert changed, "an applied shim must have changed something"
    ftshims.revert()
    after_revert = _snapshot()
    not_restored = [k for k, v in before.items() if after_revert.get(k) is not v]
    assert not not_restored, f"not restored: {not_restored[:10]} (patched by {[e.id for e in patched]})"


def test_every_target_wrapped_at_most_once():
    _import_targets()
    ftshims.apply(include=list(registry.ids()))
    ftshims.apply(include=list(registry.ids()))
    from ftshims import _manager

    for shim_id in registry.ids():
        record = _manager._RECORDS.get(shim_id)
        if record is None or record.patcher is None:
            continue
        keys = [(id(c), k, i) for c, k, i, _ in record.patcher.slots]
        assert len(keys) == len(set(keys)), shim_id
        for container, key, is_item, _ in record.patcher.slots:
            value = container[key] if is_item else vars(container).get(key)
            depth = wrapper_depth(value)
            assert depth <= sum(1 for s in _manager._RECORDS.values() if s.patcher and any(
                c is container and k == key for c, k, _, _ in s.patcher.slots)), (shim_id, key)


def _run(code: str, env=None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("FTSHIMS_DISABLE", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=300)


def test_import_is_cheap_and_patches_nothing():
    result = _run(
        """
        import sys, time, json
        t = time.perf_counter()
        import ftshims
        elapsed = time.perf_counter() - t
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft", "trl", "flash_attn", "numpy"))
        from ftshims import _manager
        print(json.dumps({"elapsed": elapsed, "heavy": heavy, "records": len(_manager._RECORDS)}))
        """
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["heavy"] == [], data["heavy"]
    assert data["records"] == 0
    assert data["elapsed"] < 0.25, f"import ftshims took {data['elapsed'] * 1000:.0f} ms"


def test_importtime_shows_no_heavy_import():
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ftshims"], capture_output=True, text=True)
    assert result.returncode == 0
    modules = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert not [m for m in modules if m.split(".")[0] in ("torch", "transformers", "peft", "trl")]


def test_apply_before_transformers_import_defers_then_applies():
    """The user's script: apply() first, import transformers later."""
    result = _run(
        """
        import json, sys
        import ftshims
        first = {e.id: e.status for e in ftshims.apply()}
        from transformers import PreTrainedModel  # lazy attribute -> imports transformers.modeling_utils
        import peft, trl
        second = {e.id: e.status for e in ftshims.status()}
        print(json.dumps({"first": first, "second": second, "heavy_before": "transformers" in sys.modules}))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    from ftshims.probing import in_affected_range

    for shim_id, first in data["first"].items():
        affected, _ = in_affected_range(shim_id)
        if first == "deferred":
            assert data["second"][shim_id] in ("applied", "deferred"), (shim_id, data["second"][shim_id])
        if affected and registry.get(shim_id).spec.kind == "fix":
            assert first in ("deferred", "applied"), (shim_id, first)
    for shim_id in ("lora_reentrant_checkpointing", "resize_embeddings_keeps_frozen", "kbit_prep_keeps_adapters_trainable"):
        if in_affected_range(shim_id)[0]:
            assert data["first"][shim_id] == "deferred"
            assert data["second"][shim_id] == "applied"


def test_auto_module_applies():
    result = _run(
        """
        import json
        import ftshims.auto
        print(json.dumps({e.id: e.status for e in ftshims.status()}))
        """
    )
    assert result.returncode == 0, result.stderr
    statuses = json.loads(result.stdout.strip().splitlines()[-1])
    assert "not applied" not in [s for k, s in statuses.items() if registry.get(k).spec.kind == "fix"]


@pytest.mark.parametrize("env_value", ["*", "lora_reentrant_checkpointing"])
def test_disable_env_var(env_value):
    result = _run(
        """
        import json, ftshims
        print(json.dumps({e.id: e.status for e in ftshims.apply()}))
        """,
        env={"FTSHIMS_DISABLE": env_value},
    )
    statuses = json.loads(result.stdout.strip().splitlines()[-1])
    assert statuses["lora_reentrant_checkpointing"] == "disabled"
    if env_value == "*":
        assert set(statuses.values()) == {"disabled"}
