"""Every bug of the catalogue that no upstream release has fixed has an upstream-ready reproduction in
docs/upstream/<id>.md (the doctor and COMPAT_MATRIX.md link it): a standalone script of at most 40 lines that does
not import ftshims, the observed and expected numbers, the root cause with file and line, and the smallest fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ftshims import registry, verdicts

ROOT = Path(__file__).resolve().parents[2]
UNFIXED = [shim_id for shim_id, shim in registry.shims().items() if verdicts.unfixed_upstream(shim.spec)]


def test_the_live_bugs_are_known():
    """The rule in verdicts.unfixed_upstream picks the live bugs (guards and fixes with no fixed_in, in range of the
    newest pinned versions), not the ones gone upstream or the warning about packing strategies by design."""
    assert "label_smoothing_peft_unshifted" in UNFIXED
    assert "trl_completion_only_template_miss" not in UNFIXED  # the collator is gone in trl 0.20
    assert "packing_contamination_warning" not in UNFIXED and "num_items_in_batch_overcount" not in UNFIXED


@pytest.mark.parametrize("shim_id", UNFIXED)
def test_unfixed_bug_has_an_upstream_ready_reproduction(shim_id):
    path = ROOT / verdicts.upstream_report(registry.get(shim_id).spec)
    assert path.is_file(), f"{shim_id}: unfixed upstream, so {path.relative_to(ROOT)} is due (issue 22 item 3)"
    text = path.read_text(encoding="utf-8")
    scripts = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert scripts, f"{path.name}: no ```python reproduction"
    for script in scripts:
        lines = [line for line in script.splitlines() if line.strip()]
        assert len(lines) <= 40, f"{path.name}: a reproduction of {len(lines)} lines (at most 40)"
        assert not re.search(r"^\s*(import|from)\s+ftshims", script, flags=re.M), f"{path.name}: imports ftshims"
    headings = [h.lower() for h in re.findall(r"^## (.+)$", text, flags=re.M)]
    for needed in ("reproduction", "observed", "root cause", "fix"):
        assert any(needed in h for h in headings), f"{path.name}: no '## ...{needed}...' section ({headings})"
    cause = text[text.lower().index("## root cause"):]
    cause = cause[:cause.find("\n## ", 1)] if "\n## " in cause[1:] else cause
    assert re.search(r"\.py\b", cause) and re.search(r"(lines?|\.py:)\s*\d", cause, flags=re.I), (
        f"{path.name}: the root cause names the file and the line(s) in the released source")
