"""Live bug probes: every shim's reproduction, run without and with the shim, in child processes.

``python -m ftshims.doctor --probe`` runs, for every registered shim that has a
``probe()`` (in range or not: a probe outside the range that shows no bug is
evidence that the shim is not needed), :func:`ftshims.probing.compare` — the
same call the shim's tests make, so the reproduction code is shared, never
duplicated here.

Isolation and budget. Importing torch and transformers is what a probe costs
most (5–15 s on a 2-core machine without bytecode caches; each probe itself
takes 0.2–3 s), so each probe in its own interpreter would blow the 30 s
budget. Instead a few long-lived *worker* processes
(:mod:`ftshims.doctor._probe_worker`; two by default on a machine with two or
more CPUs) import torch/transformers once and run probes one after another, fed
from one shared queue. Each worker is watched by a thread of the doctor:

* every probe has a strict time limit; past it the worker's whole process
  group is killed (SIGKILL) and the probe is reported ``timeout``;
* a worker that dies (segfault, abort, ``os._exit``) has its probe reported
  ``crashed`` with the signal and the tail of its stderr;
* the next probe gets a fresh worker, so one hanging or crashing probe costs
  its own result and one re-import, never the other probes;
* a worker that cannot start twice in a row (torch does not import, say)
  stops the run: the remaining probes are reported ``not run`` with the reason.

The doctor's own torch section and shim trial are computed by the server too
(``environment=``, fork mode only), in a forked child after its imports: the
doctor's process then imports none of torch/transformers/peft/trl, which
halves the CPU a ``--probe`` run needs (two imports of the same stack competed
for two cores before).

Opt-in ``speed`` shims are probed only with ``--probe-all``: their probes check
the accuracy of a fast path and may compile a kernel (tens of seconds, a
toolchain, files in a cache), which a diagnostic should not do unasked.

Probes use no network: the children run with ``HF_HUB_OFFLINE=1``,
``TRANSFORMERS_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1`` and telemetry off, and
the worker refuses outgoing socket connections. ``FTSHIMS_DISABLE`` is passed
through (a disabled shim's bug then shows "with the shim" too: unpatched);
``FTSHIMS_AUTO`` is not (the worker starts unpatched; ``compare`` applies the
shim itself). Progress goes to stderr, one line per probe, so ``--json`` on
stdout stays clean.

Size: the worker-server protocol and its failure handling (time limits, crashes, restarts, the budget)
are one state machine shared by the probe run and its result rows; the child side is
:mod:`._probe_worker`.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, TextIO

from .. import settings
from ..spec import SPEED
from ._probe_worker import ENVIRONMENT

DEFAULT_TIMEOUT_S = 30.0  # per probe, from the moment it is sent to a ready worker
STARTUP_TIMEOUT_S = 120.0  # a worker importing torch and transformers
MAX_START_FAILURES = 2

# result["status"]
OK = "ok"
UNSUPPORTED = "unsupported"
ERROR = "error"
TIMEOUT = "timeout"
CRASHED = "crashed"
NOT_RUN = "not run"
NO_PROBE = "no probe"
SKIPPED = "skipped"

# result["verdict"]
V_FIXED = "bug fixed"
V_UNPATCHED = "bug unpatched"
V_ABSENT = "bug absent"
V_NOT_NEEDED = "not needed"
V_COULD_NOT_RUN = "could not run"
V_NO_PROBE = "no probe"
V_SKIPPED = "skipped"

VERDICTS = (V_FIXED, V_UNPATCHED, V_ABSENT, V_NOT_NEEDED, V_COULD_NOT_RUN, V_NO_PROBE, V_SKIPPED)

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
}


@dataclass
class Task:
    index: int
    shim_id: str
    scenario: str = "default"
    kwargs: Dict[str, Any] = field(default_factory=dict)


def default_jobs() -> int:
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def child_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    env.pop(settings.AUTO_ENV, None)
    # The child must import this very ftshims, wherever it was imported from.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parts = [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def tasks_from_registry() -> List[Task]:
    """One task per registered shim, in registry order (shims without a probe get none)."""
    from .. import registry

    return [Task(i, shim_id) for i, shim_id in enumerate(registry.ids())]


# -- the probe server process ------------------------------------------------------------


class WorkerGone(Exception):
    """The probe server exited (crash or EOF) before saying what it was asked."""


class WorkerTimeout(Exception):
    pass


class Server:
    """A running ``_probe_worker`` process; a thread turns its protocol lines into a queue."""

    def __init__(self, env: Dict[str, str], argv: Optional[List[str]] = None):
        self._err = tempfile.TemporaryFile()
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        cmd = argv or [sys.executable, "-X", "faulthandler", "-m", "ftshims.doctor._probe_worker"]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=env,
            start_new_session=(os.name == "posix"),  # a kill takes what it started with it
        )
        self._reader = threading.Thread(target=self._read, name="ftshims-probe-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for raw in self.proc.stdout:
                self._lines.put(raw.decode("utf-8", errors="replace"))
        except (OSError, ValueError):
            pass
        self._lines.put(None)

    def send(self, message: Dict[str, Any]) -> None:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode("utf-8"))
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise WorkerGone() from exc

    def receive(self, timeout: float) -> Dict[str, Any]:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout()
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                raise WorkerTimeout() from None
            if line is None:
                raise WorkerGone()
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                return message

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                if os.name == "posix":
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
            except OSError:
                try:
                    self.proc.kill()
                except OSError:
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Close its stdin (it then stops its probes and leaves), and make sure it is gone."""
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self._reader.join(timeout=2)
        try:
            self.proc.stdout.close()
        except (OSError, ValueError):
            pass
        self._err.close()

    def exit_text(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def stderr_tail(self, limit: int = 1500) -> str:
        try:
            self._err.seek(0, os.SEEK_END)
            size = self._err.tell()
            self._err.seek(max(0, size - limit))
            text = self._err.read().decode("utf-8", errors="replace")
        except (OSError, ValueError):
            return ""
        lines = [line for line in text.splitlines() if line.strip()]
        return "\n".join(lines[-15:])


def preload_names(shim_ids: List[str]) -> List[str]:
    """What the server imports once before the probes: torch, transformers, peft and the shims' modules."""
    from .. import registry

    names = ["torch", "transformers", "transformers.modeling_utils", "peft"]
    for shim_id in shim_ids:
        shim = registry.shims().get(shim_id)
        for name in shim.spec.modules if shim is not None else ():
            if name not in names:
                names.append(name)
    return names


# -- the run -------------------------------------------------------------------------------

GRACE_S = 10.0  # fork mode: the server enforces the limit; the doctor steps in only if the server itself hangs


class ProbeRun:
    """Runs the tasks in the background; :meth:`results` waits for them and returns the report rows."""

    def __init__(
        self,
        tasks: List[Task],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        jobs: Optional[int] = None,
        progress: Optional[TextIO] = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        fork: bool = True,
        server_factory: Optional[Callable[[], Server]] = None,
        preload: Optional[List[str]] = None,
        include_speed: bool = False,
        environment: Optional[bool] = None,
    ):
        from .. import registry
        from ._probe_worker import fork_supported

        self.tasks = list(tasks)
        self.timeout_s = float(timeout_s)
        self.jobs = max(1, jobs or default_jobs())
        self.progress = progress
        self.startup_timeout_s = startup_timeout_s
        self.fork = fork
        self._preload = preload
        self.mode: Optional[str] = None
        self.servers_started = 0
        self.startup_s: Optional[float] = None
        self.preloaded: List[str] = []
        self.preload_errors: List[str] = []
        self.started = time.perf_counter()
        # environment (the trial's trial_imports): the server also computes the doctor's torch section and
        # shim trial, in a forked child (fork mode only: inline, the trial would run in the server itself).
        self._environment_request = environment if (fork and fork_supported()) else None
        self._environment: Optional[Dict[str, Any]] = None
        self._environment_done = threading.Event()
        if self._environment_request is None:
            self._environment_done.set()
        env = child_env()
        self._factory = server_factory or (lambda: Server(env))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: Optional[Server] = None
        self._results: Dict[int, Dict[str, Any]] = {}
        self._done = 0
        shims = registry.shims()
        self._runnable = []
        # Shims registered in this process but not in ftshims/shims/ (plugins, tests): the server imports them by name.
        self._extra: Dict[str, str] = {}
        for task in self.tasks:
            shim = shims.get(task.shim_id)
            if shim is None or shim.probe is None:
                self._record(task, no_probe_row(task), quiet=True)
            elif shim.spec.kind == SPEED and not include_speed:
                self._record(task, skipped_row(task), quiet=True)
            else:
                self._runnable.append(task)
                if shim.module.__name__ != f"ftshims.shims.{task.shim_id}":
                    self._extra[task.shim_id] = shim.module.__name__
        if self._extra:  # the server's registry then differs from the doctor's: the doctor runs its own trial
            self._environment_request = None
            self._environment_done.set()
        if self.progress is not None and self._runnable:
            self._say(
                f"ftshims doctor: probing {len(self._runnable)} shim(s), up to {self.jobs} at a time, "
                f"{self.timeout_s:g} s limit per probe"
            )
        self._thread = threading.Thread(target=self._supervise, name="ftshims-probe-supervisor", daemon=True)
        self._thread.start()

    # progress --------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        try:
            self.progress.write(text + "\n")
            self.progress.flush()
        except (OSError, ValueError):
            pass

    def _record(self, task: Task, row: Dict[str, Any], quiet: bool = False) -> None:
        with self._lock:
            if task.index in self._results:
                return
            self._results[task.index] = row
            if quiet:
                return
            self._done += 1
            done = self._done
        if self.progress is not None:
            seconds = row.get("seconds")
            took = f" ({seconds:.1f} s)" if isinstance(seconds, (int, float)) else ""
            self._say(f"  [{done}/{len(self._runnable)}] {task.shim_id}: {progress_text(row)}{took}")

    # the supervisor ----------------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a doctor bug: every probe not yet reported says so
            for task in self._runnable:
                self._record(task, failed_row(task, NOT_RUN, f"the doctor's probe supervisor failed: {type(exc).__name__}: {exc}", None))
        finally:
            self._environment_done.set()
            server, self._server = self._server, None
            if server is not None:
                server.close()

    def _loop(self) -> None:
        remaining = {task.index: task for task in self._runnable}
        failures = 0
        preload = self._preload if self._preload is not None else preload_names([t.shim_id for t in self._runnable])
        threads = max(1, (os.cpu_count() or 1) // self.jobs)
        while remaining and not self._stop.is_set():
            reason = None
            server = None
            try:
                server = self._factory()
                self._server = server
                # The environment task goes first (the doctor waits for it); only to the first server.
                env_task = []
                if not self._environment_done.is_set():
                    env_task = [{"index": ENVIRONMENT, "trial_imports": bool(self._environment_request)}]
                server.send(
                    {
                        "tasks": env_task + [
                            {"index": t.index, "shim_id": t.shim_id, "scenario": t.scenario, "kwargs": t.kwargs}
                            for t in remaining.values()
                        ],
                        "jobs": self.jobs,
                        "timeout": self.timeout_s,
                        "threads": threads,
                        "preload": preload,
                        "fork": self.fork,
                        "extra_shims": self._extra,
                    }
                )
                hello = server.receive(self.startup_timeout_s)
            except WorkerTimeout:
                reason = f"the probe server did not start within {self.startup_timeout_s:g} s"
            except WorkerGone:
                if server is not None:
                    server.kill()
                reason = f"the probe server died while starting ({server.exit_text() if server else 'not started'})"
            except Exception as exc:
                reason = f"could not start the probe server: {type(exc).__name__}: {exc}"
            if reason is None and hello.get("event") != "ready":
                reason = f"unexpected first message from the probe server: {hello}"
            if reason is not None:
                self._environment_done.set()
                tail = server.stderr_tail() if server is not None else ""
                if server is not None:
                    server.close()
                self._server = None
                failures += 1
                if failures >= MAX_START_FAILURES:
                    for task in list(remaining.values()):
                        self._record(task, failed_row(task, NOT_RUN, reason, None, tail))
                    return
                continue
            self.servers_started += 1
            self.mode = hello.get("mode")
            if self.progress is not None and self.servers_started == 1:
                self._say(f"  probe server ready in {hello.get('seconds', 0):.1f} s ({hello.get('mode')} mode; imported "
                          f"{', '.join(hello.get('preloaded') or []) or 'nothing'})")
            elif self.progress is not None:
                self._say(f"  probe server restarted ({hello.get('seconds', 0):.1f} s)")
            if self.startup_s is None:
                self.startup_s = hello.get("seconds")
                self.preloaded = list(hello.get("preloaded") or [])
                self.preload_errors = list(hello.get("preload_errors") or [])
            progressed = self._drain(server, remaining)
            self._environment_done.set()  # answered or not: the doctor stops waiting and checks for itself
            server.close()
            self._server = None
            failures = 0 if progressed else failures + 1
            if remaining and failures >= MAX_START_FAILURES:
                for task in list(remaining.values()):
                    self._record(task, failed_row(task, NOT_RUN, "the probe server keeps dying without finishing a probe", None))
                return

    def _drain(self, server: Server, remaining: Dict[int, Task]) -> bool:
        """Read events until every task has its result or the server hangs or dies; True if any result came."""
        inflight: Dict[int, float] = {}
        progressed = False
        limit = self.timeout_s + (GRACE_S if self.mode == "fork" else 0.0)
        idle_since = time.monotonic()
        while remaining or not self._environment_done.is_set():
            now = time.monotonic()
            deadlines = [start + limit for start in inflight.values()] or [idle_since + limit]
            try:
                message = server.receive(min(deadlines) - now)
            except WorkerTimeout:
                return self._fail_inflight(server, remaining, inflight, TIMEOUT) or progressed
            except WorkerGone:
                return self._fail_inflight(server, remaining, inflight, CRASHED) or progressed
            event = message.get("event")
            if event == "result" and message.get("index") == ENVIRONMENT:
                self._environment = message if message.get("status") == OK else None
                self._environment_done.set()
            elif event == "start" and message.get("index") in remaining:
                inflight[message["index"]] = time.monotonic()
            elif event == "result" and message.get("index") in remaining:
                inflight.pop(message["index"], None)
                task = remaining.pop(message["index"])
                self._record(task, result_row(task, message))
                progressed = True
                idle_since = time.monotonic()
            elif event == "done":
                break
        return progressed

    def _fail_inflight(self, server: Server, remaining: Dict[int, Task], inflight: Dict[int, float], status: str) -> bool:
        """Kill a hung (TIMEOUT) or dead (CRASHED) server and record its in-flight probes as failed; True if any."""
        server.kill()  # first: the exit status of a dead server is known only once it is reaped
        if status == TIMEOUT:
            why = f"no answer within {self.timeout_s:g} s; the probe process was killed"
        else:
            why = f"the probe process died ({server.exit_text()})"
        tail = server.stderr_tail()
        for index, start in inflight.items():
            task = remaining.pop(index)
            self._record(task, failed_row(task, status, why, time.monotonic() - start, tail))
        return bool(inflight)

    # results ---------------------------------------------------------------------------

    def environment(self, timeout: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """The server's ``{"torch": ..., "trial": ...}`` for the doctor, or None (not asked, failed, or
        the server did not start): the doctor then computes them itself."""
        if not self._environment_done.wait(timeout):
            return None
        return self._environment

    def results(self) -> List[Dict[str, Any]]:
        self._thread.join()
        for task in self.tasks:
            if task.index not in self._results:
                self._results[task.index] = failed_row(task, NOT_RUN, "the probe run stopped before this probe", None)
        return [self._results[task.index] for task in self.tasks]

    def close(self) -> None:
        """Stop now (KeyboardInterrupt): kill the server and its probes."""
        self._stop.set()
        server = self._server
        if server is not None:
            server.kill()
        self._thread.join(timeout=15)

    def summary(self) -> Dict[str, Any]:
        return {
            "mode": self.mode,
            "jobs": self.jobs,
            "timeout_s": self.timeout_s,
            "servers_started": self.servers_started,
            "startup_s": self.startup_s,
            "preloaded": self.preloaded,
            "preload_errors": self.preload_errors,
        }


# -- rows ------------------------------------------------------------------------------


def _base_row(task: Task) -> Dict[str, Any]:
    return {
        "shim_id": task.shim_id,
        "scenario": task.scenario,
        "kwargs": dict(task.kwargs),
        "status": None,
        "verdict": None,
        "affected": None,
        "shim_status": None,
        "shim_reason": None,
        "bug_without_shim": None,
        "bug_with_shim": None,
        "fixed": None,
        "detail": "",
        "detail_without": None,
        "detail_with": None,
        "error": None,
        "output_tail": None,
        "seconds": None,
    }


def _affected(shim_id: str) -> Optional[bool]:
    try:
        from ..probing import in_affected_range

        return in_affected_range(shim_id)[0]
    except Exception:
        return None


def no_probe_row(task: Task) -> Dict[str, Any]:
    row = _base_row(task)
    row.update(status=NO_PROBE, verdict=V_NO_PROBE, affected=_affected(task.shim_id), detail="this shim has no probe()")
    return row


def skipped_row(task: Task) -> Dict[str, Any]:
    row = _base_row(task)
    row.update(status=SKIPPED, verdict=V_SKIPPED, affected=_affected(task.shim_id))
    row["detail"] = (
        "opt-in speed shim: its probe checks the accuracy of the fast path and may build a kernel, so it runs only "
        "with --probe-all"
    )
    return row


def failed_row(task: Task, status: str, error: str, seconds: Optional[float], tail: str = "") -> Dict[str, Any]:
    row = _base_row(task)
    row.update(status=status, verdict=V_COULD_NOT_RUN, affected=_affected(task.shim_id), error=error)
    row["detail"] = error
    row["output_tail"] = tail or None
    row["seconds"] = round(seconds, 3) if seconds is not None else None
    return row


def result_row(task: Task, answer: Dict[str, Any]) -> Dict[str, Any]:
    """The report row for one answer of the probe server."""
    row = _base_row(task)
    row["seconds"] = answer.get("seconds")
    status = answer.get("status")
    if status != OK:
        status = status if status in (UNSUPPORTED, ERROR, TIMEOUT, CRASHED) else ERROR
        error = answer.get("error") or "no answer"
        row.update(status=status, verdict=V_COULD_NOT_RUN, affected=_affected(task.shim_id), error=error)
        row["detail"] = error
        row["output_tail"] = answer.get("output_tail") or None
        return row
    without, with_shim = answer["without"], answer["with_shim"]
    bug_without, bug_with = bool(without["bug"]), bool(with_shim["bug"])
    row.update(
        status=OK,
        affected=answer.get("affected"),
        shim_status=answer.get("shim_status"),
        shim_reason=answer.get("shim_reason"),
        bug_without_shim=bug_without,
        bug_with_shim=bug_with,
        fixed=(not bug_with) if bug_without else None,
        detail_without=without["detail"],
        detail_with=with_shim["detail"],
    )
    row["verdict"], row["detail"] = _verdict(row, answer)
    return row


def _verdict(row: Dict[str, Any], answer: Dict[str, Any]):
    status, reason = row["shim_status"], row["shim_reason"]
    if row["bug_with_shim"]:
        if not row["bug_without_shim"]:
            return V_UNPATCHED, f"the bug shows only WITH the shim ({status}): {row['detail_with']}"
        if status == "applied":
            why = "the shim was applied but did not fix it"
        elif not row["affected"]:
            why = f"the installed versions are outside the shim's range ({answer.get('range_reason')}), so it was not applied"
        else:
            why = f"the shim was not applied: {status} ({reason})"
        return V_UNPATCHED, f"UNPATCHED: {why}. Without the shim: {row['detail_without']}; with it: {row['detail_with']}"
    if row["bug_without_shim"]:
        return V_FIXED, f"without the shim: {row['detail_without']}; with it: {row['detail_with']}"
    if row["affected"]:
        return V_ABSENT, f"no bug in this scenario although the versions are in range: {row['detail_without']}"
    return V_NOT_NEEDED, f"bug absent, shim not needed ({answer.get('range_reason')}): {row['detail_without']}"


def bug_present_text(row: Dict[str, Any]) -> str:
    if row.get("status") == NO_PROBE:
        return "n/a (no probe)"
    if row.get("status") == SKIPPED:
        return "not probed (speed shim; --probe-all)"
    if row.get("bug_without_shim") is None:
        return f"could not run ({row.get('status')})"
    return "yes" if row["bug_without_shim"] else "no"


def fixed_text(row: Dict[str, Any]) -> str:
    if not row.get("bug_without_shim"):
        if row.get("bug_with_shim"):
            return "no (the shim causes it)"
        return "n/a"
    return "yes" if row.get("fixed") else "no"


def progress_text(row: Dict[str, Any]) -> str:
    if row.get("status") == OK:
        return f"bug present: {bug_present_text(row)}; fixed by the shim: {fixed_text(row)}"
    if row.get("status") in (NO_PROBE, SKIPPED):
        return row["status"]
    return f"could not run ({row.get('status')}): {row.get('error')}"


def is_problem(row: Dict[str, Any]) -> bool:
    """An unpatched present bug: it shows with the shim (not applied, disabled, or not fixing it)."""
    return bool(row.get("bug_with_shim")) or (bool(row.get("bug_without_shim")) and row.get("fixed") is False)


def run(
    timeout_s: float = DEFAULT_TIMEOUT_S,
    jobs: Optional[int] = None,
    progress: Optional[TextIO] = None,
    tasks: Optional[List[Task]] = None,
    fork: bool = True,
    include_speed: bool = False,
    environment: Optional[bool] = None,
) -> ProbeRun:
    """Start the probes (they run in the background); ``.results()`` collects them.

    ``environment`` (not None: the doctor's ``trial_imports``) asks the server for the doctor's torch
    section and shim trial too; :meth:`ProbeRun.environment` returns them."""
    tasks = tasks if tasks is not None else tasks_from_registry()
    return ProbeRun(
        tasks, timeout_s=timeout_s, jobs=jobs, progress=progress, fork=fork, include_speed=include_speed,
        environment=environment,
    )


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ProbeRun",
    "Task",
    "Server",
    "run",
    "is_problem",
    "bug_present_text",
    "fixed_text",
    "VERDICTS",
]
