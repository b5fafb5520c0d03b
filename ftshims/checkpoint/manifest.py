"""``ftshims-manifest.json``: what a save wrote, with the SHA-256 of every file, and its offline re-check.

Written beside the files of a checkpoint (the monitor, after each save it verified; ``write``), read by
``python -m ftshims.doctor --checkpoint DIR`` (``check``). Its keys (``schema`` 1):

* ``files``: ``{relative path: {"sha256": hex, "bytes": n}}`` for every file under the directory but the
  manifest itself (DeepSpeed's ``global_step*/`` and FSDP's sharded folders included);
* ``tensors``: ``{key: {"dtype": "float32", "shape": [..]}}`` of the weights as verified against memory (the
  doctor reports a tensor whose dtype or shape no longer match);
* ``reference``: ``{"file": "ftshims-reference.safetensors", "input_ids": [[..]]}`` when the monitor saved the
  in-memory model's logits on a fixed input (``--reload`` compares a reloaded model with them), else absent;
* ``written_by``, ``ftshims``, ``global_step``, ``created``.

Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Dict, Iterable, List, Optional, Tuple

from . import MANIFEST_NAME

SCHEMA = 1
REFERENCE_NAME = "ftshims-reference.safetensors"
CHUNK = 1 << 20


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def files_under(directory: str) -> List[str]:
    """Every file under ``directory`` (relative, sorted, ``/``-separated), the manifest itself excepted."""
    found = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if rel != MANIFEST_NAME:
                found.append(rel)
    return sorted(found)


def hash_files(directory: str, names: Optional[Iterable[str]] = None) -> Dict[str, Dict[str, object]]:
    names = files_under(directory) if names is None else names
    out = {}
    for rel in names:
        path = os.path.join(directory, rel)
        out[rel] = {"sha256": sha256(path), "bytes": os.path.getsize(path)}
    return out


def write(directory: str, written_by: str, tensors: Optional[Dict] = None, reference: Optional[Dict] = None,
          global_step: Optional[int] = None) -> Dict:
    """Hash every file under ``directory`` and write the manifest (atomically: a temporary file, then a rename)."""
    from .. import __version__

    manifest = {
        "schema": SCHEMA,
        "written_by": written_by,
        "ftshims": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "global_step": global_step,
        "files": hash_files(directory),
    }
    if tensors:
        manifest["tensors"] = tensors
    if reference:
        manifest["reference"] = reference
    path = os.path.join(directory, MANIFEST_NAME)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.write("\n")
    os.replace(temporary, path)
    return manifest


def read(directory: str) -> Tuple[Optional[Dict], Optional[str]]:
    """``(manifest, None)``; ``(None, None)`` when there is none; ``(None, why)`` when it cannot be read."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError) as exc:
        return None, f"{MANIFEST_NAME} does not parse: {type(exc).__name__}: {exc}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, f"{MANIFEST_NAME} has no 'files' mapping"
    return manifest, None


def check(directory: str, manifest: Dict) -> List[Tuple[str, str]]:
    """``[(problem, file)]``: ``"changed"`` (another SHA-256 or size), ``"missing"`` (listed, gone), ``"new"``
    (present, not listed: written after the manifest)."""
    problems = []
    listed = manifest.get("files", {})
    present = set(files_under(directory))
    for rel in sorted(listed):
        record = listed[rel] if isinstance(listed[rel], dict) else {}
        path = os.path.join(directory, rel)
        if rel not in present:
            problems.append(("missing", rel))
        elif os.path.getsize(path) != record.get("bytes") or sha256(path) != record.get("sha256"):
            problems.append(("changed", rel))
    for rel in sorted(present - set(listed)):
        problems.append(("new", rel))
    return problems
