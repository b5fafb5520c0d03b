"""What the monitor reports: a :class:`Finding` per symptom, and :class:`MonitorError` for ``policy="raise"``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class Finding:
    """One symptom seen in the running job.

    ``code``: the detector's stable snake-case id (``ftshims.monitor.options.CODES``);
    ``severity``: ``error`` / ``warning`` / ``info``; ``step``: the optimizer step
    it was seen at (0: at train begin; the Trainer's ``global_step`` numbering);
    ``explains``: the catalogue ids (shims and advisories) whose bug produces this
    symptom on the installed versions; ``detail``: for each of them whether it is
    applied (``detail["applied"]``), plus the numbers behind the finding.
    """

    code: str
    severity: str
    step: int
    message: str
    explains: List[str] = field(default_factory=list)
    detail: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """The one log line: ``[code] step N: message``."""
        return f"[{self.code}] step {self.step}: {self.message}"


class MonitorError(RuntimeError):
    """Raised at the step of a finding whose policy is ``"raise"``; ``.finding`` is the finding.

    Takes the message alone too, so that a DataLoader worker can re-raise it in the main process.
    """

    def __init__(self, message: str, finding: Optional[Finding] = None):
        super().__init__(message)
        self.finding = finding
