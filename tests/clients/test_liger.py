"""Liger kernels and ftshims in one process, in both orders (liger-kernel 0.7.0, transformers 4.57.6).

``apply_liger_kernel_to_llama()`` (``liger_kernel/transformers/monkey_patch.py``) replaces, by plain
assignment: ``modeling_llama.apply_rotary_pos_emb`` (rope), ``modeling_llama.LlamaRMSNorm`` and
``modeling_llama.LlamaMLP`` (module globals read when a model is *built*), and the class attribute
``LlamaForCausalLM.forward`` (fused linear cross-entropy). Of these only ``apply_rotary_pos_emb`` is
an ftshims target (the opt-in ``rope_fused_kernel``); ftshims' default shims wrap ``LlamaModel.forward``,
``LlamaRotaryEmbedding.forward/_apply``, ``PreTrainedModel.__call__`` / ``gradient_checkpointing_enable``
and the mask registries, none of which Liger touches, and Liger's ``lce_forward`` still calls
``self.model(...)``, so the packing shims stay on its path.

Each scenario is a fresh process (``foreign_scenario.py``); Liger's patches cannot be undone.
Objects are checked with the full default patch set on plain CPU (no kernel runs). Forward and
backward of a tiny Llama run Liger's Triton kernels under ``TRITON_INTERPRET=1`` with
``rms_norm=False``: Liger's RMSNorm kernel calls ``triton.language.extra.libdevice.rsqrt``, which the
Triton 3.9 interpreter returns as None (``InterpreterError: cannot convert None ... to tensor``);
rope, SwiGLU and the fused linear cross-entropy run.
"""

from __future__ import annotations

import pytest

import clientlib

clientlib.require("liger", "liger_kernel")

pytestmark = pytest.mark.slow

LIGER = {
    "modeling_llama.apply_rotary_pos_emb": "liger",
    "modeling_llama.LlamaRMSNorm": "liger",
    "modeling_llama.LlamaMLP": "liger",
    "LlamaForCausalLM.forward": "liger",
}
FTSHIMS_ON_MODEL = "ftshims:flash_attn_packing(ftshims:custom_4d_mask_format(transformers))"

# Six processes (each pays ~14 s of CPU for importing transformers + liger); the two orders are run
# with ``include=["rope_fused_kernel"]``, which applies every default shim as well.
SPECS = {
    # objects: the full default patch set, no kernel is run (TRITON_INTERPRET=0)
    "obj_liger_then_rope": {"steps": "liger,ftshims+rope", "liger_full": True},
    "obj_rope_then_liger": {"steps": "ftshims+rope,liger", "liger_full": True},
    # numbers: Liger's kernels under the Triton interpreter (rms_norm=False, see above)
    "liger": {"steps": "liger", "forward": True, "interpret": True},
    "ftshims": {"steps": "ftshims", "forward": True, "interpret": True},
    "liger_then_rope": {"steps": "liger,ftshims+rope", "forward": True, "interpret": True},
    "rope_then_liger": {"steps": "ftshims+rope,liger", "forward": True, "interpret": True},
}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("liger")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    weights = root / "weights.pt"
    torch.save(LlamaForCausalLM(config).state_dict(), weights)  # one set of weights for every process
    return clientlib.run_scenarios(SPECS, root, weights)


def _liger_in_place(objects):
    assert {k: objects[k] for k in LIGER} == LIGER, objects


def test_liger_objects_survive_ftshims_in_both_orders(scenarios):
    """Liger's four replacements are in place whatever the order, and ``ftshims.revert()`` leaves them."""
    for key in ("obj_liger_then_rope", "obj_rope_then_liger"):
        run = scenarios[key]
        _liger_in_place(run.objects())
        assert run.objects()["LlamaModel.forward"] == FTSHIMS_ON_MODEL, run.objects()  # ftshims' own targets
        after = run.objects(after_revert=True)
        _liger_in_place(after)
        assert after["LlamaModel.forward"] == "transformers", after


def test_rope_shim_steps_aside_when_liger_came_first(scenarios):
    """Liger first: ``rope_fused_kernel`` leaves Liger's rope alone (today: its behaviour check on fp64
    inputs does not match Liger's kernel, so the function counts as 'not a known RoPE variant')."""
    for key in ("obj_liger_then_rope", "liger_then_rope"):
        run = scenarios[key]
        assert run.objects()["modeling_llama.apply_rotary_pos_emb"] == "liger"
        status = run.status("rope_fused_kernel")
        assert not any("modeling_llama.apply_rotary_pos_emb" in p for p in status["patched"]), status
        assert any("modeling_llama.apply_rotary_pos_emb" in n for n in status["notes"]), status
    run = scenarios["liger_then_rope"]
    assert run.facts["rope_fused_kernel_calls"] == {"fused": 0, "fallback": 0}
    assert clientlib.same_numbers(run.tensors["applied"]["plain"], scenarios["liger"].tensors["applied"]["plain"])


def test_rope_shim_overwritten_when_liger_came_second(scenarios):
    """ftshims first: Liger's assignment replaces ftshims' rope wrapper; Liger's kernel runs, ftshims'
    never does (0 calls), the numbers are Liger's, and revert keeps Liger's function."""
    run = scenarios["rope_then_liger"]
    assert run.objects()["modeling_llama.apply_rotary_pos_emb"] == "liger"
    assert run.facts["rope_fused_kernel_calls"] == {"fused": 0, "fallback": 0}
    assert clientlib.same_numbers(run.tensors["applied"]["plain"], scenarios["liger"].tensors["applied"]["plain"])
    assert run.objects(after_revert=True)["modeling_llama.apply_rotary_pos_emb"] == "liger"
    assert "was replaced by other code after ftshims patched it" in run.log  # the warning at revert


def test_status_reports_liger_on_the_rope_target(scenarios):
    status = scenarios["rope_then_liger"].status("rope_fused_kernel")
    assert not any("modeling_llama.apply_rotary_pos_emb" in p for p in status["patched"]), status
    text = " ".join([status["reason"]] + status["notes"]).lower()
    assert "liger" in text or "foreign" in text or "replaced" in text, status
    status = scenarios["liger_then_rope"].status("rope_fused_kernel")
    text = " ".join([status["reason"]] + status["notes"]).lower()
    assert "liger" in text or "foreign" in text or "replaced" in text, status
    for key in ("obj_liger_then_rope", "obj_rope_then_liger", "liger_then_rope", "rope_then_liger"):
        for shim, status in scenarios[key].facts["status"].items():  # Liger touches no default shim's target
            if shim != "rope_fused_kernel":
                assert not any("foreign" in n for n in status["notes"]), (key, shim, status)


def test_outputs_equal_liger_alone_vs_liger_with_ftshims(scenarios):
    """An unpacked batch: loss and every gradient bit-identical with Liger alone and Liger + ftshims,
    in both orders, and again after ``ftshims.revert()`` (Liger still working)."""
    reference = scenarios["liger"].tensors["applied"]["plain"]
    for key in ("liger_then_rope", "rope_then_liger"):
        run = scenarios[key]
        assert clientlib.same_numbers(run.tensors["applied"]["plain"], reference), (key, clientlib.gap(run.tensors["applied"]["plain"], reference))
        assert clientlib.same_numbers(run.tensors["reverted"]["plain"], reference), key
        _liger_in_place({**run.objects(after_revert=True), "modeling_llama.LlamaRMSNorm": "liger"})


def test_packing_fix_composes_with_liger(scenarios):
    """A packed batch (position_ids restart, no mask): with Liger + ftshims the examples are isolated
    exactly as with ftshims alone (to Liger's kernel rounding); Liger alone is contaminated."""
    isolated = scenarios["ftshims"].tensors["applied"]["packed"]
    contaminated = scenarios["liger"].tensors["applied"]["packed"]
    assert clientlib.gap(isolated, contaminated) > 1e-3
    for key in ("liger_then_rope", "rope_then_liger"):
        packed = scenarios[key].tensors["applied"]["packed"]
        assert clientlib.same_numbers(packed, isolated, atol=1e-5), (key, clientlib.gap(packed, isolated))
        assert clientlib.same_numbers(scenarios[key].tensors["reverted"]["packed"], contaminated), key
