"""The assertion every shim test makes: bug without the shim exactly where the registry
says so (the negative control), no bug with it, and the gate agreeing with both."""

from __future__ import annotations

import pytest

from ftshims import probing
from ftshims.report import APPLIED, NOT_NEEDED
from ftshims.spec import ProbeUnsupported


def assert_bug_and_fix(shim_id, evidence, scenario: str, expect_bug: bool = True, options=None, **probe_kwargs):
    """Run the shim's probe off and on, and assert what the registry claims.

    expect_bug: whether this scenario shows the bug on a stack inside the
    shim's range (False for scenarios that are healthy everywhere, which
    prove the shim does no harm there).
    """
    try:
        outcome = probing.compare(shim_id, options=options, **probe_kwargs)
    except ProbeUnsupported as exc:
        pytest.skip(f"scenario not expressible on this stack: {exc}")
    if outcome.affected:
        assert outcome.status.status == APPLIED, outcome.status.reason
    else:
        assert outcome.status.status == NOT_NEEDED, outcome.status.reason
    expected = outcome.affected and expect_bug
    assert outcome.without.bug == expected, (
        f"negative control: expected bug={expected} without the shim "
        f"({'in' if outcome.affected else 'outside'} range), saw: {outcome.without.detail}"
    )
    assert not outcome.with_shim.bug, f"bug still present with the shim: {outcome.with_shim.detail}"
    evidence.record(outcome, scenario, expect_bug=expect_bug)  # after the assertions; kept only if the test passes
    return outcome


def applied_or_skip(shim_id: str, *also: str):
    """``ftshims.applied(only=[shim_id, *also])``, entered; the test is skipped (and nothing stays applied) when
    ``shim_id`` is not active on this stack. The caller exits the returned context."""
    import ftshims

    context = ftshims.applied(only=[shim_id, *also])
    report = context.__enter__()
    if not report[shim_id].active:
        context.__exit__(None, None, None)
        pytest.skip(f"{shim_id} not active on this stack: {report[shim_id].reason}")
    return context
