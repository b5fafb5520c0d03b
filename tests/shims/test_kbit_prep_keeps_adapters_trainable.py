import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import tiny
from ftshims.probing import in_affected_range

SHIM = "kbit_prep_keeps_adapters_trainable"


def test_prepare_on_peft_model_keeps_lora_trainable(evidence):
    assert_bug_and_fix(SHIM, evidence, "prepare(peft_model)")


def test_prepare_before_peft_still_freezes_base():
    """The intended use is untouched: on a bare model every parameter is frozen."""
    from peft import prepare_model_for_kbit_training

    with ftshims.applied(only=[SHIM]):
        model = tiny.tiny_llama()
        with tiny.quiet():
            prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        assert not any(p.requires_grad for p in model.parameters())


def test_alias_imported_before_apply_is_patched():
    """A `from peft import ...` copy made before apply() (a user's script, a trainer module) is wrapped too."""
    from peft import prepare_model_for_kbit_training as early_copy

    import peft

    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].status == "applied"
        assert globals()["early_copy_holder"] is not early_copy
        assert peft.prepare_model_for_kbit_training is not early_copy
    assert peft.prepare_model_for_kbit_training is early_copy
    assert globals()["early_copy_holder"] is early_copy


from peft import prepare_model_for_kbit_training as early_copy_holder  # noqa: E402  (module-level alias on purpose)


def _trl_prepare_peft_model():
    trl_utils = pytest.importorskip("trl.models.utils")
    prepare = getattr(trl_utils, "prepare_peft_model", None)
    if prepare is None or "prepare_model_for_kbit_training" not in vars(trl_utils):
        pytest.skip("this TRL has no prepare_peft_model calling prepare_model_for_kbit_training")
    return prepare


def test_trl_sft_path_keeps_adapters_of_quantized_peft_model(evidence, tmp_path):
    """TRL 0.20.0–0.23.0 prepare_peft_model(quantized PeftModel, peft_config=None): adapters frozen without the shim."""
    import trl
    from packaging.version import Version

    prepare = _trl_prepare_peft_model()
    from transformers import TrainingArguments

    def run():
        model = tiny.lora(tiny.tiny_llama())
        # what bitsandbytes sets on a 4-bit model; enough to send TRL down its QLoRA branch on CPU
        model.base_model.model.is_loaded_in_4bit = True
        args = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=False, report_to=[])
        with tiny.quiet():
            model = prepare(model, None, args)
        return [n for n, p in tiny.lora_parameters(model).items() if not p.requires_grad]

    frozen_without = run()
    with ftshims.applied(only=[SHIM]) as report:
        frozen_with = run()
    trl_buggy = Version("0.20.0") <= Version(trl.__version__) < Version("0.23.1")
    affected, _ = in_affected_range(SHIM)
    assert bool(frozen_without) == (trl_buggy and affected), frozen_without
    assert not frozen_with
    # in the shim's (peft) range everywhere; the bug shows only through TRL 0.20-0.23.0's path
    evidence.record_raw(SHIM, "trl prepare_peft_model(quantized PeftModel)", affected,
                        bool(frozen_without), bool(frozen_with), report[SHIM].status, expect_bug=trl_buggy,
                        without=f"{len(frozen_without)} LoRA parameters frozen", with_shim=f"{len(frozen_with)} frozen")
