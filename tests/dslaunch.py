"""Multi-rank launches of the DeepSpeed tests (tests/deepspeed, tests/shims/test_deepspeed_empty_param_group.py,
tests/shims/test_resize_embeddings_frozen_under_zero3.py, tests/monitor/test_deepspeed.py): one place for the gate
(skip where deepspeed is absent, fail on a stack that pins it), the ranks' environment and the torchrun launch that
leaves no rank behind."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]


def stack_pins_deepspeed() -> bool:
    from ftshims import datafiles

    stack = os.environ.get("FTSHIMS_STACK")
    return stack in datafiles.stacks() and "deepspeed" in datafiles.pinned_versions(stack)


def require(condition: bool, what: str) -> None:
    """Skip the test when ``condition`` is false; fail instead on a stack that pins deepspeed (nox installs it
    there, so a missing piece is a broken environment, not an optional one)."""
    if condition:
        return
    if stack_pins_deepspeed():
        pytest.fail(f"{what}, but stack {os.environ['FTSHIMS_STACK']} pins deepspeed (nox installs it)")
    pytest.skip(f"{what} (pip install deepspeed to run the ZeRO tests)")


def require_deepspeed() -> None:
    require(importlib.util.find_spec("deepspeed") is not None, "deepspeed is not installed")


def rank_env(auto: Optional[str] = None, noop: Iterable[str] = (), clear_prefix: bool = False) -> Dict[str, str]:
    """The ranks' environment: ftshims' switches cleared (``FTSHIMS_AUTO=auto`` when given; ``clear_prefix``
    drops every ``FTSHIMS_*``), the repository importable, one thread per rank, nothing from the network."""
    env = dict(os.environ)
    for name in [k for k in env if k.startswith("FTSHIMS_")] if clear_prefix else \
            ("FTSHIMS_AUTO", "FTSHIMS_DISABLE", "FTSHIMS_MONITOR"):
        env.pop(name, None)
    if auto:
        env["FTSHIMS_AUTO"] = auto
    noop = list(noop)
    if noop:  # the mutation check's --noop-shim reaches the ranks, which install them as no-ops
        env["FTSHIMS_TEST_NOOP_SHIMS"] = ",".join(noop)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    # DeepSpeed's JIT-built comm op, kept per environment: two environments sharing torch's default directory
    # rebuild it in turn (the build records the sources' paths), 70 s each time on 2 cores
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    return env


def argv(script: List[str], nproc: int = 2) -> List[str]:
    """``torchrun --standalone`` (a free localhost port chosen by torchrun) for ``nproc`` > 1, else plain Python."""
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script]
    return [sys.executable, *script]


def run_all(launches: Dict[str, Tuple[List[str], Dict[str, str]]], cwd: Path, timeout: float) -> Dict[str, tuple]:
    """Start every ``{name: (argv, env)}`` side by side, each in its own process group (a kill reaches the ranks
    torchrun started) with its log in ``cwd/<name>.log``; ``{name: (exit code or 'killed after N s', log text)}``.
    A failed wait or start leaves no launch and no rank running."""
    procs, logs, codes = {}, {}, {}
    try:
        for name, (command, env) in launches.items():
            logs[name] = open(cwd / f"{name}.log", "w")
            procs[name] = subprocess.Popen(command, env=env, stdout=logs[name], stderr=subprocess.STDOUT, cwd=cwd,
                                           start_new_session=True)
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                codes[name] = f"killed after {timeout:.0f} s"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs.values():
            log.close()
    return {name: (code, (cwd / f"{name}.log").read_text(errors="replace")) for name, code in codes.items()}


def run(command: List[str], env: Dict[str, str], cwd: Path, timeout: float, name: str = "launch") -> str:
    """One launch; asserts it exited 0 and returns its log."""
    code, text = run_all({name: (command, env)}, cwd, timeout)[name]
    assert code == 0, f"{name} exited {code}:\n{text[-5000:]}"
    return text
