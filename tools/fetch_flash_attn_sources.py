#!/usr/bin/env python
"""Fetch the pinned flash-attn source distributions and extract their pure-Python rotary files.

flash-attn cannot be built without a GPU toolchain, but its rotary code is pure
Python + Triton: ``flash_attn/layers/rotary.py`` and
``flash_attn/ops/triton/rotary.py``. The tests of the ``flash_attn_rotary`` and
``flash_attn_rotary_kernel`` shims run those *released* files on CPU with
Triton's interpreter (``TRITON_INTERPRET=1``), and so does flash-attn's own
``tests/test_rotary.py`` (tests/kernels/test_flash_attn_upstream_rotary.py). This
script runs at install time (CI: before pytest), never at test time, and lays
out one importable tree per version:

    <dest>/flash_attn-<version>/
        flash_attn/__init__.py              # NOT the released one (it imports the CUDA extension): only __version__
        flash_attn/bert_padding.py          # released (pure PyTorch; flash-attn's rotary tests import it)
        flash_attn/layers/__init__.py       # released
        flash_attn/layers/rotary.py         # released
        flash_attn/ops/__init__.py          # released
        flash_attn/ops/triton/__init__.py   # released
        flash_attn/ops/triton/rotary.py     # released
        upstream/tests/test_rotary.py       # released, when the sdist ships it (outside the import path)
        flash_attn-<version>.dist-info/METADATA   # the sdist's PKG-INFO, so importlib.metadata sees the version
        SOURCE.json                         # sdist file name and sha256 of every extracted file

``SOURCE.json`` has ``files`` (sdist path -> sha256) and ``tests`` (sdist path
-> sha256, or null when the sdist does not ship that test file: of the pinned
versions only 2.8.3's sdist has ``tests/test_rotary.py``; 2.5.8's and 2.6.3's
ship no ``tests/`` folder at all).

Download: ``pip download --no-deps --no-binary :all: --no-build-isolation
flash-attn==<v>`` with ``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE`` (pip prepares
the sdist's metadata, which imports torch: run this with a Python that has
torch, e.g. the test venv). Already-extracted versions are skipped.

Usage: python tools/fetch_flash_attn_sources.py [--dest DIR] [--versions 2.5.8 2.6.3 2.8.3] [--check]
``--check`` downloads nothing and exits non-zero if a version is missing (CI gate).
The default destination is ``$FTSHIMS_FLASH_ATTN_SOURCES`` or
``~/.cache/ftshims/flash-attn-sources``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSIONS = ("2.5.8", "2.6.3", "2.8.3")
ENV = "FTSHIMS_FLASH_ATTN_SOURCES"
RELEASED_FILES = (
    "flash_attn/bert_padding.py",
    "flash_attn/layers/__init__.py",
    "flash_attn/layers/rotary.py",
    "flash_attn/ops/__init__.py",
    "flash_attn/ops/triton/__init__.py",
    "flash_attn/ops/triton/rotary.py",
)
# flash-attn's own tests of these files: extracted under upstream/ when the sdist has them (recorded either way).
UPSTREAM_TESTS = ("tests/test_rotary.py",)
UPSTREAM_DIR = "upstream"


def default_dest() -> Path:
    env = os.environ.get(ENV)
    return Path(env) if env else Path.home() / ".cache" / "ftshims" / "flash-attn-sources"


def version_dir(dest: Path, version: str) -> Path:
    return dest / f"flash_attn-{version}"


def upstream_test(dest: Path, version: str, rel: str = "tests/test_rotary.py"):
    """Path of flash-attn's own test file ``rel`` extracted from this version's sdist, or None if it has none."""
    path = version_dir(dest, version) / UPSTREAM_DIR / rel
    return path if path.is_file() else None


def is_complete(dest: Path, version: str) -> bool:
    root = version_dir(dest, version)
    if not (root / "SOURCE.json").is_file() or not all((root / f).is_file() for f in RELEASED_FILES):
        return False
    try:
        tests = json.loads((root / "SOURCE.json").read_text()).get("tests")
    except ValueError:
        return False
    if not isinstance(tests, dict) or any(rel not in tests for rel in UPSTREAM_TESTS):
        return False  # laid out by an older version of this script: extract again
    return all(tests[rel] is None or (root / UPSTREAM_DIR / rel).is_file() for rel in UPSTREAM_TESTS)


def download(version: str, workdir: Path) -> Path:
    env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE", PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
        "--no-build-isolation", f"flash-attn=={version}", "-d", str(workdir),
    ]
    subprocess.run(cmd, check=True, env=env)
    found = sorted(workdir.glob(f"flash_attn-{version}.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download produced no flash_attn-{version}.tar.gz in {workdir}")
    return found[0]


def extract(sdist: Path, dest: Path, version: str) -> None:
    root = version_dir(dest, version)
    tmp = Path(tempfile.mkdtemp(prefix=f".flash_attn-{version}-", dir=dest))
    try:
        prefix = f"flash_attn-{version}/"
        hashes = {}
        with tarfile.open(sdist) as tar:
            members = {m.name: m for m in tar.getmembers()}
            for rel in RELEASED_FILES + ("PKG-INFO",):
                member = members.get(prefix + rel)
                if member is None or not member.isfile():
                    raise RuntimeError(f"{sdist.name} has no {rel}")
                data = tar.extractfile(member).read()
                target = tmp / ("PKG-INFO" if rel == "PKG-INFO" else rel)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                hashes[rel] = hashlib.sha256(data).hexdigest()
            tests = {}
            for rel in UPSTREAM_TESTS:
                member = members.get(prefix + rel)
                if member is None or not member.isfile():
                    tests[rel] = None  # this sdist does not ship it
                    continue
                data = tar.extractfile(member).read()
                target = tmp / UPSTREAM_DIR / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                tests[rel] = hashlib.sha256(data).hexdigest()
        (tmp / "flash_attn" / "__init__.py").write_text(
            f'# Stand-in for the released flash_attn/__init__.py, which imports the CUDA extension.\n__version__ = "{version}"\n'
        )
        dist_info = tmp / f"flash_attn-{version}.dist-info"
        dist_info.mkdir()
        shutil.move(str(tmp / "PKG-INFO"), str(dist_info / "METADATA"))
        (dist_info / "INSTALLER").write_text("ftshims-tools\n")
        (tmp / "SOURCE.json").write_text(
            json.dumps(
                {
                    "sdist": sdist.name,
                    "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
                    "files": hashes,
                    "tests": tests,
                },
                indent=2,
            )
            + "\n"
        )
        if root.exists():
            shutil.rmtree(root)
        tmp.rename(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=None)
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS))
    parser.add_argument("--check", action="store_true", help="only verify that every version is present")
    args = parser.parse_args(argv)
    dest = (args.dest or default_dest()).expanduser().resolve()
    dest.mkdir(parents=True, exist_ok=True)
    missing = [v for v in args.versions if not is_complete(dest, v)]
    if args.check:
        for v in args.versions:
            print(f"flash-attn {v}: {'missing' if v in missing else 'ok'} ({version_dir(dest, v)})")
        return 1 if missing else 0
    with tempfile.TemporaryDirectory(prefix="ftshims-fa-") as work:
        for version in missing:
            print(f"fetching flash-attn {version} ...", flush=True)
            sdist = download(version, Path(work))
            extract(sdist, dest, version)
    for v in args.versions:
        test = upstream_test(dest, v)
        print(f"flash-attn {v}: {version_dir(dest, v)} (tests/test_rotary.py: {'extracted' if test else 'not in the sdist'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
