"""flash-attn's own ``tests/test_rotary.py``, from the released sdist, on CPU under Triton's interpreter, with ftshims.

Which file: only the 2.8.3 sdist ships ``tests/test_rotary.py`` (2.5.8 and
2.6.3 ship no ``tests/`` folder; ``tools/fetch_flash_attn_sources.py`` records
``null`` for them in SOURCE.json). A version whose sdist has the file runs its
own; the others run the newest released one (2.8.3's) against their own
rotary code.

How: for each version, one child pytest runs a rewritten copy of that file with
the version's released ``flash_attn`` on ``sys.path``, ``TRITON_INTERPRET=1``
and the conftest ``CHILD_CONFTEST`` below, which runs every selected case in
two configurations (an extra parameter, last in the test id):

* ``default``: ``ftshims.apply()``, made *before* the test file imports
  flash-attn (the deferred install), so the fix shim ``flash_attn_rotary`` is
  on for every case (the child checks that it was applied);
* ``kernel``: ``ftshims.apply(include=["flash_attn_rotary_kernel"])`` on top,
  for the case's duration;
* a case that fails is run again at once with every shim reverted, to tell
  a difference from a property of the rewrite.

The children of two versions run at a time (the box has two cores).

The rewrite (``REWRITES``; each pattern must occur exactly as often as listed,
so a changed upstream file stops this test instead of being half-rewritten):

* ``device = "cuda"`` -> ``"cpu"``, and ``is_sm8x`` (a CUDA capability query at
  import) -> ``True``, so bf16 runs too (the interpreter supports it);
* sizes: ``batch_size`` 32 -> 2; ``seqlen`` 217 -> 13, 512 -> 16, 781 -> 19
  (odd lengths keep the partial row blocks). Triton's interpreter takes 20-50
  ms per program: at the released sizes one case takes 1-5 minutes;
* ``from flash_attn.bert_padding import ...`` -> the test file's own release's
  ``bert_padding`` (2.8.3's ``unpad_input`` returns 5 values, 2.5.8's 4);
* ``apply_rotary_emb_qkv_(..., num_heads_q=None if not gqa else nheads)`` ->
  ``num_heads_q`` passed only for GQA: ``None`` is its default in 2.8, and
  2.5.8/2.6.3 have no such parameter (every qkv case would be a TypeError).

Not run (``_skip_reason`` in the child, reported as skipped with the reason):
``test_compilation_count`` (counts Triton JIT compilations; the interpreter
compiles nothing); GQA cases on versions without ``num_heads_q``;
``compiled=True`` in ``default`` (dynamo cannot trace flash-attn's own
Triton launch for CPU tensors: ``InternalTorchDynamoError`` at ``with
torch.cuda.device(x.device.index)``, with or without ftshims; with the kernel
shim the rotation is ftshims' ``torch.library`` op, which compiles on CPU). ``compiled=True`` in
``kernel`` runs once, with the version whose own file it is (2.8.3; each
case takes ~15 s of inductor compilation).

Subsampled (``FTSHIMS_UPSTREAM_SAMPLE``, default ``cover``): per test
function, a deterministic set of cases in which every value of every other
parameter occurs at least once (about 14 of the 216 cases per configuration);
``pairwise`` covers every pair of values, ``all`` runs everything (hours).

Expected: every selected case passes in both configurations. A case that
fails is rerun without shims; failing there too, it is a property of this
setup, listed in the summary, not a difference: Triton's CPU interpreter
truncates its fp32 -> bf16/fp16 stores (a GPU rounds to nearest), up to one
ulp off the reference, and the upstream ``atol`` (the largest rounding error
found in the reference tensor) shrinks with the reduced tensors. One bf16 qkv
case of the default sample is such a case on every version (it passed in the
``kernel`` configuration, whose kernel rounds to nearest). Any other failure must be in ``DIFFERENCES`` with the bug
fix that explains it, or this test fails. None is listed: these tests keep
every offset inside the table (``randint(0, seqlen + 1)`` against a ``2 *
seqlen`` table) and pass cos/sin in x's dtype, so no fixed bug is hit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from tests.shims.test_flash_attn_rotary import VERSIONS, missing, released_root, sources

REPO = Path(__file__).resolve().parents[2]
TEST_FILE = "tests/test_rotary.py"
CONFIGS = ("default", "kernel")
PARALLEL = 2  # children at a time

# (pattern, replacement, occurrences in 2.8.3's file)
REWRITES = (
    ('is_sm8x = torch.cuda.get_device_capability("cuda") >= (8, 0)', "is_sm8x = True  # ftshims: CPU, bf16 too", 1),
    ('device = "cuda"', 'device = "cpu"', 5),
    ("batch_size = 32", "batch_size = 2", 4),
    ("seqlen = 217", "seqlen = 13", 2),
    ("seqlen = 512", "seqlen = 16", 1),
    ("seqlen = 781", "seqlen = 19", 1),
    ("from flash_attn.bert_padding import pad_input, unpad_input", "from _upstream_bert_padding import pad_input, unpad_input", 1),
    ("num_heads_q=None if not gqa else nheads", '**({"num_heads_q": nheads} if gqa else {})', 1),
)

# (version, config, test id) -> why a difference from the released result is a bug fix. None expected (see above).
DIFFERENCES: dict = {}

CHILD_CONFTEST = '''
"""Written by tests/kernels/test_flash_attn_upstream_rotary.py: CPU launch, shims per configuration, skips, subsample."""
import itertools
import json
import os

import pytest

CONFIGS = os.environ["FTSHIMS_UPSTREAM_CONFIGS"].split(",")
SAMPLE = os.environ.get("FTSHIMS_UPSTREAM_SAMPLE", "cover")
REPORT = os.environ["FTSHIMS_UPSTREAM_REPORT"]
OWN_FILE = os.environ.get("FTSHIMS_UPSTREAM_OWN_FILE") == "1"  # the test file is this version's own
KERNEL = "flash_attn_rotary_kernel"
_CPU = None


def pytest_configure(config):
    global _CPU
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    _CPU = cpu_triton()  # flash-attn launches inside torch.cuda.device(x.device.index): a no-op for CPU tensors
    _CPU.__enter__()
    ftshims.apply()  # before the test file imports flash-attn: installed by the post-import hook


def pytest_unconfigure(config):
    if _CPU is not None:
        _CPU.__exit__(None, None, None)


def pytest_generate_tests(metafunc):
    if "ftshims_config" in metafunc.fixturenames:
        metafunc.parametrize("ftshims_config", CONFIGS, indirect=True)


@pytest.fixture(autouse=True)
def ftshims_config(request):
    import ftshims

    config = request.param
    if config == "kernel":
        report = ftshims.apply(include=[KERNEL])
        assert report[KERNEL].status == "applied", report[KERNEL].reason
    try:
        yield config
    finally:
        if config == "kernel":
            ftshims.revert(only=[KERNEL])


RERUNS = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A case failing with shims is run again at once without any: does the released code fail it too?"""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.failed:
        return
    import ftshims

    ftshims.revert()
    try:
        item.runtest()
        RERUNS[item.name] = "passed"
    except Exception as exc:  # noqa: BLE001  (the test's own failure, whatever it is)
        RERUNS[item.name] = f"failed: {type(exc).__name__}"
    finally:
        ftshims.apply()  # the default shims again (the kernel shim's fixture reverts it anyway)


def pytest_sessionfinish(session):
    data = json.load(open(REPORT)) if os.path.exists(REPORT) else {}
    data["released_reruns"] = RERUNS
    with open(REPORT, "w") as fh:
        json.dump(data, fh)


def _params(item):
    spec = getattr(item, "callspec", None)
    return dict(spec.params) if spec else {}


def _skip_reason(item):
    import inspect

    from flash_attn.layers import rotary

    params = _params(item)
    if item.originalname == "test_compilation_count":
        return "counts Triton JIT compilations: Triton's CPU interpreter compiles nothing"
    if params.get("gqa") and "num_heads_q" not in inspect.signature(rotary.apply_rotary_emb_qkv_).parameters:
        return "this flash-attn has no apply_rotary_emb_qkv_(num_heads_q=...) (GQA qkv layout)"
    if params.get("compiled") and params.get("ftshims_config") != "kernel":
        return ("torch.compile cannot trace flash-attn's own Triton launch for CPU tensors, with or without shims "
                "(dynamo: InternalTorchDynamoError at `with torch.cuda.device(x.device.index)`, index None)")
    return None


def _key(item, drop=("ftshims_config", "compiled")):
    return tuple(sorted((k, getattr(v, "__name__", None) or repr(v)) for k, v in _params(item).items() if k not in drop))


def _sample(keys, pairs):
    """A deterministic subset of parameter combinations covering every value (or every pair of values)."""
    def cover(key):
        return set(itertools.combinations(key, 2)) if pairs else set(key)

    todo = set().union(*(cover(k) for k in keys))
    chosen = []
    while todo:
        best = max(keys, key=lambda k: len(cover(k) & todo))  # the first of the best, in collection order
        chosen.append(best)
        todo -= cover(best)
    return chosen


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = _skip_reason(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
    selected = {id(i) for i in items if i.originalname == "test_compilation_count"}  # reported as skipped
    if SAMPLE == "all":
        selected = {id(i) for i in items}
    else:
        groups = {}
        for item in items:
            if not _params(item).get("compiled") and (not _skip_reason(item) or not _params(item)):
                key = _key(item)
                if key not in groups.setdefault(item.originalname, []):
                    groups[item.originalname].append(key)
        chosen = {(name, key) for name, keys in groups.items() for key in _sample(keys, SAMPLE == "pairwise")}
        compiled_once = False
        for item in items:
            params = _params(item)
            if (item.originalname, _key(item)) not in chosen:
                continue
            if params.get("compiled"):
                # one case (the first chosen with tensor offsets), with the test file's own version only:
                # inductor takes ~15 s per case
                if compiled_once or not OWN_FILE or "Tensor" not in dict(_key(item)).get("seqlen_offsets_type", ""):
                    continue
                if params.get("ftshims_config") == "kernel":
                    compiled_once = True
            selected.add(id(item))
    keep = [i for i in items if id(i) in selected]
    drop = [i for i in items if id(i) not in selected]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    import ftshims

    status = {e.id: e.status for e in ftshims.status() if e.id.startswith("flash_attn_rotary")}
    with open(REPORT, "w") as fh:
        json.dump({"configs": CONFIGS, "status": status}, fh)
'''


def _rewrite(text: str) -> str:
    for pattern, replacement, count in REWRITES:
        found = text.count(pattern)
        assert found == count, f"upstream {TEST_FILE} changed: {pattern!r} occurs {found} times, expected {count}"
        text = text.replace(pattern, f"{replacement}  # ftshims rewrite" if pattern.startswith(("batch", "seqlen")) else replacement)
    return text


def _upstream_file(version):
    """(path of the test file, version it comes from): the version's own, else the newest pinned one that has it."""
    for candidate in (version,) + tuple(reversed(VERSIONS)):
        path = sources() / f"flash_attn-{candidate}" / "upstream" / TEST_FILE
        if path.is_file():
            return path, candidate
    return None, None


def _child(workdir: Path, root: Path, configs, own_file: bool):
    tag = "-".join(configs)
    report = workdir / f"report-{tag}.json"
    junit = workdir / f"junit-{tag}.xml"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(workdir), str(root), str(REPO)]),
        TRITON_INTERPRET="1",
        FTSHIMS_UPSTREAM_CONFIGS=",".join(configs),
        FTSHIMS_UPSTREAM_REPORT=str(report),
    )
    env.pop("FTSHIMS_EVIDENCE_OUT", None)  # the child records no evidence of its own
    env["FTSHIMS_UPSTREAM_OWN_FILE"] = "1" if own_file else "0"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-W", "ignore::DeprecationWarning", "--rootdir", str(workdir), str(workdir / "test_rotary.py")]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200)
    elapsed = time.monotonic() - started
    if not junit.is_file():
        raise AssertionError(f"child pytest ({tag}) wrote no results:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            outcomes[case.get("name")] = ("failed", (failure.get("message") or "").splitlines()[0][:200])
        elif skipped is not None:
            outcomes[case.get("name")] = ("skipped", skipped.get("message") or "")
        else:
            outcomes[case.get("name")] = ("passed", "")
    data = json.loads(report.read_text()) if report.is_file() else {}
    return outcomes, data, elapsed, proc


def _config_of(name: str):
    """The configuration part of a child test id (``test_x[...-dtype0-kernel]``)."""
    parts = name.rstrip("]").partition("[")[2].split("-")
    return next((p for p in parts if p in CONFIGS), None)


def _run_version(version: str, workdir: Path):
    root = sources() / f"flash_attn-{version}"
    upstream, from_version = _upstream_file(version)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "test_rotary.py").write_text(_rewrite(upstream.read_text()))
    (workdir / "_upstream_bert_padding.py").write_text((upstream.parents[2] / "flash_attn" / "bert_padding.py").read_text())
    (workdir / "conftest.py").write_text(CHILD_CONFTEST)
    outcomes, data, elapsed, proc = _child(workdir, root, CONFIGS, own_file=from_version == version)
    return from_version, outcomes, data, elapsed, proc


@pytest.fixture(scope="module")
def upstream_runs(tmp_path_factory):
    """Start every version's child now, PARALLEL at a time; each test waits for its own."""
    from concurrent.futures import ThreadPoolExecutor

    runnable = [v for v in VERSIONS if (sources() / f"flash_attn-{v}" / "SOURCE.json").is_file() and _upstream_file(v)[0]]
    try:
        import triton  # noqa: F401
    except ImportError:
        runnable = []
    base = tmp_path_factory.mktemp("upstream-rotary")
    pool = ThreadPoolExecutor(max_workers=PARALLEL)
    futures = {v: pool.submit(_run_version, v, base / v) for v in runnable}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_upstream_rotary_tests(version, upstream_runs):
    released_root(version)  # skips (or fails) without the sources or Triton
    if _upstream_file(version)[0] is None:
        missing(f"no released {TEST_FILE} among the fetched sdists ({', '.join(VERSIONS)}); rerun tools/fetch_flash_attn_sources.py")
    from_version, outcomes, data, elapsed, proc = upstream_runs[version].result()
    status, released = data.get("status", {}), data.get("released_reruns", {})
    assert status.get("flash_attn_rotary") == "applied", f"the fix shim was not applied in the child: {data}\n{proc.stdout[-2000:]}"
    lines, problems = [f"flash-attn {version}, {TEST_FILE} of flash-attn {from_version}, {elapsed:.0f}s:"], []
    for config in CONFIGS:
        mine = {n: r for n, r in outcomes.items() if _config_of(n) == config}
        counts = {k: sum(1 for o, _ in mine.values() if o == k) for k in ("passed", "failed", "skipped")}
        lines.append(f"  {config}: {counts}")
        for name, (outcome, message) in sorted(mine.items()):
            if outcome != "failed":
                continue
            if released.get(name, "").startswith("failed"):
                lines.append(f"    {name}: fails without shims too (interpreter truncation, reduced sizes): {message[:100]}")
            elif (version, config, name) in DIFFERENCES:
                lines.append(f"    {name}: documented bug fix: {DIFFERENCES[(version, config, name)]}")
            else:
                problems.append(f"{version}/{name}: {message}")
    for reason in sorted({m for o, m in outcomes.values() if o == "skipped"}):
        lines.append(f"  skipped: {reason}")
    print("\n".join(lines))
    assert not problems, "differences from flash-attn's released code that are not documented bug fixes:\n" + "\n".join(problems)
