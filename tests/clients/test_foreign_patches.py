"""Fake foreign patchers on ftshims' own targets, before and after ``ftshims.apply()`` (transformers 4.57.6).

* ``fake_unsloth`` replaces ``LlamaModel.forward`` (the target of ``custom_4d_mask_format`` and
  ``flash_attn_packing``; ``packing_block_mask`` acts in ``masking_utils`` on 4.53+) by a re-implementation
  that never calls what it replaced, the way unsloth's ``LlamaModel_fast_forward`` does (it still builds its
  masks through ``masking_utils``, as transformers' forward does);
* ``fake_axolotl`` re-registers ``masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]`` (the item
  ``expand_mask_clamp`` wraps) with a wrapper of whatever was there, the way axolotl 0.19's
  ``sdpa_varlen`` mask patch does (``axolotl/monkeypatch/attention/sdpa_varlen.py``, on CUDA fp16/bf16
  with ``sample_packing``).

LLaMA-Factory's instance-level ``gradient_checkpointing_enable`` is tested for real in
``test_llamafactory.py``; Liger in ``test_liger.py``. Each scenario is a fresh process
(``foreign_scenario.py``); numbers are the loss and all gradients of a tiny Llama (sdpa, fp32) on an
unpacked and on a packed batch.
"""

from __future__ import annotations

import pytest

import clientlib

clientlib.require("transformers", "transformers")

pytestmark = pytest.mark.slow

FTSHIMS_ON = "ftshims:flash_attn_packing(ftshims:custom_4d_mask_format({}))"

SPECS = {
    "ftshims": {"steps": "ftshims", "forward": True},
    "unsloth_then_ftshims": {"steps": "fake_unsloth,ftshims", "forward": True},
    "ftshims_then_unsloth": {"steps": "ftshims,fake_unsloth", "forward": True},
    "axolotl_then_ftshims": {"steps": "fake_axolotl,ftshims", "forward": True},
    "ftshims_then_axolotl": {"steps": "ftshims,fake_axolotl", "forward": True},
}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("foreign")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    weights = root / "weights.pt"
    torch.save(LlamaForCausalLM(config).state_dict(), weights)
    return clientlib.run_scenarios(SPECS, root, weights)


def test_model_forward_patched_before_ftshims_composes(scenarios):
    """Foreign patch first: ftshims wraps it; the foreign code runs, packed examples are isolated as
    with ftshims alone, and ``revert()`` puts the foreign function back (not transformers')."""
    run = scenarios["unsloth_then_ftshims"]
    assert run.objects()["LlamaModel.forward"] == FTSHIMS_ON.format("fake_unsloth")
    assert run.facts["calls"]["fake_unsloth"] == 2  # the plain and the packed forward
    isolated = scenarios["ftshims"].tensors["applied"]
    assert clientlib.same_numbers(run.tensors["applied"]["packed"], isolated["packed"])
    assert clientlib.same_numbers(run.tensors["applied"]["plain"], isolated["plain"])
    assert run.objects(after_revert=True)["LlamaModel.forward"] == "fake_unsloth"
    assert clientlib.gap(run.tensors["reverted"]["packed"], isolated["packed"]) > 1e-3  # contaminated again


def test_model_forward_replaced_after_ftshims_is_left_alone(scenarios):
    """Foreign replacement second: it takes the slot, ftshims' wrappers on it are off the call path, and
    ``revert()`` does not undo the foreign patch (it warns instead). The packed examples stay isolated all the
    same: packing_block_mask acts where the masks are built (masking_utils), which the foreign forward calls."""
    run = scenarios["ftshims_then_unsloth"]
    contaminated = scenarios["unsloth_then_ftshims"].tensors["reverted"]["packed"]  # fake_unsloth alone
    isolated = scenarios["ftshims"].tensors["applied"]["packed"]
    assert run.objects()["LlamaModel.forward"] == "fake_unsloth"
    assert run.facts["calls"]["fake_unsloth"] == 2
    assert clientlib.same_numbers(run.tensors["applied"]["packed"], isolated)
    assert clientlib.gap(contaminated, isolated) > 1e-3
    assert run.objects(after_revert=True)["LlamaModel.forward"] == "fake_unsloth"
    assert "LlamaModel.forward was replaced by other code after ftshims patched it" in run.log


def test_status_reports_model_forward_taken_over(scenarios):
    """Foreign replacement after ftshims: status() no longer lists the slot as patched and says who took it."""
    for shim in ("custom_4d_mask_format", "flash_attn_packing"):
        status = scenarios["ftshims_then_unsloth"].status(shim)
        assert "LlamaModel.forward" not in status["patched"], (shim, status)
        notes = [n for n in status["notes"] if n.startswith("LlamaModel.forward was replaced by foreign code")]
        assert notes and "fast_forward" in notes[0] and "no longer called" in notes[0], (shim, status)


def test_status_reports_foreign_code_it_composes_with(scenarios):
    """Foreign patch before ftshims: the wrapper composes (numbers above) and status() says so."""
    for shim in ("custom_4d_mask_format", "flash_attn_packing"):
        status = scenarios["unsloth_then_ftshims"].status(shim)
        assert "LlamaModel.forward" in status["patched"], (shim, status)
        assert any("LlamaModel.forward already held foreign code" in n and "fast_forward" in n and "composes" in n
                   for n in status["notes"]), (shim, status)
    status = scenarios["ftshims"].status("packing_block_mask")
    assert not any("foreign" in n for n in status["notes"]), status  # no false alarm on transformers' own code
    first = scenarios["axolotl_then_ftshims"].status("expand_mask_clamp")
    assert any("already held foreign code" in n and "mask_wrapper" in n for n in first["notes"]), first
    second = scenarios["ftshims_then_axolotl"].status("expand_mask_clamp")
    assert any("replaced by foreign code" in n and "still runs inside it" in n for n in second["notes"]), second


def test_mask_registry_composes_in_both_orders(scenarios):
    """Both orders nest the two wrappers, both run, the numbers equal ftshims alone, and ``revert()``
    leaves the foreign registration (ftshims' layer inside it turns into a pass-through)."""
    reference = scenarios["ftshims"].tensors["applied"]
    key = "ALL_MASK_ATTENTION_FUNCTIONS['sdpa']"
    first = scenarios["axolotl_then_ftshims"]
    assert first.objects()[key] == "ftshims:expand_mask_clamp(fake_axolotl(transformers))"
    assert first.objects(after_revert=True)[key] == "fake_axolotl(transformers)"
    second = scenarios["ftshims_then_axolotl"]
    assert second.objects()[key] == "fake_axolotl(ftshims:expand_mask_clamp(transformers))"
    assert second.objects(after_revert=True)[key] == "fake_axolotl(ftshims:expand_mask_clamp(transformers))"
    assert "was replaced by other code after ftshims patched it" in second.log
    for run in (first, second):
        assert run.facts["calls"]["fake_axolotl"] >= 1
        for batch in ("plain", "packed"):
            assert clientlib.same_numbers(run.tensors["applied"][batch], reference[batch]), (run.steps, batch)
