"""A shim that backports an upstream fix states what upstream changed after that fix (issue 24).

``num_items_in_batch_overcount`` copied transformers PR #46204 without its follow-up #46903 and
miscounted encoder-decoders. So every shim that backports (``fixed_in`` names a release, or
``backports`` names the fix it carries) must say which fix it carries, list the follow-ups (carried,
or why not) or say what was read when there are none, cite them in ``refs``, and repeat the same
statements in a "Follow-ups:" paragraph of its module docstring, where a reader of the code sees them.
"""

from __future__ import annotations

import re

import pytest

from ftshims import registry
from ftshims.spec import FollowUp, ShimSpec

IDS = registry.ids()
_GITHUB = re.compile(r"^https://github\.com/([^/]+)/([^/]+)/(?:pull|issues)/(\d+)$")


def is_backport(spec: ShimSpec) -> bool:
    return bool(spec.fixed_in) or bool(spec.backports)


def _flat(text: str) -> str:
    return " ".join(text.split())


def follow_ups_paragraph(doc: str) -> str:
    """The docstring paragraph (up to the next blank line) that starts with "Follow-ups:", whitespace-flattened."""
    paragraphs = re.split(r"\n\s*\n", doc or "")
    found = [p for p in paragraphs if p.lstrip().startswith("Follow-ups:")]
    return _flat(found[0]) if found else ""


def spellings(statement: str, ref: str):
    """The statement as written, and with a GitHub PR/issue URL shortened to #N, repo#N or owner/repo#N."""
    yield statement
    match = _GITHUB.match(ref)
    if match:
        owner, repo, number = match.groups()
        for short in (f"#{number}", f"{repo}#{number}", f"{owner}/{repo}#{number}"):
            yield short + statement[len(ref):]


def problems(spec: ShimSpec, doc: str) -> list:
    """What is missing for ``spec`` (with module docstring ``doc``) to state its follow-ups; empty when nothing is."""
    if not is_backport(spec):
        if spec.follow_ups or spec.follow_ups_checked:
            return ["follow-ups without backports=: name the upstream fix they follow"]
        return []
    found = []
    if not spec.backports:
        found.append(f"fixed_in={dict(spec.fixed_in)} but no backports=: cite the upstream fix the shim carries "
                     "(or, when its fix differs, the upstream fix anyway, and say how it differs in follow_ups_checked=)")
    if not (spec.follow_ups or spec.follow_ups_checked):
        found.append("no follow_ups= and no follow_ups_checked=: say what upstream changed after the fix, or what "
                     "was read when nothing did")
    for ref in list(spec.backports) + [f.ref for f in spec.follow_ups]:
        if ref not in spec.refs:
            found.append(f"{ref} is not in refs=")
    paragraph = follow_ups_paragraph(doc)
    if not paragraph:
        found.append('the module docstring has no "Follow-ups:" paragraph')
        return found
    for follow_up in spec.follow_ups:
        statement = _flat(follow_up.statement)
        if not any(_flat(s) in paragraph for s in spellings(statement, follow_up.ref)):
            found.append(f'the "Follow-ups:" paragraph does not state: {statement}')
    if spec.follow_ups_checked and _flat(spec.follow_ups_checked) not in paragraph:
        found.append(f'the "Follow-ups:" paragraph does not state what was read: {spec.follow_ups_checked}')
    return found


@pytest.mark.parametrize("shim_id", IDS)
def test_backport_states_its_follow_ups(shim_id):
    shim = registry.get(shim_id)
    assert problems(shim.spec, shim.module.__doc__) == [], shim_id


def test_the_num_items_lesson_is_recorded():
    spec = registry.get("num_items_in_batch_overcount").spec
    assert [f.ref for f in spec.follow_ups if f.carried] == ["https://github.com/huggingface/transformers/pull/46903"]


# --- the checker itself: each omission is named --------------------------------------------------------------

PR = "https://github.com/huggingface/transformers/pull/1"
LATER = "https://github.com/huggingface/transformers/pull/2"


def _spec(**overrides) -> ShimSpec:
    """A valid fake spec with ``overrides`` set afterwards (ShimSpec itself refuses some of the omissions)."""
    spec = ShimSpec(id="fake", title="t", symptom="s", requires={"transformers": ">=4"}, fixed_in={"transformers": "5"},
                    refs=(PR, LATER), targets=(), modules=("transformers",), why="w", backports=(PR,),
                    follow_ups=(FollowUp(LATER, "encoder-decoders", carried=True),))
    for name, value in overrides.items():
        object.__setattr__(spec, name, value)
    return spec


GOOD_DOC = "Title.\n\nFollow-ups: #2 (encoder-decoders) —\n  carried. More words.\n\nApplies to ..."


def test_checker_accepts_a_complete_backport():
    assert problems(_spec(), GOOD_DOC) == []
    full = "Follow-ups: https://github.com/huggingface/transformers/pull/2 (encoder-decoders) — carried."
    assert problems(_spec(), full) == []
    checked = _spec(follow_ups=(), follow_ups_checked="trainer.py read in 5.0 and 5.1: unchanged.")
    assert problems(checked, "x\n\nFollow-ups: none found; trainer.py read in 5.0 and\n5.1: unchanged.\n") == []


def test_checker_names_each_omission():
    assert any("no backports=" in p for p in problems(_spec(backports=()), GOOD_DOC))
    assert any("no follow_ups=" in p for p in problems(_spec(follow_ups=()), GOOD_DOC))
    assert any('no "Follow-ups:" paragraph' in p for p in problems(_spec(), "Title.\n\nFollow-ups are below."))
    assert any("does not state" in p for p in problems(_spec(), "x\n\nFollow-ups: #2 (encoder-decoders) — not carried."))
    stale = _spec(follow_ups=(), follow_ups_checked="read in 5.0: unchanged.")
    assert any("what was read" in p for p in problems(stale, "x\n\nFollow-ups: read in 4.9: unchanged."))
    # a statement outside the paragraph does not count
    assert problems(_spec(), "Follow-ups: see below.\n\n#2 (encoder-decoders) — carried.") != []


def test_checker_wants_backports_for_follow_ups_and_refs_for_both():
    not_a_backport = _spec(fixed_in={}, backports=())
    assert any("without backports=" in p for p in problems(not_a_backport, GOOD_DOC))
    assert problems(_spec(fixed_in={}, backports=(), follow_ups=()), "no paragraph needed") == []
    assert any(f"{LATER} is not in refs=" in p for p in problems(_spec(refs=(PR,)), GOOD_DOC))
    assert any(f"{PR} is not in refs=" in p for p in problems(_spec(refs=(LATER,)), GOOD_DOC))
