"""DeepSpeed ZeRO-3 ranks for ``resize_embeddings_frozen_under_zero3``: frozen input embeddings, a resize, a step.

Run under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo). Two modes, one after the other in the same
ranks: ``off`` (no shim) and ``on`` (``ftshims.apply(only=[the shim], strict=True)``). Each mode, with a ZeRO-3
``HfDeepSpeedConfig`` alive: a tiny untied Llama saved by rank 0 is loaded with ``from_pretrained`` (so under
``zero.Init``: partitioned parameters), its input embeddings frozen, ``resize_token_embeddings`` adds 8 rows,
then one DeepSpeed step (``deepspeed.initialize`` with a torch SGD over the parameters that require grad).
Recorded per mode: the input and output embeddings' ``requires_grad`` before and after the resize, whether the
input embedding is in the optimizer, whether the embedding's values changed in the step (gathered), the loss.

``--noop-shim ID`` installs that shim as a no-op in the ranks (the mutation check, ``tests/noop_shims.py``).
Each rank writes ``<--out>/rank<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHIM = "resize_embeddings_frozen_under_zero3"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def ds_config():
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3}, "steps_per_print": 1000, "zero_allow_untested_optimizer": True}


def gathered(param):
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.detach().clone()


def run_mode(base, rank):
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from ftshims import tiny

    dschf = HfDeepSpeedConfig(ds_config())  # noqa: F841  (kept alive: from_pretrained builds under zero.Init)
    with tiny.quiet():
        model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa")
    embed = model.get_input_embeddings()
    result = {"zero_init": hasattr(embed.weight, "ds_id")}
    embed.weight.requires_grad_(False)
    result["input_before"] = embed.weight.requires_grad
    result["output_before"] = model.get_output_embeddings().weight.requires_grad
    torch.manual_seed(123)
    with tiny.quiet():
        model.resize_token_embeddings(136)
    embed = model.get_input_embeddings()
    result["input_after"] = embed.weight.requires_grad
    result["output_after"] = model.get_output_embeddings().weight.requires_grad
    result["vocab"] = model.config.vocab_size
    before = gathered(embed.weight)
    trainable = [p for p in model.parameters() if p.requires_grad]
    result["embed_in_optimizer"] = any(p is embed.weight for p in trainable)
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config())
    g = torch.Generator().manual_seed(7 + rank)
    ids = torch.randint(3, 136, (1, 8), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    after = gathered(engine.module.get_input_embeddings().weight)
    result["loss"] = float(loss.detach())
    result["embed_changed"] = not torch.equal(before, after)
    result["embed_max_change"] = float((after - before).abs().max())
    engine.destroy()
    unset_hf_deepspeed_config()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--noop-shim", action="append", default=[])
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    if args.noop_shim:
        from tests.noop_shims import make_noop

        make_noop(args.noop_shim)
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    import ftshims
    from ftshims import tiny

    base = os.path.join(args.out, "base")
    if rank == 0:
        tiny.tiny_llama(attn="sdpa", tie_word_embeddings=False).save_pretrained(base)
    torch.distributed.barrier()
    results = {"off": run_mode(base, rank)}
    torch.distributed.barrier()
    ftshims.apply(only=[SHIM], strict=True)
    results["on"] = run_mode(base, rank)
    results["status"] = {e.id: e.status for e in ftshims.status()}[SHIM]
    results["acted"] = {e.id: dict(e.actions) for e in ftshims.status() if e.actions}.get(SHIM, {})
    torch.distributed.barrier()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
