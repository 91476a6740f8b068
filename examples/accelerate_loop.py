"""A custom accelerate loop over a sharded model: ``tiershard.hf.Accelerator`` in place of ``accelerate.Accelerator``.

    torchrun --nproc-per-node 4 examples/accelerate_loop.py

Everything else is accelerate's own recipe: ``prepare`` of the model, optimizer (built before the model is
sharded: it is pointed at the shards), scheduler and loader; ``accumulate``, ``backward``, ``clip_grad_norm_``
(the global norm), ``gather_for_metrics``; ``save_state`` / ``load_state`` (the model and optimizer through
``ts.save`` / ``ts.load``, loadable on any world size).
"""
from __future__ import annotations

import torch
import transformers as T

import tiershard.hf as tsh


def main(out: str = "runs/accelerate_loop", micro_steps: int = 8) -> list[float]:
    accelerator = tsh.Accelerator(gradient_accumulation_steps=2, plan="IIG", cpu=not torch.cuda.is_available())
    config = T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    model = T.GPT2LMHeadModel(config)                           # tied embeddings: kept tied when sharded
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-3)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=micro_steps)
    rows = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    losses = []
    for step, batch in zip(range(micro_steps), loader):
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather_for_metrics(loss.detach()[None]).mean().item())
    accelerator.save_state(out)               # accelerate.load_state(out) resumes, on any world size
    return losses


if __name__ == "__main__":
    print(main())
