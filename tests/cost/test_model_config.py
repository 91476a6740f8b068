"""A ModelSpec from a Hugging Face config.json, counted against transformers' own build, and the planner's
tie rule (time within REL_TIE, then fewer outermost-tier bytes, less memory, the plan text)."""
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


def test_times_within_the_tolerance_tie_and_fewer_outer_bytes_win():
    cluster = clusters.preset("dgx-a100", 64)
    model, job = ModelSpec.named("7b"), Job()
    zero3, paro = (cost.evaluate(code, model, cluster, job) for code in ("GGG", "IIG"))
    assert paro.tier_bytes["world"] < zero3.tier_bytes["world"]
    # GGG a hair faster, by less than the tolerance, straddling a 6-digit rounding boundary: still a tie
    t = 1.0000051
    fast, slow = replace(zero3, step_time=t * (1 - 0.4 * cost.REL_TIE)), replace(paro, step_time=t)
    for order in ([fast, slow], [slow, fast]):
        ranked = cost.rank_estimates(order)
        assert [str(e.plan) for e in ranked] == ["IIG", "GGG"]
        assert ranked[1].reason == "ties; more inter-node bytes"
    # beyond the tolerance time decides
    faster = replace(fast, step_time=t * (1 - 3 * cost.REL_TIE))
    assert [str(e.plan) for e in cost.rank_estimates([slow, faster])] == ["GGG", "IIG"]
