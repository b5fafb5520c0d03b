"""Training-step overhead of the default ``ftshims.apply()``: step time with and without it, side by side.

Four configurations (``--config``, default all):

* ``llama``: a ~33 M-parameter Llama (hidden 512, 8 layers, vocabulary 8000, sdpa), batch 2 x 512 tokens,
  a plain loop as the Trainer runs it: forward with labels, backward, ``clip_grad_norm_``, AdamW, ``zero_grad``;
* ``llama-packed``: the same model and loop, each row packing examples of 40-120 tokens with restarting
  ``position_ids`` (no attention mask, DataCollatorWithFlattening's form). Here ``packing_block_mask`` *acts*:
  it builds a block mask and attention runs with it instead of ``is_causal`` - the cost of the fix, not of a
  pass-through;
* ``llama-packed-nocache``: the packed rows with ``use_cache=False``: transformers' own packed-sequence
  detection (4.53+, no mask and no cache) builds the block mask itself, so the shims have nothing to fix and
  what is measured is their overhead on a packed run;
* ``bert``: a BERT-base-sized sequence classifier (hidden 768, 12 layers, vocabulary 30522, 110 M parameters)
  at sequence 256, batch 2, under ``Trainer.train()`` with gradient accumulation 2 (where the Trainer-side
  shims - ``num_items_in_batch_ignored`` on 4.48.1+, ``num_items_in_batch_overcount`` on 4.57-5.10 - run).

Both variants run in the same process, alternating: every repetition switches to one variant, runs
``--settle`` untimed steps (one-time work after a switch: a shim's per-model profile, the first micro-batch
``num_items_in_batch_ignored`` watches), then ``--block`` timed steps; then the same for the other variant
(the order alternates between repetitions, so drift hits both alike). The switch is the real one:
``ftshims.apply()`` / ``ftshims.revert()`` (``--toggle layers`` instead turns the installed wrappers into
pass-throughs, the patcher's own switch, as bench/mask_overhead.py does). The Trainer's
``model_accepts_loss_kwargs``, which ``num_items_in_batch_ignored`` decides once per trainer, is set to what
each variant computes. Process CPU time with one thread is the default clock: on a shared machine wall time
mostly measures the neighbours. Reported: the median step time of each variant, the ratio of the medians,
the median and quartiles of the per-repetition ratios, and which shims acted. Target: <= 1.01.

    python bench/apply_overhead.py                          # all four configurations, 11 repetitions
    python bench/apply_overhead.py --config llama --reps 21
    python bench/apply_overhead.py --config bert --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = ("llama", "llama-packed", "llama-packed-nocache", "bert")
OWN_LAST = {"seconds": 0.0, "calls": 0, "steps": 0}  # the last configuration's OwnTime totals


def llama(seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1344, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq,
                         tie_word_embeddings=False)
    try:
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    except (TypeError, ValueError):
        model = LlamaForCausalLM(config)
    return model.train()


def llama_batches(batch: int, seq: int, packed: bool, n: int = 4, use_cache=None):
    """``n`` batches of random ids; packed rows hold examples of 40-120 tokens with restarting position ids."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 8000, (batch, seq), generator=g)
        item = {"input_ids": ids, "labels": ids.clone()}
        if packed:
            rows = []
            for _ in range(batch):
                lengths = []
                while sum(lengths) < seq:
                    lengths.append(int(torch.randint(40, 121, (1,), generator=g)))
                lengths[-1] -= sum(lengths) - seq
                rows.append(torch.cat([torch.arange(length) for length in lengths]))
            item["position_ids"] = torch.stack(rows)
            item["labels"] = ids.masked_fill(item["position_ids"] == 0, -100)
            if use_cache is not None:
                item["use_cache"] = use_cache
        else:
            item["attention_mask"] = torch.ones_like(ids)
        out.append(item)
    return out


class OwnTime:
    """The shims' own work, timed inside their wrappers: CPU time in each ftshims wrapper minus the time spent in
    the call it wraps (nested wrappers counted once each). Installed before ``apply()``, through the patcher's
    wrapper builder; only while ``counting`` (the timed steps with the shims on). Immune to the neighbours' noise;
    it leaves out what a shim changes inside the wrapped call (a block mask makes attention itself cost more)."""

    def __init__(self, clock):
        from ftshims import patching

        self.clock = clock
        self.seconds = 0.0
        self.calls = 0
        self.counting = False
        self._inside = []  # per active wrapper: time spent in the call it wraps
        builder = patching._wrapper_builder

        def timed_builder(layer, wrapper, method):
            return builder(layer, self._timed(wrapper), method)

        patching._wrapper_builder = timed_builder

    def _timed(self, wrapper):
        own = self

        class Inner:
            """The wrapped call, timed; attributes (``__self__``, ``__func__``) read through."""

            def __init__(self, wrapped, frame):
                self.wrapped, self.frame = wrapped, frame

            def __getattr__(self, name):
                return getattr(self.wrapped, name)

            def __call__(self, *args, **kwargs):
                self.frame[1] = True
                start = own.clock()
                try:
                    return self.wrapped(*args, **kwargs)
                finally:
                    self.frame[0] += own.clock() - start
                    self.frame[1] = False

        def run(wrapped, instance, args, kwargs):
            if not own.counting:
                return wrapper(wrapped, instance, args, kwargs)
            frame = [0.0, False]  # time in the wrapped call; whether that call is running now
            own._inside.append(frame)
            start = own.clock()
            try:
                return wrapper(Inner(wrapped, frame), instance, args, kwargs)
            finally:
                total = own.clock() - start
                own._inside.pop()
                own.seconds += total - frame[0]
                own.calls += 1
                if own._inside and not own._inside[-1][1]:
                    # called from an enclosing wrapper's own code (not through its wrapped call): counted here,
                    # so not as that wrapper's work
                    own._inside[-1][0] += total

        return run


class Switch:
    """Turns the default shims on and off: apply()/revert(), or the installed wrappers' pass-through flags."""

    def __init__(self, how: str, clock):
        import ftshims

        self.own = OwnTime(clock)
        self.how = how
        self.on = None
        self.report = ftshims.apply()  # every deferred part installs as its module is imported
        self.layers = []
        self.trainer = None  # (trainer, {True: flag with the shims, False: flag without})
        self.acted = {}  # what the shims did, summed over the switches (an install starts its counts afresh)

    def _collect(self) -> None:
        from ftshims import _util

        for (shim, action), n in list(_util.ACTIONS.items()):
            key = f"{shim}: {action}"
            self.acted[key] = self.acted.get(key, 0) + n
        _util.ACTIONS.clear()

    def set(self, on: bool) -> None:
        import ftshims
        from ftshims import _manager

        if on == self.on:
            return
        self._collect()
        if self.how == "apply":
            ftshims.apply() if on else ftshims.revert()
        else:
            if not self.layers:
                self.layers = [layer for record in _manager._RECORDS.values() if record.patcher is not None
                               for _, layer in record.patcher._layers]
            for layer in self.layers:
                layer.active = on
        if self.trainer is not None and on in self.trainer[1]:
            self.trainer[0].model_accepts_loss_kwargs = self.trainer[1][on]
        self.on = on
        gc.collect()

    def close(self) -> None:
        import ftshims

        self._collect()
        for layer in self.layers:
            layer.active = True
        ftshims.revert()


def measure(step, switch: Switch, reps: int, settle: int, block: int, clock):
    """Alternate the variants; returns {True: [seconds per step per block], False: [...]} and per-rep ratios."""
    times = {True: [], False: []}
    ratios = []
    for rep in range(reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        got = {}
        for on in order:
            switch.set(on)
            for _ in range(settle):
                step()
            switch.own.counting = on
            start = clock()
            for _ in range(block):
                step()
            got[on] = (clock() - start) / block
            switch.own.counting = False
            times[on].append(got[on])
        ratios.append(got[True] / got[False])
    return times, ratios


def run_llama(args, packed: bool, clock, use_cache=None):
    import torch

    from ftshims import _util

    switch = Switch(args.toggle, clock)
    model = llama(args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = llama_batches(args.batch, args.seq, packed, use_cache=use_cache)
    state = {"i": 0}

    def step():
        batch = batches[state["i"] % len(batches)]
        state["i"] += 1
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _util.ACTIONS.clear()
    switch.set(True)
    step()  # warm-up, both ways
    switch.set(False)
    step()
    result = measure(step, switch, args.reps, args.settle, args.block, clock)
    switch.close()
    OWN_LAST.update(seconds=switch.own.seconds, calls=switch.own.calls, steps=args.reps * args.block)
    params = sum(p.numel() for p in model.parameters())
    what = ", packed rows" if packed else ""
    if use_cache is False:
        what += " and use_cache=False (transformers' own packed-sequence detection isolates them: nothing to fix)"
    return result, switch.acted, params, f"batch {args.batch} x {args.seq}{what}"


def run_bert(args, clock):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from ftshims import _util
    from ftshims.tiny import quiet

    switch = Switch(args.toggle, clock)
    torch.manual_seed(0)
    config = BertConfig(num_labels=3, max_position_embeddings=512)  # bert-base-uncased's sizes
    model = BertForSequenceClassification(config).train()
    seq = args.bert_seq
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor(i % 3)}
            for i, ids in enumerate(torch.randint(1000, 30000, (64, seq), generator=g))]
    steps_per_variant = args.settle + args.block
    warmup = 2
    total = warmup + args.reps * 2 * steps_per_variant
    # the schedule of every optimizer step: (variant, timed)
    schedule = [(True, False), (False, False)]
    for rep in range(args.reps):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            schedule += [(on, False)] * args.settle + [(on, True)] * args.block
    samples = {True: [], False: []}
    per_rep = []

    class Timer(TrainerCallback):
        def __init__(self):
            self.start = None

        def on_train_begin(self, a, state, control, **kwargs):
            switch.set(schedule[0][0])
            self.start = clock()

        def on_step_end(self, a, state, control, **kwargs):
            took = clock() - self.start
            k = state.global_step - 1
            on, timed = schedule[k]
            if k == 0 and switch.trainer is None:
                switch.trainer = (trainer, {True: trainer.model_accepts_loss_kwargs, False: flag_without})
            if timed:
                samples[on].append(took)
            if k + 1 < len(schedule):
                switch.set(schedule[k + 1][0])
                switch.own.counting = schedule[k + 1] == (True, True)
            self.start = clock()

    collate = lambda batch: {key: torch.stack([row[key] for row in batch]) for key in batch[0]}  # noqa: E731
    _util.ACTIONS.clear()
    with tempfile.TemporaryDirectory() as output_dir, quiet():
        training = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=args.batch,
                                     gradient_accumulation_steps=2, max_steps=total, learning_rate=1e-5,
                                     logging_steps=10 ** 6, save_strategy="no", report_to=[], disable_tqdm=True,
                                     use_cpu=True, dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=model, args=training, train_dataset=rows * (total * 4 * args.batch // 64 + 1),
                          data_collator=collate, callbacks=[Timer()])
        flag_without = getattr(trainer, "model_accepts_loss_kwargs", False)
        trainer.train()
    switch.close()
    OWN_LAST.update(seconds=switch.own.seconds, calls=switch.own.calls, steps=args.reps * args.block)
    for rep in range(args.reps):
        on_block = samples[True][rep * args.block:(rep + 1) * args.block]
        off_block = samples[False][rep * args.block:(rep + 1) * args.block]
        per_rep.append(statistics.mean(on_block) / statistics.mean(off_block))
    block_means = {on: [statistics.mean(samples[on][i:i + args.block]) for i in range(0, len(samples[on]), args.block)]
                   for on in (True, False)}
    params = sum(p.numel() for p in model.parameters())
    note = (f"Trainer, batch {args.batch} x {seq}, gradient accumulation 2; model_accepts_loss_kwargs with the "
            f"shims {switch.trainer[1][True]}, without {switch.trainer[1][False]}")
    return (block_means, per_rep), switch.acted, params, note


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", choices=CONFIGS, help="default: all four")
    parser.add_argument("--reps", type=int, default=11, help="repetitions (each runs both variants)")
    parser.add_argument("--settle", type=int, default=1, help="untimed steps after each switch")
    parser.add_argument("--block", type=int, default=2, help="timed steps after each switch")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512, help="Llama sequence length")
    parser.add_argument("--bert-seq", type=int, default=256)
    parser.add_argument("--toggle", choices=("apply", "layers"), default="apply",
                        help="apply: ftshims.apply()/revert() at each switch; layers: the wrappers' pass-through flags")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    results = {}
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{'process CPU time' if args.clock == 'cpu' else 'wall time'}, toggle {args.toggle}, {args.reps} repetitions "
          f"x ({args.settle} untimed + {args.block} timed steps) per variant")
    for config in args.config or CONFIGS:
        if config == "bert":
            (times, ratios), acted, params, note = run_bert(args, clock)
        else:
            packed = config.startswith("llama-packed")
            (times, ratios), acted, params, note = run_llama(args, packed, clock,
                                                             use_cache=False if config.endswith("nocache") else None)
        acted = {key: n for key, n in acted.items() if n}
        on, off = statistics.median(times[True]), statistics.median(times[False])
        own = OWN_LAST["seconds"] / max(1, OWN_LAST["steps"])
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        results[config] = {
            "params_million": round(params / 1e6, 1), "what": note, "step_s_without": round(off, 4),
            "step_s_with": round(on, 4), "ratio_of_medians": round(on / off, 4),
            "median_ratio": round(statistics.median(ratios), 4), "ratio_quartiles": [round(x, 4) for x in q],
            "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)], "acted": acted,
            "ratios": [round(r, 4) for r in ratios], "own_s_per_step": round(own, 6),
            "own_fraction": round(own / off, 6), "own_wrapper_calls_per_step": OWN_LAST["calls"] / max(1, OWN_LAST["steps"]),
        }
        r = results[config]
        print(f"{config}: {r['params_million']} M parameters, {note}")
        print(f"  step without ftshims {off:.3f} s, with apply() {on:.3f} s: ratio of medians {on / off:.4f}; "
              f"per-repetition ratios median {r['median_ratio']:.4f}, quartiles {q[0]:.4f} / {q[2]:.4f}, "
              f"range {min(ratios):.4f}-{max(ratios):.4f} (target <= 1.01)")
        print(f"  the shims' own work, timed inside their wrappers: {own * 1e3:.2f} ms per step = {own / off:.3%} of the "
              f"step ({r['own_wrapper_calls_per_step']:.0f} wrapper calls per step)")
        print(f"  acted: {acted or 'nothing'}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "args": vars(args),
                       "results": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
