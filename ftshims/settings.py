"""Every setting, checked in one place, whether it comes from ``apply()`` or from an ``FTSHIMS_*`` variable.

``apply()`` calls :func:`check_arguments` and :func:`shim_options` before it
installs anything, the start-up hook (:mod:`ftshims.auto`) parses
``FTSHIMS_AUTO`` with :func:`parse_auto`, and the doctor lists what is wrong
with :func:`environment_problems`, which calls the same functions. A bad value
is a one-line ``ValueError`` naming the setting, what was given, what is
allowed, and the closest allowed value. The grammar (README.md, "Environment
variables"):

* shim ids (``only``/``exclude``/``include``, the keys of ``options``,
  ``FTSHIMS_DISABLE``) are case-insensitive and ``-`` stands for ``_``;
* ``FTSHIMS_DISABLE``: ids separated by commas and/or whitespace; ``*`` or
  ``all`` means every shim; empty means none;
* ``FTSHIMS_AUTO``: ``0``/``false``/``no``/``off`` or empty: off;
  ``1``/``true``/``yes``/``on``: the defaults; a JSON object whose keys are
  ``apply()`` keywords (``only``, ``exclude``, ``include``, ``options``,
  ``strict``, ``release``): those. Unset, an explicit ``import ftshims.auto`` applies the
  defaults;
* ``FTSHIMS_MONITOR``: off or on as ``FTSHIMS_AUTO``, or a JSON object of
  ``ftshims.monitor.callback()`` options; ``FTSHIMS_MONITOR_LOG``: a file path
  whose directory exists;
* option values, and the variables that supply them when ``apply()`` does not
  (``FTSHIMS_MAX_POSITIONS_POLICY``, ``FTSHIMS_ROTARY_BACKEND``), are declared
  in each shim's ``ShimSpec.choices``; an empty variable counts as unset.

Importing this module imports nothing heavy (the registry is loaded on use):
the start-up hook imports it in every process where ``FTSHIMS_AUTO`` is set.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

# The error format and the monitor's log path live in _setting_base, which the monitor's options import too:
# settings -> monitor.options -> _setting_base, one way (the names stay importable from here).
from ._setting_base import MONITOR_LOG_ENV, invalid, parse_monitor_log  # noqa: F401 (re-exported)

DISABLE_ENV = "FTSHIMS_DISABLE"
AUTO_ENV = "FTSHIMS_AUTO"
AUTO_KEYS = ("only", "exclude", "include", "options", "strict", "release")
AUTO_OFF = ("", "0", "false", "no", "off")
AUTO_ON = ("1", "true", "yes", "on")
EVERY_SHIM = ("*", "all")
SUMMARY_ENV = "FTSHIMS_SUMMARY"
# The rotary kernel's backend (ftshims.kernels.rotary reads it at each call; the rotary shims declare
# it): here, so that declaring it imports nothing of the kernel.
ROTARY_BACKEND_ENV = "FTSHIMS_ROTARY_BACKEND"
ROTARY_BACKENDS = ("auto", "cpu", "cuda", "reference")
# The training health monitor (ftshims.monitor): attach it to every Trainer, and where its JSON lines go.
MONITOR_ENV = "FTSHIMS_MONITOR"
# The drift canary's download folder (ftshims.canary; default: the user's cache directory).
CANARY_CACHE_ENV = "FTSHIMS_CANARY_CACHE"


def check_value(setting: str, value: Any, choice) -> Any:
    """``value`` if ``choice`` (a :class:`ftshims.spec.Choice`) accepts it, in the spelling it lists; else ValueError."""
    if choice.type is not None:
        # bool is an int to isinstance, but True is never meant as a count
        if isinstance(value, choice.type) and not (isinstance(value, bool) and choice.type is not bool):
            return value
        raise invalid(setting, value, f"got {value!r} ({type(value).__name__})", [f"any {choice.type.__name__}"])
    for allowed in choice.values:
        if isinstance(allowed, str) and isinstance(value, str) and value.strip().lower() == allowed.lower():
            return allowed
        if not isinstance(allowed, str) and value == allowed:
            return allowed
    raise invalid(setting, value, f"got {value!r}", choice.values)


# ---------------------------------------------------------------------------
# shim ids


def known_ids() -> Tuple[str, ...]:
    from . import registry

    return registry.ids() + tuple(i for i in registry.load_errors() if i not in registry.ids())


def canonical_id(name: str) -> str:
    """The registry's spelling of a shim id: case-insensitive, ``-`` for ``_``."""
    return name.strip().lower().replace("-", "_")


def check_ids(names: Any, setting: str) -> Optional[Set[str]]:
    """The shim ids in ``names`` (a string or an iterable of strings) in canonical form; None stays None."""
    if names is None:
        return None
    if isinstance(names, str):
        names = [names]
    known = known_ids()
    if not isinstance(names, Iterable):
        raise invalid(setting, names, f"expected a list of shim ids, got {names!r}", known)
    chosen = set()
    for name in names:
        if not isinstance(name, str) or canonical_id(name) not in known:
            raise invalid(setting, canonical_id(str(name)), f"unknown shim id {name!r}", known)
        chosen.add(canonical_id(name))
    return chosen


def parse_disable(raw: Optional[str] = None) -> Set[str]:
    """The shim ids ``FTSHIMS_DISABLE`` turns off (read from the environment when ``raw`` is None)."""
    raw = os.environ.get(DISABLE_ENV, "") if raw is None else raw
    tokens = raw.replace(",", " ").split()  # commas and/or any whitespace separate ids
    known = known_ids()
    if any(t.lower() in EVERY_SHIM for t in tokens):
        return set(known)
    disabled = set()
    for token in tokens:
        if canonical_id(token) not in known:
            raise invalid(f"{DISABLE_ENV}={raw!r}", canonical_id(token), f"unknown shim id {token!r}", known + EVERY_SHIM)
        disabled.add(canonical_id(token))
    return disabled


# ---------------------------------------------------------------------------
# options


def _specs() -> Dict[str, Any]:
    from . import registry

    return {shim_id: shim.spec for shim_id, shim in registry.shims().items()}


def shim_options(spec, given: Any, environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """``spec.options`` updated with ``given`` (this shim's ``apply()`` options), every value checked.

    With ``environ``, every setting's variable (``Choice.env``) that is set
    is checked the same way; an option that ``given`` leaves at its default
    takes the variable's value, an environment-only setting is just checked
    (its user reads the variable itself).
    """
    where = f"options[{spec.id!r}]"
    if not isinstance(given, Mapping):
        raise invalid(where, given, f"expected a dict of options, got {given!r}", list(spec.options))
    merged = dict(spec.options)
    for key, value in given.items():
        if key not in spec.options:
            raise invalid(where, key, f"unknown key {key!r}", list(spec.options))
        if value != spec.options[key]:  # the default (None: "not set") is always allowed
            merged[key] = check_value(f"{where}[{key!r}]", value, spec.choices[key])
    for name, choice in spec.choices.items():
        raw = (environ or {}).get(choice.env, "").strip() if choice.env else ""
        if not raw:
            continue
        value = check_value(choice.env, raw, choice)  # checked even when apply()'s value wins: never ignored silently
        if name in spec.options and merged[name] == spec.options[name]:
            merged[name] = value
    return merged


def check_release(release: Any, setting: str = "release") -> Optional[str]:
    """The full ftshims release a pin names (``"0.1"`` -> ``"0.1.0"``), None for no pin; ValueError for an unknown one."""
    if release is None:
        return None
    from .releases import RELEASES, normalize

    try:
        return normalize(release)
    except ValueError:
        raise invalid(setting, release, f"unknown ftshims release {release!r}", RELEASES) from None


def check_arguments(only=None, exclude=None, include=None, options=None) -> Tuple[Any, Any, Any, Dict[str, Dict[str, Any]]]:
    """``apply()``'s keywords checked: ``(only, exclude, include, options)`` with canonical ids.

    Every option value given is checked here, for every shim named, selected
    or not; the variables behind options are checked by :func:`shim_options`
    for the shims ``apply()`` is about to install.
    """
    only_set = check_ids(only, "only")
    exclude_set = check_ids(exclude, "exclude")
    include_set = check_ids(include, "include")
    if options is not None and not isinstance(options, Mapping):
        raise invalid("options", options, f"expected {{shim_id: {{option: value}}}}, got {options!r}", known_ids())
    specs = _specs()
    checked: Dict[str, Dict[str, Any]] = {}
    for name, given in (options or {}).items():
        (shim_id,) = check_ids([name], "options")
        if shim_id in specs:
            shim_options(specs[shim_id], given)
        checked[shim_id] = dict(given)
    return only_set, exclude_set, include_set, checked


# ---------------------------------------------------------------------------
# FTSHIMS_AUTO


def parse_auto(raw: Optional[str]) -> Optional[Dict[str, Any]]:
    """``FTSHIMS_AUTO``: None when off, else the ``apply()`` keywords (``{}``: the defaults).

    ``raw`` None (unset) means the defaults: only an explicit ``import
    ftshims.auto`` gets there, the start-up hook imports it only when set.
    """
    if raw is None:
        return {}
    text = raw.strip()
    if text.lower() in AUTO_OFF:
        return None
    if text.lower() in AUTO_ON:
        return {}
    expected = "0/false/no/off, 1/true/yes/on, or a JSON object of apply() keywords"
    if not text.startswith("{"):
        raise invalid(f"{AUTO_ENV}={raw!r}", text, f"expected {expected}", AUTO_OFF[1:] + AUTO_ON + ("{...}",))
    import json

    try:
        arguments = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{AUTO_ENV}={raw!r}: not valid JSON ({exc}); expected {expected}") from None
    for key in arguments:
        if key not in AUTO_KEYS:
            raise invalid(f"{AUTO_ENV}={raw!r}", key, f"unknown key {key!r}", AUTO_KEYS)
    if not isinstance(arguments.get("strict", False), bool):
        raise invalid(f"{AUTO_ENV}={raw!r}", arguments["strict"], f"strict must be true or false, got {arguments['strict']!r}", ("true", "false"))
    return arguments


def parse_summary(raw: Optional[str] = None) -> bool:
    """``FTSHIMS_SUMMARY``: print ``ftshims.summary()`` at exit (rank 0): 0/false/no/off or empty, 1/true/yes/on."""
    raw = os.environ.get(SUMMARY_ENV, "") if raw is None else raw
    text = raw.strip().lower()
    if text in AUTO_OFF:
        return False
    if text in AUTO_ON:
        return True
    raise invalid(f"{SUMMARY_ENV}={raw!r}", text, "expected 0/false/no/off or 1/true/yes/on", AUTO_OFF[1:] + AUTO_ON)


def parse_monitor(raw: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """``FTSHIMS_MONITOR``: None when off (unset, empty, 0/false/no/off), else the monitor's options, checked
    (``{}`` for 1/true/yes/on; a JSON object of ``ftshims.monitor.callback()`` options)."""
    raw = os.environ.get(MONITOR_ENV, "") if raw is None else raw
    text = raw.strip()
    if text.lower() in AUTO_OFF:
        return None
    if text.lower() in AUTO_ON:
        return {}
    expected = "0/false/no/off, 1/true/yes/on, or a JSON object of monitor options"
    if not text.startswith("{"):
        raise invalid(f"{MONITOR_ENV}={raw!r}", text, f"expected {expected}", AUTO_OFF[1:] + AUTO_ON + ("{...}",))
    import json

    try:
        given = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{MONITOR_ENV}={raw!r}: not valid JSON ({exc}); expected {expected}") from None
    from .monitor import options  # light: the monitor's option table, no torch

    options.check(given, source=f"{MONITOR_ENV}={raw!r}")
    return given


def parse_canary_cache(raw: Optional[str] = None) -> Optional[str]:
    """``FTSHIMS_CANARY_CACHE``: the folder the drift canary downloads releases into (created on use), or None
    (unset or empty: ``$XDG_CACHE_HOME/ftshims/canary``, else ``~/.cache/ftshims/canary``). It must not be an
    existing file."""
    raw = os.environ.get(CANARY_CACHE_ENV, "") if raw is None else raw
    text = raw.strip()
    if not text:
        return None
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(path) and not os.path.isdir(path):
        raise invalid(f"{CANARY_CACHE_ENV}={raw!r}", text, "is a file, not a directory", ["a directory (created on use)"])
    return path


# ---------------------------------------------------------------------------
# the doctor's view


def environment_problems(environ: Optional[Mapping[str, str]] = None) -> List[Dict[str, str]]:
    """Every ``FTSHIMS_*`` variable that ``apply()`` or the start-up hook would reject: ``[{"variable", "message"}]``.

    Unlike ``apply()``, which checks the variables of the shims it installs,
    this checks every declared variable, so a typo shows before it matters.
    """
    environ = os.environ if environ is None else environ
    problems: List[Dict[str, str]] = []

    def check(variable: str, step) -> None:
        try:
            step()
        except ValueError as exc:
            problems.append({"variable": variable, "message": " ".join(str(exc).split())})

    check(DISABLE_ENV, lambda: parse_disable(environ.get(DISABLE_ENV, "")))
    check(SUMMARY_ENV, lambda: parse_summary(environ.get(SUMMARY_ENV, "")))
    check(MONITOR_ENV, lambda: parse_monitor(environ.get(MONITOR_ENV, "")))
    check(MONITOR_LOG_ENV, lambda: parse_monitor_log(environ.get(MONITOR_LOG_ENV, "")))
    check(CANARY_CACHE_ENV, lambda: parse_canary_cache(environ.get(CANARY_CACHE_ENV, "")))
    if AUTO_ENV in environ:
        def check_auto() -> None:
            arguments = parse_auto(environ[AUTO_ENV]) or {}
            check_arguments(**{k: v for k, v in arguments.items() if k not in ("strict", "release")})
            check_release(arguments.get("release"), f"{AUTO_ENV} release")

        check(AUTO_ENV, check_auto)
    seen = set()
    for spec in _specs().values():
        for choice in spec.choices.values():
            if choice.env and choice.env not in seen:
                seen.add(choice.env)
                check(choice.env, lambda: shim_options(spec, {}, {choice.env: environ.get(choice.env, "")}))
    return problems
