"""No range without a stack inside: every shim's affected range, and each versioned target's part of it, holds at
least one pinned stack that runs the suite, or the shim says in ``ShimSpec.unpinned`` why none can."""

from __future__ import annotations

import pytest

from ftshims import datafiles, registry
from ftshims.versions import in_range

# Stacks that run the whole suite (the default and the matrix); session stacks run a part of it.
SUITE_STACKS = [name for name, info in datafiles.stacks().items() if "session" not in info]


def stacks_inside(requires) -> list:
    inside = []
    for name in SUITE_STACKS:
        pins = dict(datafiles.pinned_versions(name), torch=datafiles.torch_version(name))
        if all(dist in pins and in_range(pins[dist], spec) for dist, spec in requires.items()):
            inside.append(name)
    return inside


def ranges(spec) -> list:
    """The shim's range, then each versioned target's part of it."""
    out = [("range", dict(spec.requires))]
    for target in spec.targets:
        if target.when:
            part = dict(spec.requires)
            part[target.package] = ",".join(filter(None, [spec.requires.get(target.package), target.when]))
            out.append((f"target {target.dotted} ({target.package} {target.when})", part))
    return out


@pytest.mark.parametrize("shim_id", registry.ids())
def test_every_range_has_a_pinned_stack_inside(shim_id):
    spec = registry.get(shim_id).spec
    empty = [what for what, requires in ranges(spec) if not stacks_inside(requires)]
    if spec.unpinned:
        assert empty, f"{shim_id}: says unpinned= but every range has a stack inside; drop the statement"
        return
    assert not empty, (f"{shim_id}: no pinned stack inside {'; '.join(empty)}: add one to stacks.toml, or say in the "
                       "spec (unpinned=) why none can be")


def test_the_v5_gap_has_stacks():
    """Issue 24: 5.0-5.23 is where the v5 refactors landed; a stack before the count fix (5.10.1) and one after."""
    versions = sorted(tuple(int(p) for p in datafiles.pinned_versions(name)["transformers"].split(".")[:2])
                      for name in SUITE_STACKS)
    assert any((5, 0) <= v < (5, 10) for v in versions) and any((5, 12) <= v <= (5, 20) for v in versions)


def test_compile_era_stacks_are_matrix_stacks():
    """tests/conftest.py runs the compile tests on one stack per era: each must be a stack the matrix runs."""
    from tests.conftest import COMPILE_STACKS

    assert set(COMPILE_STACKS) <= set(datafiles.matrix_stacks())
