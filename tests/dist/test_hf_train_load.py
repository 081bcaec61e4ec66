"""Hugging Face weights read into a sharded model, each rank its own rows
(``raggedfsdp.models.hf``; [Note: reading Hugging Face weights]).

A tiny Llama and a tiny Qwen3-MoE, with sizes that no world size here divides (vocab
259, hidden 24, 3 experts of 10 rows), are saved by transformers (``save_pretrained``:
the experts one matrix each) and as the module holds them (what ``export --hf`` writes:
the experts stacked and fused). On 3 gloo ranks each is built on ``meta``, sharded per
decoder layer and root by ``parallelize`` (raggedfsdp, 1-row blocks, so shards start
and end inside experts; and torch's FSDP2), and filled by ``materialize_hf``. Every
parameter and buffer must equal what transformers' own ``from_pretrained`` gives, bit
for bit (both copy the file's fp32 values), and each rank must have read exactly its
own elements: no full tensor on any rank.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.harness import run_cases, spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed: pip install 'raggedfsdp[hf]'",
)

WORLD = 3


def tiny_config(kind: str, **sizes):
    """A tiny LlamaConfig or Qwen3MoeConfig; ``sizes`` override the defaults here."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    common.update(sizes)
    if kind == "llama":
        return LlamaConfig(**common)
    moe = dict(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    moe.update({k: common.pop(k) for k in list(common) if k in moe})
    return Qwen3MoeConfig(**common, **moe, decoder_sparse_step=1, norm_topk_prob=True)


def write_model(directory: Path, config, *, weights: bool, seed: int = 0) -> Path:
    """``config.json`` in ``directory``, and with ``weights`` transformers' safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    return directory


def _write_as_module(source: Path, directory: Path) -> None:
    """``source``'s model saved under the module's own names (stacked, fused experts)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source)
    directory.mkdir()
    shutil.copy(source / "config.json", directory / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _check(directory: str, backend: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, init_device_mesh
    from transformers import AutoModelForCausalLM

    from raggedfsdp.models.hf import build_hf_model, hf_blocks, load_hf_weights, materialize_hf
    from raggedfsdp.models.parallelize import parallelize

    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from raggedfsdp import BlockPolicy, fully_shard
    source = f"hf:{directory}"
    model = build_hf_model(source)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = {} if backend == "fsdp2" else {"block_policy": BlockPolicy(rows=1)}
    parallelize(model, mesh, fully_shard=fully_shard, blocks=hf_blocks(model), **kw)
    # materialize_hf(weights="auto") is these two steps where DIR holds safetensors files
    assert materialize_hf(model, source, device="cpu", seed=0, weights="none") == "none"
    read = load_hf_weights(model, directory)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    assert read == local, f"read {read} elements, this rank holds {local}"
    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ref_state = ref.state_dict()
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        assert torch.equal(full, ref_state[name]), name
    for name, b in model.named_buffers():
        assert torch.equal(b, dict(ref.named_buffers())[name]), name


def _grid(rank: int, world: int, dirs: dict[str, str]) -> None:
    cases = {}
    for name, directory in dirs.items():
        for backend in ("raggedfsdp", "fsdp2"):
            cases[f"{name}-{backend}"] = lambda d=directory, b=backend: _check(d, b)
    run_cases(cases)


def test_each_rank_reads_its_rows_of_the_files(tmp_path):
    odd = dict(vocab_size=259, hidden_size=24, intermediate_size=40, head_dim=6)
    dirs = {}
    for kind in ("llama", "qwen3_moe"):
        sizes = dict(odd, moe_intermediate_size=10, num_experts=3) if kind == "qwen3_moe" else odd
        if kind == "llama":
            sizes.pop("head_dim")
        saved = write_model(tmp_path / kind, tiny_config(kind, **sizes), weights=True)
        dirs[f"{kind}-transformers"] = str(saved)
        _write_as_module(saved, tmp_path / f"{kind}-module")
        dirs[f"{kind}-module"] = str(tmp_path / f"{kind}-module")
    spawn(WORLD, _grid, dirs, timeout=300)
