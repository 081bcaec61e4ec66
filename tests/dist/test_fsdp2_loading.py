"""Loading weights into a sharded model the ways FSDP2's users do, and ``fully_shard``'s
argument checks, against torch 2.13's FSDP2 with the same calls on 2 gloo ranks.

- Meta-device init, then ``model.load_state_dict(sharded, assign=True)`` (Hugging Face
  accelerate's ``cpu_ram_efficient_loading``: a DTensor per parameter with its own mesh
  and placements), full-size plain tensors (raggedfsdp only: FSDP2 needs DTensors),
  torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` on a meta model, and
  partial loads (``strict=False``): the assigned tensors are adopted into the flat
  buffer, every parameter is a view of it again, and training equals FSDP2's bit for bit
  (fp32, SGD).
- ``CPUOffloadPolicy`` on a model built on meta, then ``to_empty(device="cpu")``
  (torchtitan's ``--training.enable_cpu_offload``).
- ``MixedPrecisionPolicy``'s positional arguments, ``set_all_reduce_hook(hook, stream=)``
  and the exception types of ``fully_shard``'s validation, raised before the module
  changes.
"""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

import raggedfsdp
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer
from tests.dist.test_fsdp2_dropin import SEQ, STEPS, _batches, _shard, _train
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics
BOTH = {"FSDP2": torch_fsdp.fully_shard, "raggedfsdp": raggedfsdp.fully_shard}


# ---- a model, its shards, its training ------------------------------------------------------
def _pretrained() -> Transformer:
    return Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=3)


def _meta_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(get_config("llama-tiny"), max_seq_len=SEQ)


def _assert_same_training(ours, theirs, what: str) -> None:
    """Bitwise: the same fp32 arithmetic on 2 ranks (see _accumulate_bf16 in the drop-in
    tests: sums of two addends do not depend on the layout)."""
    (losses, params), (ref_losses, ref_params) = ours, theirs
    assert losses == ref_losses, f"{what}: losses {losses} vs FSDP2's {ref_losses}"
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert torch.equal(p, ref_params[name]), f"{what}: {name} differs from FSDP2's"


def _assert_views(model) -> None:
    """Every sharded parameter the modules hold is a view of its buffer's shard storage
    (no copy of its own), and ``buffer_of`` finds it."""
    held = {id(p) for p in model.parameters()}
    seen = 0
    for buf in buffers_of(model):
        for s in buf.params:
            local = s.param.to_local()
            assert id(s.param) in held, f"{s.fqn}: the buffer's parameter is not the module's"
            assert local.untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr()
            if s.numel:
                assert local.data_ptr() == s.view(buf.shard).data_ptr(), s.fqn
            assert raggedfsdp.fsdp.buffer_of(s.param)[0] is buf, s.fqn
            seen += 1
    assert seen == len(held)


def _set_rope(model, pretrained) -> None:
    model.rope = pretrained.rope.clone()  # a non-persistent buffer: never in a state dict


# ---- A: meta init, then load_state_dict(assign=True) -----------------------------------------
def _sharded_like(model, full: dict) -> dict:
    """accelerate's ``fsdp2_load_full_state_dict``: each full tensor distributed with the
    sharded (meta) parameter's own mesh and placements."""
    return {
        k: distribute_tensor(full[k], p.device_mesh, p.placements)
        for k, p in model.state_dict().items()
    }


def _meta_then_assign(fully_shard, mesh, rank, world, *, plain=False):
    pretrained = _pretrained()
    full = pretrained.state_dict()
    model = _shard(fully_shard, _meta_model(), mesh)
    sd = {k: v.clone() for k, v in full.items()} if plain else _sharded_like(model, full)
    model.load_state_dict(sd, assign=True)
    _set_rope(model, pretrained)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta, name
        assert torch.equal(p.full_tensor(), full[name]), name
    if fully_shard is raggedfsdp.fully_shard:
        _assert_views(model)
    return _train(model, rank, world)


def _check_meta_assign(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    theirs = _meta_then_assign(torch_fsdp.fully_shard, mesh, rank, world)
    ours = _meta_then_assign(raggedfsdp.fully_shard, mesh, rank, world)
    _assert_same_training(ours, theirs, "meta + load_state_dict(DTensors, assign=True)")
    ours = _meta_then_assign(raggedfsdp.fully_shard, mesh, rank, world, plain=True)
    _assert_same_training(ours, theirs, "meta + load_state_dict(full tensors, assign=True)")


def _check_set_model_state_dict_on_meta(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    pretrained = _pretrained()
    results = {}
    for name, fully_shard in BOTH.items():
        model = _shard(fully_shard, _meta_model(), mesh)
        full = {k: v.clone() for k, v in pretrained.state_dict().items()} if rank == 0 else {}
        set_model_state_dict(model, full, options=options)
        _set_rope(model, pretrained)
        if name == "raggedfsdp":
            _assert_views(model)
        results[name] = _train(model, rank, world)
    _assert_same_training(results["raggedfsdp"], results["FSDP2"], "set_model_state_dict")


def _check_partial_on_meta(rank, world):
    """Loaded in two halves (``strict=False``): trains as FSDP2 loaded the same way. A
    forward between the halves raises FSDP2's exception type, naming what is still on
    meta; raggedfsdp then takes the second half and trains the same."""
    mesh = init_device_mesh("cpu", (world,))
    pretrained = _pretrained()
    full = pretrained.state_dict()
    x = _batches(rank, world)[0][:, :-1]
    errors, results = {}, {}
    for name, fully_shard in BOTH.items():
        model = _shard(fully_shard, _meta_model(), mesh)
        sd = _sharded_like(model, full)
        first = {k: v for k, v in sd.items() if not k.startswith("layers.1.")}
        rest = {k: v for k, v in sd.items() if k.startswith("layers.1.")}
        missing, unexpected = model.load_state_dict(first, strict=False, assign=True)
        assert sorted(missing) == sorted(rest) and not unexpected
        _set_rope(model, pretrained)
        with pytest.raises(RuntimeError) as err:
            model(x)
        errors[name] = str(err.value)
        if name == "raggedfsdp":
            model.reset_iter_state()  # after an exception in forward, as documented
        if name == "FSDP2":  # its lazy init failed half way: a fresh model for the reference
            model = _shard(fully_shard, _meta_model(), mesh)
            model.load_state_dict(first, strict=False, assign=True)
            _set_rope(model, pretrained)
        model.load_state_dict(rest, strict=False, assign=True)
        if name == "raggedfsdp":
            _assert_views(model)
        results[name] = _train(model, rank, world)
    for name in BOTH:  # FSDP2's words, naming the unloaded block's parameters
        assert re.search(r"still on meta device: \[.*'layers\.1\.", errors[name]), errors
    _assert_same_training(results["raggedfsdp"], results["FSDP2"], "partial loads on meta")


def _check_partial_on_materialized(rank, world):
    """A model built on the CPU (other values), one block and the head replaced with
    ``strict=False, assign=True``: the rest keeps its values."""
    mesh = init_device_mesh("cpu", (world,))
    pretrained = _pretrained()
    full = pretrained.state_dict()
    results = {}
    for name, fully_shard in BOTH.items():
        model = _shard(
            fully_shard, Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0), mesh
        )
        sd = _sharded_like(model, full)
        part = {k: v for k, v in sd.items() if k.startswith(("layers.0.", "output."))}
        model.load_state_dict(part, strict=False, assign=True)
        for k, p in model.named_parameters():
            if k in part:
                assert torch.equal(p.full_tensor(), full[k]), k
        if name == "raggedfsdp":
            _assert_views(model)
        results[name] = _train(model, rank, world)
    _assert_same_training(results["raggedfsdp"], results["FSDP2"], "a partial load, assigned")


def _check_assign_refusals(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    full = _pretrained().state_dict()
    model = _shard(raggedfsdp.fully_shard, _meta_model(), mesh)
    key = "layers.0.attention.wq.weight"
    wrong = distribute_tensor(full[key], mesh, [Replicate()])
    held = model.get_parameter(key)
    for bad, what in [
        (wrong, r"placements \(Replicate\(\),\).*expected \(RaggedShard"),
        (full[key].double(), r"dtype torch.float64; fully_shard holds it in torch.float32"),
    ]:
        with pytest.raises(ValueError, match=rf"'{key}' was assigned .*{what}"):
            model.load_state_dict({key: bad}, strict=False, assign=True)
        assert model.get_parameter(key) is held  # the module keeps its sharded parameter


# ---- B: CPU offload on a meta model ----------------------------------------------------------
def _check_offload_on_meta(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, fully_shard in BOTH.items():
        offload = torch_fsdp.CPUOffloadPolicy(pin_memory=False)
        model = _shard(fully_shard, _meta_model(), mesh, offload_policy=offload)
        model.to_empty(device="cpu")
        model.init_weights(3)
        if name == "raggedfsdp":
            _assert_views(model)
        results[name] = _train(model, rank, world)
    _assert_same_training(results["raggedfsdp"], results["FSDP2"], "CPU offload, meta init")


# ---- C: smaller API gaps ---------------------------------------------------------------------
def test_mixed_precision_policy_takes_positional_arguments():
    ours = raggedfsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, False)
    theirs = torch_fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, False)
    for field in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"):
        assert getattr(ours, field) == getattr(theirs, field), field


def _check_all_reduce_hook_stream(rank, world):
    """torch's signature; on the CPU the stream is ignored (no streams), as FSDP2 does."""
    mesh = init_device_mesh("cpu", (world,))
    results, calls = {}, {}
    for name, fully_shard in BOTH.items():
        model = _shard(fully_shard, _pretrained(), mesh)
        calls[name] = []

        def hook(out, seen=calls[name]):
            seen.append(out.numel())
            out.mul_(0.5)

        model.set_all_reduce_hook(hook, stream=torch.cpu.Stream())
        results[name] = _train(model, rank, world)
    assert len(calls["raggedfsdp"]) == len(calls["FSDP2"]) == STEPS
    _assert_same_training(results["raggedfsdp"], results["FSDP2"], "all-reduce hook, stream=")


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


class _Sharded(nn.Linear):
    pass


def _validation_cases(mesh1d):
    """(what, build the module, fully_shard keyword arguments, ours must name this)."""
    named = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    return [
        ("container without forward", lambda: nn.ModuleList([nn.Linear(4, 4)]), {}, "ModuleList"),
        (
            "2-D mesh without dim names",
            lambda: nn.Linear(4, 4),
            {"mesh": init_device_mesh("cpu", (1, 2))},
            "mesh_dim_names",
        ),
        ("3-D mesh", lambda: nn.Linear(4, 4), {"mesh": init_device_mesh("cpu", (1, 1, 2))}, "3-D"),
        (
            "channels-last parameter",
            lambda: nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last),
            {"mesh": mesh1d},
            "'weight'",
        ),
        ("0-d parameter", _Scalar, {"mesh": mesh1d}, "'scale'"),
        (
            "reshard_after_forward not a bool or int",
            lambda: nn.Linear(4, 4),
            {"mesh": mesh1d, "reshard_after_forward": "yes"},
            "reshard_after_forward",
        ),
        (
            "reshard_after_forward not a factor",
            lambda: nn.Linear(4, 4),
            {"mesh": mesh1d, "reshard_after_forward": 3},
            "factor",
        ),
        (
            "shard_placement_fn gives Replicate",
            lambda: nn.Linear(4, 4),
            {"mesh": mesh1d, "shard_placement_fn": lambda p: Replicate()},
            "'weight'",
        ),
        (
            "dp_mesh_dims names no dim of the mesh",
            lambda: nn.Linear(4, 4),
            {"mesh": named, "dp_mesh_dims": torch_fsdp.DataParallelMeshDims(shard="nope")},
            "nope",
        ),
        (
            "dp_mesh_dims on a mesh without names",
            lambda: nn.Linear(4, 4),
            {"mesh": mesh1d, "dp_mesh_dims": torch_fsdp.DataParallelMeshDims(shard="dp")},
            "mesh_dim_names",
        ),
    ]


def _untouched(module, params) -> None:
    assert "FSDP" not in type(module).__name__, type(module)
    now = list(module.parameters())
    assert len(now) == len(params) and all(p is q for p, q in zip(now, params))
    assert not any(isinstance(p, DTensor) for p in now)


def _raised(fn, *args, **kw) -> Exception | None:
    try:
        fn(*args, **kw)
    except Exception as e:
        return e
    return None


def _check_validation_types(rank, world):
    """Each bad argument raises the exception type FSDP2 raises (a message of our own,
    naming what is wrong), and leaves the module as it was."""
    mesh = init_device_mesh("cpu", (world,))
    problems = []
    for what, build, kw, names in _validation_cases(mesh):
        theirs = _raised(torch_fsdp.fully_shard, build(), **kw)
        assert theirs is not None, f"{what}: FSDP2 accepts it"
        module = build()
        params = list(module.parameters())
        ours = _raised(raggedfsdp.fully_shard, module, **kw)
        if not isinstance(ours, type(theirs)):
            problems.append(f"{what}: raggedfsdp raised {ours!r}, FSDP2 {theirs!r}")
        elif names not in str(ours):
            problems.append(f"{what}: {names!r} not in {ours}")
        if ours is not None:
            _untouched(module, params)
    assert not problems, "\n".join(problems)
    # applying twice: FSDP2's contract refuses with AssertionError
    for fully_shard in BOTH.values():
        lin = fully_shard(_Sharded(4, 4), mesh=mesh)
        with pytest.raises(AssertionError):
            fully_shard(lin, mesh=mesh)
    # Shard(-1) of a 1-D parameter is Shard(0), as in FSDP2
    raggedfsdp.fully_shard(
        nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(-1) if p.dim() == 1 else None
    )


def _grid(rank, world):
    run_cases(
        {
            "meta + load_state_dict(assign=True)": partial(_check_meta_assign, rank, world),
            "set_model_state_dict on meta": partial(
                _check_set_model_state_dict_on_meta, rank, world
            ),
            "partial loads on meta": partial(_check_partial_on_meta, rank, world),
            "partial load on a materialized model": partial(
                _check_partial_on_materialized, rank, world
            ),
            "assign refusals": partial(_check_assign_refusals, rank, world),
            "CPU offload on meta": partial(_check_offload_on_meta, rank, world),
            "set_all_reduce_hook(stream=)": partial(_check_all_reduce_hook_stream, rank, world),
            "validation: FSDP2's exception types": partial(_check_validation_types, rank, world),
        }
    )
    dist.barrier()


def test_loading_and_validation_against_fsdp2():
    spawn(2, _grid, timeout=600)
