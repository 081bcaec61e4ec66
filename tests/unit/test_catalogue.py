"""The model-shape catalogue, the JSON model files, and the planner on every real model."""

from __future__ import annotations

import json

import pytest

from raggedfsdp.models import CATALOGUE, get_config, load_model_json, num_params, param_groups
from raggedfsdp.models.catalogue import REAL_MODELS
from raggedfsdp.planner import (
    TensorSpec,
    clear_plan_cache,
    fsdp1_padding,
    fsdp2_padding,
    plan_groups,
    zero3_padding,
)

# published totals (billions); ours count no multi-token-prediction module
PUBLISHED = {
    "llama3-8b": 8.03,
    "llama3-70b": 70.6,
    "llama3.1-405b": 405.9,
    "gpt-oss-120b": 116.8,
    "deepseek-v3": 671.0,
    "qwen3-235b-a22b": 235.1,
    "moe-2.4t": 2400.0,
}


def model_groups(name: str, block_rows):
    return [(g.name, g.kind, g.specs(block_rows)) for g in param_groups(get_config(name))]


def test_real_models_are_all_catalogued():
    assert set(REAL_MODELS) == set(PUBLISHED)
    assert set(REAL_MODELS) <= set(CATALOGUE)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(name):
    assert num_params(get_config(name)) / 1e9 == pytest.approx(PUBLISHED[name], rel=0.005)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_groups_are_fully_shard_groups(name):
    cfg = get_config(name)
    groups = param_groups(cfg)
    assert [g.name for g in groups] == (
        ["tok_embeddings"] + [f"layers.{i}" for i in range(cfg.n_layers)] + ["head"]
    )
    fqns = [p.fqn for g in groups for p in g.params]
    assert len(fqns) == len(set(fqns))
    for g in groups[1:-1]:
        assert all(p.fqn.startswith(g.name + ".") for p in g.params)
        stacks = [p for p in g.params if p.stack]
        assert (g.kind == "moe") == bool(stacks)
        assert all(p.shape[0] == cfg.n_experts for p in stacks)


def test_deepseek_block_kinds_and_gpt_oss_layout():
    kinds = [g.kind for g in param_groups(get_config("deepseek-v3"))]
    assert kinds.count("dense") == 3 and kinds.count("moe") == 58
    moe = param_groups(get_config("gpt-oss-120b"))[1]
    shapes = {p.fqn.rsplit(".", 1)[-1]: p.shape for p in moe.params}
    assert shapes["gate_up_proj"] == (128, 2880, 5760)
    assert shapes["down_proj"] == (128, 2880, 2880)


def test_unknown_model_error():
    with pytest.raises(ValueError, match="unknown model 'llama5'; catalogued models: llama3-8b"):
        get_config("llama5")


# --- the peers' rules reproduce the figures measured independently (the issue) -------------
@pytest.mark.parametrize(
    "name, world, ratio",
    [("gpt-oss-120b", 256, 0.98), ("gpt-oss-120b", 1024, 6.87), ("deepseek-v3", 1024, 2.92)],
)
def test_fsdp2_padding_figures(name, world, ratio):
    specs = [s for _, _, group in model_groups(name, 1) for s in group]
    assert fsdp2_padding(specs, world).padding_ratio == pytest.approx(ratio, abs=0.01)


def test_peer_rules_on_a_small_case():
    specs = [TensorSpec(name="w", shape=(10, 4), block_rows=2), TensorSpec(name="b", shape=(3,))]
    # FSDP2: dim 0 of w in chunks of 3 rows -> 12 rows (pad 8); b in chunks of 1 -> 4 (pad 1)
    f2 = fsdp2_padding(specs, 4)
    assert f2.padding == 9
    # w: cuts at rows 3 and 9 (odd rows: inside its 2-row blocks); b: a 1-D tensor's
    # blocks are its elements, so its cuts split none
    assert f2.split_blocks == 2
    z3 = zero3_padding(specs, 4)  # 40 -> 40, 3 -> 4
    assert z3.padding == 1
    f1 = fsdp1_padding(specs, 4, "float32")  # 16-byte aligned starts: 40 + 3 = 43 -> 44
    assert f1.padding == 1


# --- acceptance: padding close to the proven bound, fast at 16,384 ranks -----------------
WORLDS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_padding_within_one_point_of_the_lower_bound(name):
    for block_rows in (1, 16, 128):
        groups = model_groups(name, block_rows)
        for m in WORLDS:
            plans = plan_groups(groups, m)
            total = sum(p.layout.total_numel for p in plans)
            pad = sum(p.layout.padding for p in plans) / total
            bound = sum(p.layout.lower_bound_padding for p in plans) / total
            where = f"{name} block {block_rows} rows world {m}"
            assert bound <= pad <= bound + 0.01, where
            if bound < 0.02:
                assert pad <= 0.03, where


def test_whole_model_at_16384_ranks_plans_every_group():
    # Its plan time is a benchmark figure (benchmarks/planner.py), not asserted here.
    groups = model_groups("moe-2.4t", 128)
    clear_plan_cache()
    plans = plan_groups(groups, 16384)
    assert [p.name for p in plans] == [name for name, _, _ in groups]
    for plan, (_, _, specs) in zip(plans, groups):
        layout = plan.layout  # checked its own invariants when it was built
        assert layout.world_size == 16384
        assert {t.name for t in layout.tensors} == {s.name for s in specs}
        assert layout.total_numel == sum(s.numel for s in specs)
        assert 0 <= layout.lower_bound_padding <= layout.padding


# --- JSON model files ----------------------------------------------------------------------
def test_json_model_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps(
            {
                "name": "mine",
                "groups": [
                    {"name": "emb", "kind": "embed", "params": [{"name": "w", "shape": [10, 4]}]},
                    {
                        "name": "layers",
                        "kind": "moe",
                        "repeat": 2,
                        "params": [
                            {"name": "experts", "shape": [4, 8, 4], "stack": True},
                            {"name": "norm", "shape": [4], "block_rows": "whole"},
                        ],
                    },
                ],
            }
        )
    )
    name, groups = load_model_json(path)
    assert name == "mine"
    assert [g.name for g in groups] == ["emb", "layers.0", "layers.1"]
    assert groups[2].params[0].fqn == "layers.1.experts" and groups[2].params[0].stack
    assert groups[1].params[1].block_rows == "whole"


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ('{"groups": 3}', 'an object with a "groups" list'),
        ('{"groups": [{"name": "g", "params": []}]}', r"groups\[0\]: expected"),
        ('{"groups": [{"params": [{"name": "w", "shape": [0]}]}]}', "list of ints >= 1"),
        ('{"groups": [{"params": [{"name": "w"}]}]}', r"params\[0\]: expected"),
        (
            '{"groups": [{"params": [{"name": "w", "shape": [2], "block_rows": -1}]}]}',
            "block_rows must be an int >= 1 or 'whole'",
        ),
        ('{"groups": [{"repeat": 0, "params": [{"name": "w", "shape": [2]}]}]}', "repeat"),
    ],
)
def test_json_model_file_errors(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_model_json(path)


def test_json_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model_json(tmp_path / "nope.json")
