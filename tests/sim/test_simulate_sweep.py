"""``python -m raggedfsdp simulate`` over several world sizes and from any model source.

A comma list of world sizes sweeps them (both systems per world size, side by side); the
model may be a catalogue name, a JSON config file (``TransformerConfig``'s fields) or a
Hugging Face ``config.json`` (``hf:DIR``, skipped without transformers). Tiny models,
world sizes 4 and 8, 16 tokens: each simulation takes well under a second.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys

import pytest
import torch

from raggedfsdp.cli.simulate import format_sweep, main, plot_sweep
from raggedfsdp.models import (
    Transformer,
    get_config,
    load_config_json,
    load_model_json,
    num_params,
    param_groups,
)
from raggedfsdp.tools.simulate import SimConfig, simulate
from raggedfsdp.tools.simulate_results import sweep_row

# A GPT-2-style config: LayerNorms with biases, biased projections, a GELU MLP, learned
# positions, and a head with a bias (its 1-D bias is longer than a shard at 8 ranks).
TINY_GPT = {
    "name": "tiny-gpt",
    "vocab_size": 300,
    "dim": 32,
    "n_layers": 2,
    "n_heads": 2,
    "n_kv_heads": 2,
    "ffn_dim": 128,
    "norm": "layer",
    "ffn": "gelu",
    "qkv_bias": True,
    "o_bias": True,
    "ffn_bias": True,
    "output_bias": True,
    "learned_positions": 64,
}
WORLDS = "4,8"
SEQ = ["--seq", "16"]
QUICK = [*SEQ, "--warmup", "0", "--optim", "none"]  # where the step's content does not matter


def _write(tmp_path, obj, name="model.json"):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return path


def _run(capsys, argv) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny_gpt(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("config"), TINY_GPT)


@pytest.fixture(scope="module")
def swept(tiny_gpt):
    """A two-point sweep of the JSON config, with every ``simulate`` result it made."""
    made = []

    def recording(cfg):
        made.append(simulate(cfg))
        return made[-1]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr("raggedfsdp.cli.simulate.simulate", recording)
        assert main(["--model", str(tiny_gpt), "--world", WORLDS, *SEQ, "--json"]) == 0
    return json.loads(out.getvalue()), made


def test_sweep_rows_hold_both_systems_from_the_same_run(swept, tiny_gpt):
    rows, made = swept
    assert [r["world"] for r in rows] == [4, 8] and len(made) == 4
    for row, ours, fsdp2 in zip(rows, made[0::2], made[1::2]):
        assert (ours["config"]["system"], fsdp2["config"]["system"]) == ("raggedfsdp", "fsdp2")
        assert ours["config"]["world"] == fsdp2["config"]["world"] == row["world"]
        assert row["peak_raggedfsdp"] == ours["peak"]["total"] > 0
        assert row["peak_fsdp2"] == fsdp2["peak"]["total"] > 0
        assert row["peak_ratio"] == row["peak_raggedfsdp"] / row["peak_fsdp2"]
        assert row["gathered_raggedfsdp"] == ours["comm"]["all_gather"][2] > 0
        assert row["gathered_fsdp2"] == fsdp2["comm"]["all_gather"][2] > 0
        assert row["gathered_ratio"] == row["gathered_raggedfsdp"] / row["gathered_fsdp2"]
        pad = ours["layout"]["padding_elems"] / ours["layout"]["numel"]
        assert row["padding_raggedfsdp"] == pad
        assert row["params"] == num_params(load_config_json(tiny_gpt))
        assert fsdp2["fsdp_mem_tracker"] is None  # the sweep skips the cross-check step


def test_sweep_row_refuses_results_of_different_configs(swept):
    _, made = swept
    with pytest.raises(ValueError, match=r"configs differing in \['world'\]"):
        sweep_row(made[0], made[3])
    with pytest.raises(ValueError, match="pass raggedfsdp's result, then FSDP2's"):
        sweep_row(made[1], made[0])


def test_sweep_table_and_plot(swept, tmp_path, capsys):
    rows, _ = swept
    table = format_sweep(rows).splitlines()
    assert table[0].startswith("| ranks | peak raggedfsdp (MiB) | peak FSDP2 (MiB) | peak ratio")
    assert table[2].startswith("| 4 |") and table[3].startswith("| 8 |")
    assert f"| {rows[1]['peak_ratio']:.3f} |" in table[3]
    path = tmp_path / "sweep.png"
    plot_sweep(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_text_output(capsys):
    code, out, err = _run(capsys, ["--model", "llama-tiny", "--world", "2,4", *QUICK])
    assert code == 0 and "simulated 4 ranks (2 of 2)" in err
    lines = out.splitlines()
    assert lines[0].startswith("llama-tiny (2 blocks, ")
    assert [line.split("|")[1].strip() for line in lines[-2:]] == ["2", "4"]


def test_single_world_report_still_compares_one_world(capsys):
    code, out, _ = _run(capsys, ["--model", "llama-tiny", "--world", "4", *QUICK])
    assert code == 0 and out.startswith("raggedfsdp: llama-tiny") and "fsdp2: llama-tiny" in out
    assert re.search(r"peak raggedfsdp / FSDP2: \d\.\d{3}", out)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--world", "8,x"], "argument --world: takes a rank count or a comma list"),
        (["--world", "8,0"], "argument --world: takes a rank count or a comma list"),
    ],
)
def test_world_list_is_checked_by_argparse(capsys, argv, match):
    with pytest.raises(SystemExit):
        main(["--model", "llama-tiny", *argv])
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--world", "8,16", "--system", "fsdp2"], "a sweep .* compares both systems; drop"),
        (["--world", "8,16", "--mesh", "replicate=2,shard=4"], "fixes one world size"),
        (["--seq", "4096", "--model", "gpt2"], r"seq=4096 exceeds model 'gpt2''s learned_pos"),
        (["--model", "nope"], "unknown model 'nope'; catalogued models: llama3-8b"),
    ],
)
def test_sweep_errors_come_before_any_work(capsys, argv, match):
    code, out, err = _run(capsys, ["--model", "llama-tiny", *argv])
    assert code == 2 and out == "" and err.startswith("raggedfsdp simulate: error: ")
    assert re.search(match, err), err


# ------------------------------------------------------------------------------------------
# JSON config files
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, match",
    [
        ({"n_head": 2}, r"n_head: not a TransformerConfig field; did you mean 'n_heads'\?"),
        ({"dim": None}, "dim: must be a JSON int, got None"),
        ({"dim": "32"}, "dim: must be a JSON int, got '32'"),
        ({"qkv_bias": 1}, "qkv_bias: must be a JSON bool, got 1"),
        ({"n_layers": 0}, "n_layers: must be >= 1, got 0"),
        ({"ffn_dim": -1}, "ffn_dim: must be >= 0, got -1"),
        ({"norm": "batch"}, r"norm: must be one of \['rms', 'layer'\], got 'batch'"),
        ({"n_dense_layers": 5}, "config: tiny-gpt: n_dense_layers > n_layers"),
    ],
)
def test_bad_config_fields_name_the_field(tmp_path, change, match):
    path = _write(tmp_path, TINY_GPT | change)
    with pytest.raises(ValueError, match=f"model file {re.escape(str(path))}: {match}"):
        load_config_json(path)


def test_config_file_errors(tmp_path, capsys):
    missing = {k: v for k, v in TINY_GPT.items() if k != "n_kv_heads"}
    with pytest.raises(ValueError, match="n_kv_heads: missing; a config needs vocab_size, dim"):
        load_config_json(_write(tmp_path, missing))
    shapes = {"groups": [{"name": "g", "params": [{"name": "w", "shape": [4]}]}]}
    with pytest.raises(ValueError, match=r"a shapes file \(\"groups\"\), which only the planner"):
        load_config_json(_write(tmp_path, shapes, "shapes.json"))
    with pytest.raises(ValueError, match="does not exist"):
        load_config_json(tmp_path / "nope.json")
    # what only the modules check is found before any work too
    bad = _write(tmp_path, TINY_GPT | {"n_kv_heads": 3}, "gqa.json")
    code, out, err = _run(capsys, ["--model", str(bad), "--world", WORLDS, *SEQ])
    assert code == 2 and out == ""
    assert "n_heads (2) must be a multiple of n_kv_heads (3)" in err
    code, _, err = _run(capsys, ["--model", str(tmp_path / "shapes.json"), *SEQ])
    assert code == 2 and "which only the planner reads" in err


def test_config_file_is_a_model_for_the_planner_too(tmp_path):
    path = _write(tmp_path, TINY_GPT)
    name, groups = load_model_json(path)
    assert name == "tiny-gpt" and groups == param_groups(load_config_json(path))


# ------------------------------------------------------------------------------------------
# The GPT-2-style models
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["gpt2", "benchmarks/models/lm-32k-head.json"])
def test_gpt_style_models_build_with_the_catalogues_shapes(source):
    config = get_config(source) if source == "gpt2" else load_config_json(source)
    with torch.device("meta"):
        model = Transformer(config, max_seq_len=64)
    got = [(fqn, tuple(p.shape)) for fqn, p in model.named_parameters()]
    assert got == [(p.fqn, p.shape) for g in param_groups(config) for p in g.params]
    biases = {fqn for fqn, _ in got if fqn.endswith(".bias")}
    assert "layers.0.attention_norm.bias" in biases and "layers.1.feed_forward.w2.bias" in biases
    if source == "gpt2":  # openai-community/gpt2's count (wte tied to the head)
        assert num_params(config) == 124_439_808 and "pos_embeddings.weight" in dict(got)
    else:
        assert dict(got)["output.bias"] == (32_000,) and dict(got)["output.weight"] == (32_000, 64)


def test_learned_positions_train(tiny_gpt):
    config = load_config_json(tiny_gpt)
    model = Transformer(config, max_seq_len=16)
    assert model.rope is None
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    loss = torch.nn.functional.cross_entropy(
        model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
    )
    loss.backward()
    assert model.pos_embeddings.weight.grad is not None and model.output.bias.grad is not None
    with pytest.raises(ValueError, match="max_seq_len=65 exceeds config 'tiny-gpt''s learned"):
        Transformer(config, max_seq_len=65)


# ------------------------------------------------------------------------------------------
# Hugging Face configs
# ------------------------------------------------------------------------------------------
HF_LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def test_hf_config_sweep(tmp_path, capsys):
    pytest.importorskip("transformers")
    _write(tmp_path, HF_LLAMA, "config.json")
    code, out, err = _run(
        capsys, ["--model", f"hf:{tmp_path}", "--world", WORLDS, *QUICK, "--layers", "2", "--json"]
    )
    assert code == 0, err
    rows = json.loads(out)
    assert [r["world"] for r in rows] == [4, 8]
    assert all(r["peak_raggedfsdp"] > 0 and r["peak_fsdp2"] > 0 for r in rows)
    # embedding and head 2 x 256 x 32; per block q, o 32 x 32, k, v 16 x 32 (2 kv heads),
    # MLP 3 x 32 x 64, 2 norms; the final norm
    assert rows[0]["params"] == 2 * 256 * 32 + 2 * (2 * 1024 + 2 * 512 + 3 * 2048 + 64) + 32


def test_hf_errors(tmp_path, capsys, monkeypatch):
    code, _, err = _run(capsys, ["--model", f"hf:{tmp_path}", *SEQ])
    assert code == 2 and "config.json does not exist; pass hf:DIR with DIR a directory" in err
    _write(tmp_path, HF_LLAMA, "config.json")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    code, _, err = _run(capsys, ["--model", f"hf:{tmp_path}", *SEQ])
    assert code == 2 and "Hugging Face transformers, which is not installed; install it" in err
    with pytest.raises(ImportError, match="which is not installed"):
        SimConfig(model=f"hf:{tmp_path}", seq=16)
