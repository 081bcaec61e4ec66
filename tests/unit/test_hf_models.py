"""``--model hf:DIR`` and ``export --hf``: what is refused before any rank starts or any
file is written, and ``load_hf_weights`` on a model that is not sharded (the sharded
reads are ``tests/dist/test_hf_train_load.py``)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from raggedfsdp.cli import export
from raggedfsdp.cli import train as train_cli

needs_transformers = pytest.importorskip


def _config(directory, **fields):
    directory.mkdir(exist_ok=True)
    config = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
    }
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _refused(argv, match, capsys, tmp_path, command=train_cli):
    with pytest.raises(SystemExit) as exit_:
        command.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


def _train_refused(argv, match, capsys, tmp_path):
    out = tmp_path / "out"
    # the arguments under test last: argparse keeps an option's last value
    argv = ["--max-bytes", "100000", "--seq-len", "16", "--nproc", "2", "--out", str(out), *argv]
    _refused(argv, match, capsys, tmp_path)
    assert not out.exists()  # nothing written, nothing launched


def test_train_refuses_a_directory_without_config(capsys, tmp_path):
    _train_refused(
        ["--model", f"hf:{tmp_path}"],
        r"config.json does not exist; pass hf:DIR with DIR a directory holding",
        capsys,
        tmp_path,
    )


def test_train_names_the_extra_when_transformers_is_missing(capsys, tmp_path, monkeypatch):
    _config(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    _train_refused(
        ["--model", f"hf:{tmp_path / 'm'}"],
        r"Hugging Face transformers, which is not installed; install it "
        r"\(pip install 'raggedfsdp\[hf\]'",
        capsys,
        tmp_path,
    )


@pytest.mark.parametrize(
    "fields, argv, match",
    [
        ({"model_type": "vit"}, [], r"model_type 'vit' of .*config.json is not a causal language"),
        ({"model_type": "no-such-model"}, [], r"transformers cannot read .*config.json"),
        ({"vocab_size": 128}, [], r"has a vocabulary of 128 ids, fewer than the data's 256"),
        ({}, ["--seq-len", "33"], r"--seq-len 33 exceeds max_position_embeddings=32"),
        ({}, ["--mesh", "tp=2"], r"tensor and expert parallel split the catalogue models"),
        ({}, ["--optim", "muon"], r"--optim muon with --model hf:.*pass --optim adamw"),
        (
            {},
            ["--block-rows", "3"],
            r"--block-rows 3 does not divide the 256 rows of .model.embed_tokens.weight.",
        ),
    ],
)
def test_train_refuses_what_the_model_cannot_run(fields, argv, match, capsys, tmp_path):
    needs_transformers("transformers")
    model = _config(tmp_path / "m", **fields)
    _train_refused(["--model", f"hf:{model}", *argv], match, capsys, tmp_path)


def test_train_refuses_bin_weights(capsys, tmp_path):
    needs_transformers("transformers")
    model = _config(tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"")
    _train_refused(
        ["--model", f"hf:{model}"], r"holds PyTorch \*.bin weights, which are not read", capsys,
        tmp_path,
    )  # fmt: skip


def test_export_refuses_before_writing(capsys, tmp_path):
    needs_transformers("transformers")
    out = tmp_path / "hf"
    run = tmp_path / "run"
    run.mkdir()
    _refused(["--run", str(run), "--hf", str(out)], r"holds no readable run.json", capsys,
             tmp_path, export)  # fmt: skip
    (run / "run.json").write_text(json.dumps({"args": {"model": "llama-tiny"}}))
    _refused(["--run", str(run), "--hf", str(out)], r"trained --model 'llama-tiny', not a "
             r"Hugging Face model", capsys, tmp_path, export)  # fmt: skip
    model = _config(tmp_path / "m")
    (run / "run.json").write_text(json.dumps({"args": {"model": f"hf:{tmp_path / 'gone'}"}}))
    _refused(["--run", str(run), "--hf", str(out)], r"config.json does not exist.*pass --model "
             r"hf:DIR where the run's directory is now", capsys, tmp_path, export)  # fmt: skip
    (run / "run.json").write_text(json.dumps({"args": {"model": f"hf:{model}"}}))
    _refused(["--run", str(run), "--hf", str(out)], r"holds no complete checkpoint; train with "
             r"--ckpt-every", capsys, tmp_path, export)  # fmt: skip
    _refused(["--run", str(run), "--hf", str(out), "--checkpoint", str(run / "ckpt" / "x")],
             r"the checkpoint '.*x' cannot be read", capsys, tmp_path, export)  # fmt: skip
    assert not out.exists()


def _tiny_llama(directory, seed=0):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_load_hf_weights_unsharded_and_its_errors(tmp_path):
    needs_transformers("transformers")
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from raggedfsdp.models.hf import build_hf_model, load_hf_weights, materialize_hf

    directory = _tiny_llama(tmp_path / "m")
    source = f"hf:{directory}"
    model = build_hf_model(source)
    assert materialize_hf(model, source, device="cpu", seed=0) == "file"
    ref = AutoModelForCausalLM.from_pretrained(directory)
    for (name, p), (ref_name, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert name == ref_name and torch.equal(p, q), name

    with pytest.raises(ValueError, match=r"holds no \*.safetensors file"):
        load_hf_weights(model, tmp_path)
    weights = load_file(directory / "model.safetensors")
    less = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    save_file(less, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"hold no tensor for 1 of the model's: \['model.norm"):
        load_hf_weights(model, directory)
    save_file({**less, "model.norm.weight": torch.ones(3)}, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\) in .* the "
                       r"module's is \(16,\)"):  # fmt: skip
        load_hf_weights(model, directory)
    save_file({"model.norm.weight": torch.ones(16)}, directory / "extra.safetensors")
    with pytest.raises(ValueError, match=r"'model.norm.weight' is in two safetensors files"):
        load_hf_weights(model, directory)


def test_materialize_without_weights_is_seeded(tmp_path):
    needs_transformers("transformers")
    import torch

    from raggedfsdp.models.hf import build_hf_model, hf_blocks, materialize_hf

    model = _config(tmp_path / "m")
    a, b = build_hf_model(f"hf:{model}"), build_hf_model(f"hf:{model}")
    assert [type(m).__name__ for m in hf_blocks(a)] == ["LlamaDecoderLayer"]
    assert materialize_hf(a, f"hf:{model}", device="cpu", seed=3) == "init"
    assert materialize_hf(b, f"hf:{model}", device="cpu", seed=3) == "init"
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q) and torch.isfinite(p).all(), name
    inv_freq = a.model.rotary_emb.inv_freq  # a buffer recomputed after to_empty
    assert torch.equal(inv_freq, 10000.0 ** -(torch.arange(0, 8, 2).float() / 8))


def test_transformers_stays_optional():
    """The library, the models (hf.py included) and the train command's modules import
    without transformers; only building an hf:DIR model imports it."""
    import subprocess

    code = (
        "import sys\nimport raggedfsdp, raggedfsdp.models.hf, raggedfsdp.cli.train, "
        "raggedfsdp.cli.export, raggedfsdp.train.loop\n"
        "print('transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_the_memory_and_storage_checks_read_a_hf_model(capsys, tmp_path, monkeypatch):
    """The step-memory estimate and the checkpoint size of ``hf:DIR`` come from its modules:
    a Hugging Face Llama of llama-tiny's shapes is read as llama-tiny, and a job whose
    step cannot fit is refused before any rank starts, as a catalogue model's."""
    pytest.importorskip("transformers")
    from raggedfsdp.models.mesh import parse_mesh_spec
    from raggedfsdp.train import resources

    twin = _config(
        tmp_path / "twin",
        vocab_size=1001,
        hidden_size=96,
        intermediate_size=260,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
    )
    mesh = parse_mesh_spec(None, 2)
    ours = resources.model_size(
        train_cli.build_parser().parse_args(["--model", f"hf:{twin}"]), mesh
    )
    assert ours == resources.model_size(
        train_cli.build_parser().parse_args(["--model", "llama-tiny"]), mesh
    )
    monkeypatch.setattr(resources, "memory_limit", lambda: (1 << 20, "a 1 MiB test limit"))
    _train_refused(
        ["--model", f"hf:{twin}"],
        r"needs about [\d,.]+ MiB .*more than its 1.0 MiB \(a 1 MiB test limit\)",
        capsys,
        tmp_path,
    )
