"""The JIT build: cache key, the cross-process lock, stale torch lock files, concurrent ranks."""

from __future__ import annotations

import json
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
    key = _build.build_key(_build.source_dir(), with_cuda=_build.plan()[0])
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


# ---------------------------------------------------------------------------
# Which kernels are built: a CUDA build of torch on a machine without a CUDA device (CI runners, login nodes)


@pytest.fixture
def cuda_torch(monkeypatch):
    """This torch seen as a CUDA build with a toolkit (nvcc) and no visible device; the arch list unset."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.2")
    monkeypatch.setattr(_build, "cuda_toolkit", lambda: "/opt/cuda")
    monkeypatch.setattr(_build, "_cudart_dir", lambda toolkit: toolkit + "/lib64")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv(_build.ARCH_ENV, raising=False)
    return torch


def test_plan_without_a_device_is_cpu_kernels_and_says_why(cuda_torch, monkeypatch):
    with_cuda, what = _build.plan()
    assert with_cuda is False
    assert "CPU kernels only" in what and "no CUDA device is visible" in what and "TORCH_CUDA_ARCH_LIST is not set" in what
    monkeypatch.setattr(cuda_torch.cuda, "device_count", lambda: 1)
    with_cuda, what = _build.plan()
    assert with_cuda is True and "1 visible CUDA device(s)" in what


@pytest.mark.parametrize("arch", ["8.0;9.0", "Hopper", "native"])
def test_plan_takes_the_arch_list_from_the_environment(cuda_torch, monkeypatch, arch):
    monkeypatch.setenv(_build.ARCH_ENV, arch)
    with_cuda, what = _build.plan()
    if arch == "native":  # "the visible devices' architectures": none here, so CPU kernels, and it says why
        assert with_cuda is False and "'native' needs a visible device" in what
    else:
        assert with_cuda is True and f"TORCH_CUDA_ARCH_LIST={arch!r}" in what and "CUDA kernels" in what


def test_plan_on_cpu_torch_and_without_a_toolkit(cuda_torch, monkeypatch):
    monkeypatch.setattr(_build, "cuda_toolkit", lambda: None)
    monkeypatch.setenv(_build.ARCH_ENV, "9.0")
    with_cuda, what = _build.plan()
    assert with_cuda is False and "no CUDA toolkit" in what
    monkeypatch.setattr(cuda_torch.version, "cuda", None)
    assert _build.plan() == (False, f"CPU kernels (torch {cuda_torch.__version__} is a CPU build)")


def test_plan_needs_the_cuda_runtime_library_to_link(monkeypatch, tmp_path):
    """A CUDA_HOME with nvcc but no libcudart (torch takes /usr/local when /usr/local/bin/nvcc is a wrapper):
    the CUDA kernels would compile and then fail to link, so CPU kernels, and the plan says what to set."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.2")
    monkeypatch.setattr(_build, "cuda_toolkit", lambda: str(tmp_path))
    monkeypatch.setenv(_build.ARCH_ENV, "9.0")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "lib").mkdir()
    with_cuda, what = _build.plan()
    assert with_cuda is False and f"CUDA_HOME={tmp_path} has bin/nvcc but no libcudart" in what and "set CUDA_HOME" in what
    assert "TORCH_CUDA_ARCH_LIST='9.0'" in what
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libcudart.so").write_text("")
    assert _build.plan()[0] is True


def test_load_builds_what_the_plan_says_and_reports_it(cuda_torch, monkeypatch):
    """No device: load() asks for the CPU kernels (torch's builder would raise IndexError for the CUDA ones)
    and status() says which kernels and why; a failing build names what it tried and the error."""
    monkeypatch.setattr(_build, "_STATE", dict(_build._STATE, tried=False, loaded=False, how=None, reason=None, build=None))
    monkeypatch.setattr(_build, "_ops_registered", lambda: False)
    monkeypatch.setattr(_build, "_aot_library", lambda: None)
    asked = []

    def failing_build(verbose=False, with_cuda=None):
        asked.append(with_cuda)
        raise IndexError("list index out of range")

    monkeypatch.setattr(_build, "jit_build", failing_build)
    assert _build.load(jit=True) is False
    status = _build.status()
    assert asked == [False]
    assert status["build"].startswith("CPU kernels only") and "no CUDA device is visible" in status["build"]
    assert status["reason"] == f"no ahead-of-time build; JIT build of {status['build']} failed: IndexError: list index out of range"


def test_cuda_torch_without_a_device_builds_and_loads_the_cpu_kernels(tmp_path):
    """The real build, in a fresh process, on this torch: on a CUDA build of torch with no visible device
    (the t5_25 stack here: torch 2.15.0) the CPU kernels build and run, and status() says so."""
    import torch

    if torch.version.cuda is None or _build.cuda_toolkit() is None or torch.cuda.device_count() > 0:
        pytest.skip(f"needs a CUDA build of torch, a CUDA toolkit and no device (torch {torch.__version__}, "
                    f"CUDA {torch.version.cuda}, toolkit {_build.cuda_toolkit()})")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(_build.ARCH_ENV, None)
    code = (
        "import json, torch; from ftshims.kernels import _build, rotary; ok = _build.load(); "
        "x = torch.randn(1, 4, 2, 8); same = torch.allclose(rotary.apply_rotary(x, rope_theta=1e4, backend='cpu'), "
        "rotary.apply_rotary(x, rope_theta=1e4, backend='reference'), atol=1e-6); "
        "print(json.dumps(dict(_build.status(), ok=ok, same=same)))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    status = json.loads(out.stdout.strip().splitlines()[-1])
    assert status["ok"] and status["same"] and status["cuda"] is False, status
    assert status["build"].startswith("CPU kernels only") and "no CUDA device is visible" in status["build"], status


def test_a_failed_build_names_the_line_of_the_log_that_says_why():
    log = (
        "Error building extension 'ftshims_rotary_x': [1/1] c++ rotary.o rotary_cuda.cuda.o -shared -lcudart\n"
        "FAILED: ftshims_rotary_x.so\n"
        "/usr/bin/ld: cannot find -lcudart: No such file or directory\n"
        "collect2: error: ld returned 1 exit status\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    assert _build._describe(RuntimeError(log)) == (
        "RuntimeError: /usr/bin/ld: cannot find -lcudart: No such file or directory ... ninja: build stopped: subcommand failed."
    )
    assert _build._describe(IndexError("list index out of range")) == "IndexError: list index out of range"
    assert _build._describe(IndexError()) == "IndexError"


def test_the_ptx_check_flags_split_or_missing_16_byte_accesses():
    """tools/nvcc_compile_check.py reads each vectorised kernel's PTX: 16-byte loads and stores pass, a store split
    into 2-byte pieces (what the compiler made of a struct copy before store16) or a kernel without 16-byte loads
    fails."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import nvcc_compile_check as check
    finally:
        sys.path.pop(0)
    name = "_ZN14ftshims_rotary12_GLOBAL__N_113rotary_kernelIN3c108BFloat16ES3_Li8ELb0ELb1EEEvNS_6ParamsEl"
    scalar = name.replace("Li8ELb0ELb1E", "Li1ELb0ELb0E")

    def entry(kernel, body):
        return f".visible .entry {kernel}(\n.param .u64 p\n)\n{{\n{body}\n}}\n"

    good = ("ld.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];\nld.global.v4.u32 {%r5, %r6, %r7, %r8}, [%rd2];\n"
            "st.global.v4.u32 [%rd3], {%r1, %r2, %r3, %r4};\nst.global.v4.u32 [%rd4], {%r5, %r6, %r7, %r8};")
    split = good.replace("st.global.v4.u32 [%rd4], {%r5, %r6, %r7, %r8};",
                         "st.global.v2.u16 [%rd4], {%rs1, %rs2};\nst.global.v2.u16 [%rd4+4], {%rs3, %rs4};")
    scalar_loads = good.replace("ld.global.v4.u32 {%r5, %r6, %r7, %r8}, [%rd2];", "ld.global.u16 %rs9, [%rd2];")
    assert check.vector_access_report(entry(name, good) + entry(scalar, "st.global.u16 [%rd1], %rs1;")) == (1, [])
    for bad in (split, scalar_loads):
        checked, problems = check.vector_access_report(entry(name, bad))
        assert checked == 1 and len(problems) == 1, problems
