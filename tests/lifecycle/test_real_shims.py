"""The lifecycle promises of test_apply_revert.py, kept by every real registered shim in the installed stack.

Runs on every pinned stack (it is not in conftest.DEFAULT_STACK_ONLY), because what
the real shims patch, and whether they are in range, changes with the versions:
``import ftshims`` imports nothing heavy and patches nothing; apply() then
revert() restores every module global and class attribute of the patched
packages by identity; applying twice wraps each target at most once; apply()
before the imports defers to import hooks that the user's own imports fire, and
ends in the same statuses and wrapped call sites as apply() after them;
``import ftshims.auto`` applies; ``FTSHIMS_DISABLE=*`` disables every shim.

Left to the others: the machinery's edge cases, on fake shims (test_apply_revert.py);
faults, threads and hostile inputs injected into the real shims (test_hardening.py);
the settings grammar (test_settings.py).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

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


def _run(code: str, env=None, flags=()) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("FTSHIMS_DISABLE", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=300,
    )


def _last_json(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; the JSON on its last line of output."""
    result = _run(code)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_is_cheap_and_patches_nothing():
    """``import ftshims`` neither imports nor even tries to import (``-X importtime`` lists failed and
    absent-module attempts too) a heavy package, applies no shim, and takes under 0.25 s."""
    result = _run(
        """
        import sys, time, json
        t = time.perf_counter()
        import ftshims
        elapsed = time.perf_counter() - t
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft", "trl", "flash_attn", "numpy"))
        from ftshims import _manager
        print(json.dumps({"elapsed": elapsed, "heavy": heavy, "records": len(_manager._RECORDS)}))
        """,
        flags=("-X", "importtime"),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["heavy"] == [], data["heavy"]
    assert data["records"] == 0
    assert data["elapsed"] < 0.25, f"import ftshims took {data['elapsed'] * 1000:.0f} ms"
    attempted = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert attempted, "-X importtime printed nothing to check"
    assert not [m for m in attempted if m.split(".")[0] in ("torch", "transformers", "peft", "trl")], attempted


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


def test_apply_before_and_after_import_agree():
    """Same statuses and the same wrapped call sites whether apply() runs before or after the imports."""
    code = """
        import inspect, json, importlib, sys, ftshims
        from ftshims import registry
        from ftshims.patching import is_shim_wrapper
        import_all = registry.import_shim_modules
        def wrapped_sites():
            sites = []
            for name, module in list(sys.modules.items()):
                if module is None or name.split(".")[0] not in ("transformers", "peft", "trl"):
                    continue
                for attr, value in list(vars(module).items()):
                    if is_shim_wrapper(value):
                        sites.append(name + ":" + attr)
                    if inspect.isclass(value) and value.__module__ == name:
                        sites += [name + ":" + attr + "." + a for a, v in vars(value).items() if is_shim_wrapper(v)]
            return sorted(sites)
        {first}
        ftshims.apply()
        {second}
        print(json.dumps({{"status": {{e.id: e.status for e in ftshims.status()}}, "sites": wrapped_sites()}}))
    """
    before = _last_json(code.format(first="", second="import_all()"))
    after = _last_json(code.format(first="import_all()", second=""))
    assert before["status"] == after["status"]
    assert before["sites"] == after["sites"]


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


def test_disable_all_env_var_disables_every_shim():
    """FTSHIMS_DISABLE=* set before the process starts: every entry of apply()'s report is "disabled" on
    this stack, so none is "failed" either (a shim module that fails to load is reported so, whatever the
    variable says). Naming single ids, and the grammar: test_settings.py::test_disable_grammar."""
    result = _run(
        """
        import json, ftshims
        print(json.dumps({e.id: e.status for e in ftshims.apply()}))
        """,
        env={"FTSHIMS_DISABLE": "*"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    statuses = json.loads(result.stdout.strip().splitlines()[-1])
    assert statuses["lora_reentrant_checkpointing"] == "disabled"
    assert set(statuses.values()) == {"disabled"}
