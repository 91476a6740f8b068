"""transformers.Trainer, accelerate and Lightning over a sharded model, each against its own DDP route.

Four gloo ranks as two emulated nodes (``IIG``) train a tiny Llama and a tied GPT-2 for 8 optimizer steps with
accumulation 2, AdamW with weight-decay groups, an LR schedule and clipping that is active (the norms exceed
it): ``tiershard.hf.Trainer`` against ``transformers.Trainer`` + DDP (with evaluation and
``load_best_model_at_end``), ``tiershard.hf.Accelerator`` against ``accelerate.Accelerator`` + DDP, and
``tiershard.lightning.TieredStrategy`` against Lightning's ``ddp``; losses and weights agree to 1e-4. Each route
resumes from its own mid-run checkpoint with the unbroken run's losses, and two ranks under ``zero3`` resume the
same checkpoints within fp32 noise. The plain routes given a sharded model stop with tiershard's error before a
step; the Trainer's collectives are the hand-written loop's. One launch of four ranks, one of two.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import pytest
import torch

from _dist import run_ranks

VOCAB, SEQ, PER_RANK, STEPS, ACCUM, CLIP = 97, 12, 2, 8, 2, 0.05
KINDS = ("llama", "gpt2")


def build(kind: str) -> torch.nn.Module:
    from runtime.test_hf import build as build_hf

    return build_hf(kind)


class Tokens(torch.utils.data.Dataset):
    """Random token rows, the same for every rank and every route: row i from seed i."""

    def __init__(self, rows: int = 64, offset: int = 0):
        self.rows, self.offset = rows, offset

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict:
        x = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(self.offset + i))
        return {"input_ids": x, "labels": x}


def _env(rank: int, world: int) -> None:
    per_node = min(2, world)
    os.environ.update(LOCAL_RANK=str(rank % per_node), NODE_RANK=str(rank // per_node),
                      LOCAL_WORLD_SIZE=str(per_node))


def _weights(model) -> dict:
    import tiershard as ts

    if getattr(model, "_tiershard", None) is not None:
        return ts.full_state_dict(model)
    model = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fresh() -> None:
    """accelerate keeps its gradient and accelerator state per process, shared by every Accelerator (and Trainer):
    each run here starts from a fresh one, as a new job would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def _refused(fn) -> str:
    try:
        fn()
    except RuntimeError as err:
        return str(err)
    return "no error"


# -- transformers.Trainer ---------------------------------------------------------------------------------------
def _trainer_args(out: str, world: int, **kw):
    import transformers as T

    settings = dict(
        output_dir=out, per_device_train_batch_size=PER_RANK * 4 // world, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=CLIP, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="steps", save_steps=4, eval_strategy="steps", eval_steps=4,
        per_device_eval_batch_size=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return T.TrainingArguments(**{**settings, **kw})


def _trainer_run(kind: str, out: str, world: int, sharded: bool, plan: str = "IIG", resume: str | None = None):
    import transformers as T

    import tiershard.hf as tsh

    _fresh()
    args = _trainer_args(out, world)
    data = dict(train_dataset=Tokens(), eval_dataset=Tokens(8, offset=1000))
    if sharded:
        trainer = tsh.Trainer(model=build(kind), args=args, plan=plan, **data)
    else:
        trainer = T.Trainer(model=build(kind), args=args, **data)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    return {"loss": [h["loss"] for h in history if "loss" in h],
            "norm": [h["grad_norm"] for h in history if "grad_norm" in h],
            "eval": [h["eval_loss"] for h in history if "eval_loss" in h],
            "best": os.path.basename(trainer.state.best_model_checkpoint or ""),
            "weights": _weights(trainer.model), "trainer": trainer}


def _trainer_routes(rank, world, root, out):
    import transformers as T

    import tiershard as ts
    import tiershard.hf as tsh
    from trl import SFTConfig, SFTTrainer

    for kind in KINDS:
        ref = _trainer_run(kind, f"{root}/{kind}-trainer-ddp", world, sharded=False)
        ref.pop("trainer")
        mine = _trainer_run(kind, f"{root}/{kind}-trainer", world, sharded=True)
        trainer = mine.pop("trainer")
        trainer.save_model(f"{root}/{kind}-pretrained")
        resumed = _trainer_run(kind, f"{root}/{kind}-trainer-resume", world, sharded=True,
                               resume=f"{root}/{kind}-trainer/checkpoint-4")
        out[f"trainer/{kind}"] = {"ref": ref, "mine": mine, "resumed": resumed.pop("loss"),
                                  "files": sorted(os.listdir(f"{root}/{kind}-trainer/checkpoint-4"))}
    # plain Trainer with a sharded model: tiershard's error at train(), before a step
    args = _trainer_args(f"{root}/plain", world, eval_strategy="no", load_best_model_at_end=False)
    _fresh()
    plain = T.Trainer(model=ts.shard(build("llama"), "IIG", ts.Topology.from_env()), args=args,
                      train_dataset=Tokens())
    out["refused/trainer"] = _refused(plain.train)
    # trl's SFTTrainer through the one line, on pre-tokenised rows
    SFT = tsh.sharded_trainer(SFTTrainer)
    config = SFTConfig(output_dir=f"{root}/sft", per_device_train_batch_size=PER_RANK, max_steps=2, report_to=[],
                       use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, max_length=SEQ,
                       dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    from datasets import Dataset

    rows = Dataset.from_dict({"input_ids": [Tokens(8)[i]["input_ids"].tolist() for i in range(8)]})
    from tokenizers import Tokenizer, models

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer = T.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")
    _fresh()
    sft = SFT(model=build("llama"), args=config, train_dataset=rows, processing_class=tokenizer, plan="IIG")
    sft.train()
    out["sft"] = {"sft": isinstance(sft, SFTTrainer) and isinstance(sft, tsh.ShardedTrainerMixin),
                  "steps": sft.state.global_step, "sharded": getattr(sft.model, "_tiershard", None) is not None}


# -- accelerate -------------------------------------------------------------------------------------------------
def _accelerate_loop(make, model, micro_steps: int, state_dir: str | None = None, resume: str | None = None):
    _fresh()
    accelerator = make(cpu=True, gradient_accumulation_steps=ACCUM)
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
                                   {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0}], lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / 20)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=PER_RANK * 4 // accelerator.num_processes)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    skip = 0
    if resume:
        accelerator.load_state(resume)
        skip = micro_steps
        loader = accelerator.skip_first_batches(loader, skip)
    losses, norms = [], []
    for i, batch in enumerate(loader, start=skip):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP).item())
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather_for_metrics(loss.detach()[None]).mean().item())
        if state_dir and i + 1 == micro_steps:
            accelerator.save_state(state_dir)
    return model, losses, norms


def _accelerate_routes(rank, world, root, out):
    import accelerate

    import tiershard as ts
    import tiershard.hf as tsh

    for kind in KINDS:
        iig = functools.partial(tsh.Accelerator, plan="IIG")
        model, ref_losses, ref_norms = _accelerate_loop(accelerate.Accelerator, build(kind), 4)
        ref_weights = _weights(model)
        model, losses, norms = _accelerate_loop(iig, build(kind), 4, state_dir=f"{root}/{kind}-accelerate")
        _, resumed, _ = _accelerate_loop(iig, build(kind), 4, resume=f"{root}/{kind}-accelerate")
        out[f"accelerate/{kind}"] = {"ref": {"loss": ref_losses, "norm": ref_norms, "weights": ref_weights},
                                     "mine": {"loss": losses, "norm": norms, "weights": _weights(model)},
                                     "resumed": resumed}
    sharded = ts.shard(build("llama"), "IIG", ts.Topology.from_env())
    opt = torch.optim.AdamW(sharded.parameters())
    _fresh()
    out["refused/accelerate"] = _refused(lambda: accelerate.Accelerator(cpu=True).prepare(sharded, opt))
    out["refused/ddp"] = _refused(lambda: torch.nn.parallel.DistributedDataParallel(sharded))
    out["to"] = {"noop": sharded.to("cpu:0") is sharded and sharded.to(torch.device("cpu", 0)) is sharded,
                 "to_empty": _refused(lambda: sharded.to_empty(device="cpu")),
                 "double": _refused(lambda: sharded.double())}


# -- Lightning --------------------------------------------------------------------------------------------------
def _lightning_run(kind: str, root: str, sharded: bool, steps: int, resume: str | None = None, plan: str = "IIG"):
    import pytorch_lightning as pl

    import tiershard as ts
    from tiershard.lightning import TieredStrategy

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses = build(kind), []

        def configure_model(self):
            if sharded and getattr(self.model, "_tiershard", None) is None:
                ts.shard(self.model, plan, ts.Topology.from_env())

        def training_step(self, batch, index):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            named = list(self.model.named_parameters())
            return torch.optim.AdamW([{"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
                                      {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0}],
                                     lr=1e-2)

        def train_dataloader(self):
            # two optimizer steps an epoch: the checkpoint at step 2 ends an epoch, where Lightning resumes exactly
            return torch.utils.data.DataLoader(Tokens(32), batch_size=PER_RANK * 4 // self.trainer.world_size)

    import torch.distributed as dist

    world = dist.get_world_size()
    _env(dist.get_rank(), world)            # Lightning's teardown removes WORLD_SIZE; put the launcher's back
    os.environ["WORLD_SIZE"] = str(world)
    saver = pl.callbacks.ModelCheckpoint(dirpath=f"{root}/{kind}-lightning", every_n_epochs=1, save_top_k=-1,
                                         save_on_train_epoch_end=True, filename="{step}")
    trainer = pl.Trainer(accelerator="cpu", devices=min(2, world), num_nodes=max(1, world // 2),
                         strategy=TieredStrategy() if sharded else "ddp", max_steps=steps,
                         accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         callbacks=[saver] if resume is None else [], enable_checkpointing=resume is None)
    module = LM()
    trainer.fit(module, ckpt_path=resume)
    return {"loss": module.losses, "weights": _weights(module.model)}


def _lightning_routes(rank, world, root, out):
    for kind in KINDS:
        ref = _lightning_run(kind, f"{root}/pl-ddp", sharded=False, steps=4)
        ref_resumed = _lightning_run(kind, f"{root}/pl-ddp", sharded=False, steps=4,
                                     resume=f"{root}/pl-ddp/{kind}-lightning/step=2.ckpt")
        mine = _lightning_run(kind, root, sharded=True, steps=4)
        resumed = _lightning_run(kind, root, sharded=True, steps=4, resume=f"{root}/{kind}-lightning/step=2.ckpt")
        out[f"lightning/{kind}"] = {"ref": ref, "mine": mine, "resumed": resumed["loss"],
                                    "ref_resumed": ref_resumed["loss"]}


# -- bytes: the Trainer adds no collective of its own ---------------------------------------------------------
def _bytes_per_step(rank, world, root, out):
    import tiershard as ts
    import tiershard.hf as tsh

    model = ts.shard(build("llama"), "IIG", ts.Topology.from_env())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rows = Tokens()
    ts.reset_comm_stats()
    for step in range(2):
        for micro in range(ACCUM):
            batch = [rows[(step * ACCUM + micro) * 4 * PER_RANK + rank * PER_RANK + j] for j in range(PER_RANK)]
            batch = {k: torch.stack([b[k] for b in batch]) for k in batch[0]}
            with (ts.no_sync(model) if micro < ACCUM - 1 else torch.enable_grad()):
                model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    hand = ts.comm_stats()
    args = _trainer_args(f"{root}/bytes", world, max_steps=2, save_strategy="no", eval_strategy="no",
                         load_best_model_at_end=False, optim="sgd", max_grad_norm=0.0, logging_steps=100)
    _fresh()
    trainer = tsh.Trainer(model=build("llama"), args=args, train_dataset=Tokens(), plan="IIG")
    ts.reset_comm_stats()
    trainer.train()
    bytes_only = lambda stats: {k: v for k, v in stats.items() if k != "seconds"}    # noqa: E731 (times vary)
    out["bytes"] = {"hand": bytes_only(hand), "trainer": bytes_only(ts.comm_stats())}


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _examples(rank, world, root, out):
    """The three examples as their documentation runs them, shortened."""
    import importlib.util

    for name, length in (("hf_trainer", {"max_steps": 2}), ("accelerate_loop", {"micro_steps": 4}),
                         ("lightning_fit", {"max_steps": 2})):
        _fresh()
        _env(rank, world)
        os.environ["WORLD_SIZE"] = str(world)
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        result = module.main(f"{root}/example-{name}", **length)
        out[f"example/{name}"] = {"result": result, "files": sorted(os.listdir(f"{root}/example-{name}"))}


def _routes(rank, world, root):
    _env(rank, world)
    out = {}
    for part in (_trainer_routes, _accelerate_routes, _lightning_routes, _bytes_per_step, _examples):
        part(rank, world, root, out)
    return out if rank == 0 else None


def _other_world(rank, world, root):
    """Two ranks under zero3 resume the four-rank checkpoints of each route."""
    _env(rank, world)
    import tiershard.hf as tsh

    out = {}
    for kind in KINDS:
        out[f"trainer/{kind}"] = _trainer_run(kind, f"{root}/{kind}-trainer-2", world, sharded=True, plan="zero3",
                                              resume=f"{root}/{kind}-trainer/checkpoint-4")["loss"]
        zero3 = functools.partial(tsh.Accelerator, plan="zero3")
        out[f"accelerate/{kind}"] = _accelerate_loop(zero3, build(kind), 4,
                                                     resume=f"{root}/{kind}-accelerate")[1]
        out[f"lightning/{kind}"] = _lightning_run(kind, root, sharded=True, steps=4, plan="zero3",
                                                  resume=f"{root}/{kind}-lightning/step=2.ckpt")["loss"]
        out[f"lightning-ddp/{kind}"] = _lightning_run(kind, f"{root}/pl-ddp", sharded=False, steps=4,
                                                      resume=f"{root}/pl-ddp/{kind}-lightning/step=2.ckpt")["loss"]
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("routes"))
    four = run_ranks(_routes, 4, root)[0]
    two = run_ranks(_other_world, 2, root)[0]
    return four, two


def rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).abs() / b.abs()).max().item()


def rel_l2(state: dict, ref: dict) -> float:
    """The weights' difference relative to their size, over the whole model."""
    num = sum(((state[k] - ref[k]).double() ** 2).sum() for k in ref) ** 0.5
    return (num / sum((v.double() ** 2).sum() for v in ref.values()) ** 0.5).item()


@pytest.mark.parametrize("route", ["trainer", "accelerate", "lightning"])
@pytest.mark.parametrize("kind", KINDS)
def test_route_matches_its_ddp_twin(results, route, kind):
    run = results[0][f"{route}/{kind}"]
    ref, mine = run["ref"], run["mine"]
    assert len(mine["loss"]) == len(ref["loss"]) > 0
    assert rel(mine["loss"], ref["loss"]) < 1e-4
    assert mine["weights"].keys() == ref["weights"].keys()
    assert rel_l2(mine["weights"], ref["weights"]) < 1e-4
    if "norm" in ref:                          # clipping was active: the norms exceeded the limit
        assert min(ref["norm"]) > CLIP and rel(mine["norm"], ref["norm"]) < 1e-4
    if route == "trainer":
        assert rel(mine["eval"], ref["eval"]) < 1e-4 and mine["best"] == ref["best"]


@pytest.mark.parametrize("route", ["trainer", "accelerate", "lightning"])
@pytest.mark.parametrize("kind", KINDS)
def test_route_resumes_exactly_and_on_another_world(results, route, kind):
    four, two = results
    run = four[f"{route}/{kind}"]
    unbroken, resumed = run["mine"]["loss"], run["resumed"]
    tail = unbroken[len(unbroken) - len(resumed):]
    if route == "lightning":
        # Lightning resumes an accumulating run at an epoch-end checkpoint taking the first batch as an
        # accumulation boundary, under its DDP too: the resume is exact against DDP's own resume
        tail = run["ref_resumed"]
        assert rel(resumed, tail) < 1e-6 and resumed[0] == unbroken[len(unbroken) // 2]
    assert len(resumed) > 0 and (resumed == tail or route == "lightning")
    other = two[f"{route}/{kind}"]
    if route == "lightning":          # Lightning's own resume on another world size is DDP's, on two ranks too
        tail = two[f"lightning-ddp/{kind}"]
    assert len(other) == len(resumed) and rel(other, tail) < 1e-5


def test_trainer_checkpoint_folder_is_trainers_plus_tiershard(results):
    files = results[0]["trainer/llama"]["files"]
    assert {"tiershard", "trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_3.pth"} <= set(files)
    assert "optimizer.pt" not in files                  # never one rank's shard of the optimizer state


def test_save_model_writes_a_from_pretrained_folder(results, tmp_path_factory):
    import transformers as T

    for kind in KINDS:
        weights = results[0][f"trainer/{kind}"]["mine"]["weights"]
        root = next(p for p in tmp_path_factory.getbasetemp().glob("routes*"))
        loaded = T.AutoModelForCausalLM.from_pretrained(root / f"{kind}-pretrained")
        state = loaded.state_dict()
        assert all(torch.equal(state[k], weights[k]) for k in weights)
        if kind == "gpt2":                                # the tie survives
            assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_plain_routes_stop_with_tiershards_error(results):
    four = results[0]
    for what in ("trainer", "accelerate", "ddp"):
        message = four[f"refused/{what}"]
        assert "tiershard.hf.Trainer" in message and "tiershard.hf.Accelerator" in message, message
        assert "mixed torch.Tensor and DTensor" not in message


def test_sft_trainer_through_one_line(results):
    assert results[0]["sft"] == {"sft": True, "steps": 2, "sharded": True}


def test_trainer_adds_no_collective(results):
    hand, trainer = results[0]["bytes"]["hand"], results[0]["bytes"]["trainer"]
    assert trainer == hand


def test_examples_run_as_documented(results):
    four = results[0]
    trainer, loop, fit = (four[f"example/{n}"] for n in ("hf_trainer", "accelerate_loop", "lightning_fit"))
    assert len(trainer["result"]) == 2 and all(math.isfinite(x) for x in trainer["result"])
    assert "final" in trainer["files"]
    assert len(loop["result"]) == 4 and "tiershard" in loop["files"]
    assert math.isfinite(fit["result"]) and any(f.endswith(".ckpt") for f in fit["files"])



def test_noop_to_is_a_noop_and_real_changes_are_refused(results):
    to = results[0]["to"]
    assert to["noop"]                         # Trainer's and Lightning's .to(cpu:0) / .to(cuda:N)
    assert "would replace" in to["to_empty"] and "would cast" in to["double"]
