"""What a shim did is visible: per-shim action counts in status(), ftshims.summary(), and the
opt-in exit summary (FTSHIMS_SUMMARY)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import ftshims
from ftshims import tiny

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_packing_block_mask_counts_the_masks_it_built():
    from ftshims.shims import _packing

    if not _packing.transformers_version().release[:2] >= (4, 37):
        pytest.skip("no packing shim before 4.37")
    model = _packing.tiny_decoder("llama", "sdpa").eval()
    batch = _packing.packed_batch(_packing.example_pair(), mask="ones")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with ftshims.applied(only=["packing_block_mask"]):
        assert ftshims.status()["packing_block_mask"].actions == {}
        with torch.no_grad():
            model(**inputs, use_cache=False)
            model(**inputs, use_cache=False)
        assert ftshims.status()["packing_block_mask"].actions == {"block masks built": 2}
        line = ftshims.summary()
    assert line.startswith("ftshims: 1 shim applied; acted: packing_block_mask 2 block masks built"), line


def test_rope_inv_freq_fp32_counts_the_buffers_it_recomputed():
    with ftshims.applied(only=["rope_inv_freq_fp32"]):
        model = tiny.tiny_llama()
        model.to(torch.bfloat16)
        counts = ftshims.status()["rope_inv_freq_fp32"].actions
    assert counts.get("inv_freq buffers recomputed in fp32", 0) >= 1, counts


def test_counts_start_again_with_each_installation():
    from ftshims._util import acted

    with ftshims.applied(only=["rope_inv_freq_fp32"]):
        acted("rope_inv_freq_fp32", "test actions")
        assert ftshims.status()["rope_inv_freq_fp32"].actions == {"test actions": 1}
    with ftshims.applied(only=["rope_inv_freq_fp32"]):
        assert ftshims.status()["rope_inv_freq_fp32"].actions == {}


def _run(env_updates, code):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTSHIMS_")}
    env.update(env_updates)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(ftshims.__file__)))] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_exit_summary_is_opt_in_and_rank_0_only():
    code = "import ftshims; ftshims.apply(only=['rope_inv_freq_fp32'])"
    # transformers is never imported here: the shim stays deferred, and the line says so (issue 37)
    assert "ftshims: 0 shims applied, 1 deferred (waiting for import of transformers)" in _run(
        {"FTSHIMS_SUMMARY": "1"}, code).stderr
    code += "; import transformers.modeling_utils"
    assert "ftshims: 1 shim applied;" in _run({"FTSHIMS_SUMMARY": "1"}, code).stderr
    assert "shim applied" not in _run({}, code).stderr
    assert "shim applied" not in _run({"FTSHIMS_SUMMARY": "1", "RANK": "1"}, code).stderr


def test_bad_summary_setting_is_an_error_at_apply():
    result = _run({"FTSHIMS_SUMMARY": "maybe"}, "import ftshims; ftshims.apply()")
    assert result.returncode != 0 and "FTSHIMS_SUMMARY='maybe'" in result.stderr
