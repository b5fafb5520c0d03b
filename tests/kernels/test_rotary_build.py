"""The JIT build: cache key, the cross-process lock, stale torch lock files, concurrent ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ftshims.kernels import _build  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_sources_found():
    assert _build.source_dir() is not None


def test_build_key_tracks_sources_and_flags(tmp_path, monkeypatch):
    src = _build.source_dir()
    copy = tmp_path / "csrc"
    shutil.copytree(src, copy)
    key = _build.build_key(copy, with_cuda=False)
    assert key == _build.build_key(copy, with_cuda=False)
    assert key != _build.build_key(copy, with_cuda=True)
    (copy / "rotary.cpp").write_text((copy / "rotary.cpp").read_text() + "\n// changed\n")
    assert key != _build.build_key(copy, with_cuda=False)


def test_file_lock_is_exclusive(tmp_path):
    path = tmp_path / "x.lock"
    order = []
    with _build._FileLock(path):
        def other():
            with _build._FileLock(path):
                order.append("other")

        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.3)
        order.append("first")
    thread.join(5)
    assert order == ["first", "other"]


@pytest.mark.slow
def test_concurrent_ranks_and_stale_torch_lock(tmp_path):
    """Two processes start together on an empty cache in which an interrupted build left torch's lock file:
    both load the extension, the first builds, the second waits on the flock and reuses the build."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    key = _build.build_key(_build.source_dir(), with_cuda=_build.cuda_toolkit() is not None)
    stale = tmp_path / f"ftshims_rotary_{key}"
    stale.mkdir(parents=True)
    (stale / "lock").write_text("")  # what a killed torch build leaves behind
    code = (
        "import time; from ftshims.kernels import _build; t = time.time(); ok = _build.load(); "
        "print('LOADED', ok, _build.status()['how'], round(time.time() - t, 1))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for out in outs:
        assert "LOADED True" in out, out
    assert [d.name for d in tmp_path.iterdir() if d.is_dir()] == [stale.name]
