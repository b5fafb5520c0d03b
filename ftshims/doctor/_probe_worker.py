"""The probe server behind ``python -m ftshims.doctor --probe``.

Started by :mod:`ftshims.doctor.probes` as ``python -m ftshims.doctor._probe_worker``.
It imports torch, transformers and every module the probed shims need *once*,
then reads one JSON line on stdin, ``{"tasks": [...], "jobs": N, "timeout": S}``,
runs the tasks and writes one JSON line per event on the protocol channel (its
original stdout): ``ready``, then ``start`` and ``result`` per task. Whatever
the probes print goes to log files, never to the channel.

A task whose index is ``"environment"`` is not a probe: it computes the
doctor's torch section and shim trial (:func:`run_environment`), so that the
doctor does not import torch and transformers a second time.

Two modes:

* ``fork`` (Linux): every probe runs in a child forked from this process after
  the imports, so it starts from a clean, already-imported interpreter and no
  probe can leave state behind for the next. Up to ``jobs`` children run at
  once. The server enforces the per-probe time limit itself: a child past it
  has its process group killed (SIGKILL) and is reported ``timeout``; a child
  that dies without writing its result (segfault, abort, ``os._exit``) is
  reported ``crashed`` with the signal and the tail of its output.
* ``inline`` (other platforms, where forking an interpreter that imported
  torch is not safe): the probes run one after another in this process; the
  doctor's watchdog kills and restarts the server when one hangs or crashes.

The reproduction is the shim's own ``probe()`` through
:func:`ftshims.probing.compare`, exactly as the tests run it. No network:
the doctor sets ``HF_HUB_OFFLINE`` and friends, and outgoing socket
connections raise here.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback

FORK = "fork"
INLINE = "inline"

RUNNING = set()  # pids of probe children (fork mode), killed if the doctor goes away


def fork_supported() -> bool:
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def _no_network() -> None:
    """Every outgoing TCP/UDP connection fails fast: probes build tiny models from configs."""

    def refuse(*args, **kwargs):
        raise OSError("network access is disabled in ftshims doctor probes")

    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            refuse()
        return original_connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            refuse()
        return original_connect_ex(self, address)

    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex
    socket.create_connection = refuse


def _error_text(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _observation(obs) -> dict:
    return {"bug": bool(obs.bug), "detail": str(obs.detail)}


ENVIRONMENT = "environment"  # the index of the doctor's own checks (torch facts and the apply trial), run here too


def run_environment(task: dict) -> dict:
    """The doctor's torch section and shim trial, computed in a forked child that already has the imports.

    Without this the doctor imports torch, transformers, peft and trl itself while this server imports
    them too: twice the CPU for the same modules, which on a 2-core machine with one busy core is most
    of the run. The child is thrown away afterwards, so the trial cannot leave anything behind.
    """
    from ftshims.doctor.environment import torch_info
    from ftshims.doctor.shims import run_trial

    answer = {"event": "result", "index": task.get("index"), "status": None}
    start = time.perf_counter()
    try:
        torch = torch_info()
        trial = run_trial(bool(task.get("trial_imports", True)))
        statuses = {
            shim_id: {"status": entry.status, "reason": entry.reason, "patched": list(entry.patched or ())}
            for shim_id, entry in trial["statuses"].items()
        }
        answer.update(status="ok", torch=torch, trial=dict(trial, statuses=statuses))
    except Exception as exc:  # the doctor then runs its own checks
        answer.update(status="error", error=_error_text(exc), output_tail=traceback.format_exc(limit=6))
    answer["seconds"] = round(time.perf_counter() - start, 3)
    return answer


def run_one(task: dict) -> dict:
    """Run one probe and return its answer; never raises (except KeyboardInterrupt/SystemExit)."""
    if task.get("index") == ENVIRONMENT:
        return run_environment(task)
    from ftshims import probing
    from ftshims.spec import ProbeUnsupported

    answer = {"event": "result", "index": task.get("index"), "status": None}
    start = time.perf_counter()
    try:
        outcome = probing.compare(task["shim_id"], **(task.get("kwargs") or {}))
    except ProbeUnsupported as exc:
        answer.update(status="unsupported", error=f"ProbeUnsupported: {exc}")
    except Exception as exc:
        answer.update(status="error", error=_error_text(exc), output_tail=traceback.format_exc(limit=6))
    else:
        answer.update(
            status="ok",
            affected=bool(outcome.affected),
            range_reason=outcome.range_reason,
            shim_status=outcome.status.status,
            shim_reason=outcome.status.reason,
            without=_observation(outcome.without),
            with_shim=_observation(outcome.with_shim),
        )
    answer["seconds"] = round(time.perf_counter() - start, 3)
    return answer


def preload(names) -> dict:
    """Import what the probes will need, once (in fork mode every child inherits it)."""
    done, errors = [], []
    for name in names:
        try:
            if name not in sys.modules and importlib.util.find_spec(name.split(".")[0]) is None:
                continue
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:  # the probes that need it will report the failure themselves
            errors.append(f"{name}: {_error_text(exc, 300)}")
    return {"preloaded": done, "preload_errors": errors}


def register_extra(extra: dict) -> list:
    """Shims the doctor knows that are not in ftshims/shims/ (plugins, tests): import and register them here too."""
    from ftshims import registry

    errors = []
    shims = registry.shims()  # the registry's cache: the probes look shims up there
    for shim_id, module_name in extra.items():
        try:
            module = importlib.import_module(module_name)
            shims[shim_id] = registry.Shim(module.SPEC, module)
        except Exception as exc:  # its probe then reports "unknown shim id"
            errors.append(f"{shim_id}: {_error_text(exc, 300)}")
    return errors


def _tail(path: str, limit: int = 1500) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-15:])


def _exit_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            return f"killed by signal {number}"
    return f"exit code {os.WEXITSTATUS(status)} without an answer"


def _child(task: dict, result_path: str, log_path: str, threads: int) -> None:
    """In the forked child: own process group, own log, run the probe, write the answer, leave."""
    code = 0
    try:
        os.setpgid(0, 0)  # own process group, so a timeout kills what the probe started too
    except OSError:
        pass  # the server already did it (it calls setpgid(pid, pid) as well)
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if threads and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        answer = run_one(task)
        with open(result_path, "w", encoding="utf-8") as handle:
            json.dump(answer, handle, default=str)
    except BaseException:  # the server reports the missing answer as a crash, with this traceback in the log
        traceback.print_exc()
        code = 3
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve_fork(tasks, jobs: int, timeout: float, threads: int, emit) -> None:
    workdir = tempfile.mkdtemp(prefix="ftshims-probes-")
    pending = list(tasks)
    running = {}  # pid -> (task, started, result_path, log_path, timed_out)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                task = pending.pop(0)
                base = os.path.join(workdir, str(task["index"]))
                result_path, log_path = base + ".json", base + ".log"
                emit({"event": "start", "index": task["index"]})
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(task, result_path, log_path, threads)
                try:
                    os.setpgid(pid, pid)  # also done by the child: whichever runs first closes the race
                except OSError:
                    pass
                running[pid] = [task, time.monotonic(), result_path, log_path, False]
                RUNNING.add(pid)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                now = time.monotonic()
                for child, entry in running.items():
                    if not entry[4] and now - entry[1] > timeout:
                        entry[4] = True
                        try:
                            os.killpg(child, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            try:
                                os.kill(child, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                time.sleep(0.02)
                continue
            if pid not in running:
                continue
            task, started, result_path, log_path, timed_out = running.pop(pid)
            RUNNING.discard(pid)
            seconds = round(time.monotonic() - started, 3)
            answer = None
            if not timed_out and os.path.exists(result_path):
                try:
                    with open(result_path, encoding="utf-8") as handle:
                        answer = json.load(handle)
                except (OSError, ValueError):
                    answer = None
            if answer is None:
                answer = {"event": "result", "index": task["index"], "seconds": seconds, "output_tail": _tail(log_path) or None}
                if timed_out:
                    answer.update(status="timeout", error=f"no answer within {timeout:g} s; the probe's process group was killed")
                else:
                    answer.update(status="crashed", error=f"the probe process died ({_exit_text(status)})")
            for path in (result_path, log_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            emit(answer)
    finally:
        for child in list(running):
            try:
                os.killpg(child, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(workdir)
        except OSError:
            pass


def _watch_parent() -> None:
    """The doctor closes our stdin when it is done or dies: then stop every probe and leave."""

    def watch():
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        for child in list(RUNNING):
            try:
                os.killpg(child, signal.SIGKILL)
            except OSError:
                pass
        os._exit(1)

    import threading

    threading.Thread(target=watch, name="ftshims-probe-parent-watch", daemon=True).start()


def serve_inline(tasks, emit) -> None:
    for task in tasks:
        emit({"event": "start", "index": task["index"]})
        emit(run_one(task))


def _read_request() -> str:
    """The first line of stdin, read without Python's buffered reader (its lock must not be shared with forks)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 65536)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8").strip() or "{}"


def main() -> int:
    # The protocol channel is the original stdout; from here on fd 1 writes to stderr (the doctor's log file).
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(event: dict) -> None:
        channel.write(json.dumps(event, default=str) + "\n")
        channel.flush()

    _no_network()
    request = json.loads(_read_request())
    mode = FORK if (request.get("fork", True) and fork_supported()) else INLINE
    start = time.perf_counter()
    ready = {"event": "ready", "pid": os.getpid(), "mode": mode}
    ready.update(preload(request.get("preload", ("torch", "transformers"))))
    ready["extra_shim_errors"] = register_extra(request.get("extra_shims") or {})
    ready["seconds"] = round(time.perf_counter() - start, 3)
    emit(ready)

    tasks = request.get("tasks") or []
    _watch_parent()
    if mode == FORK:
        serve_fork(tasks, max(1, int(request.get("jobs") or 1)), float(request.get("timeout") or 30), int(request.get("threads") or 0), emit)
    else:
        if request.get("threads") and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(request["threads"]))
        serve_inline(tasks, emit)
    emit({"event": "done"})
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # skip the slow interpreter teardown after torch; every answer is flushed
