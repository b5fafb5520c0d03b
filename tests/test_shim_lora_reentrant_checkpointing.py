import pytest
from shimcheck import assert_bug_and_fix

SHIM = "lora_reentrant_checkpointing"


@pytest.mark.parametrize("use_reentrant", [None, True, False], ids=["default", "reentrant", "non_reentrant"])
@pytest.mark.parametrize("order", ["peft_first", "checkpointing_first"])
def test_lora_grads_with_checkpointing(evidence, order, use_reentrant):
    # Only Trainer's order (PEFT first) with reentrant checkpointing loses the gradients;
    # the other cases prove the shim changes nothing where there is no bug.
    broken = order == "peft_first" and use_reentrant is not False
    assert_bug_and_fix(SHIM, evidence, f"{order}/{use_reentrant}", expect_bug=broken, order=order, use_reentrant=use_reentrant)
