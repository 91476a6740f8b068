"""A ModelSpec from a Hugging Face config.json, counted against transformers' own build, and the planner's
tie rule (time within REL_TIE, then less quantization, more memory headroom, fewer bytes on the slowest tier, ...)
and the no-fit message, true to the job given."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from tiershard import cost
from tiershard.cli import main
from tiershard.cost import Job, ModelSpec
from tiershard.cost import presets as clusters

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
              "vocab_size": 1000, "max_position_embeddings": 128, "tie_word_embeddings": False}
TINY_GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 48, "n_layer": 2, "n_head": 4,
             "n_positions": 96, "vocab_size": 500}
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _meta_build(config: dict):
    """What transformers builds for the config, on the meta device (no memory, no weights)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("config", [
    TINY_LLAMA, TINY_GPT2, LLAMA2_7B,
    {**TINY_LLAMA, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    {**TINY_GPT2, "n_inner": 40, "tie_word_embeddings": False},
    {**TINY_LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"]},
], ids=["llama", "gpt2", "llama2-7b", "llama-tied-bias", "gpt2-untied-inner", "mistral"])
def test_config_json_counts_what_transformers_builds(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = ModelSpec.from_hf_config(path)
    model = _meta_build(config)
    assert spec.params == sum(p.numel() for p in model.parameters())
    built = ModelSpec.from_module(model)          # units cut as ts.shard cuts them
    assert spec.units == built.units and spec.param_shapes == built.param_shapes
    assert (spec.layers, spec.hidden, spec.vocab) == (built.layers, built.hidden, built.vocab)
    if config is LLAMA2_7B:
        assert spec.params == 6_738_415_616       # LLaMA-2-7B's published count


@pytest.mark.parametrize("config,message", [
    ({**TINY_LLAMA, "model_type": "bert"}, "unknown model_type 'bert'.*supported: gpt2, llama, mistral"),
    ({k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, "no model_type.*supported"),
    ({k: v for k, v in TINY_LLAMA.items() if k != "intermediate_size"}, "missing 'intermediate_size'"),
    ({k: v for k, v in TINY_GPT2.items() if k != "n_positions"}, "missing 'n_positions'"),
    ({**TINY_LLAMA, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({**TINY_LLAMA, "hidden_size": 0}, "hidden_size"),
])
def test_bad_configs_name_the_field(tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(path)


def test_plan_cli_reads_a_model_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    assert main(["plan", "--model-config", str(path), "--gpus", "64", "--gpus-per-node", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["params"] == 6_738_415_616 and doc["model"]["layers"] == 32
    assert main(["plan", "--model-config", str(path), "--model", "7b"]) == 2
    assert "--model-config" in capsys.readouterr().err
    assert main(["plan", "--model-config", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert main(["plan", "--model-config", str(tmp_path / "bad.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


# ---- the tie rule ---------------------------------------------------------------------------------
def test_ranking_does_not_depend_on_candidate_order():
    cluster = clusters.preset("dgx-a100", 64)
    model, job = ModelSpec.named("7b"), Job(accum=4, micro_batch=2)
    plans = cost.candidate_plans(cluster.topology)
    reference = [str(e.plan) for e in cost.rank_plans(model, cluster, job, plans)]
    rng = random.Random(0)
    for _ in range(3):
        shuffled = plans[:]
        rng.shuffle(shuffled)
        assert [str(e.plan) for e in cost.rank_plans(model, cluster, job, shuffled)] == reference
        assert str(cost.auto_plan(model, cluster, job, candidates=shuffled)) == reference[0]


def test_times_within_the_tolerance_tie_then_headroom_then_slowest_tier_bytes():
    cluster = clusters.preset("dgx-a100", 64)
    model, job = ModelSpec.named("7b"), Job()
    zero3, paro, zero3_cc = (cost.evaluate(code, model, cluster, job) for code in ("GGG", "IGG", "GGG+cc"))
    assert zero3.headroom > paro.headroom and zero3.tier_bytes["world"] > paro.tier_bytes["world"]
    assert zero3.slowest_tier == "world" and zero3_cc.memory.total == zero3.memory.total
    # GGG a hair slower, by less than the tolerance, straddling a 6-digit rounding boundary: still a tie, and its
    # headroom wins over IGG's fewer inter-node bytes
    t = 1.0000051
    fast, slow = replace(paro, step_time=t * (1 - 0.4 * cost.REL_TIE)), replace(zero3, step_time=t)
    for order in ([fast, slow], [slow, fast]):
        ranked = cost.rank_estimates(order)
        assert [str(e.plan) for e in ranked] == ["GGG", "IGG"]
        assert ranked[1].reason.startswith("ties; less memory headroom (") and "GB free" in ranked[1].reason
    # equal headroom: fewer bytes on the slowest tier win
    ranked = cost.rank_estimates([replace(zero3, step_time=t), replace(zero3_cc, step_time=t)])
    assert [str(e.plan) for e in ranked] == ["GGG+cc", "GGG"]
    assert ranked[1].reason.startswith("ties; more bytes on the slowest tier, world (")
    # beyond the tolerance time decides
    faster = replace(fast, step_time=t * (1 - 3 * cost.REL_TIE))
    assert [str(e.plan) for e in cost.rank_estimates([slow, faster])] == ["IGG", "GGG"]


def test_the_slowest_tier_is_the_one_with_least_bandwidth():
    from tiershard.cost import Cluster, Tier
    # a node tier slower than the world's (a PCIe box on a fast fabric): its bytes break the tie
    odd = Cluster(tiers=(Tier(name="node", size=8, bandwidth=5e9), Tier(name="world", size=64, bandwidth=25e9)), gpu_memory=80e9, peak_flops=312e12)
    assert cost.evaluate("GGG", ModelSpec.named("7b"), odd, Job()).slowest_tier == "node"
    same = Cluster(tiers=(Tier(name="node", size=8, bandwidth=5e9), Tier(name="world", size=64, bandwidth=5e9)), gpu_memory=80e9, peak_flops=312e12)
    assert cost.planner.slowest_tier(same) == "world"


LLAMA2 = {"13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=40),
          "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8)}


@pytest.mark.parametrize("size", ["7b", "13b", "70b"])
def test_llama2_ties_rank_by_headroom_then_slowest_tier_bytes(tmp_path, capsys, size):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA2_7B, **LLAMA2.get(size, {})}))
    assert main(["plan", "--model-config", str(path), "--gpus", "64", "--gpus-per-node", "8", "--top", "0"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    tied = [r for r in rows if r[2] == rows[0][2] and "does not fit" not in " ".join(r)]
    assert len(tied) >= 5 and rows[:len(tied)] == tied, out                                   # compute-bound: the top plans tie
    keys = [(-float(r[5]), float(r[6])) for r in tied]          # free GB (more first), world GB/node (fewer first)
    assert keys == sorted(keys), out
    assert rows[0][1] == "GGG+cc" and all("ties; " in " ".join(r) for r in tied[1:])
    assert "free GB" in out and "world GB/node" in out
    assert f"{len(tied)} plans tie the best step time. Ties, step times within 1e-06 (relative), rank by less " \
           "quantization, then more free GB (memory headroom), then fewer world GB (bytes on the slowest tier)" in out


@pytest.mark.parametrize("flags,says,never", [
    ([], ["add devices (GGG fits on 16)", "shorten the sequence (now 2048)", "weigh tensor parallelism"],
     ["recompute", "micro-batch"]),
    (["--no-recompute", "--micro-batch", "2"], ["lower the micro-batch (now 2)", "turn on recompute"],
     ["add devices"]),                        # what does not shard already exceeds a device
    (["--tp", "1,2,4,8"], ["add devices (GGG tp=4 fits on 16)"], ["recompute", "weigh tensor parallelism"]),
])
def test_the_no_fit_message_is_true_to_the_flags(tmp_path, capsys, flags, says, never):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA2_7B, **LLAMA2["70b"]}))
    assert main(["plan", "--model-config", str(path), "--gpus", "8", "--gpus-per-node", "8", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "77.3 GB usable (85.9 GB less the 10% reserve) per device" in err, err
    assert all(s in err for s in says) and not any(n in err for n in never), err


def test_the_device_count_named_fits_and_one_node_fewer_does_not():
    cluster = clusters.preset("dgx-a100", 8).resized(8, 8)
    model = ModelSpec.from_hf_config({**LLAMA2_7B, **LLAMA2["70b"]})
    with pytest.raises(cost.NoPlanFits, match=r"GGG tp=4 fits on 16\)") as err:
        cost.auto_plan(model, cluster, Job())
    assert "turn on recompute" not in str(err.value)
    assert cost.evaluate("GGG", model, cluster.resized(16), Job(), tp=4).fits
    assert not cost.evaluate("GGG", model, cluster.resized(8), Job(), tp=4).fits
    with pytest.raises(cost.NoPlanFits, match=r"GGG fits on 16\)"):      # without TP: whole nodes, 2 of them
        cost.auto_plan(model, cluster, Job(), tp=(1,))
    assert cost.evaluate("GGG", model, cluster.resized(16), Job()).fits
    assert not cost.evaluate("GGG", model, cluster.resized(8), Job()).fits
