"""transformers.Trainer over a sharded model: ``tiershard.hf.Trainer`` takes what Trainer takes, plus ``plan=``.

    torchrun --nproc-per-node 4 examples/hf_trainer.py            # TIERSHARD_TOPOLOGY=2,4 for two "nodes" of 2

A tiny Llama (random weights, no download) on random tokens, AdamW with Trainer's weight-decay groups, accumulation,
clipping, a checkpoint every 4 steps (``checkpoint-N/tiershard`` beside Trainer's own files) and a
``from_pretrained`` folder at the end. ``resume_from_checkpoint=True`` on the second run, on any world size.
"""
from __future__ import annotations

import sys

import torch
import transformers as T

import tiershard.hf as tsh


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        x = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def main(out: str = "runs/hf_trainer", max_steps: int = 8, resume: bool = False) -> list[float]:
    config = T.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    args = T.TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               max_steps=max_steps, learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0,
                               save_steps=4, logging_steps=1, report_to=[], use_cpu=not torch.cuda.is_available())
    trainer = tsh.Trainer(model=T.LlamaForCausalLM(config), args=args, train_dataset=RandomTokens(),
                          plan="IIG")          # or leave plan out: the planner's fastest exact plan that fits
    trainer.train(resume_from_checkpoint=resume or None)
    trainer.save_model(f"{out}/final")        # every rank gathers, rank 0 writes; from_pretrained reads it
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    print(main(resume="--resume" in sys.argv))
