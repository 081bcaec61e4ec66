"""``python -m raggedfsdp train --model hf:DIR --tokenizer DIR --data FILE.jsonl`` and
``export --hf`` end to end, on a tiny Llama saved with weights and a tiny Qwen3-MoE saved
as ``config.json`` alone (a seeded random init), a BPE tokenizer trained by the test on
the default text and JSON-lines data written by the test; ranks forked by
``tests.harness.train_cli``.

- Llama on 2 ranks: a run split in two jobs by a checkpoint gives the losses of the run
  in one job bit for bit (same ranks and layout: the same arithmetic), and they fall.
- Qwen3-MoE on 4 ranks: the losses fall.
- Each run is exported (``export --run RUN --hf OUT``) and loaded by transformers'
  ``from_pretrained``: its weights are the checkpoint's and its logits are those of the
  trained model, the sharded model filled from the same checkpoint, bit for bit: the
  same fp32 weights through the same modules, on the same batch in the same process, so
  the same arithmetic (the sharded forward all-gathers the weights, exactly, first).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from raggedfsdp.train.data import DataConfig, iter_documents
from tests.dist.test_hf_train_load import tiny_config, write_model
from tests.harness import spawn, train_cli
from tests.unit.test_tokenize import train_bpe, write_jsonl

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="transformers is not installed: pip install 'raggedfsdp[hf]'",
    ),
    pytest.mark.numerics,  # bit for bit on any kernels: `make test-numerics` too
]

VOCAB = 320  # the tokenizer's and the models' vocabulary
COMMON = [
    "--steps", "8", "--batch-size", "4", "--seq-len", "16", "--max-bytes", "200000",
    "--val-every", "0", "--lr", "3e-2", "--warmup", "1", "--no-progress", "--no-plot",
]  # fmt: skip


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    return [r["loss"] for r in rows]


def _train(model_dir: Path, out: Path, nproc: int, *extra: str) -> None:
    train_cli(["--model", f"hf:{model_dir}", "--nproc", str(nproc), *COMMON, "--out", str(out)]
              + list(extra))  # fmt: skip


def _export_and_compare(rank: int, world: int, runs: dict[str, tuple[str, str]]) -> None:
    """For each run: ``export``, then the exported model against the checkpoint's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, init_device_mesh
    from transformers import AutoModelForCausalLM

    from raggedfsdp import checkpoint
    from raggedfsdp.cli import export
    from raggedfsdp.models.hf import build_hf_model, hf_blocks, logits_of, materialize_hf
    from raggedfsdp.models.parallelize import parallelize

    for run, out in runs.values():
        assert export.main(["--run", run, "--hf", out]) == 0  # inside this process's group
        source = json.loads((Path(run) / "run.json").read_text())["args"]["model"]
        model = build_hf_model(source)
        parallelize(model, init_device_mesh("cpu", (world,)), blocks=hf_blocks(model))
        materialize_hf(model, source, device="cpu", seed=0, weights="none")
        checkpoint.load(Path(run) / "ckpt", model)
        exported = AutoModelForCausalLM.from_pretrained(out)
        assert exported.dtype == torch.float32
        state = exported.state_dict()
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            assert torch.equal(full, state[name]), name
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        model.eval()
        with torch.no_grad():
            ours = logits_of(model(tokens))
            theirs = exported(tokens).logits
        worst = (ours - theirs).abs().max().item()
        print(f"{out}: largest logit difference after export: {worst}")
        assert torch.equal(ours, theirs), worst
    dist.barrier()


def test_train_resume_export(tmp_path):
    """On a BPE tokenizer trained here and JSON-lines data written here."""
    pytest.importorskip("tokenizers")
    tok = train_bpe(tmp_path / "tok", VOCAB)
    text = b"".join(d.text for d in iter_documents(DataConfig(max_bytes=150_000))).decode()
    data = write_jsonl(tmp_path / "data.jsonl", [p for p in text.split("\n\n") if p.strip()])
    common = ["--tokenizer", str(tok), "--data", str(data)]
    llama = write_model(tmp_path / "llama", tiny_config("llama", vocab_size=VOCAB), weights=True)
    moe = write_model(tmp_path / "moe", tiny_config("qwen3_moe", vocab_size=VOCAB), weights=False)
    assert not list(moe.glob("*.safetensors"))

    whole, split = tmp_path / "llama-whole", tmp_path / "llama-split"
    _train(llama, whole, 2, *common, "--ckpt-every", "8")
    _train(llama, split, 2, *common, "--ckpt-every", "4", "--stop-after", "4")
    assert len(_losses(split)) == 4
    _train(llama, split, 2, *common, "--ckpt-every", "4", "--resume")
    a, b = _losses(whole), _losses(split)
    assert a == b, (a, b)  # bit for bit (JSON keeps every bit)
    assert a[-1] < a[0] - 0.5, a  # from about ln(VOCAB) = 5.8 nats

    run_moe = tmp_path / "moe-run"
    _train(moe, run_moe, 4, *common, "--ckpt-every", "8")
    losses = _losses(run_moe)
    assert losses[-1] < losses[0] - 0.5, losses

    runs = {
        "llama": (str(whole), str(tmp_path / "llama-hf")),
        "qwen3_moe": (str(run_moe), str(tmp_path / "moe-hf")),
    }
    spawn(1, _export_and_compare, runs, timeout=300)
    index = json.loads((tmp_path / "moe-hf" / "model.safetensors.index.json").read_text())
    assert (
        "model.layers.0.mlp.experts.gate_up_proj" in index["weight_map"]
    )  # as the module holds it
