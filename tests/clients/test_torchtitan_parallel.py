"""torchtitan 0.3.0 with tensor and expert parallelism, raggedfsdp against FSDP2, 4 ranks.

The runs of ``test_torchtitan.py`` (its shims, its assets, its ``_run_both``: FSDP2 first,
then the same run with ``torchtitan.distributed.fsdp.fully_shard`` bound to
``raggedfsdp.fully_shard``), on 4 gloo ranks with torchtitan's own parallelism options,
under the ``full_dtensor`` backend (see that file for why not the default ``spmd_types``):
every parameter is a DTensor on torchtitan's whole storage mesh and every ``fully_shard``
gets that mesh with ``dp_mesh_dims`` (torch 2.13's SPMD mesh):

- **llama3 debugmodel, TP 2 x FSDP 2** (``--parallelism.tensor_parallel_degree 2
  --parallelism.data_parallel_shard_degree 2``): the parameters are placed ``Shard(d)`` or
  ``Replicate()`` on ``tp`` and ``Replicate()`` on ``dp_shard`` of one mesh;
- **qwen3 MoE, EP 2** (``--parallelism.expert_parallel_degree 2``, dp shard 4): the experts
  get the 2-rank ``efsdp`` mesh through ``shard_placement_fn`` returning torch's
  ``ShardPlacementResult``, the rest of each block the 4-rank ``fsdp`` mesh. The model is
  ``qwen3_moe_debug_small`` below (selected with ``--module
  tests.clients.test_torchtitan_parallel``): torchtitan's ``debugmodel_moe`` layers with 2
  layers, 8 experts (so ``efsdp * ep`` = 4 does not exceed them: experts sharded on
  ``Shard(0)``) of hidden size 64, top 2, so that a step takes seconds on the CPU;
- **llama3 debugmodel, HSDP 2 x 2** (``--parallelism.data_parallel_replicate_degree 2
  --parallelism.data_parallel_shard_degree 2``): ``dp_mesh_dims`` names ``dp_shard`` and
  ``dp_replicate``: buffers sharded over 2 ranks, their gradients reduce-scattered over
  the shard dim, then all-reduced over the replicate dim;
- **llama3 debugmodel, PP 2 x FSDP 2** (``--parallelism.pipeline_parallel_degree 2
  --parallelism.data_parallel_shard_degree 2``, schedule ``1F1B``, 2 microbatches of 1):
  each rank's stage is one ``fully_shard`` root, driven by ``torch.distributed.pipelining``:
  before each microbatch's backward the stage calls ``set_is_last_backward(False)``,
  ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``, then
  after the last one its ``perform_reduce_grad`` sets all three back to True and finishes
  the gradients through FSDP2's state (``fully_shard.state(module)``). The loss is the
  last stage's (rank 3's), the weights the full model's copied into each stage
  (``_same_initial_weights_by_part``); torchtitan's microbatch lists reach torch 2.13's
  schedule through ``_step_microbatches_shim``. raggedfsdp answers
  ``fully_shard.state(module)`` with its own state ([Note: FSDP2's state, as torch reads
  it] in ``raggedfsdp/fsdp/_torch_state.py``).

Each run takes the fewest steps (2) and a short sequence; the losses must agree within
``TOL`` (fp32) and the gradient norms within ``GRAD_NORM_RTOL``.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.clients import test_torchtitan as tt
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
    "llama3_hsdp_2x2": [
        "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", "2",
        *SHORT,
    ],
    "llama3_pp2_fsdp2": [
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--parallelism.pipeline_parallel_microbatch_size", "1",
        *SHORT,
        "--training.local_batch_size", "2",  # 2 microbatches of 1
    ],
}  # fmt: skip


# what raggedfsdp's buffers must show on rank 0: (ranks a buffer is sharded over,
# tensor-parallel, replicas: the size of the mesh's replicate dim, 1 on a 1-D mesh)
EXPECTED_BUFFERS = {
    "llama3_tp2_fsdp2": {(2, True, 1)},  # every block's TP-local buffer over the 2 fsdp ranks
    # experts over efsdp (ep-local), the rest over 4
    "qwen3_moe_ep2": {(2, True, 1), (4, False, 1)},
    "llama3_hsdp_2x2": {(2, False, 2)},  # sharded over fsdp, replicated over dp_replicate
    "llama3_pp2_fsdp2": {(2, False, 1)},  # rank 0's stage, over its 2 fsdp ranks
}
# the rank whose logged losses are compared: under PP the last stage's (the others log -1)
LOSS_RANK = {"llama3_pp2_fsdp2": 3}
# under PP: the values each raggedfsdp stage root must have been set to by the schedule
PIPELINE_SETTERS = (
    "set_is_last_backward",
    "set_reshard_after_backward",
    "set_requires_gradient_sync",
)


def _step_microbatches_shim():
    """torchtitan 0.3.0 hands its schedule's ``step`` the microbatches already split
    (``arg_mbs=``, ``kwarg_mbs=``, ``target_mbs=``), which torch 2.13's
    ``PipelineScheduleSingle.step`` does not take (it would chunk them as model keyword
    inputs: "Expecting 2 arg_mbs but got 1"). Bound for PP runs, both backends alike, this
    ``step`` runs them through the schedule's ``_step_microbatches``, as torch's ``step``
    does after its own split. Returns the original, to restore."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    step = PipelineScheduleSingle.step

    def step_split(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        if kwarg_mbs is None:  # a whole batch: torch's own split
            return step(self, *args, **kwargs)
        losses, loss_kwargs = kwargs.pop("losses", None), kwargs.pop("loss_kwargs", None)
        return_outputs = kwargs.pop("return_outputs", True)
        assert not args and not kwargs, (args, kwargs)
        self._stage.has_backward = self._has_backward
        self._stage.clear_runtime_states()
        self._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        if self._stage.is_last and return_outputs:
            return self._merge_outputs(self._stage.output_chunks)
        return None

    PipelineScheduleSingle.step = step_split
    return step


def _same_initial_weights_by_part(trainer, seed: int) -> None:
    """Shim 6 for pipeline stages: each model part's parameters (a subset of the model's,
    under the same names less activation checkpointing's wrapper) from one unsharded
    ``init_weights`` of the whole model."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    def clean(fqn: str) -> str:
        return fqn.replace("_checkpoint_wrapped_module.", "")

    torch.manual_seed(seed)
    with torch.device("cpu"):
        reference = trainer.model_config.build()
    with torch.no_grad():
        reference.init_weights(buffer_device=None)
        full = dict(reference.named_parameters())
        for part in trainer.model_parts:
            names = {clean(k) for k, _ in part.named_parameters()}
            assert names and names <= set(full), sorted(names - set(full))
            for fqn, param in part.named_parameters():
                assert isinstance(param, DTensor), fqn
                value = full[clean(fqn)].to(param.dtype)
                local = distribute_tensor(value, param.device_mesh, param.placements).to_local()
                param.to_local().copy_(local)
                assert torch.equal(param.full_tensor(), value), f"{fqn}: the copy did not land"


def _run_recorded(
    rank, world, tmp: str, argvs, seed: int, out: str, seen: str, loss_rank: int = 0,
    pipeline: bool = False,
) -> None:  # fmt: skip
    """``_run_both``, recording on rank 0 the kinds of buffer raggedfsdp made (and under
    ``pipeline`` the values the schedule set on raggedfsdp's modules); rank ``loss_rank``
    writes the logged steps to ``out``."""
    import raggedfsdp
    from raggedfsdp.fsdp import FSDPModule, buffers_of

    real, kinds, runs = raggedfsdp.fully_shard, set(), []
    train_once, init_weights = tt._train_once, tt._same_initial_weights
    setters = {name: getattr(FSDPModule, name) for name in PIPELINE_SETTERS}
    calls = {name: [] for name in PIPELINE_SETTERS}

    def fully_shard(module, **kwargs):
        out = real(module, **kwargs)
        modules = module if isinstance(module, list) else [module]
        for view in (v for m in modules for v in buffers_of(m)):
            replicas = view.mesh.size(0) if view.mesh.ndim == 2 else 1
            kinds.add((view.world_size, view.tensor_parallel, replicas))
        return out

    def recording(name):
        def setter(self, value, *args, **kwargs):
            calls[name].append(bool(value))
            return setters[name](self, value, *args, **kwargs)

        return setter

    def train_and_keep(argv, seed):
        runs.append(train_once(argv, seed))
        if rank == loss_rank != 0:  # each run as it ends (FSDP2's even if raggedfsdp fails)
            with open(out, "w") as f:
                json.dump({"fsdp2": runs[: len(argvs)], "raggedfsdp": runs[len(argvs) :]}, f)
        return runs[-1]

    raggedfsdp.fully_shard, tt._train_once = fully_shard, train_and_keep
    if pipeline:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        schedule_step = _step_microbatches_shim()
        tt._same_initial_weights = _same_initial_weights_by_part
        for name in PIPELINE_SETTERS:
            setattr(FSDPModule, name, recording(name))
    try:
        _run_both(rank, world, tmp, argvs, seed, out if loss_rank == 0 else os.devnull)
    finally:
        raggedfsdp.fully_shard, tt._train_once = real, train_once
        tt._same_initial_weights = init_weights
        for name, setter in setters.items():
            setattr(FSDPModule, name, setter)
        if pipeline:
            PipelineScheduleSingle.step = schedule_step
    if rank == 0:
        with open(seen, "w") as f:
            json.dump({"kinds": sorted(kinds), "calls": calls}, f)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_equal_fsdp2(name, assets, tmp_path):  # noqa: F811
    out = tmp_path / "losses.json"
    argv = _argv(*assets, *CONFIGS[name])
    seen = tmp_path / "buffers.json"
    pipeline = name in LOSS_RANK
    spawn(
        WORLD, _run_recorded, str(tmp_path), [argv], SEED, str(out), str(seen),
        LOSS_RANK.get(name, 0), pipeline, timeout=TIMEOUT,
    )  # fmt: skip
    recorded = json.loads(seen.read_text())
    kinds = {tuple(k) for k in recorded["kinds"]}
    assert kinds == EXPECTED_BUFFERS[name], kinds
    if pipeline:  # each microbatch's backward without sync, then perform_reduce_grad's
        for setter, values in recorded["calls"].items():
            assert values[-1] is True and False in values, (setter, values)
    results = json.loads(out.read_text())
    (ref,), (ours,) = results["fsdp2"], results["raggedfsdp"]
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1)), ref
    assert [s for s, _, _ in ours] == [s for s, _, _ in ref], (ours, ref)
    worst = max(abs(a[1] - b[1]) for a, b in zip(ours, ref))
    assert worst <= TOL, f"losses differ from FSDP2's by {worst:.3g}: {ours} vs {ref}"
    worst = max(abs(a[2] - b[2]) / b[2] for a, b in zip(ours, ref))
    assert worst <= GRAD_NORM_RTOL, f"gradient norms differ by {worst:.3g}: {ours} vs {ref}"
