"""raggedfsdp as a drop-in for FSDP2 (torch 2.13): torch's policy classes, a list of
modules as one group, ``isinstance`` of torch's ``FSDPModule`` and the helpers that
branch on it, the rest of ``FSDPModule``'s methods, against torch's FSDP2 with the same
calls on 2 gloo ranks; and the surface itself, by introspection."""

from __future__ import annotations

import inspect
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

import raggedfsdp
from raggedfsdp.fsdp import FSDP2_SURFACE
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from tests.harness import run_cases, spawn
from tests.numerics import assert_losses_match, assert_param_matches, reference

pytestmark = pytest.mark.numerics
SEQ, STEPS = 16, 3


# ---- the surface, by introspection (no process group) --------------------------------------
def _public_and_overridden(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("__") and callable(getattr(cls, n))}


def test_every_fsdp2_method_is_answered():
    theirs = _public_and_overridden(torch_fsdp.FSDPModule)
    ours = vars(raggedfsdp.FSDPModule)
    missing = sorted(n for n in theirs if n not in ours)
    assert not missing, f"torch's FSDPModule methods raggedfsdp does not override: {missing}"
    unlisted = sorted(theirs - set(FSDP2_SURFACE))
    assert not unlisted, f"FSDPModule methods missing from FSDP2_SURFACE: {unlisted}"
    assert issubclass(raggedfsdp.FSDPModule, torch_fsdp.FSDPModule)


def test_every_fully_shard_parameter_is_accepted():
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    ours = inspect.signature(raggedfsdp.fully_shard).parameters
    missing = sorted(n for n in theirs if n not in ours)
    assert not missing, f"fully_shard parameters of FSDP2 that raggedfsdp lacks: {missing}"


# Every method is answered; a method refused outright would be listed here with the
# arguments that make it raise (the memory settings refuse only on devices that have the
# allocator: tests/dist/test_custom_comms.py).
REFUSED_CALLS: dict[str, tuple] = {}


def test_refused_methods_say_why():
    refused = {n for n, how in FSDP2_SURFACE.items() if how.startswith("refused")}
    assert refused == set(REFUSED_CALLS)
    for name, args in REFUSED_CALLS.items():
        with pytest.raises(NotImplementedError, match=name):
            getattr(raggedfsdp.FSDPModule, name)(object(), *args)


# ---- against FSDP2 on 2 ranks ---------------------------------------------------------------
def _model():
    return Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0)


def _shard(fully_shard, model, mesh, *, head_group=False, **kw):
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, **kw)
    if head_group:  # torchtitan's: the final norm and the output projection, one group
        fully_shard([model.norm, model.output], mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _batches(rank, world):
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, 1001, (STEPS, 2 * world, SEQ + 1), generator=gen)
    return [d[2 * rank : 2 * rank + 2] for d in data]


def _train(model, rank, world, *, setup=lambda m: None, clip=None):
    setup(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for x in _batches(rank, world):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, {k: v.full_tensor() for k, v in model.named_parameters()}


def _against_fsdp2(rank, world, *, shard_kw=None, setup=lambda m: None, clip=None):
    """Losses and final parameters within the bound derived from FSDP2's own run, nudged
    on the same ranks ([Note: derived tolerances] in ``tests/numerics.py``)."""
    mesh = init_device_mesh("cpu", (world,))
    shard_kw = shard_kw or {}

    def run(fully_shard):
        model = _shard(fully_shard, _model(), mesh, **shard_kw)
        return _train(model, rank, world, setup=setup, clip=clip)

    ref = reference(partial(run, torch_fsdp.fully_shard))
    losses, params = run(raggedfsdp.fully_shard)
    assert_losses_match(losses, ref, world=world, tokens=2 * world * SEQ, what="against FSDP2: ")
    for name, p in params.items():
        assert_param_matches(name, p, ref, steps=STEPS, what="against FSDP2: ")


def _accumulate_bf16(rank, world, microbatches=8):
    """bf16 compute, fp32 reduce, ``microbatches`` backwards per step without sync but the
    last: FSDP2 accumulates the unsharded gradients in fp32 (the reduce dtype)."""
    mesh = init_device_mesh("cpu", (world,))
    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results = []
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        model = _shard(fully_shard, _model(), mesh, mp_policy=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for x in _batches(rank, world):
            for i in range(microbatches):
                model.set_requires_gradient_sync(i == microbatches - 1)
                xm = x.roll(i, dims=1)
                loss = lm_loss(model(xm[:, :-1]), xm[:, 1:]) / microbatches
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results.append((losses, [p.full_tensor() for p in model.parameters()]))
    (ref_losses, ref_params), (losses, params) = results
    assert losses == ref_losses, f"{losses} vs FSDP2's {ref_losses}"
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


def _load_pretrained_from_rank0(rank, world, model_name):
    """``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``: rank 0
    holds the full state dict, the others nothing (the usual pretrained load)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    mesh = init_device_mesh("cpu", (world,))
    pretrained = Transformer(get_config(model_name), max_seq_len=SEQ, seed=5).state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
        _shard(fully_shard, model, mesh)
        full = {k: v.clone() for k, v in pretrained.items()} if rank == 0 else {}
        set_model_state_dict(model, full, options=options)  # (it rewrites the dict it gets)
        for name, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), pretrained[name]), (fully_shard.__module__, name)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        for name, value in full.items():
            assert torch.equal(value, pretrained[name]), name


def _divide_factor_as_torchtitan(model):
    # torchtitan: sum gradients (its loss is already normalised globally); force_sum:
    # FSDP2 would reduce with PREMUL_SUM, which gloo lacks (torchtitan's CPU shim)
    for m in model.modules():
        if isinstance(m, torch_fsdp.FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _unshard_embedding_only_for_grads(model):
    model.set_unshard_in_backward(True)
    model.layers[0].set_unshard_in_backward(True)


def _check_isinstance_and_helpers(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = _shard(raggedfsdp.fully_shard, _model(), mesh, head_group=True)
    assert all(isinstance(m, torch_fsdp.FSDPModule) for m in (model, model.norm, model.output))
    # register_fsdp_forward_method (torch's): a method other than forward unshards too
    model.logits_of = lambda tokens: model.forward(tokens)
    torch_fsdp.register_fsdp_forward_method(model, "logits_of")
    with torch.no_grad():
        x = _batches(rank, world)[0][:, :-1]
        out = model.logits_of(x)
        assert torch.equal(out, model(x))
    assert isinstance(model.output.weight, DTensor)  # resharded after the method


def _check_list_group_meta_and_repeated_member(rank, world):
    """torchtitan's head group: ``fully_shard([norm, output])`` built on meta, ``to_empty``
    from the root, and the output projection called several times per forward."""
    mesh = init_device_mesh("cpu", (world,))

    class Net(nn.Sequential):
        def forward(self, x):
            h = self[1](self[0](x))
            return sum(self[2](h * k).square().mean() for k in (1.0, 0.5, 2.0))  # head x 3

    def build(fully_shard):
        with torch.device("meta"):
            net = Net(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))
        fully_shard(net[0], mesh=mesh)
        fully_shard([net[1], net[2]], mesh=mesh)
        fully_shard(net, mesh=mesh)
        net.to_empty(device="cpu")
        torch.manual_seed(2)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(distribute_like(torch.randn(p.shape), p))
        return net

    results = []
    for fully_shard in (torch_fsdp.fully_shard, raggedfsdp.fully_shard):
        net = build(fully_shard)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step + 10 * rank))
            loss = net(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results.append(losses)
    assert results[0] == results[1], results


def distribute_like(full, param):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements)


def _check_tied_sibling_groups_refused(rank, world):
    """A parameter two separate models shard: FSDP2 trains two copies that drift apart;
    raggedfsdp accepts both calls as FSDP2 does and refuses at the first forward of the
    model that sharded it second."""
    mesh = init_device_mesh("cpu", (world,))
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    b = nn.Linear(4, 4)
    a[2].weight = b.weight
    raggedfsdp.fully_shard(b, mesh=mesh)
    raggedfsdp.fully_shard(a, mesh=mesh)
    with pytest.raises(ValueError, match=r"parameter '2.weight' is also sharded by a fully_"):
        a(torch.zeros(2, 4))
    b(torch.zeros(2, 4))  # the first copy is b's own
    root = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    raggedfsdp.fully_shard(root, mesh=mesh)
    with pytest.raises(ValueError, match=r"'weight' is already sharded, as '0.weight' of "):
        raggedfsdp.fully_shard(root[0], mesh=mesh)  # wrong order: root first
    assert type(root[0]) is nn.Linear


def _check_reset_iter_state(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = _shard(raggedfsdp.fully_shard, _model(), mesh)
    x = _batches(rank, world)[0]
    with pytest.raises(ValueError, match="tokens must be"):
        model(x[0])  # a 1-D batch: the forward fails after the root's pre-forward
    model.reset_iter_state()
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    assert all(p.grad is not None for p in model.parameters())


def _check_refusals(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    with pytest.raises(AssertionError, match=r"Shard dim 2 is invalid .*parameter 'weight'"):
        raggedfsdp.fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(2))
    with pytest.raises(ValueError, match="dp_mesh_dims must be torch.distributed.fsdp"):
        raggedfsdp.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=object())
    with pytest.raises(ValueError, match="mp_policy must be a MixedPrecisionPolicy"):
        raggedfsdp.fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy="bf16")


def _grid(rank, world):
    torch_mp = torch_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    cases = {
        "torch MixedPrecisionPolicy": partial(
            _against_fsdp2, rank, world, shard_kw={"mp_policy": torch_mp}
        ),
        "torch OffloadPolicy": partial(
            _against_fsdp2, rank, world, shard_kw={"offload_policy": torch_fsdp.OffloadPolicy()}
        ),
        "torch CPUOffloadPolicy": partial(
            _against_fsdp2,
            rank,
            world,
            shard_kw={"offload_policy": torch_fsdp.CPUOffloadPolicy(pin_memory=False)},
        ),
        "a list of modules, one group": partial(
            _against_fsdp2, rank, world, shard_kw={"head_group": True}
        ),
        "shard_placement_fn Shard(0)": partial(
            _against_fsdp2, rank, world, shard_kw={"shard_placement_fn": lambda p: Shard(0)}
        ),
        "torchtitan's divide factor through isinstance": partial(
            _against_fsdp2, rank, world, setup=_divide_factor_as_torchtitan
        ),
        "torch clip_grad_norm_": partial(_against_fsdp2, rank, world, clip=0.5),
        "force sum reduction": partial(
            _against_fsdp2, rank, world, setup=lambda m: m.set_force_sum_reduction_for_comms(True)
        ),
        "two reduce-scatters in flight": partial(
            _against_fsdp2, rank, world, setup=lambda m: m.set_reduce_scatter_max_input_buffers(2)
        ),
        "separate reduce-scatter group": partial(
            _against_fsdp2, rank, world, setup=lambda m: m.set_separate_reduce_scatter_group()
        ),
        "unshard in backward": partial(
            _against_fsdp2, rank, world, setup=_unshard_embedding_only_for_grads
        ),
        "bf16 accumulation without sync": partial(_accumulate_bf16, rank, world),
        "set_model_state_dict from rank 0, dense": partial(
            _load_pretrained_from_rank0, rank, world, "llama-tiny"
        ),
        "set_model_state_dict from rank 0, MoE": partial(
            _load_pretrained_from_rank0, rank, world, "moe-tiny"
        ),
        "isinstance and register_fsdp_forward_method": partial(
            _check_isinstance_and_helpers, rank, world
        ),
        "tied across sibling groups": partial(_check_tied_sibling_groups_refused, rank, world),
        "list group: meta init, a member called 3 times": partial(
            _check_list_group_meta_and_repeated_member, rank, world
        ),
        "reset_iter_state": partial(_check_reset_iter_state, rank, world),
        "refusals": partial(_check_refusals, rank, world),
    }
    run_cases(cases)
    dist.barrier()


def test_drop_in_against_fsdp2():
    spawn(2, _grid, timeout=600)
