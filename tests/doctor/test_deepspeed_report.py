"""The doctor's DeepSpeed line: the version (metadata) and the accelerator DeepSpeed would pick, without
importing deepspeed (its import picks and initialises the accelerator itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ftshims.doctor import deepspeed_info
from ftshims.doctor.formats import _deepspeed_line
from ftshims.doctor.packages import package_row
from ftshims.doctor.report import Options, skeleton

ROOT = Path(__file__).resolve().parents[2]
CPU = {"status": "imported", "cuda_available": False, "device_count": 0, "mps_available": False}
GPU = {"status": "imported", "cuda_available": True, "device_count": 2, "mps_available": False}
INSTALLED = {"name": "deepspeed", "status": "installed", "version": "0.19.8"}


@pytest.fixture
def no_vendor_extensions(monkeypatch):
    monkeypatch.setattr(deepspeed_info, "_present", lambda module: False)
    monkeypatch.setattr(deepspeed_info, "_xpu_available", lambda: False)


def test_cpu_without_a_cuda_device(no_vendor_extensions):
    info = deepspeed_info.deepspeed_section(INSTALLED, CPU)
    assert info == {"status": "installed", "version": "0.19.8", "accelerator": "cpu", "source": "detected",
                    "detail": "no CUDA device"}
    assert _deepspeed_line(info) == "0.19.8, accelerator cpu (detected: no CUDA device)"


def test_cuda_when_torch_sees_a_device(no_vendor_extensions, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    info = deepspeed_info.deepspeed_section(INSTALLED, GPU)
    assert (info["accelerator"], info["source"], info["detail"]) == ("cuda", "detected", "2 CUDA device(s)")


def test_ds_accelerator_overrides_detection(no_vendor_extensions, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    info = deepspeed_info.deepspeed_section(INSTALLED, GPU)
    assert (info["accelerator"], info["source"], info["detail"]) == ("cpu", "DS_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", "gpu")  # not a DeepSpeed accelerator: DeepSpeed raises at import
    info = deepspeed_info.deepspeed_section(INSTALLED, GPU)
    assert info["accelerator"] == "gpu" and "DS_ACCELERATOR must be one of" in info["detail"]


def test_detection_order_follows_deepspeed(monkeypatch):
    """A vendor extension found before cuda wins, as in real_accelerator.get_accelerator (npu before cuda)."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(deepspeed_info, "_xpu_available", lambda: False)
    monkeypatch.setattr(deepspeed_info, "_present", lambda module: module == "torch_npu")
    assert deepspeed_info.deepspeed_section(INSTALLED, GPU)["accelerator"] == "npu"
    monkeypatch.setattr(deepspeed_info, "_present", lambda module: False)
    assert deepspeed_info.deepspeed_section(INSTALLED, dict(CPU, mps_available=True))["accelerator"] == "mps"


def test_not_installed_has_no_accelerator_and_no_line():
    info = deepspeed_info.deepspeed_section({"name": "deepspeed", "status": "not installed", "version": None}, CPU)
    assert info["accelerator"] is None and info["status"] == "not installed"
    assert _deepspeed_line(info) is None


def test_the_report_has_the_entry_at_its_empty_value():
    assert skeleton(Options())["environment"]["deepspeed"] == {
        "status": None, "version": None, "accelerator": None, "source": None, "detail": None}


def test_installed_version_comes_from_metadata_and_deepspeed_is_not_imported():
    """In a fresh process: the section for the installed deepspeed (if any) leaves deepspeed unimported."""
    code = (
        "import sys, json\n"
        "from ftshims.doctor.deepspeed_info import deepspeed_section\n"
        "from ftshims.doctor.packages import package_row\n"
        "info = deepspeed_section(package_row('deepspeed'), "
        "{'status': 'imported', 'cuda_available': False, 'device_count': 0})\n"
        "print(json.dumps([info, 'deepspeed' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    info, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported is False
    row = package_row("deepspeed")
    assert info["version"] == row["version"]
    if row["version"]:
        assert info["accelerator"] is not None
