"""Hugging Face Llama and Qwen3-MoE with raggedfsdp against torch's FSDP2.

Tiny configs, no downloads. For each model, on 2 gloo ranks, the large-model recipe runs
twice in the same processes, with ``torch.distributed.fsdp.fully_shard`` and with
``raggedfsdp.fully_shard``, nothing else different:

1. build the model on ``meta``, ``fully_shard`` each decoder layer then the root,
   ``to_empty(device="cpu")``, ``init_weights()`` (transformers' ``_init_weights``:
   ``init.normal_`` / ``ones_`` / ``zeros_`` on the sharded parameters, the rotary
   buffers recomputed);
2. ``set_model_state_dict(model, full, StateDictOptions(full_state_dict=True,
   broadcast_from_rank0=True))`` from rank 0's full state dict (rank 1 passes ``{}``);
3. a few AdamW steps (each rank its own batch, global loss all-reduced);
4. greedy ``generate()`` of a fixed number of tokens.

The loaded weights must equal the full state dict exactly, and the losses, the trained
weights and the generated tokens must equal FSDP2's (fp32: 1e-6). On the CPU, torch's
DTensor has no RNG tracker, so a random init of sharded parameters depends on the
sharding and cannot be compared between the two; step 1 is checked for what holds for
both: the deterministic parameters (the norms' ones) and the rotary buffers equal FSDP2's,
and the random ones are finite with the configured spread. (FSDP2 there draws the same
values into each rank's shard, and its ``init.zeros_(weight[padding_idx])`` writes into a
copy, leaving the padding row random: neither is compared.)
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.harness import spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed: `make test-clients` installs the clients extra",
)

WORLD = 2
STEPS = 3
SEQ = 16
NEW_TOKENS = 6
TOL = 1e-6
VOCAB = 256


def _config(name: str):
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.02,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if name == "llama":
        return LlamaConfig(intermediate_size=128, **common)
    return Qwen3MoeConfig(
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        **common,
    )


def _meta_init_and_shard(fully_shard, cfg, mesh):
    """Steps 1: meta build, fully_shard per layer then root, to_empty, init_weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.init_weights()
    return model


def _after_init(model, cfg) -> dict:
    """What step 1 gives that does not depend on the sharding: the full deterministic
    parameters and buffers, and each random parameter's spread."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        assert torch.isfinite(full).all(), f"{name}: not finite after init_weights"
        if "norm" in name:  # init.ones_
            out[name] = full
        else:
            std = full.std().item()
            assert 0.5 * cfg.initializer_range < std < 1.5 * cfg.initializer_range, (name, std)
    for name, b in model.named_buffers():
        out[name] = b.full_tensor() if isinstance(b, DTensor) else b.detach().clone()
    return out


def _init_case(fully_shard, cfg, rank: int, world: int) -> dict:
    """Step 1; returns what must equal FSDP2's."""
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _meta_init_and_shard(fully_shard, cfg, mesh)
    return {"init": _after_init(model, cfg)}


def _load_train_generate_case(fully_shard, cfg, rank: int, world: int) -> dict:
    """Steps 2-4 on a model built on the CPU (its own init, then sharded), so that they
    do not depend on step 1; returns what must equal FSDP2's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor, init_device_mesh
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    full_sd = AutoModelForCausalLM.from_config(cfg).state_dict()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)  # other weights than full_sd's: the load must replace them
    model = AutoModelForCausalLM.from_config(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    result = {}

    # 2. load a full state dict from rank 0
    set_model_state_dict(
        model,
        dict(full_sd) if rank == 0 else {},  # a copy: torch writes DTensors into it
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        assert torch.equal(full, full_sd[name]), f"{name}: loaded value differs"

    # 3. train
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    batches = torch.randint(3, VOCAB, (STEPS, world, 2, SEQ), generator=gen)
    losses = []
    model.train()
    for step in range(STEPS):
        ids = batches[step, rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    result["losses"] = losses
    result["params"] = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())
        for n, p in model.named_parameters()
    }

    # 4. generate: the same prompt and length on every rank (same number of forwards)
    model.eval()
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        tokens = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    result["generated"] = tokens
    return result


def _compare(ours: dict, ref: dict) -> None:
    import torch

    for name, value in ref.get("init", {}).items():
        torch.testing.assert_close(ours["init"][name], value, atol=0, rtol=0, msg=name)
    if "losses" in ref:
        worst = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))
        assert worst <= TOL, f"losses differ by {worst:.3g}: {ours['losses']} vs {ref['losses']}"
    for name, p in ref.get("params", {}).items():
        torch.testing.assert_close(ours["params"][name], p, atol=TOL, rtol=TOL, msg=name)
    if "generated" in ref:
        assert torch.equal(ours["generated"], ref["generated"]), (
            f"generate() differs:\n{ours['generated']}\nvs FSDP2's\n{ref['generated']}"
        )


CASES = {"init": _init_case, "load_train_generate": _load_train_generate_case}


def _against_fsdp2(rank: int, world: int, model: str, case: str) -> None:
    import torch.distributed.fsdp as torch_fsdp

    cfg = _config(model)
    ref = CASES[case](torch_fsdp.fully_shard, cfg, rank, world)

    import raggedfsdp  # after FSDP2's run

    ours = CASES[case](raggedfsdp.fully_shard, cfg, rank, world)
    _compare(ours, ref)


PARAMS = [f"{m}-{c}" for m in ("llama", "qwen3_moe") for c in CASES]


@pytest.mark.parametrize("name", PARAMS)
def test_hf_against_fsdp2(name):
    model, case = name.split("-")
    spawn(WORLD, _against_fsdp2, model, case, timeout=300)
