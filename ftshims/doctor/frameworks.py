"""Fine-tuning frameworks and patchers next to ftshims: the report's ``frameworks`` section.

:func:`frameworks_section` reads versions from package metadata only (nothing is imported) and lists
the known-bad orderings of the installed patchers as advisories. :func:`probe_section` (``--probe``)
starts a fresh Python, imports the installed frameworks there (without ftshims applied: the child's
``FTSHIMS_AUTO`` is removed), optionally runs Liger's ``apply_liger_kernel_to_*``, and reports which
declared targets of ftshims' shims (``spec.targets``) then hold another patcher's code: the same
test ``ftshims.status()`` uses for its foreign-patch notes (:func:`ftshims.patching.foreign_origin`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

# (distribution, import name, what it is). Order: frameworks, patchers, the HF stack, back-ends.
FRAMEWORKS = (
    ("llamafactory", "llamafactory", "framework"),
    ("axolotl", "axolotl", "framework"),
    ("ms-swift", "swift", "framework"),
    ("torchtune", "torchtune", "framework"),
    ("unsloth", "unsloth", "patcher"),
    ("unsloth-zoo", "unsloth_zoo", "patcher"),
    ("liger-kernel", "liger_kernel", "patcher"),
    ("trl", "trl", "library"),
    ("peft", "peft", "library"),
    ("accelerate", "accelerate", "library"),
    ("deepspeed", "deepspeed", "backend"),
    ("flash-attn", "flash_attn", "backend"),
    ("xformers", "xformers", "backend"),
    ("bitsandbytes", "bitsandbytes", "backend"),
)

# Advisories for installed patchers: ordering rules and what each means for ftshims.
ADVISORIES = (
    {
        "id": "unsloth-import-first",
        "requires": "unsloth",
        "severity": "warning",
        "message": (
            "unsloth must be imported first, before transformers, peft and trl: it patches them at import time "
            "(LlamaModel.forward and friends replaced by its own re-implementations). For ftshims: call "
            "ftshims.apply() after `import unsloth`, not FTSHIMS_AUTO=1 (which applies at interpreter start, "
            "before unsloth). Then ftshims wraps unsloth's functions where it wraps (composes) and steps aside "
            "where it would replace them; applied before unsloth, ftshims' wrappers on the targets unsloth "
            "replaces no longer run (status() notes say which) and revert() leaves unsloth's code in place. "
            "unsloth's forward ignores a 2D attention mask for packed rows, so ftshims' packing fix cannot "
            "reach it there."
        ),
    },
    {
        "id": "liger-before-model",
        "requires": "liger-kernel",
        "severity": "info",
        "message": (
            "apply_liger_kernel_to_<model>() replaces module globals (RMSNorm, MLP, apply_rotary_pos_emb) and "
            "<Model>ForCausalLM.forward by plain assignment: call it before the model is built. Its order with "
            "ftshims.apply() does not matter for ftshims' default shims (different targets; Liger's forward still "
            "calls the decoder ftshims wraps); the opt-in rope_fused_kernel leaves Liger's rope alone."
        ),
    },
    {
        "id": "axolotl-monkeypatches",
        "requires": "axolotl",
        "severity": "info",
        "message": (
            "axolotl applies its monkeypatches (axolotl/monkeypatch/) in the training process while loading the "
            "model, after FTSHIMS_AUTO=1 applied ftshims: where axolotl re-registers a mask or attention function "
            "it wraps what is there (ftshims' layer keeps running); where it replaces one outright, status() notes "
            "it. axolotl's LoRA Triton kernels (lora_*_kernel, auto-enabled for single-device LoRA) need CUDA."
        ),
    },
    {
        "id": "llamafactory-own-fixes",
        "requires": "llamafactory",
        "severity": "info",
        "message": (
            "LLaMA-Factory handles two bugs itself: neat_packing builds its own block-diagonal 4D mask, and its "
            "gradient checkpointing (on by default) is set on the model instance with inputs marked as requiring "
            "grad; ftshims stays out of both. `packing: true` without neat_packing feeds an all-ones mask: on "
            "sdpa/eager the packed examples attend to each other unless ftshims' packing_block_mask is active "
            "(FTSHIMS_AUTO=1)."
        ),
    },
    {
        "id": "deepspeed-zero3-frozen",
        "requires": "deepspeed",
        "severity": "info",
        "message": (
            "DeepSpeed ZeRO-3 partitions parameters at model construction: apply ftshims (FTSHIMS_AUTO=1 covers "
            "every rank) before the model is built, so that shims on construction paths see every rank."
        ),
    },
)


def _version(distribution: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken dist-info must not break the report
        return None


def frameworks_section() -> Dict[str, Any]:
    """``{"frameworks": [...], "installed": [...], "advisories": [...], "probe": None}`` from metadata only.

    Every entry of ``frameworks``: ``name`` (distribution), ``module``, ``kind`` (framework, patcher,
    library, backend), ``version`` (None: not installed). ``advisories``: the ordering rules of the
    installed patchers (``id``, ``severity``, ``applies_to``, ``message``).
    """
    rows: List[Dict[str, Any]] = []
    for distribution, module, kind in FRAMEWORKS:
        rows.append({"name": distribution, "module": module, "kind": kind, "version": _version(distribution)})
    installed = [row["name"] for row in rows if row["version"]]
    advisories = [
        {"id": a["id"], "severity": a["severity"], "applies_to": a["requires"], "message": a["message"]}
        for a in ADVISORIES
        if a["requires"] in installed
    ]
    return {"frameworks": rows, "installed": installed, "advisories": advisories, "probe": None}


# The child of probe_section(): import the frameworks, then judge every declared target of every shim.
_CHILD = r"""
import importlib, json, sys, time
t0 = time.monotonic()
wanted, liger, target_modules = json.loads(sys.argv[1])
imported = {}
for module in wanted:
    try:
        importlib.import_module(module)
        imported[module] = "ok"
    except BaseException as exc:  # noqa: BLE001  (a framework's import may even call sys.exit)
        imported[module] = f"{type(exc).__name__}: {exc}"[:300]
if liger:
    try:
        import liger_kernel.transformers as lt
        for name in sorted(set(dir(lt)) | set(getattr(lt, "__all__", ()))):
            if name.startswith("apply_liger_kernel_to_") and (liger is True or name[len("apply_liger_kernel_to_"):] in liger):
                try:
                    getattr(lt, name)()
                except BaseException as exc:  # noqa: BLE001
                    imported[f"liger_kernel.transformers.{name}"] = f"{type(exc).__name__}: {exc}"[:300]
    except BaseException as exc:  # noqa: BLE001
        imported["liger_kernel.transformers"] = f"{type(exc).__name__}: {exc}"[:300]
for module in target_modules:
    try:
        importlib.import_module(module)
    except BaseException:  # noqa: BLE001  (an optional model family missing on this version)
        pass
from ftshims import registry
from ftshims._manager import foreign_targets
replaced = []
for shim in registry.shims().values():
    for target, origin in foreign_targets(shim.spec).items():
        replaced.append({"shim": shim.id, "target": target, "by": origin})
print(json.dumps({"imported": imported, "replaced": replaced, "seconds": round(time.monotonic() - t0, 1)}))
"""


def probe_section(
    modules: Optional[Sequence[str]] = None,
    apply_liger: Any = True,
    target_modules: Optional[Sequence[str]] = None,
    timeout: float = 180.0,
    python: Optional[str] = None,
) -> Dict[str, Any]:
    """In a fresh subprocess: import the installed frameworks, then list ftshims' declared targets they replaced.

    ``modules``: what to import (default: every installed framework/patcher of :data:`FRAMEWORKS` plus
    trl and peft). ``apply_liger``: also run every ``apply_liger_kernel_to_*`` (Liger patches only when
    asked), or only those of the model types listed (``["llama"]``). ``target_modules``: the modules of the targets to import in the child (default: every
    declared target module; those missing on the installed versions are skipped). Returns
    ``{"status": "ok"|"error"|"timeout", "imported": {module: "ok"|error}, "replaced": [{"shim", "target",
    "by"}], "seconds", "message"}``.
    """
    from .. import registry

    if modules is None:
        modules = [m for d, m, kind in FRAMEWORKS if kind in ("framework", "patcher", "library") and _version(d)]
        # unsloth must come first (see the unsloth-import-first advisory)
        modules = sorted(modules, key=lambda m: 0 if m.startswith("unsloth") else 1)
    if target_modules is None:
        target_modules = sorted({t.module for shim in registry.shims().values() for t in shim.spec.targets})
    if not _version("liger-kernel"):
        apply_liger = False
    elif apply_liger is not True:
        apply_liger = list(apply_liger or [])
    env = dict(os.environ)
    for name in ("FTSHIMS_AUTO", "FTSHIMS_SUMMARY"):
        env.pop(name, None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("TRITON_INTERPRET", "1")  # Liger's import of triton on a machine without a GPU
    argv = [python or sys.executable, "-c", _CHILD, json.dumps([list(modules), apply_liger, list(target_modules)])]
    t0 = time.monotonic()
    out: Dict[str, Any] = {"status": "error", "imported": {}, "replaced": [], "seconds": None, "message": None}
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        out.update(status="timeout", seconds=round(time.monotonic() - t0, 1),
                   message=f"the framework import probe did not finish within {timeout:.0f} s")
        return out
    except OSError as exc:
        out["message"] = f"could not start a Python subprocess: {exc}"
        return out
    out["seconds"] = round(time.monotonic() - t0, 1)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        out["message"] = f"the probe exited {done.returncode}: " + (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return out
    result = json.loads(lines[-1])
    out.update(status="ok", imported=result["imported"], replaced=result["replaced"])
    n = len(result["replaced"])
    out["message"] = (
        "no ftshims target was replaced by the installed frameworks"
        if n == 0
        else f"{n} ftshims target{'s' if n != 1 else ''} replaced by other patchers: ftshims composes or steps aside there"
    )
    return out
