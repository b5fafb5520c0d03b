"""The monitor's JSON lines: one file per rank, one record per line, flushed as written.

Records (``"type"``): ``header`` (rank, world size, versions, ftshims' fingerprint,
the options), ``step`` (``step``, ``loss``, ``grad_norm``, ``lr``: the monitor's own
per-step values), ``log`` (what the Trainer logged at a logging step), ``finding``
(a :class:`~ftshims.monitor.findings.Finding`), ``skip`` (policy ``"skip"``: a step whose
update was not applied: ``step``, ``reasons``, ``by`` (``monitor`` or ``deepspeed``),
``consecutive``), ``updates`` (the update statistics of a sampled step: ``step``, ``lr``, ``ratio``
the median ||dw||/||w||, ``lost`` the share of unchanged elements with a gradient in bf16/fp16 weights),
``summary`` (at the end; on rank 0 with every rank's codes; ``skipped``:
the skipped steps). Every record carries ``rank``. A distributed run writes
``<stem>.rank<N><suffix>`` per rank (``run.jsonl`` -> ``run.rank1.jsonl``).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional


def rank_path(path: str, rank: int, world: int) -> str:
    if world <= 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def _number(value: Optional[float]):
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else str(value)  # "nan"/"inf": JSON has no literal for them


class JsonlWriter:
    def __init__(self, path: str, rank: int, world: int):
        self.path = rank_path(path, rank, world)
        self.rank = rank
        self.world = world
        self._file = open(self.path, "w", encoding="utf-8")

    def write(self, record: Dict[str, Any]) -> None:
        if self._file.closed:
            return
        self._file.write(json.dumps({"rank": self.rank, **record}, sort_keys=False) + "\n")
        self._file.flush()

    def header(self, extra: Dict[str, Any]) -> None:
        import ftshims
        from ..versions import installed_versions

        versions = installed_versions(("torch", "transformers", "peft", "trl", "accelerate", "flash-attn"))
        self.write({"type": "header", "world_size": self.world, "time": time.time(), "ftshims": ftshims.__version__,
                    "versions": {k: v for k, v in versions.items() if v}, **extra})

    def step(self, step: int, loss, grad_norm, lr) -> None:
        self.write({"type": "step", "step": step, "loss": _number(loss), "grad_norm": _number(grad_norm), "lr": _number(lr)})

    def log(self, step: int, logs: Dict[str, Any]) -> None:
        numbers = {k: _number(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.write({"type": "log", "step": step, **numbers})

    def updates(self, record: Dict[str, Any]) -> None:
        self.write({"type": "updates", **{k: _number(v) if isinstance(v, float) else v for k, v in record.items()}})

    def skip(self, record: Dict[str, Any]) -> None:
        self.write({"type": "skip", **record})

    def finding(self, finding) -> None:
        self.write({"type": "finding", **finding.to_dict()})

    def summary(self, monitor, per_rank: Optional[List[List[str]]]) -> None:
        record = {"type": "summary", "steps": monitor.steps_done, "findings": [f.code for f in monitor.findings],
                  "skipped": [s["step"] for s in monitor.skipped], "text": monitor.summary()}
        if per_rank is not None:
            record["ranks"] = per_rank
        self.write(record)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read(paths: Iterable[str]) -> List[Dict[str, Any]]:
    """Every record of the given files, in order (a line that is not JSON is an error naming file and line)."""
    records: List[Dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from None
                record.setdefault("_file", os.fspath(path))
                records.append(record)
    return records
