import pytest
from tests.shimcheck import assert_bug_and_fix

SHIM = "causal_mask_buffer_regrow"


@pytest.mark.parametrize("case", ["long_mask", "long_no_mask", "generate"])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_long_inputs_past_twice_the_buffer(evidence, family, case):
    # 4.38.0-4.38.2: IndexError / size mismatch without the shim; with it, the logits of a model whose
    # buffer was large enough from the start. Elsewhere: no bug, shim not applied.
    assert_bug_and_fix(SHIM, evidence, f"{family}/{case}", family=family, case=case)
