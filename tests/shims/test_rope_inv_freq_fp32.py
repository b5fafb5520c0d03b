import pytest
from tests.shimcheck import assert_bug_and_fix

from ftshims.versions import in_range, installed_version

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SHIM = "rope_inv_freq_fp32"
TF = installed_version("transformers")
# Up to 4.37 the cos/sin tables are built at init in fp32 and survive the cast (bf16 rounding only)
# as long as the sequence fits the table; from 4.38 cos/sin are recomputed from inv_freq every call.
RECOMPUTES_EVERY_CALL = in_range(TF, ">=4.38")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_within_table(evidence, dtype):
    assert_bug_and_fix(SHIM, evidence, f"within_table/{dtype}", expect_bug=RECOMPUTES_EVERY_CALL, case="within_table", dtype=dtype)


def test_beyond_table(evidence):
    assert_bug_and_fix(SHIM, evidence, "beyond_table/bfloat16", expect_bug=True, case="beyond_table")


def test_no_cast_is_healthy(evidence):
    assert_bug_and_fix(SHIM, evidence, "no_cast", expect_bug=False, case="no_cast")


def _model(max_pos=4096):
    from ftshims import tiny

    return tiny.tiny_llama(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=1, max_position_embeddings=max_pos,
    )


def test_error_figures_drop_to_bf16_rounding():
    """The issue's numbers: ~0.7 (4.38+) without the shim, bf16 rounding (< 2**-8) with it."""
    import ftshims
    from ftshims.shims.rope_inv_freq_fp32 import rope_error

    model = _model().to(torch.bfloat16)
    before = rope_error(model)
    with ftshims.applied(only=[SHIM]):
        after = rope_error(model)
    if RECOMPUTES_EVERY_CALL:
        assert before > 0.3
    assert after < 2 ** -8
    # the buffer was restored to the exact fp32 values of an uncast model
    reference = _model()
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    reference_rotary = next(m for m in reference.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, reference_rotary.inv_freq)


def test_fp32_model_bit_identical_and_bf16_logits_closer():
    import ftshims
    from ftshims import tiny

    ids = tiny.batch(batch_size=1, seq_len=1024)["input_ids"]
    model32 = _model(max_pos=512)  # 1024 tokens: past the table on <= 4.37 too
    with torch.no_grad():
        plain32 = model32(ids).logits
        ref64 = plain32.double()  # the fp32 model has no cast buffers: the reference
        with ftshims.applied(only=[SHIM]):
            shim32 = model32(ids).logits
        assert torch.equal(plain32, shim32)
        model16 = _model(max_pos=512).to(torch.bfloat16)
        plain16 = model16(ids).logits.double()
        with ftshims.applied(only=[SHIM]):
            shim16 = model16(ids).logits.double()
    err_plain = (plain16 - ref64).abs().max().item()
    err_shim = (shim16 - ref64).abs().max().item()
    assert err_shim < err_plain, (err_shim, err_plain)


def test_unverifiable_buffer_is_left_alone():
    """A buffer no fp32 source reproduces (here: hand-edited) is not replaced, and the reason is recorded."""
    import ftshims
    from ftshims import _manager
    from ftshims.shims.rope_inv_freq_fp32 import restore_fp32_inv_freq

    model = _model().to(torch.bfloat16)
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    rotary.inv_freq = rotary.inv_freq * 1.5
    edited = rotary.inv_freq.clone()
    assert restore_fp32_inv_freq(rotary)  # a problem is reported
    assert torch.equal(rotary.inv_freq, edited)
    with ftshims.applied(only=[SHIM]):
        _ = rotary(torch.zeros(1, 1, 4, 128, dtype=torch.bfloat16), torch.arange(4)[None]) if "position_ids" in str(
            __import__("inspect").signature(type(rotary).forward)
        ) else rotary(torch.zeros(1, 1, 4, 128, dtype=torch.bfloat16), seq_len=4)
        assert any("no fp32 source" in note for note in _manager.notes(SHIM))
    assert torch.equal(rotary.inv_freq, edited)


def test_revert_restores_original_forward():
    import ftshims
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRotaryEmbedding.__dict__["forward"]
    ftshims.apply(only=[SHIM])
    assert modeling_llama.LlamaRotaryEmbedding.__dict__["forward"] is not original
    ftshims.revert(only=[SHIM])
    assert modeling_llama.LlamaRotaryEmbedding.__dict__["forward"] is original


def test_applied_before_transformers_is_imported():
    """The usual order: ftshims.apply() first, then the model code is imported (deferred install)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import ftshims; ftshims.apply(only=['rope_inv_freq_fp32']);"
        "import torch; from ftshims import tiny; from ftshims.shims.rope_inv_freq_fp32 import rope_error;"
        "m = tiny.tiny_llama(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,"
        " num_hidden_layers=1, max_position_embeddings=4096).to(torch.bfloat16);"
        "print('ERROR', rope_error(m))"
    )
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=600,
                         env=dict(__import__("os").environ, PYTHONPATH=repo))
    assert out.returncode == 0, out.stderr[-2000:]
    error = float(out.stdout.split("ERROR")[-1])
    assert error < 2 ** -8, out.stdout


def test_model_cast_before_apply_is_repaired_at_its_first_forward():
    """apply() after model.to(bfloat16): no cast happens under the shim, so the forward check repairs it."""
    import ftshims
    from ftshims import tiny
    from ftshims.probing import in_affected_range
    from ftshims.shims.rope_inv_freq_fp32 import THRESHOLD, rope_error

    torch = pytest.importorskip("torch")
    model = tiny.tiny_llama(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                            num_hidden_layers=1, max_position_embeddings=4096).to(torch.bfloat16)
    with tiny.quiet():
        before = rope_error(model, 4096)
    with ftshims.applied(only=["rope_inv_freq_fp32"]):
        with tiny.quiet():
            after = rope_error(model, 4096)
    if in_affected_range("rope_inv_freq_fp32")[0] and RECOMPUTES_EVERY_CALL:
        assert before > THRESHOLD, "negative control"
    assert after < THRESHOLD


def test_fp64_models_are_left_alone():
    import ftshims
    from ftshims import tiny

    torch = pytest.importorskip("torch")
    with ftshims.applied(only=["rope_inv_freq_fp32"]):
        model = tiny.tiny_llama().to(torch.float64)
        buffers = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
    assert buffers and all(b.dtype == torch.float64 for b in buffers.values())
