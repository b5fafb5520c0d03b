"""Does flash-attn actually import? Checked in a child process, with a timeout.

A flash-attn wheel is compiled against one torch release, one CUDA major and
one C++ ABI. When torch is upgraded after flash-attn was installed (or pip
picked a wheel built for another torch), ``import flash_attn`` fails with
``ImportError: .../flash_attn_2_cuda...so: undefined symbol: _ZN3c10...``, a
message few users can read. The import runs in a child process so that a
segfault, a hang or a slow CUDA initialisation cannot take the doctor down;
it starts before the doctor imports torch itself, so the two overlap.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Optional

OK = "ok"
NOT_INSTALLED = "not installed"
ABI_MISMATCH = "abi mismatch"
MISSING_LIBRARY = "missing library"
IMPORT_ERROR = "import error"
TIMEOUT = "timeout"
CRASHED = "crashed"
CHECK_FAILED = "check failed"
SKIPPED = "skipped"

DEFAULT_TIMEOUT_S = 60.0
RELEASES = "https://github.com/Dao-AILab/flash-attention/releases"

_MARK = "@@ftshims-doctor-flash-attn@@"

# Run in the child: import flash_attn, print one marked JSON line whatever happens.
_CHILD = f"""
import json, sys, time
start = time.perf_counter()
out = {{"ok": False}}
try:
    import flash_attn
    out["ok"] = True
    out["version"] = str(getattr(flash_attn, "__version__", "") or "") or None
    out["file"] = getattr(flash_attn, "__file__", None)
except BaseException as exc:
    out["error_type"] = type(exc).__name__
    out["error"] = str(exc)
out["seconds"] = round(time.perf_counter() - start, 3)
sys.stdout.write("\\n{_MARK}" + json.dumps(out) + "\\n")
sys.stdout.flush()
"""

_SYMBOL = re.compile(r"undefined symbol:\s*(\S+)")


def is_present(metadata_version: Optional[str], broken_metadata: bool = False) -> bool:
    """Installed per metadata, or an importable ``flash_attn`` without metadata (never imported here)."""
    if metadata_version is not None or broken_metadata:
        return True
    if "flash_attn" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except Exception:  # a broken finder or package raises anything here; the child process says what
        return True


class FlashAttnCheck:
    """The running child process; :meth:`result` waits for it (up to the deadline)."""

    def __init__(self, timeout_s: float, metadata_version: Optional[str]):
        self.timeout_s = timeout_s
        self.metadata_version = metadata_version
        self.start = time.perf_counter()
        self.proc: Optional[subprocess.Popen] = None
        self.start_error: Optional[str] = None
        self._out = tempfile.TemporaryFile()  # files, not pipes: a chatty import cannot block on a full pipe
        self._err = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-X", "faulthandler", "-c", _CHILD],
                stdin=subprocess.DEVNULL,
                stdout=self._out,
                stderr=self._err,
                start_new_session=(os.name == "posix"),  # so a timeout kills its children too
            )
        except Exception as exc:
            self.start_error = f"{type(exc).__name__}: {exc}"

    def _kill(self) -> None:
        assert self.proc is not None
        try:
            if os.name == "posix":
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        except (ProcessLookupError, PermissionError, OSError):
            self.proc.kill()
        self.proc.wait()

    def _read(self, stream) -> str:
        stream.seek(0)
        return stream.read().decode("utf-8", errors="replace")

    def result(self, torch: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        out = _base(self.metadata_version, self.timeout_s)
        try:
            return self._result(out, torch or {})
        finally:
            self.close()

    def close(self) -> None:
        """Stop the child if it still runs (the doctor was interrupted) and drop its output files."""
        if self.proc is not None and self.proc.poll() is None:
            self._kill()
        self._out.close()
        self._err.close()

    def _result(self, out: Dict[str, Any], torch: Dict[str, Any]) -> Dict[str, Any]:
        if self.proc is None:
            out.update(status=CHECK_FAILED, error=f"could not start {sys.executable}: {self.start_error}")
            out["message"] = "The flash-attn import check could not run (the doctor could not start a Python subprocess)."
            return out
        remaining = max(0.1, self.timeout_s - (time.perf_counter() - self.start))
        try:
            self.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            self._kill()
            out["seconds"] = self.timeout_s
            out.update(status=TIMEOUT, ok=False, error=f"import flash_attn did not finish within {self.timeout_s:g} s")
            out["message"] = (
                f"`import flash_attn` was still running after {self.timeout_s:g} s and was stopped. A slow "
                "CUDA initialisation, a deadlock at import, or a network filesystem can cause this."
            )
            out["fix"] = "Run `python -c 'import flash_attn'` yourself to see where it hangs; raise --flash-attn-timeout if it is just slow."
            return out
        stdout, stderr = self._read(self._out), self._read(self._err)
        payload = None
        for line in stdout.splitlines():
            if line.startswith(_MARK):
                try:
                    payload = json.loads(line[len(_MARK):])
                except ValueError:
                    payload = None
        if payload is None:
            code = self.proc.returncode
            why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
            fatal = [line for line in lines if line.startswith("Fatal Python error")]
            tail = " | ".join(fatal[:1] or lines[-3:])
            out.update(status=CRASHED, ok=False, error=f"the import process died ({why}){': ' + tail if tail else ''}")
            out["message"] = "`import flash_attn` crashed the Python process (a segfault or abort in a compiled extension)."
            out["fix"] = _fix_text(out.get("version"), torch)
            return out
        out["imported_version"] = payload.get("version")
        out["seconds"] = payload.get("seconds")
        if payload.get("ok"):
            out.update(status=OK, ok=True)
            out["message"] = "flash_attn imports."
            return out
        error = f"{payload.get('error_type')}: {payload.get('error')}"
        out.update(ok=False, error=" ".join(error.split())[:1000])
        symbol = _SYMBOL.search(error)
        if symbol:
            out.update(status=ABI_MISMATCH, symbol=symbol.group(1))
            out["message"] = _abi_message(out.get("version"), symbol.group(1), torch)
            out["fix"] = _fix_text(out.get("version"), torch)
        elif "cannot open shared object file" in error:
            out.update(status=MISSING_LIBRARY)
            out["message"] = (
                "flash-attn's compiled extension needs a shared library that is not on the loader path "
                "(often the CUDA runtime of a different CUDA major than the installed torch)."
            )
            out["fix"] = _fix_text(out.get("version"), torch)
        else:
            out.update(status=IMPORT_ERROR)
            out["message"] = "`import flash_attn` raised; transformers will fall back to another attention implementation or fail."
            out["fix"] = "Read the error above; reinstalling flash-attn for the installed torch usually fixes a broken install."
        return out


def _base(version: Optional[str], timeout_s: float) -> Dict[str, Any]:
    return {
        "status": NOT_INSTALLED,
        "ok": None,
        "version": version,
        "imported_version": None,
        "error": None,
        "symbol": None,
        "message": None,
        "fix": None,
        "seconds": None,
        "timeout_s": timeout_s,
    }


def not_installed(timeout_s: float) -> Dict[str, Any]:
    out = _base(None, timeout_s)
    out["message"] = "flash-attn is not installed."
    return out


def skipped(version: Optional[str], timeout_s: float, why: str) -> Dict[str, Any]:
    out = _base(version, timeout_s)
    out.update(status=SKIPPED, message=why)
    return out


def _torch_short(torch: Dict[str, Any]) -> Optional[str]:
    version = torch.get("version")
    if not version:
        return None
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def _abi_message(version: Optional[str], symbol: str, torch: Dict[str, Any]) -> str:
    name = f"flash-attn {version}" if version else "flash-attn"
    torch_version = torch.get("version") or "the installed torch"
    return (
        f"{name} was compiled against a different torch / CUDA / C++ ABI than the installed torch "
        f"{torch_version}: its extension needs `{symbol}`, which this torch does not export. This happens "
        "when torch is upgraded or downgraded after flash-attn was installed, or when pip picks a wheel "
        "built for another torch."
    )


def _fix_text(version: Optional[str], torch: Dict[str, Any]) -> str:
    short = _torch_short(torch)
    cuda = torch.get("cuda")
    abi = torch.get("cxx11_abi")
    wanted = []
    if short:
        wanted.append(f"torch {short}")
    if cuda:
        wanted.append(f"CUDA {cuda}")
    if abi is not None:
        wanted.append(f"C++11 ABI {'TRUE' if abi else 'FALSE'}")
    tag = ""
    if short and cuda and abi is not None:
        tag = f" (release wheels are tagged like `+cu{cuda.split('.')[0]}torch{short}cxx11abi{'TRUE' if abi else 'FALSE'}`)"
    target = ", ".join(wanted) if wanted else "the installed torch, CUDA and C++ ABI"
    cpu_only = torch.get("status") == "imported" and not cuda and not torch.get("hip")
    prefix = "The installed torch is a CPU-only build; flash-attn needs a CUDA build of torch first. " if cpu_only else ""
    return prefix + (
        f"Reinstall a flash-attn build matching {target}: either the matching wheel from {RELEASES}{tag}, "
        "or build it against this torch: `pip uninstall -y flash-attn && "
        "pip install flash-attn --no-build-isolation --no-cache-dir`."
    )


def start(timeout_s: float, metadata_version: Optional[str], broken_metadata: bool = False):
    """Start the check; returns a :class:`FlashAttnCheck`, or None when flash-attn is not installed."""
    if not is_present(metadata_version, broken_metadata):
        return None
    return FlashAttnCheck(timeout_s, metadata_version)
