"""PyTorch Lightning over a sharded model: shard in ``configure_model()``, ``strategy=TieredStrategy()``.

    torchrun --nproc-per-node 4 examples/lightning_fit.py

Lightning's own ``fit`` with ``precision="bf16-mixed"``, ``accumulate_grad_batches`` (the micro-steps under
``ts.no_sync``), ``gradient_clip_val`` (the global norm) and ``ModelCheckpoint`` (``ts.save`` folders; resume with
``ckpt_path=``, on any world size).
"""
from __future__ import annotations

import os

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import transformers as T

import tiershard as ts
from tiershard.lightning import TieredStrategy


class LanguageModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = T.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
        with torch.device("meta"):                     # built without memory; ts.shard materialises the shards
            self.model = T.LlamaForCausalLM(config)

    def configure_model(self) -> None:
        if getattr(self.model, "_tiershard", None) is None:
            ts.shard(self.model, "IIG", ts.Topology.from_env(), device=self.device,
                     init=lambda module: self.model._init_weights(module))

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)

    def train_dataloader(self):
        rows = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(rows, batch_size=2)


def main(out: str = "runs/lightning_fit", max_steps: int = 4) -> float:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))            # torchrun's; Lightning asks for them
    nodes = int(os.environ.get("WORLD_SIZE", per_node)) // per_node
    trainer = pl.Trainer(accelerator="auto", devices=per_node, num_nodes=nodes, strategy=TieredStrategy(),
                         max_steps=max_steps,
                         precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=1.0,
                         default_root_dir=out, logger=False, enable_progress_bar=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=2)])
    module = LanguageModel()
    trainer.fit(module)
    return float(trainer.callback_metrics["loss"])


if __name__ == "__main__":
    loss = main()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"loss {loss:.4f}")
