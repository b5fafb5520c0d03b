"""Drift canary: do every shim's targets still exist, with the expected parameters, in released code?

    python -m ftshims.canary            # tracked versions (stacks.toml) + newest releases
    python -m ftshims.canary --tracked-only

For each package a shim patches, the canary fetches the released distribution
with ``pip download --no-deps`` (nothing is installed), reads the target
modules' source and checks each declared :class:`~ftshims.spec.Target`
statically with ``ast``: the class/function exists (following one level of
``from x import name`` re-exports and base classes defined in the same
package) and accepts the declared parameters. A target only counts on versions
inside the shim's range and the target's own ``when`` range.

The monitor's attach points (``ftshims.monitor.core.ATTACH_POINTS``: the clipping path whose return value is
the gradient norm, the callback events, DeepSpeed's global norm) are checked the same way, reported as
``monitor``, on every release their ``when`` range covers; some must also still *mention* a name (the
Trainer's class a ``clip_grad_norm_``, the ZeRO optimizers' ``step`` the ``_global_grad_norm`` it sets).

A drifted target on a tracked version (one the pinned matrix tests) is an
error; on the newest release it is reported as "needs attention": the shim
would be skipped there with "target missing".
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from . import registry
from .versions import in_range


def cache_dir() -> Path:
    """Where downloaded releases are kept: ``FTSHIMS_CANARY_CACHE`` if set, else the user's cache directory
    (``$XDG_CACHE_HOME/ftshims/canary``, else ``~/.cache/ftshims/canary``). Never inside the package:
    an installed ftshims lives in site-packages."""
    from .settings import parse_canary_cache

    chosen = parse_canary_cache()  # ValueError for a path that is a file
    if chosen:
        return Path(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"  # the XDG spec ignores relative paths
    return base / "ftshims" / "canary"


@dataclass
class Finding:
    shim_id: str
    package: str
    version: str
    tracked: bool
    target: str
    ok: bool
    detail: str


# -- fetching ---------------------------------------------------------------


def _pip() -> List[str]:
    """A pip command line: this interpreter's pip, else the first pip on PATH (uv venvs have none)."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    for name in ("pip3", "pip"):
        found = shutil.which(name)
        if found:
            return [found]
    raise RuntimeError("no pip found to download releases with")


def _download(package: str, version: Optional[str], cache: Path) -> Path:
    """Path of the downloaded wheel or sdist of ``package==version`` (newest when None)."""
    cache.mkdir(parents=True, exist_ok=True)
    normal = package.replace("-", "_").lower()
    if version is not None:
        for path in cache.iterdir():
            name = path.name.lower().replace("-", "_")
            if name.startswith(f"{normal}_{version}".lower()) or name.startswith(f"{normal}-{version}".lower()):
                return path
    requirement = f"{package}=={version}" if version else package
    before = set(cache.iterdir())
    command = _pip() + ["download", "--no-deps", "-q", "-d", str(cache), requirement]
    env = None
    if package == "flash-attn":
        # Its PyPI wheels are build-specific; the sdist has the Python files. Its setup.py imports torch
        # even to list build requirements, so pip must use this environment (which has torch) rather
        # than an isolated one, and must not start a CUDA build.
        command[-1:-1] = ["--no-binary", ":all:", "--no-build-isolation"]
        env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed: {result.stderr.strip()[-300:]}")
    new = set(cache.iterdir()) - before
    if new:
        return sorted(new)[0]
    # Already cached under a name we did not guess: pick the file pip just reported as saved or existing.
    for path in sorted(cache.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if path.name.lower().replace("-", "_").startswith(normal):
            return path
    raise RuntimeError(f"pip download {requirement} produced no file")


def _version_of(archive: Path, package: str) -> str:
    stem = archive.name
    for suffix in (".tar.gz", ".zip", ".whl"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    return stem.split("-")[1]


class Source:
    """The Python files of one downloaded distribution, read lazily."""

    def __init__(self, archive: Path):
        self.archive = archive
        self._names: Optional[Dict[str, str]] = None  # "pkg/mod.py" -> member name

    def _index(self) -> Dict[str, str]:
        if self._names is None:
            names: Dict[str, str] = {}
            for member in self._members():
                parts = member.split("/")
                # sdists nest everything under "<name>-<version>/"; strip that
                rel = "/".join(parts[1:]) if self.archive.name.endswith(".tar.gz") else member
                if rel.endswith(".py"):
                    names[rel] = member
                    if rel.startswith("src/"):
                        names[rel[4:]] = member
            self._names = names
        return self._names

    def _members(self) -> List[str]:
        if self.archive.name.endswith(".tar.gz"):
            with tarfile.open(self.archive) as tar:
                return tar.getnames()
        with zipfile.ZipFile(self.archive) as zf:
            return zf.namelist()

    def is_package(self, module: str) -> bool:
        """Whether ``module`` is a package (its source is ``__init__.py``): relative imports start there."""
        return f"{module.replace('.', '/')}/__init__.py" in self._index()

    def read(self, module: str) -> Optional[str]:
        base = module.replace(".", "/")
        index = self._index()
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            member = index.get(rel)
            if member is None:
                continue
            if self.archive.name.endswith(".tar.gz"):
                with tarfile.open(self.archive) as tar:
                    return tar.extractfile(member).read().decode("utf-8", "replace")
            with zipfile.ZipFile(self.archive) as zf:
                return zf.read(member).decode("utf-8", "replace")
        return None


# -- static lookup ------------------------------------------------------------


def _definitions(tree: ast.Module) -> Dict[str, ast.AST]:
    defs: Dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    defs[target.id] = node
        elif isinstance(node, (ast.ImportFrom,)):
            for alias in node.names:
                defs[alias.asname or alias.name] = node
        elif isinstance(node, ast.If):  # `if is_torch_available(): from x import y` and friends
            for sub in node.body + node.orelse:
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    defs.setdefault(sub.name, sub)
                elif isinstance(sub, ast.ImportFrom):
                    for alias in sub.names:
                        defs.setdefault(alias.asname or alias.name, sub)
    return defs


def _resolve_import(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    # `from .x import y` in pkg/mod.py means pkg.x, but in pkg/__init__.py it means pkg.x too: the package
    # itself is the anchor there, one level deeper than for a plain module.
    parts = module.split(".") + ([""] if is_package else [])
    base = parts[: len(parts) - node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _params(func: ast.AST) -> Tuple[str, ...]:
    args = func.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return tuple(names)


def _find(source: Source, module: str, qualname: str, depth: int = 0):
    """``(node, where)`` for ``module.qualname`` or ``(None, reason)``."""
    text = source.read(module)
    if text is None:
        return None, f"module {module} not in the distribution"
    defs = _definitions(ast.parse(text))
    head, _, rest = qualname.partition(".")
    node = defs.get(head)
    if isinstance(node, ast.ImportFrom) and depth < 3:
        real = next(a.name for a in node.names if (a.asname or a.name) == head)
        return _find(source, _resolve_import(node, module, source.is_package(module)), real + qualname[len(head):], depth + 1)
    if node is None:
        return None, f"{module}.{head} not defined"
    if not rest:
        return node, module
    if not isinstance(node, ast.ClassDef):
        return None, f"{module}.{head} is not a class"
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == rest:
            return item, module
        if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == rest for t in item.targets):
            return item, module
    # Inherited from a base class defined (or imported) in the same module: look there.
    for base in node.bases:
        if isinstance(base, ast.Name) and depth < 3:
            found, where = _find(source, module, f"{base.id}.{rest}", depth + 1)
            if found is not None:
                return found, where
    return None, f"{module}.{qualname} not defined"


def _mentioned(node: ast.AST) -> set:
    """Every attribute and variable name used inside ``node`` (a function or a class body)."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute):
            names.add(sub.attr)
        elif isinstance(sub, ast.Name):
            names.add(sub.id)
    return names


def check_target(source: Source, target, mentions: Iterable[str] = ()) -> Tuple[bool, str]:
    """Whether ``target`` exists with its parameters and, for each of ``mentions``, still uses that name."""
    node, where = _find(source, target.module, target.qualname)
    if node is None:
        return False, where
    missing = [name for name in mentions if name not in _mentioned(node)]
    if missing:
        return False, f"no longer mentions {', '.join(missing)} (in {where})"
    if target.params and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        params = _params(node)
        flexible = any(p.startswith("**") for p in params)
        missing = [p for p in target.params if p not in params]
        if missing and not flexible:
            return False, f"signature changed: no parameter {', '.join(missing)} in ({', '.join(params)})"
    return True, f"found in {where}"


# -- the run ------------------------------------------------------------------


def tracked_versions(package: str) -> List[str]:
    from .datafiles import stacks

    versions = set()
    for info in stacks().values():
        for pin in info["pins"]:
            name, _, version = pin.partition("==")
            if name == package and version:
                versions.add(version)
    return sorted(versions)


MONITOR = "monitor"  # the shim_id column of the monitor's attach points


def monitor_points() -> Dict[str, List[Tuple[object, Tuple[str, ...]]]]:
    """``{package: [(Target, mentions), ...]}`` of the monitor's attach points."""
    from .monitor.core import ATTACH_POINTS

    points: Dict[str, List[Tuple[object, Tuple[str, ...]]]] = {}
    for target, mentions in ATTACH_POINTS:
        points.setdefault(target.package, []).append((target, tuple(mentions)))
    return points


def check_monitor(source: Source, package: str, version: str, tracked: bool, points=None) -> List[Finding]:
    """The monitor's attach points in one release of ``package`` (those whose ``when`` covers ``version``)."""
    found = []
    for target, mentions in (monitor_points() if points is None else points).get(package, []):
        if target.when and not in_range(version, target.when):
            continue
        ok, detail = check_target(source, target, mentions)
        found.append(Finding(MONITOR, package, version, tracked, target.dotted, ok, detail))
    return found


def run(include_newest: bool = True, cache: Optional[Path] = None, log=print) -> List[Finding]:
    cache = cache_dir() if cache is None else Path(cache)
    findings: List[Finding] = []
    by_package: Dict[str, List] = {}
    for shim in registry.shims().values():
        for package in sorted({target.package for target in shim.spec.targets}):
            by_package.setdefault(package, []).append(shim)
    points = monitor_points()
    for package in points:
        by_package.setdefault(package, [])
    for package, shims in sorted(by_package.items()):
        versions: List[Tuple[Optional[str], bool]] = [(v, True) for v in tracked_versions(package)]
        if include_newest:
            versions.append((None, False))
        for version, tracked in versions:
            try:
                archive = _download(package, version, cache)
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                findings.append(Finding("*", package, version or "newest", tracked, "*", False, str(exc)))
                continue
            actual = version or _version_of(archive, package)
            if not tracked and actual in tracked_versions(package):
                continue  # the newest release is already tracked
            source = Source(archive)
            log(f"canary: {package} {actual}{'' if tracked else ' (newest)'}")
            for shim in shims:
                spec_range = shim.spec.requires[package]
                if not in_range(actual, spec_range):
                    continue
                for target in shim.spec.targets:
                    if target.package != package or target.when and not in_range(actual, target.when):
                        continue
                    ok, detail = check_target(source, target)
                    findings.append(Finding(shim.id, package, actual, tracked, target.dotted, ok, detail))
            findings.extend(check_monitor(source, package, actual, tracked, points))
    return findings


def report(findings: Iterable[Finding]) -> Tuple[str, int]:
    """Text report and exit code (1 when a tracked version drifted or could not be fetched)."""
    findings = list(findings)
    lines = []
    failed = 0
    for f in findings:
        if f.ok:
            continue
        severity = "ERROR" if f.tracked else "ATTENTION"
        failed += f.tracked
        lines.append(f"{severity:9} {f.shim_id}: {f.package} {f.version}: {f.target}: {f.detail}")
    ok = sum(1 for f in findings if f.ok)
    lines.append(
        f"canary: {ok} target checks passed, {sum(1 for f in findings if not f.ok)} failed "
        f"({failed} on tracked versions) across {len({(f.package, f.version) for f in findings})} releases"
    )
    return "\n".join(lines), 1 if failed else 0


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ftshims.canary", description=__doc__.splitlines()[0])
    parser.add_argument("--tracked-only", action="store_true", help="skip the newest releases")
    args = parser.parse_args(argv)
    try:
        cache = cache_dir()
    except ValueError as exc:  # FTSHIMS_CANARY_CACHE names a file
        parser.error(str(exc))
    text, code = report(run(include_newest=not args.tracked_only, cache=cache))
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
