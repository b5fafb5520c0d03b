"""``rope_low_precision``: a rotary ``inv_freq`` buffer in fp16/bf16 while training.

``model.to(torch.bfloat16)`` casts RoPE's ``inv_freq`` buffer with the weights;
the phases ``position * inv_freq`` then lose precision at every position
(``rope_inv_freq_fp32``). Checked once, right after the first training forward
(a dtype is host metadata: no device read): by then ``rope_inv_freq_fp32``, when
applied, has repaired a buffer that was cast before ``apply()``.
"""

from __future__ import annotations

from . import Detector


class RopeLowPrecision(Detector):
    codes = ("rope_low_precision",)

    def __init__(self):
        self.done = False

    def output(self, mon, micro, output) -> None:
        if self.done:
            return
        self.done = True
        import torch

        low = [(name, str(buf.dtype).replace("torch.", "")) for name, buf in mon.model.named_buffers()
               if name.rsplit(".", 1)[-1].endswith("inv_freq") and buf.dtype in (torch.float16, torch.bfloat16)]
        if not low:
            return
        names = [name for name, _ in low]
        mon.report("rope_low_precision", micro.step,
                   f"{len(names)} rotary inv_freq buffer{'s are' if len(names) != 1 else ' is'} {low[0][1]}, not float32 "
                   f"({', '.join(names[:3])}): rotary phases lose precision at every position",
                   ("rope_inv_freq_fp32",), {"buffers": names, "dtype": low[0][1]})
