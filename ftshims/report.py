"""What ``apply()`` / ``status()`` return: one line per shim, printable and serialisable."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List, Optional

APPLIED = "applied"
DEFERRED = "deferred"
NOT_NEEDED = "not needed"
DISABLED = "disabled"
TARGET_MISSING = "target missing"
FAILED = "failed"
NOT_APPLIED = "not applied"


@dataclass
class ShimStatus:
    id: str
    kind: str
    status: str
    reason: str
    title: str = ""
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    patched: List[str] = field(default_factory=list)
    waiting: List[str] = field(default_factory=list)  # modules whose parts are installed on import
    notes: List[str] = field(default_factory=list)  # what an active shim left alone, and why
    # What the shim delivers here, in the vocabulary shared with the doctor and COMPAT_MATRIX.md
    # (ftshims.verdicts): fixed / fixed on a stand-in / guarded / warned / same results while
    # active, absent when the installed versions are outside its range, else not run.
    evidence: str = "not run"
    # How often it acted since installed: {"block masks built": 12} (empty: installed, never needed)
    actions: Dict[str, int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.status in (APPLIED, DEFERRED)

    def line(self, id_width: int = 0) -> str:
        return f"{self.id:<{id_width}}  {self.status:<14}  {self.reason}"


class Report:
    """An ordered collection of :class:`ShimStatus`; ``report["shim_id"]`` looks one up."""

    def __init__(self, entries: List[ShimStatus]):
        self.entries = list(entries)

    def __iter__(self) -> Iterator[ShimStatus]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, shim_id: str) -> ShimStatus:
        for entry in self.entries:
            if entry.id == shim_id:
                return entry
        raise KeyError(shim_id)

    def ids(self, status: str) -> List[str]:
        return [e.id for e in self.entries if e.status == status]

    @property
    def applied(self) -> List[str]:
        return self.ids(APPLIED)

    def summary(self) -> str:
        counts = {}
        for entry in self.entries:
            counts[entry.status] = counts.get(entry.status, 0) + 1
        return ", ".join(f"{n} {status}" for status, n in counts.items()) or "no shims"

    def __str__(self) -> str:
        width = max((len(e.id) for e in self.entries), default=0)
        lines = [f"ftshims: {self.summary()}"]
        lines += ["  " + e.line(width) for e in self.entries]
        return "\n".join(lines)

    __repr__ = __str__

    def to_dict(self) -> dict:
        return {"shims": [asdict(e) for e in self.entries]}
