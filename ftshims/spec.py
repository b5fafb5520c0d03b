"""The declarative part of a shim: what it fixes, where, on which versions.

Every shim module in :mod:`ftshims.shims` starts with a ``SPEC = ShimSpec(...)``.
The registry, ``apply()``, the doctor, ``COMPAT_MATRIX.md`` and the drift canary
all read this object; none of them needs to import the shim's target packages
to do so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple, Type

FIX = "fix"  # corrects wrong behaviour; applied by default
OPT_IN = "opt-in"  # corrects behaviour that some runs rely on (which labels are trained); applied only when asked for
SPEED = "speed"  # same results, faster; applied only when asked for
KINDS = (FIX, OPT_IN, SPEED)


@dataclass(frozen=True)
class Target:
    """One object a shim replaces or wraps.

    ``module`` is the module that defines it and ``qualname`` the dotted path
    inside that module (``"PreTrainedModel.gradient_checkpointing_enable"``).
    ``params`` lists parameter names the shim relies on; a target without them
    counts as *changed* and the shim is skipped. ``when`` is a specifier on the
    distribution that ships ``module`` (:attr:`package`: ``trl.trainer.utils``
    -> ``trl``, ``flash_attn.layers`` -> ``flash-attn``): the target only exists
    (and is only checked) on versions inside it.
    """

    module: str
    qualname: str
    params: Tuple[str, ...] = ()
    when: Optional[str] = None
    distribution: Optional[str] = None  # what ``when`` is read against, when not the one that ships ``module``

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def package(self) -> str:
        """The distribution ``when`` is read against: ``distribution``, else the one that ships ``module``."""
        return self.distribution or self.module.split(".", 1)[0].replace("_", "-")


@dataclass(frozen=True)
class Choice:
    """What one setting of a shim accepts; ``apply()`` checks it before installing anything.

    ``values`` lists the allowed values (strings compare case-insensitively and
    are passed on in the spelling listed here), or ``type`` is the type a value
    must have. ``env`` names the environment variable that supplies the setting
    when ``apply()`` does not (an empty variable counts as unset). The
    option's default (``ShimSpec.options``) is always allowed. The one checker
    is :func:`ftshims.settings.check_value`.
    """

    values: Tuple[object, ...] = ()
    type: Optional[Type] = None
    env: Optional[str] = None


@dataclass(frozen=True)
class FollowUp:
    """What upstream changed after the fix a shim backports, and what the shim does about it.

    ``ref`` is the follow-up (a PR, a revert, a regression report or a later
    release's code at the same place), ``what`` says what it changed,
    ``carried`` whether the shim carries it, and ``reason`` why not when it
    does not (it does not apply to the versions in range, say).
    """

    ref: str
    what: str
    carried: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.ref or not self.what:
            raise ValueError("a follow-up needs ref= and what=")
        if not self.carried and not self.reason:
            raise ValueError(f"follow-up {self.ref}: not carried, so it needs reason= (why it does not apply)")

    @property
    def statement(self) -> str:
        """One line for the docstring, the matrix and the doctor: ``#46903 (encoder-decoders) — carried``."""
        return f"{self.ref} ({self.what}) — " + ("carried" if self.carried else f"not carried: {self.reason}")


@dataclass(frozen=True)
class ShimSpec:
    """The declarative description of one shim.

    ``requires`` maps distribution names to PEP 440 specifiers; the shim is
    selected only when every listed distribution is installed and inside its
    range (evaluated with ``prereleases=True``, see :mod:`ftshims.versions`).
    ``modules`` are the modules that must be imported before the patch can be
    installed; until then the shim is *deferred* behind a post-import hook.
    ``why`` says in two or three sentences why the shim exists (the matrix shows it;
    the module docstring has the full story). ``effect`` says what the shim does where its bug exists (``"fixes"``,
    ``"guards"``: a clear error instead of a crash or corruption, ``"warns"``),
    and ``stand_in`` names the CPU stand-in its evidence comes from when the
    real code needs a GPU; together they give its verdict (:mod:`ftshims.verdicts`).
    ``needs_any`` names distributions without which the bug cannot happen (flash
    attention needs flash-attn): the doctor counts a stack affected only when one
    is installed, while ``apply()`` still installs the shim (tests use stand-ins).
    ``options`` maps each option to its default; ``choices`` says what each
    option accepts (every option needs one). A ``choices`` entry that is not an
    option is a setting read only from its ``env`` variable (the rotary
    kernel's backend): ``apply()`` checks it when the shim is selected.

    ``since`` is the ftshims release that added the shim as a default, or last
    changed what it computes (:mod:`ftshims.releases`; ``apply(release=...)``
    leaves out shims newer than the pinned release). ``backports`` lists the
    upstream fixes the shim carries to older versions; each backport states
    what upstream changed after it in ``follow_ups`` (carried, or why not), or,
    when nothing changed, what was read in ``follow_ups_checked``.
    ``unpinned`` says why no pinned stack can sit inside the shim's range, when
    none can (a registry test checks every other range against stacks.toml).
    """

    id: str
    title: str
    symptom: str
    requires: Mapping[str, str]
    fixed_in: Mapping[str, str]
    refs: Tuple[str, ...]
    targets: Tuple[Target, ...]
    modules: Tuple[str, ...]
    kind: str = FIX
    why: str = ""
    effect: str = "fixes"
    stand_in: str = ""
    needs_any: Tuple[str, ...] = ()
    options: Mapping[str, object] = field(default_factory=dict)
    choices: Mapping[str, Choice] = field(default_factory=dict)
    since: str = ""
    backports: Tuple[str, ...] = ()
    follow_ups: Tuple[FollowUp, ...] = ()
    follow_ups_checked: str = ""
    unpinned: str = ""

    @property
    def changes_numerics(self) -> bool:
        """Whether applying it changes what a run computes where its bug exists (CHANGELOG.md marks it so):
        a fix does; a guard (a clear error instead of corruption), a warning and a speed shim do not."""
        return self.kind != SPEED and self.effect == "fixes"

    @property
    def by_default(self) -> bool:
        """Whether ``apply()`` installs the shim without being asked: only ``fix`` shims are."""
        return self.kind == FIX

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.id}: kind must be one of {', '.join(map(repr, KINDS))}, not {self.kind!r}")
        if self.effect not in ("fixes", "guards", "warns"):
            raise ValueError(f"{self.id}: effect must be 'fixes', 'guards' or 'warns', not {self.effect!r}")
        if not self.requires:
            raise ValueError(f"{self.id}: a shim must name the package versions it applies to")
        if not self.why:
            raise ValueError(f"{self.id}: a shim must say why it exists (why=)")
        if not self.refs:
            raise ValueError(f"{self.id}: a shim must cite at least one upstream reference")
        if not self.modules:
            raise ValueError(f"{self.id}: a shim must name the modules it patches")
        from .releases import check_release

        if self.since:  # every registered shim declares one (tests/registry/test_checklist.py); test fakes may not
            check_release(self.since, what=f"{self.id}: since=")
        if self.backports and not (self.follow_ups or self.follow_ups_checked):
            raise ValueError(f"{self.id}: a backport states its upstream follow-ups (follow_ups=, or follow_ups_checked= "
                             "saying what was read when there are none)")
        missing = [f.ref for f in self.follow_ups if f.ref not in self.refs] + [b for b in self.backports if b not in self.refs]
        if missing:
            raise ValueError(f"{self.id}: backports and follow-ups are cited in refs= too: {', '.join(missing)}")
        for target in self.targets:
            if target.when and target.package not in self.requires:
                raise ValueError(f"{self.id}: target {target.dotted} has when= on {target.package}, which requires= does not name")
        # Undeclared values would only fail at the (possibly deferred) install: declare them up front.
        undeclared = [name for name in self.options if name not in self.choices]
        if undeclared:
            raise ValueError(f"{self.id}: option(s) {', '.join(undeclared)} need a Choice in choices=")
        for name, choice in self.choices.items():
            if not choice.values and choice.type is None:
                raise ValueError(f"{self.id}: choice {name!r} must list values= or give a type=")
            if name not in self.options and not choice.env:
                raise ValueError(f"{self.id}: choice {name!r} is not an option, so it needs env=")


class TargetMissing(Exception):
    """Raised by a shim's ``install`` when a target is absent or has changed shape.

    The shim is then skipped (and anything it already patched is rolled back);
    this is an expected outcome on versions the shim was not written for, not an
    error.
    """


@dataclass(frozen=True)
class Observation:
    """What a shim's ``probe()`` saw: whether the bug happened, and the evidence in words."""

    bug: bool
    detail: str


class ProbeUnsupported(Exception):
    """Raised by a probe whose scenario cannot be expressed on the installed versions."""
