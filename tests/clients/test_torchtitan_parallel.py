"""torchtitan 0.3.0 with tensor and expert parallelism, raggedfsdp against FSDP2, 4 ranks.

The runs of ``test_torchtitan.py`` (its shims, its assets, its ``_run_both``: FSDP2 first,
then the same run with ``torchtitan.distributed.fsdp.fully_shard`` bound to
``raggedfsdp.fully_shard``), on 4 gloo ranks with torchtitan's own parallelism options:

- **llama3 debugmodel, TP 2 x FSDP 2** (``--parallelism.tensor_parallel_degree 2
  --parallelism.data_parallel_shard_degree 2``): torchtitan unflattens one 1-D world mesh
  into its tp and fsdp meshes (two unflattens), so neither name is in a common root mesh;
- **qwen3 MoE, EP 2** (``--parallelism.expert_parallel_degree 2``, dp shard 4): the experts
  get the 2-rank ``efsdp`` mesh through ``shard_placement_fn`` returning torch's
  ``ShardPlacementResult``, the rest of each block the 4-rank ``fsdp`` mesh. The model is
  ``qwen3_moe_debug_small`` below (selected with ``--module
  tests.clients.test_torchtitan_parallel``): torchtitan's ``debugmodel_moe`` layers with 2
  layers, 8 experts (so ``efsdp * ep`` = 4 does not exceed them: experts sharded on
  ``Shard(0)``) of hidden size 64, top 2, so that a step takes seconds on the CPU.

Each run takes the fewest steps (2) and a short sequence; the losses must agree within
``TOL`` (fp32) and the gradient norms within ``GRAD_NORM_RTOL``.
"""

from __future__ import annotations

import json

import pytest

from tests.clients.test_torchtitan import SEED, _argv, _run_both, assets  # noqa: F401
from tests.harness import spawn

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed: `make test-clients` installs the clients extra",
)

WORLD = 4
STEPS = 2
TIMEOUT = 600.0
TOL = 1e-5  # on the losses, fp32
GRAD_NORM_RTOL = 1e-5

SHORT = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "32",
    "--training.local_batch_size", "1",
    "--training.mixed_precision_param", "float32",
]  # fmt: skip


def qwen3_moe_debug_small():
    """torchtitan's ``qwen3_moe_debug``, smaller: 2 layers of 8 experts (hidden 64, top 2)."""
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    model = config.model_spec.model
    rope = model.layers[0].attention.rope
    model.layers = _build_qwen3_moe_layers(
        n_layers=2,
        dim=model.dim,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        moe_hidden_dim=64,
        num_experts=8,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=rope,
    )
    return config


CONFIGS: dict[str, list[str]] = {
    "llama3_tp2_fsdp2": [
        "--parallelism.tensor_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "2",
        *SHORT,
    ],
    "qwen3_moe_ep2": [
        *SHORT,
        "--module", "tests.clients.test_torchtitan_parallel",
        "--config", "qwen3_moe_debug_small",
        "--parallelism.expert_parallel_degree", "2",
    ],
}  # fmt: skip


# what raggedfsdp's buffers must show: (ranks a buffer is sharded over, tensor-parallel)
EXPECTED_BUFFERS = {
    "llama3_tp2_fsdp2": {(2, True)},  # every block's TP-local buffer over the 2 fsdp ranks
    "qwen3_moe_ep2": {(2, True), (4, False)},  # experts over efsdp (ep-local), the rest over 4
}


def _run_recorded(rank, world, tmp: str, argvs, seed: int, out: str, seen: str) -> None:
    """``_run_both``, recording on rank 0 the kinds of buffer raggedfsdp made."""
    import raggedfsdp
    from raggedfsdp.fsdp import buffers_of

    real, kinds = raggedfsdp.fully_shard, set()

    def fully_shard(module, **kwargs):
        out = real(module, **kwargs)
        modules = module if isinstance(module, list) else [module]
        for view in (v for m in modules for v in buffers_of(m)):
            kinds.add((view.world_size, view.tensor_parallel))
        return out

    raggedfsdp.fully_shard = fully_shard
    try:
        _run_both(rank, world, tmp, argvs, seed, out)
    finally:
        raggedfsdp.fully_shard = real
    if rank == 0:
        with open(seen, "w") as f:
            json.dump(sorted(kinds), f)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_equal_fsdp2(name, assets, tmp_path):  # noqa: F811
    out = tmp_path / "losses.json"
    argv = _argv(*assets, *CONFIGS[name])
    seen = tmp_path / "buffers.json"
    spawn(WORLD, _run_recorded, str(tmp_path), [argv], SEED, str(out), str(seen), timeout=TIMEOUT)
    kinds = {tuple(k) for k in json.loads(seen.read_text())}
    assert kinds == EXPECTED_BUFFERS[name], kinds
    results = json.loads(out.read_text())
    (ref,), (ours,) = results["fsdp2"], results["raggedfsdp"]
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1)), ref
    assert [s for s, _, _ in ours] == [s for s, _, _ in ref], (ours, ref)
    worst = max(abs(a[1] - b[1]) for a, b in zip(ours, ref))
    assert worst <= TOL, f"losses differ from FSDP2's by {worst:.3g}: {ours} vs {ref}"
    worst = max(abs(a[2] - b[2]) / b[2] for a, b in zip(ours, ref))
    assert worst <= GRAD_NORM_RTOL, f"gradient norms differ by {worst:.3g}: {ours} vs {ref}"
