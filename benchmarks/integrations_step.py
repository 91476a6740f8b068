"""Step time of each framework route against the hand-written loop: same plan, data, ranks and model.

    .venv/bin/python benchmarks/integrations_step.py --steps 12

Four gloo ranks as 2 nodes of 2 train a Llama of 4 layers x 256 wide (seq 128, 2 rows a rank, accumulation 2,
AdamW, clipping) under one plan through: the hand-written loop (``ts.no_sync`` micro-steps, torch clipping),
``tiershard.hf.Trainer``, ``tiershard.hf.Accelerator`` and ``tiershard.lightning.TieredStrategy``. Each route
times its optimizer steps from one step's end to the next (data loading included), after two warm-up steps; the table gives the median and its ratio to the hand loop,
and the engine's bytes per step, which an integration must not change.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tiershard.cluster.local import run_local  # noqa: E402

ROWS, SEQ, ACCUM, VOCAB, WARM = 2, 128, 2, 512, 2


def build():
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=768,
                                            num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                                            max_position_embeddings=SEQ))


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        x = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def hand(plan, steps, world, rank):
    import tiershard as ts

    model = ts.shard(build(), plan, ts.Topology.from_env())
    opt = _optimizer(model)
    rows, times, start = Rows(10 ** 6), [], None
    for step in range(steps):
        for micro in range(ACCUM):
            first = ((step * ACCUM + micro) * world + rank) * ROWS
            batch = [rows[first + j] for j in range(ROWS)]
            batch = {k: torch.stack([b[k] for b in batch]) for k in batch[0]}
            with ts.no_sync(model) if micro < ACCUM - 1 else torch.enable_grad():
                model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        if start is not None:                       # step end to step end, as the framework routes
            times.append(now - start)
        start = now
    return times


def trainer(plan, steps, world, rank, root):
    import transformers as T

    import tiershard.hf as tsh

    times = []

    class Clock(T.TrainerCallback):              # step end to step end: the data loading is inside, as for all
        last = None

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            if self.last is not None:
                times.append(now - self.last)
            self.last = now

    args = T.TrainingArguments(f"{root}/trainer", per_device_train_batch_size=ROWS, gradient_accumulation_steps=ACCUM,
                               max_steps=steps, learning_rate=1e-4, weight_decay=0.1, max_grad_norm=1.0,
                               save_strategy="no", logging_steps=10 ** 6, report_to=[], use_cpu=True,
                               disable_tqdm=True, optim="adamw_torch")
    run = tsh.Trainer(model=build(), args=args, train_dataset=Rows(steps * ACCUM * ROWS * world), plan=plan,
                      callbacks=[Clock()])
    run.train()
    return times


def accelerate_loop(plan, steps, world, rank, root):
    import tiershard.hf as tsh

    accelerator = tsh.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, plan=plan)
    model = build()
    opt = _optimizer(model)
    loader = torch.utils.data.DataLoader(Rows(steps * ACCUM * ROWS * world), batch_size=ROWS)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    times, start = [], None
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:            # step end to step end
            now = time.perf_counter()
            if start is not None:
                times.append(now - start)
            start = now
    return times


def lightning_fit(plan, steps, world, rank, root):
    import pytorch_lightning as pl

    import tiershard as ts
    from tiershard.lightning import TieredStrategy

    times = []

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build()

        def configure_model(self):
            if getattr(self.model, "_tiershard", None) is None:
                ts.shard(self.model, plan, ts.Topology.from_env())

        def training_step(self, batch, index):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return _optimizer(self.model)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Rows(steps * ACCUM * ROWS * world), batch_size=ROWS)

    class Clock(pl.Callback):                    # optimizer step end to step end, as the other routes
        last, seen = None, 0

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            if trainer.global_step != self.seen:
                self.seen = trainer.global_step
                now = time.perf_counter()
                if self.last is not None:
                    times.append(now - self.last)
                self.last = now

    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=world // 2, strategy=TieredStrategy(),
                         max_steps=steps, accumulate_grad_batches=ACCUM, gradient_clip_val=1.0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=f"{root}/lightning", callbacks=[Clock()])
    trainer.fit(LM())
    return times


def rank(rank_, world, plan, steps, rounds, root):
    os.environ.update(LOCAL_RANK=str(rank_ % 2), NODE_RANK=str(rank_ // 2), LOCAL_WORLD_SIZE="2")
    import tiershard as ts
    from accelerate.state import AcceleratorState, GradientState

    out = {}
    for _ in range(rounds):                  # interleaved, so that a change of load hits every route alike
        for name, fn in (("hand loop", hand), ("tiershard.hf.Trainer", trainer),
                         ("tiershard.hf.Accelerator", accelerate_loop), ("tiershard.lightning", lightning_fit)):
            AcceleratorState._reset_state()
            GradientState._reset_state()
            os.environ.update(LOCAL_RANK=str(rank_ % 2), NODE_RANK=str(rank_ // 2), WORLD_SIZE=str(world))
            ts.reset_comm_stats()
            args = (plan, steps, world, rank_) + (() if fn is hand else (root,))
            times = fn(*args)[WARM:]
            stats = ts.comm_stats()
            entry = out.setdefault(name, {"times": [], "bytes": None})
            entry["times"] += times
            entry["bytes"] = stats
    return out if rank_ == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="IIG")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        out = run_local(rank, 4, args.plan, args.steps, args.rounds, root, timeout=3600)[0]
    base = statistics.median(out["hand loop"]["times"])
    print(f"| route ({args.plan}, 4 ranks as 2 nodes) | median step ms | vs hand loop | engine bytes = hand loop's |")
    print("| --- | ---: | ---: | --- |")
    for name, entry in out.items():
        median = statistics.median(entry["times"])
        same = "yes" if entry["bytes"] == out["hand loop"]["bytes"] else "no"
        print(f"| {name} | {median * 1e3:.0f} | {median / base:.2f} | {same} |")
    timed = len(out["hand loop"]["times"]) // args.rounds
    print(f"\nload average {os.getloadavg()[0]:.1f}; {timed} timed steps x {args.rounds} rounds per route")


if __name__ == "__main__":
    main()
