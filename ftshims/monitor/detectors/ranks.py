"""``ranks_identical_batches``: every rank of a distributed run received the same batch.

A sampler that does not shard (a plain ``RandomSampler`` with a shared seed, a
``SequentialSampler``, an iterable dataset without ``split_dataset_by_node``)
gives every rank the same data: N ranks train on 1/N of the data N times. At
step 1 and every ``hash_every`` steps the first micro-batch's input ids are
hashed on the device (a weighted sum, int64); at the read the ranks exchange
``(step, shape, hash)`` with one ``all_gather_object`` (every rank reads at the
same steps: read points are step-aligned). Equal everywhere: a finding.
"""

from __future__ import annotations

from . import Detector


def ids_hash(input_ids):
    """A device-side int64 hash of ``input_ids`` (position-weighted sum; wraps around, same on every rank)."""
    import torch

    flat = input_ids.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * 1000003 + 7
    return (flat * weights).sum()


class RanksIdenticalBatches(Detector):
    codes = ("ranks_identical_batches",)

    def sampled(self, mon, step: int) -> bool:
        return mon.world > 1 and (step == 1 or step % mon.options["hash_every"] == 0)

    def batch(self, mon, inputs, micro) -> None:
        ids = inputs.get("input_ids")
        if micro.index == 0 and ids is not None and self.sampled(mon, micro.step):
            micro.ints["hash"] = ids_hash(ids)
            micro.host["shape"] = list(ids.shape)

    def read(self, mon, view) -> None:
        if not self.sampled(mon, view.step):
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        first = view.micros[0] if view.micros and view.micros[0].index == 0 else None
        mine = (view.step, first.host.get("shape") if first else None, view.values[0].get("hash") if first else None)
        everyone = [None] * mon.world
        dist.all_gather_object(everyone, mine)  # every rank reaches this at the same step
        if mine[2] is None or any(other != mine for other in everyone):
            return
        mon.report("ranks_identical_batches", view.step,
                   f"all {mon.world} ranks received the same batch at step {view.step} (input ids of shape {mine[1]} "
                   "hash equal): the sampler does not shard the data (use DistributedSampler, or let accelerate/"
                   "the Trainer prepare the DataLoader)", (), {"world_size": mon.world, "hash": mine[2], "shape": mine[1]})
