"""``packing_contaminated``: a packed example whose logits differ from the same example run alone.

Once per run, on the first packed training batch: a row whose ``position_ids`` restart at 0 between real tokens
(at most ``LOOKS`` batches with position ids are read to the host to find one), or a single flattened row the
collator built from several examples without any boundary (TRL 0.19-0.23.0 padding-free batches: the Trainer
callback learns where the examples start from the collator's input, their lengths or the position ids of TRL's
packed rows). The row up to the end of its second example and that example alone (positions from 0, no padding)
go through two extra no-grad forwards, with the same attention inputs the training forward got (a 2D mask cut to
the row, a 4D block mask a collator built cut to the same rows and columns), the model in eval mode for them
(every dropout off, attention dropout too; each module's mode restored after): they draw no random number and
change no weight, so the run is the one it would be without the check. Under causal attention the first example
cannot see anything else, so the second is the first one that can be contaminated. Logits further apart than
``TOLERANCE`` (relative to their scale; ``HALF_TOLERANCE`` in fp16/bf16) mean the examples attend to each other.

Not judged under DeepSpeed ZeRO-3 (partitioned parameters; a note in the monitor's engine header, and rank 0
logs it once, at the first packed row). Every forward of a ZeRO-3 model goes through the engine's parameter
coordinator: hooks on each module gather its parameters and release them after, following a trace of the module
order that the start of a root forward resets, and the backward re-gathers by that bookkeeping. The two forwards
change it, and the run's next backward then meets a released, 0-element parameter (deepspeed 0.19.8, 2 CPU
ranks, TRL packing: "The size of tensor a (0) must match the size of tensor b (64)"): run inside the training
forward (from the model's forward pre-hook, as here) they reset the trace mid-step, and even run whole between
two optimizer steps, on every rank at once, they broke the next backward of a resumed run (the first step after
DeepSpeed's checkpoint load). A check that can break the run it watches stays out; what it looks for (attention
across packed examples) depends on the model, the attention and the collator, not on the engine, so one process
shows it.

Explains ``packing_block_mask`` (eager/sdpa with packed position ids), the
packing advisories of old transformers/torch, ``flash_attn_packing`` (flash
attention, flash-attn installed) and, for a row without position ids,
``trl_padding_free_position_ids``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from . import Detector
from .. import facts

LOOKS = 4
TOLERANCE = 1e-3
HALF_TOLERANCE = 3e-2


def packed_row(position_ids, attention_mask=None) -> Optional[Tuple[int, int, int]]:
    """``(row, start, end)`` of the second example of the first packed row, or None (reads the tensors to the host)."""
    import torch

    pos = position_ids.detach().to("cpu")
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    mask = None
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 2 and attention_mask.shape == pos.shape:
        mask = attention_mask.detach().to("cpu").bool()  # 2D padding; a 4D block mask keeps every token "real"
    for row in range(pos.shape[0]):
        real = mask[row] if mask is not None else torch.ones_like(pos[row], dtype=torch.bool)
        restarts = [i for i in range(1, pos.shape[1]) if int(pos[row, i]) == 0 and bool(real[i]) and bool(real[i - 1])]
        if not restarts:
            continue
        start = restarts[0]
        later = restarts[1:]
        last_real = int(real.nonzero().max()) + 1
        return row, start, (later[0] if later else last_real)
    return None


class PackingContaminated(Detector):
    codes = ("packing_contaminated",)

    def __init__(self):
        self.looked = 0
        self.done = False
        self.collated: List[List[int]] = []  # position ids of a flattened row the collator sent without them
        self.compared_at: Optional[int] = None  # the step whose packed row went through the two forwards
        self.zero3 = False  # DeepSpeed ZeRO-3: not judged (the module docstring)

    def begin(self, mon) -> None:
        self.zero3 = mon.engine.get("name") == "deepspeed" and mon.engine.get("zero_stage") == 3

    def note_collated(self, features, batch) -> None:
        """From the Trainer's collate_fn (main process): a single flattened row without position ids, built from
        several examples (or pre-packed rows with their own position ids, TRL's packed datasets): where they start."""
        if self.done or self.collated or not hasattr(batch, "get") or batch.get("position_ids") is not None:
            return
        ids = batch.get("input_ids")
        if ids is None or getattr(ids, "dim", lambda: 0)() != 2 or ids.shape[0] != 1:
            return
        positions: List[int] = []
        try:
            for feature in features:
                own = feature.get("position_ids") if hasattr(feature, "get") else None
                positions.extend(int(p) for p in own) if own is not None else positions.extend(range(len(feature["input_ids"])))
        except (KeyError, TypeError):
            return
        if len(positions) == ids.shape[1] and positions.count(0) >= 2:
            self.collated.append(positions)

    def batch(self, mon, inputs, micro) -> None:
        if self.done or micro.call is None:
            return
        ids = inputs.get("input_ids")
        if ids is None or ids.dim() != 2:
            return
        positions = inputs.get("position_ids")
        if positions is not None:
            self.looked += 1
            self.done = self.looked >= LOOKS
            found = packed_row(positions, inputs.get("attention_mask"))
            if found is not None:
                self.done = True
                self._check(mon, micro, inputs, *found, with_positions=True)
        elif self.collated and ids.shape[0] == 1 and len(self.collated[0]) == ids.shape[1]:
            import torch

            found = packed_row(torch.tensor([self.collated.pop(0)]))
            self.done = True
            if found is not None:
                self._check(mon, micro, inputs, *found, with_positions=False)

    def _check(self, mon, micro, inputs, row, start, end, with_positions) -> None:
        import torch

        if self.zero3:  # the first packed row: said once (rank 0), where it matters; no forward
            if mon.rank == 0:
                import logging

                logging.getLogger("ftshims.monitor").warning(
                    "step %d: packed rows, packing_contaminated not judged under DeepSpeed ZeRO-3 (its extra forwards "
                    "would break the run's next backward); run the check on one process", micro.step)
            return

        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        packed = {"input_ids": ids[row : row + 1, :end]}
        alone = {"input_ids": ids[row : row + 1, start:end]}
        if torch.is_tensor(mask) and mask.dim() == 2:
            packed["attention_mask"] = mask[row : row + 1, :end]
            alone["attention_mask"] = torch.ones_like(alone["input_ids"])
        elif torch.is_tensor(mask) and mask.dim() == 4:  # a block mask the collator built: the same rows and columns
            packed["attention_mask"] = mask[row : row + 1, :, :end, :end]
            alone["attention_mask"] = mask[row : row + 1, :, start:end, start:end]
        elif mask is not None:
            return  # a mask form this check cannot slice: no judgement
        if with_positions:
            packed["position_ids"] = inputs["position_ids"].reshape(ids.shape)[row : row + 1, :end]
            alone["position_ids"] = torch.arange(end - start, device=ids.device).unsqueeze(0)
        model = mon.model
        # the whole model in eval mode, not only its nn.Dropout modules: attention dropout is functional and reads
        # the attention module's own flag (Llama's ``dropout=0.0 if not self.training else ...``); run in training
        # mode it drew random numbers, which shifted every later dropout mask of the run, and put dropout noise
        # into the comparison (a false packing_contaminated with the packing fixed). Each module's mode restored.
        modes = [(m, m.training) for m in model.modules()]
        mon._busy = True
        try:
            model.eval()
            with torch.no_grad():
                packed_logits = getattr(model(**packed), "logits", None)
                alone_logits = getattr(model(**alone), "logits", None)
        finally:
            for m, training in modes:
                m.training = training
            mon._busy = False
        if packed_logits is None or alone_logits is None:
            return
        self.compared_at = micro.step
        a = packed_logits[0, start:end].float()
        b = alone_logits[0].float()
        diff = float((a - b).abs().max())
        scale = max(1.0, float(b.abs().max()))
        half = packed_logits.dtype in (torch.float16, torch.bfloat16)
        tolerance = HALF_TOLERANCE if half else TOLERANCE
        if diff <= tolerance * scale:
            return
        attention = facts.attn_implementation(model)
        if not with_positions:
            candidates = ("trl_padding_free_position_ids",)
        elif attention.startswith("flash"):
            candidates = ("flash_attn_packing",)
        else:
            candidates = ("packing_block_mask", "packing_contaminated_below_4_37", "packing_detection_needs_torch_2_6")
        boundary = "position_ids restart" if with_positions else "no position_ids: boundaries from the collator's examples"
        mon.report("packing_contaminated", micro.step,
                   f"packed examples attend to each other: the second example of a packed row ({boundary}; tokens "
                   f"{start}..{end - 1}) gives logits {diff:.3g} away from the same example alone ({attention} attention)",
                   candidates, {"max_abs_logit_diff": diff, "logit_scale": scale, "row": row, "start": start, "end": end,
                                "attention": attention, "position_ids": with_positions})
