"""packing_contamination_warning: TRL packers that keep no example boundaries say so, once."""

import warnings

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.spec import ProbeUnsupported

SHIM = "packing_contamination_warning"
module = registry.get(SHIM).module
PACKERS = ["constant_length_dataset", "pack_examples", "wrapped"]


@pytest.mark.parametrize("packer", PACKERS)
def test_contaminating_packers_warn(evidence, packer):
    assert_bug_and_fix(SHIM, evidence, packer, expect_bug=True, packer=packer)


@pytest.mark.parametrize("packer", PACKERS)
def test_one_warning_per_packer_and_data_unchanged(packer):
    from ftshims.shims import _packing

    examples = _packing.example_pair(low=len(_packing.SPECIAL))
    try:
        with _packing.quiet_datasets():
            plain = module._pack(packer, examples)
    except ProbeUnsupported as exc:
        pytest.skip(str(exc))
    with ftshims.applied(only=[SHIM]), warnings.catch_warnings(record=True) as caught, _packing.quiet_datasets():
        warnings.simplefilter("always")
        first = module._pack(packer, examples)
        second = module._pack(packer, examples)
    ours = [w for w in caught if issubclass(w.category, module.PackingContaminationWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "Fix:" in str(ours[0].message) and "attend to each other" in str(ours[0].message)
    if packer != "constant_length_dataset":  # ConstantLengthDataset shuffles its buffer
        assert plain == first == second


def test_isolating_strategy_does_not_warn():
    from ftshims.shims import _packing

    try:
        from trl.data_utils import pack_dataset
    except ImportError:
        pytest.skip("this TRL has no pack_dataset")
    import inspect

    import datasets

    strategy = inspect.signature(pack_dataset).parameters.get("strategy")
    if strategy is None:
        pytest.skip("this TRL's pack_dataset only wraps")
    dataset = datasets.Dataset.from_list([{"input_ids": e.tolist()} for e in _packing.example_pair()])
    with ftshims.applied(only=[SHIM]), warnings.catch_warnings(record=True) as caught, _packing.quiet_datasets():
        warnings.simplefilter("always")
        pack_dataset(dataset, 16, strategy=strategy.default)
    assert not [w for w in caught if issubclass(w.category, module.PackingContaminationWarning)]
