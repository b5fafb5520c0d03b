"""torchrun worker for tests/monitor/test_distributed.py: a plain DDP loop (gloo, CPU) with the Monitor, run
twice: with a sampler that does not shard (every rank gets the same batches) and with DistributedSampler.

    torchrun --standalone --nproc_per_node=2 ranks.py OUT_DIR
"""

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftshims.monitor import Monitor

VOCAB = 64


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Tiny())
    ids = torch.randint(0, VOCAB, (32, 12), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    results = {}
    for name in ("plain", "sharded"):
        if name == "plain":
            sampler = torch.utils.data.SequentialSampler(dataset)
        else:
            sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=False)
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = Monitor(model, optimizer, log=str(out / f"{name}.jsonl"), hash_every=2)
        for step, batch in enumerate(loader, 1):
            loss = model(**batch)["loss"]
            loss.backward()
            monitor.after_backward(loss)
            optimizer.step()
            monitor.after_step()
            optimizer.zero_grad()
            if step == 4:
                break
        monitor.close()
        results[name] = [(f.code, f.step) for f in monitor.findings]
    (out / f"result.rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
