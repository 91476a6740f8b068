"""Fine-tune a transformers Llama with tiershard: built on the meta device, planned by the cost model.

A tiny randomly initialised Llama (byte vocabulary) trains on the embedded corpus (Python's standard library
sources) on 4 CPU ranks emulating 2 nodes of 2::

    .venv/bin/torchrun --nproc-per-node 4 examples/hf_finetune.py                  # --plan auto
    .venv/bin/torchrun --nproc-per-node 4 examples/hf_finetune.py --plan IIG --lora --save runs/llama-lora

Nothing is downloaded. The model never exists in full on a rank: it is built under ``torch.device("meta")``
and ``ts.shard`` materialises this rank's shards with the model's own ``_init_weights``. With ``--lora`` only
PEFT adapters train (frozen weights keep no fp32 copy and no optimizer state; try ``--plan ING``).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers

import tiershard as ts
from tiershard import cost
from tiershard.train import data

SEQ, VOCAB = 64, 256


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                    tie_word_embeddings=False)


def pick_plan(model: torch.nn.Module, topo: ts.Topology, batch: int) -> str:
    """The planner's choice for this machine: its memory per rank, 10 GB/s inside a node, 1 GB/s between."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / topo.world_size
    bandwidths = [10e9] * (len(topo.sizes) - 1) + [1e9]
    cluster = cost.Cluster(tiers=tuple(cost.Tier(name=n, size=s, bandwidth=b)
                                       for n, s, b in zip(topo.names, topo.sizes, bandwidths)),
                           gpu_memory=memory, peak_flops=5e10, name="this machine")
    spec = cost.ModelSpec.from_module(model, wrap={"LlamaDecoderLayer"})
    return str(cost.auto_plan(spec, cluster, cost.Job(micro_batch=batch, seq=SEQ, param_bytes=4, reduce_bytes=4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="auto")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=4, help="rows per rank")
    parser.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters only")
    parser.add_argument("--save", default=None, help="folder for save_pretrained (rank 0 writes it)")
    args = parser.parse_args()
    os.environ.setdefault("TIERSHARD_TOPOLOGY", "2,4")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    topo = ts.Topology.from_env()

    with torch.device("meta"):                     # no weights anywhere yet
        model = transformers.LlamaForCausalLM(llama_config())
    init = model._init_weights
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))
    plan = pick_plan(model, topo, args.batch) if args.plan == "auto" else args.plan
    model = ts.shard(model, plan, topo, wrap={"LlamaDecoderLayer"}, init=init)   # the model's _no_split_modules
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in trainable if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3 if args.lora else 1e-3)

    tokens = data.load(data.DataConfig(max_bytes=1_000_000))
    if rank == 0:
        print(f"plan {plan} over {topo.sizes}; {sum(p.numel() for _, p in trainable):,} trainable of "
              f"{sum(p.numel() for p in model.parameters()):,} parameters; {tokens.description}", flush=True)
    for step in range(args.steps):
        x, y = data.train_batch(tokens.train, SEQ, args.batch, rank, world, seed=0, step=step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    prompt = torch.tensor([list(b"def ")])
    with torch.no_grad():                          # exact weights, whatever the plan quantizes
        text = model.generate(prompt, max_new_tokens=24, do_sample=False)
    if rank == 0:
        print("sample:", bytes(text[0].tolist()).decode("utf-8", "replace"))
    state = ts.full_state_dict(model, rank0_only=True)      # the whole model on rank 0 only
    if args.save and rank == 0:
        model.save_pretrained(args.save, state_dict=state)
        print(f"saved to {args.save}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
