"""``token_id_out_of_range``: an input id at or above the embedding's row count, as a clear error before the forward.

On a GPU the embedding lookup of such an id is a device-side assert, reported
asynchronously far from its cause (and it poisons the CUDA context). The ids are
checked where that costs no synchronisation: on CPU tensors. In a Trainer run
that is the batch as the collator returns it, before it reaches the device
(the callback wraps the train DataLoader's ``collate_fn``); in every run, the
forward's ``input_ids`` when they are on the CPU. Ids already on an accelerator
(a custom loop) are checked device-side and read at the next read point.
Default policy ``raise``: the forward would fail anyway.
"""

from __future__ import annotations

from . import Detector
from .. import facts

CODE = "token_id_out_of_range"


def _message(low: int, high: int, rows: int, where: str) -> tuple:
    bad = high if high >= rows else low
    return (f"input id {bad} is outside the embedding's {rows} rows (ids must be in 0..{rows - 1}; this batch "
            f"spans {low}..{high}), {where}", {"id": bad, "min_id": low, "max_id": high, "embedding_rows": rows})


class TokenIdOutOfRange(Detector):
    codes = (CODE,)

    def __init__(self):
        self.rows = None

    def begin(self, mon) -> None:
        self.rows = facts.embedding_rows(mon.model)
        vocab = getattr(facts.config(mon.model), "vocab_size", None)
        self.vocab = int(vocab) if isinstance(vocab, int) else None

    def host_check(self, mon, input_ids, where: str) -> None:
        """Check CPU ids now (free); report and, by default policy, raise before they are used."""
        import torch

        if self.rows is None or input_ids is None or not input_ids.numel():
            return
        low, high = (int(v) for v in torch.aminmax(input_ids))
        if 0 <= low and high < self.rows:
            return
        message, detail = _message(low, high, self.rows, where)
        detail["config_vocab_size"] = self.vocab
        mon.report(CODE, mon.step, message, (), detail)

    def worker_check(self, input_ids) -> None:
        """In a DataLoader worker: raise at once (the finding is made when the main process re-raises it)."""
        from ..findings import MonitorError

        if self.rows is None or not input_ids.numel():
            return
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.rows:
            message, _ = _message(low, high, self.rows, "in a DataLoader worker's batch")
            raise MonitorError(f"ftshims.monitor [{CODE}] {message}")

    def batch(self, mon, inputs, micro) -> None:
        ids = inputs.get("input_ids")
        if ids is None or self.rows is None or not ids.numel():
            return
        if ids.device.type == "cpu":
            self.host_check(mon, ids, "before the forward")
        else:
            import torch

            micro.ints["min_id"], micro.ints["max_id"] = torch.aminmax(ids)

    def read(self, mon, view) -> None:
        for values in view.values:
            if "max_id" in values and (values["max_id"] >= self.rows or values["min_id"] < 0):
                message, detail = _message(values["min_id"], values["max_id"], self.rows,
                                           "seen after the forward (the ids were already on the device)")
                mon.report(CODE, view.step, message, (), detail)
                return
