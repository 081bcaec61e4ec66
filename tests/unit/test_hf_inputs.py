"""Hugging Face directories as ``train --model hf:DIR`` and ``export`` read them: checked in
one place (``raggedfsdp.models.hf``: ``check_hf_causal_lm``, ``check_hf_weights``) before any
rank starts, read as transformers reads them, and every failure naming the file. Tiny
configs built here (GPT-2, BERT, Mixtral, Llama); nothing is downloaded."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from raggedfsdp.cli import export
from raggedfsdp.cli import train as train_command

pytest.importorskip("transformers")

TRAIN = [
    "--nproc", "1", "--batch-size", "2", "--seq-len", "8", "--max-bytes", "50000",
    "--no-progress", "--no-plot",
]  # fmt: skip


def _save(directory: Path, config, *, weights: bool = True, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    return directory


def _gpt2(directory: Path, **kw) -> Path:
    from transformers import GPT2Config

    sizes = dict(vocab_size=256, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    sizes.update(kw)
    return _save(directory, GPT2Config(**sizes, bos_token_id=0, eos_token_id=0))


def _llama(directory: Path, seed: int = 0, **kw) -> Path:
    from transformers import LlamaConfig

    sizes = dict(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    sizes.update(kw)
    return _save(directory, LlamaConfig(**sizes), seed=seed)


def _launched(argv: list[str]) -> dict:
    got = {}

    def launch(args) -> int:
        got.update(vars(args))
        return 0

    assert train_command.main([*TRAIN, *argv], launch=launch) == 0
    return got


def _refused(main, argv: list[str], match: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert "Traceback" not in err


def _train_refused(argv, match, capsys, tmp_path) -> None:
    def no_ranks(args):
        raise AssertionError("ranks were started")

    out = tmp_path / "run"
    _refused(lambda a: train_command.main(a, launch=no_ranks), [*TRAIN, *argv, "--out", str(out)],
             match, capsys)  # fmt: skip
    assert not out.exists()


def _same_as_transformers(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from raggedfsdp.models.hf import build_hf_model, materialize_hf

    model = build_hf_model(f"hf:{directory}")
    assert materialize_hf(model, f"hf:{directory}", device="cpu", seed=0) == "file"
    ref = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, ref[name]), name


# ---- architectures ------------------------------------------------------------------------------
def test_gpt2_is_measured_from_its_modules_and_read_as_transformers_reads_it(tmp_path):
    """GPT-2 names its sizes n_embd / n_layer / n_inner (None: 4 x n_embd): the launcher
    used to crash on ``config.intermediate_size``."""
    from raggedfsdp.models.mesh import parse_mesh_spec
    from raggedfsdp.train import resources

    model = _gpt2(tmp_path / "gpt2")
    args = train_command.build_parser().parse_args(["--model", f"hf:{model}"])
    size = resources.model_size(args, parse_mesh_spec(None, 1))
    assert size.per_token == 2 * (4 * 16 + 3 * 64) and size.vocab == 256
    assert _launched(["--model", f"hf:{model}", "--out", str(tmp_path / "run")])["model"]
    _same_as_transformers(model)
    wide = _gpt2(tmp_path / "wide", n_inner=40)
    args = train_command.build_parser().parse_args(["--model", f"hf:{wide}"])
    assert resources.model_size(args, parse_mesh_spec(None, 1)).per_token == 2 * (64 + 120)


def test_an_encoder_is_refused_by_name(tmp_path, capsys):
    """BERT is in AutoModelForCausalLM's mapping (BertLMHeadModel), but it is an encoder."""
    from transformers import BertConfig

    bert = _save(
        tmp_path / "bert",
        BertConfig(vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=32, max_position_embeddings=32),
        weights=False,
    )  # fmt: skip
    match = (
        r"--model hf:.*bert: model_type 'bert' of .*config.json is an encoder \(a masked or "
        r"sequence-to-sequence model; its causal head BertLMHeadModel is not a decoder-only "
        r"language model\), which is not trained here; pass a decoder-only model"
    )
    _train_refused(["--model", f"hf:{bert}"], match, capsys, tmp_path)


def test_mixtral_saved_by_transformers_is_read_with_its_renamings(tmp_path):
    """transformers 5 saves Mixtral's experts as ``block_sparse_moe.experts.E.w1`` and
    renames them on load (``.block_sparse_moe.`` -> ``.mlp.``, then stacks them)."""
    from transformers import MixtralConfig

    mixtral = _save(
        tmp_path / "mixtral",
        MixtralConfig(vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, num_local_experts=3,
                      num_experts_per_tok=2, max_position_embeddings=32),
    )  # fmt: skip
    _launched(["--model", f"hf:{mixtral}", "--out", str(tmp_path / "run")])
    _same_as_transformers(mixtral)


# ---- damaged weights ----------------------------------------------------------------------------
def test_damaged_safetensors_are_named_before_any_rank_starts(tmp_path, capsys):
    model = _llama(tmp_path / "m")
    weights = model / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # truncated
    unreadable = (
        r"load_hf_weights: '.*m/model.safetensors' is not a readable safetensors file "
        r"\(.*\): truncated or damaged; save the weights again"
    )
    _train_refused(["--model", f"hf:{model}"], unreadable, capsys, tmp_path)
    weights.write_bytes(b"\xff" * 8 + good[8:])  # a damaged header
    _train_refused(["--model", f"hf:{model}"], unreadable, capsys, tmp_path)
    from raggedfsdp.models.hf import build_hf_model, check_hf_weights, load_hf_weights

    meta = build_hf_model(f"hf:{model}")
    with pytest.raises(ValueError, match=unreadable):
        check_hf_weights(meta, model)
    # sharded: the index lists a shard that is not there
    weights.write_bytes(good)
    weights.rename(model / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors",
             "lm_head.weight": "model-00001-of-00002.safetensors"}}  # fmt: skip
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    missing = (
        r"'.*m/model.safetensors.index.json' lists 1 shard file\(s\) that '.*m' lacks: "
        r"\['model-00002-of-00002.safetensors'\]; copy them there"
    )
    _train_refused(["--model", f"hf:{model}"], missing, capsys, tmp_path)
    with pytest.raises(ValueError, match=missing):
        load_hf_weights(meta.to_empty(device="cpu"), model)


def test_nan_in_the_weights_is_named_not_taken_for_divergence(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from raggedfsdp.models.hf import build_hf_model, load_hf_weights

    model = _llama(tmp_path / "m")
    weights = load_file(model / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][3, 1] = float("nan")
    save_file(weights, model / "model.safetensors")
    module = build_hf_model(f"hf:{model}").to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' holds nan or inf "
                       r"values in '.*m' \(model.safetensors\): the weights are damaged, not the "
                       r"training"):  # fmt: skip
        load_hf_weights(module, model)
    assert torch.isfinite(weights["model.norm.weight"]).all()


# ---- export -----------------------------------------------------------------------------------
def _run_with_checkpoints(tmp_path: Path, model: Path, steps: list[int]) -> Path:
    """A run folder of ``train --model hf:MODEL`` whose ``ckpt/`` holds ``steps``, saved by
    ``checkpoint.save`` from the unsharded model (``load`` reshards it)."""
    from raggedfsdp import checkpoint
    from raggedfsdp.models.hf import build_hf_model, materialize_hf

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"args": {"model": f"hf:{model}"}}))
    module = build_hf_model(f"hf:{model}")
    materialize_hf(module, f"hf:{model}", device="cpu", seed=0)
    for step in steps:
        checkpoint.save(run / "ckpt", module, step=step, keep_last=None)
    return run


def test_export_with_another_model_is_one_clean_message(tmp_path, capsys):
    model = _llama(tmp_path / "m")
    other = _llama(tmp_path / "other", hidden_size=24)
    run = _run_with_checkpoints(tmp_path, model, [1])
    out = tmp_path / "hf"
    _refused(
        export.main,
        ["--run", str(run), "--hf", str(out), "--model", f"hf:{other}"],
        r"export: the checkpoint '.*step_00000001' does not fit --model hf:.*other: .*shape.*; "
        r"pass --model hf:DIR with the directory the run trained",
        capsys,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "other", "run"]


def test_export_holds_its_checkpoint_while_the_run_prunes(tmp_path, monkeypatch, capsys):
    """The run saves steps 2 and 3 with keep_last=1 while export reads step 1: step 1 stays
    until export ends (and the next save removes it); a second export on the same --hf is
    refused meanwhile; the export is whole and equals the model."""
    import torch
    from safetensors.torch import load_file

    from raggedfsdp import checkpoint
    from raggedfsdp.models.hf import build_hf_model, materialize_hf

    model = _llama(tmp_path / "m")
    run = _run_with_checkpoints(tmp_path, model, [1])
    module = build_hf_model(f"hf:{model}")
    materialize_hf(module, f"hf:{model}", device="cpu", seed=0)
    out = tmp_path / "hf"
    real = export.export_hf
    seen = {}

    def export_while_the_run_saves(source, ckpt, target, dtype):
        for step in (2, 3):  # the training job prunes while this export reads
            checkpoint.save(run / "ckpt", module, step=step, keep_last=1)
        seen["left"] = sorted(p.name for p in (run / "ckpt").iterdir())
        second = threading.Thread(target=_second_export, args=(run, out, seen))
        second.start()
        second.join(60)
        return real(source, ckpt, target, dtype)

    monkeypatch.setattr(export, "export_hf", export_while_the_run_saves)
    assert export.main(["--run", str(run), "--hf", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"from '{run / 'ckpt' / 'step_00000001'}' (step 1)" in printed.out
    assert seen["left"] == ["step_00000001", "step_00000003"]  # held: not pruned
    assert seen["second"] == 2
    assert re.search(r"another live process \(pid \d+\) is writing --hf '.*hf'", printed.err)
    exported = load_file(out / "model-00001-of-00002.safetensors")
    exported.update(load_file(out / "model-00002-of-00002.safetensors"))
    for name, t in module.state_dict().items():
        assert torch.equal(exported[name], t), name
    checkpoint.save(run / "ckpt", module, step=4, keep_last=1)  # no longer held: pruned
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step_00000004"]


def _second_export(run: Path, out: Path, seen: dict) -> None:
    with pytest.raises(SystemExit) as exit_:
        export.main(["--run", str(run), "--hf", str(out)])
    seen["second"] = exit_.value.code
