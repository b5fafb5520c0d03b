"""Test sessions: the default suite and the pinned-version matrix.

    nox -s tests              # the default stack (README's test command)
    nox -s matrix             # every other pinned stack in ftshims/data/stacks.toml
    nox -s "matrix(stack='t4_34')"
    nox -s compat             # COMPAT_MATRIX.md and the recorded evidence agree
    nox -s rotary_flash       # the rotary kernel against flash-attn's released Triton files (interpreter)
    nox -s nvcc               # compile check of the CUDA sources for sm_80 and sm_90 (no GPU needed)
    nox -s canary             # every shim target still exists in the tracked and newest releases

Every session is a uv venv with torch 2.13.0 (CPU). uv does not read pip's
configuration, so a local wheel folder named by ``pip config get
global.find-links`` is passed on explicitly; without one, the PyTorch CPU index
is used so that uv never pulls a multi-GB CUDA build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
STACKS = tomllib.loads((ROOT / "ftshims" / "data" / "stacks.toml").read_text())["stacks"]
DEFAULT_STACK = next(name for name, stack in STACKS.items() if stack.get("default"))
RESULTS = ROOT / "matrix-results"
TORCH = "torch==2.13.0"
TEST_DEPS = ["wrapt>=1.14", "packaging>=21", "pytest>=7", "hypothesis>=6", "pyyaml", "ninja"]

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests", "matrix", "compat", "rotary_flash", "nvcc", "canary"]
os.environ.setdefault("UV_CACHE_DIR", str(ROOT / ".nox" / ".uv-cache"))


def _torch_source() -> list:
    try:
        links = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        links = ""
    if links and Path(links).is_dir():
        return ["--find-links", links]
    return ["--extra-index-url", "https://download.pytorch.org/whl/cpu", "--index-strategy", "unsafe-best-match"]


def _test_env(**extra) -> dict:
    env = {
        "PYTHONPATH": str(ROOT),
        # The rotary extension is built once (~20 s) and shared by every session: same torch everywhere.
        "TORCH_EXTENSIONS_DIR": str(ROOT / ".nox" / ".torch-extensions"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Tiny models: one thread is faster than two, and stays fast when the box is shared.
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


def _install_project(session: nox.Session) -> None:
    """A regular (non-editable) install, so the ftshims-auto.pth start-up hook is in site-packages.

    Tests import the checkout through PYTHONPATH; the installed copy only provides the hook.
    """
    session.install("--no-deps", "--reinstall-package", "ftshims", str(ROOT))


def _run_suite(session: nox.Session, stack: str) -> None:
    session.install(*_torch_source(), TORCH, *STACKS[stack]["pins"], *TEST_DEPS)
    _install_project(session)
    RESULTS.mkdir(exist_ok=True)
    env = _test_env(FTSHIMS_STACK=stack, FTSHIMS_EVIDENCE_OUT=str(RESULTS / f"{stack}.json"))
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *session.posargs, env=env)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The default suite on the default stack."""
    _run_suite(session, DEFAULT_STACK)


@nox.session(python="3.11")
@nox.parametrize("stack", [name for name, info in STACKS.items() if name != DEFAULT_STACK and "session" not in info])
def matrix(session: nox.Session, stack: str) -> None:
    """The whole suite on one pinned stack."""
    _run_suite(session, stack)


@nox.session(python="3.11", venv_backend="none")
def compat(session: nox.Session) -> None:
    """COMPAT_MATRIX.md is current and the evidence of this run matches what it claims."""
    session.run(sys.executable, "-m", "ftshims.matrix", "--check", "--evidence", str(RESULTS), env={"PYTHONPATH": str(ROOT)})


@nox.session(python="3.11")
def rotary_flash(session: nox.Session) -> None:
    """The rotary kernel and the flash_attn_rotary shim against flash-attn's released rotary files.

    flash-attn cannot be built here, but its rotary code is Python + Triton: the sources of the
    pinned releases are fetched now (network at install time only) and run under Triton's CPU
    interpreter. With FTSHIMS_FLASH_ATTN_SOURCES set, missing sources or triton fail the tests.
    """
    stack = "fa_rotary"
    session.install(*_torch_source(), TORCH, "pip", *STACKS[stack]["pins"], *TEST_DEPS)
    _install_project(session)
    sources = ROOT / ".nox" / ".flash-attn-sources"
    RESULTS.mkdir(exist_ok=True)
    env = _test_env(
        FTSHIMS_FLASH_ATTN_SOURCES=str(sources), FTSHIMS_STACK=stack, FTSHIMS_EVIDENCE_OUT=str(RESULTS / f"{stack}.json")
    )
    session.run("python", "tools/fetch_flash_attn_sources.py", "--dest", str(sources), env=env)
    session.run("python", "tools/fetch_flash_attn_sources.py", "--dest", str(sources), "--check", env=env)
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels",
        "tests/test_shim_flash_attn_rotary.py", "tests/test_shim_rope_inv_freq_fp32.py",
        "tests/test_shim_rope_fused_kernel.py", "--hypothesis-profile=fuzz", "--hypothesis-show-statistics",
        *session.posargs, env=env,
    )


@nox.session(python="3.11")
def nvcc(session: nox.Session) -> None:
    """csrc/rotary_cuda.cu compiles for sm_80 and sm_90 with no spills (nvcc from the image, CPU torch headers)."""
    session.install(*_torch_source(), TORCH)
    session.run("python", "tools/nvcc_compile_check.py", "--arch", "80", "90", env={"PYTHONPATH": str(ROOT)})


@nox.session(python="3.11")
def canary(session: nox.Session) -> None:
    """Every shim's targets exist, with their parameters, in the tracked and newest releases (downloads).

    Nothing downloaded is installed; torch is here only because flash-attn's setup.py imports it
    while pip prepares the sdist.
    """
    session.install(*_torch_source(), TORCH, "pip", "setuptools", "wheel", "packaging", "wrapt")
    session.run("python", "-m", "ftshims.matrix", "--canary", *session.posargs, env={"PYTHONPATH": str(ROOT)})
