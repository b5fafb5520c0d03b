"""The doctor's ``frameworks`` section (ftshims/doctor/frameworks.py) in the clients venv.

Metadata only: LLaMA-Factory and Liger are listed with their pinned versions and their advisories.
Probe mode (a fresh process): Liger's ``apply_liger_kernel_to_llama()`` replaces the target of the opt-in
``rope_fused_kernel`` (``modeling_llama.apply_rotary_pos_emb``) and no default shim's; a fake unsloth-style
package that replaces ``LlamaModel.forward`` at import is reported on the three packing shims.
"""

from __future__ import annotations

import os

import pytest

import clientlib

clientlib.require("liger", "liger_kernel")

pytestmark = pytest.mark.slow

FAKE = '''
from transformers.models.llama import modeling_llama

def fast_forward(self, input_ids=None, attention_mask=None, **kwargs):
    raise NotImplementedError

modeling_llama.LlamaModel.forward = fast_forward
'''


def test_frameworks_section_from_metadata():
    from importlib import metadata

    from ftshims.doctor.frameworks import frameworks_section

    section = frameworks_section()
    versions = {row["name"]: row["version"] for row in section["frameworks"]}
    assert versions["llamafactory"] == metadata.version("llamafactory")
    assert versions["liger-kernel"] == metadata.version("liger-kernel")
    assert versions["unsloth"] is None and "unsloth" not in section["installed"]
    ids = {a["id"] for a in section["advisories"]}
    assert {"liger-before-model", "llamafactory-own-fixes"} <= ids and "unsloth-import-first" not in ids


def test_probe_lists_targets_replaced_by_liger_and_a_fake_unsloth(tmp_path, monkeypatch):
    from ftshims.doctor.frameworks import probe_section

    (tmp_path / "fake_unsloth_patcher.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    probe = probe_section(modules=["liger_kernel.transformers", "fake_unsloth_patcher"], apply_liger=["llama"],
                          target_modules=["transformers.models.llama.modeling_llama"], timeout=300)
    assert probe["status"] == "ok", probe
    assert probe["imported"] == {"liger_kernel.transformers": "ok", "fake_unsloth_patcher": "ok"}, probe
    replaced = {(r["shim"], r["target"].rsplit(".", 2)[-2] + "." + r["target"].rsplit(".", 1)[-1]): r["by"]
                for r in probe["replaced"]}
    rope = replaced.pop(("rope_fused_kernel", "modeling_llama.apply_rotary_pos_emb"))
    assert rope.startswith("liger_kernel."), rope
    for shim in ("packing_block_mask", "custom_4d_mask_format", "flash_attn_packing", "causal_mask_buffer_regrow"):
        assert replaced.pop((shim, "LlamaModel.forward")).startswith("fake_unsloth_patcher.fast_forward")
    assert replaced == {}, replaced  # nothing else: Liger touches no default shim's target
