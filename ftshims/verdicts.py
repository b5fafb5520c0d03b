"""The one vocabulary for what ftshims proved about a bug on a stack: ``status()``, the doctor
and COMPAT_MATRIX.md all speak it.

* **fixed** — the bug reproduced on this real stack and is gone with the shim;
* **fixed on a stand-in** — reproduced with a named CPU stand-in for a GPU kernel
  (``ShimSpec.stand_in``); GPU evidence pending;
* **guarded** — nothing wrong can be fixed: a crash or silent corruption becomes a clear error;
* **warned** — the shim only warns. Never counted as a fix;
* **absent** — the bug does not exist on this stack (the shim does not select it);
* **not run** — no evidence (nothing could run here, or it was not asked for);
* **same results** — a ``speed`` shim: same numbers with and without it;
* **mismatch** — the evidence contradicts the registry (CI fails on it).
"""

from __future__ import annotations

FIXED = "fixed"
FIXED_ON_STAND_IN = "fixed on a stand-in"
GUARDED = "guarded"
WARNED = "warned"
ABSENT = "absent"
NOT_RUN = "not run"
SAME_RESULTS = "same results"
MISMATCH = "mismatch"

VERDICTS = (FIXED, FIXED_ON_STAND_IN, GUARDED, WARNED, ABSENT, NOT_RUN, SAME_RESULTS, MISMATCH)
FIXES = (FIXED, FIXED_ON_STAND_IN)  # what the doctor, the README and the matrix count as fixes

# ShimSpec.effect: what the shim does where its bug exists
EFFECT_FIXES = "fixes"
EFFECT_GUARDS = "guards"
EFFECT_WARNS = "warns"
EFFECTS = (EFFECT_FIXES, EFFECT_GUARDS, EFFECT_WARNS)


def delivered(spec) -> str:
    """The verdict a shim's reproduced bug earns: from its declared effect, its stand-in and its kind."""
    if spec.kind == "speed":
        return SAME_RESULTS
    if spec.effect == EFFECT_GUARDS:
        return GUARDED
    if spec.effect == EFFECT_WARNS:
        return WARNED
    return FIXED_ON_STAND_IN if spec.stand_in else FIXED


UPSTREAM_REPORTS = "docs/upstream"  # in the ftshims repository: one upstream-ready reproduction per unfixed bug


def unfixed_upstream(spec) -> bool:
    """A bug no upstream release has fixed: ``fixed_in`` is empty and the shim's range takes in the newest pinned
    version of each package it names (a range that ends below it, like a collator removed upstream, is not a live
    bug). Speed shims fix no bug; a warning-only shim's "bug" is a documented design (TRL's packing strategies)."""
    if spec.kind == "speed" or spec.effect == EFFECT_WARNS or spec.fixed_in:
        return False
    from .datafiles import newest_pinned
    from .versions import in_range

    for distribution, specifier in spec.requires.items():
        newest = newest_pinned(distribution)
        if newest is not None and not in_range(newest, specifier):
            return False
    return True


def upstream_report(spec) -> str:
    """``docs/upstream/<id>.md`` for a bug unfixed upstream (the repository's upstream-ready reproduction), else ``""``."""
    return f"{UPSTREAM_REPORTS}/{spec.id}.md" if unfixed_upstream(spec) else ""
