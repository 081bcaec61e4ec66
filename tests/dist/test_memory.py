"""Memory, structurally: when gradient storage is allocated, and how many groups are unsharded.

Peaks in bytes depend on the model and the allocator; these checks hold whatever the
sizes. See [Note: gradients in place] and [Note: gradient storage] in
``fsdp/_grads.py``:

- by default no group allocates gradient storage: each gradient is written over its
  unsharded parameter; with ``grads_in_params=False`` a group's flat gradient storage
  is allocated when its first gradient arrives;
- either way a group holds gradients only from its first gradient on, not from its
  pre-backward: the embedding's group (torchtitan's grouping) holds none until
  ``embedding_dense_backward`` has produced one;
- every gradient (and unsharded parameter) storage is freed by the end of the step;
- at no moment of backward are more groups unsharded than under torch's FSDP2 (the same
  backward prefetch), for both groupings;
- a group whose parameters get no gradient on one rank still reduce-scatters (zeros):
  the ranks' collectives match and, with ``set_reduce_scatter_unused_params(True)``
  (FSDP2's setting for it), the other rank's gradient arrives, averaged;
- the gradients equal FSDP2's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from raggedfsdp import fully_shard
from raggedfsdp.fsdp import buffer_of, buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from tests.harness import spawn

WORLD = 2
SEQ = 16


class _AfterEachOp(TorchDispatchMode):
    """Calls ``probe(op name)`` after every op on plain tensors (DTensor ops: their local ops)."""

    def __init__(self, probe):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.probe(str(func))
        return out


def _build(fs, grouping: str, mesh, **kw) -> Transformer:
    model = Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0)
    if grouping == "titan":  # torchtitan: embedding, each block, [norm, output], the root
        fs(model.tok_embeddings, mesh=mesh, **kw)
        for block in model.transformer_blocks():
            fs(block, mesh=mesh, **kw)
        fs([model.norm, model.output], mesh=mesh, **kw)
    else:  # each block, then the root (benchmarks/_common.py)
        for block in model.transformer_blocks():
            fs(block, mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    return model


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, get_config("llama-tiny").vocab_size, (2, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _unsharded_groups(model, system: str):
    """A function: how many groups hold unsharded parameters (or an all-gather in flight)."""
    if system == "raggedfsdp":
        bufs = buffers_of(model)
        return lambda: sum(b.unsharded.untyped_storage().nbytes() > 0 for b in bufs)
    groups = [
        m._get_fsdp_state()._fsdp_param_group
        for m in model.modules()
        if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None
    ]
    return lambda: sum(g.is_unsharded or g._all_gather_result is not None for g in groups)


def _step(model, rank: int, step: int, probe=None) -> None:
    x, y = _batch(rank, step)
    loss = lm_loss(model(x), y)
    if probe is None:
        loss.backward()
    else:
        with _AfterEachOp(probe):
            loss.backward()


def _most_unsharded_in_backward(model, system: str, rank: int) -> int:
    count, most = _unsharded_groups(model, system), [0]
    _step(model, rank, 0)  # the first step records the order that prefetch follows
    for p in model.parameters():
        p.grad = None
    _step(model, rank, 1, lambda op: most.__setitem__(0, max(most[0], count())))
    return most[0]


def _grad_storage_timeline(model, rank: int) -> tuple[list[str], dict[int, int], bool]:
    """Backward's ops; for each buffer the index of the op after which it first held a
    gradient (in a gradient storage, or over its parameters); whether any buffer
    allocated a gradient storage of its own."""
    bufs = buffers_of(model)
    ops: list[str] = []
    first: dict[int, int] = {}
    separate = [False]

    def probe(op):
        ops.append(op)
        for i, b in enumerate(bufs):
            own = b.unsharded_grad.untyped_storage().nbytes() > 0
            separate[0] |= own
            if i not in first and (own or b.unsharded_holds_grads):
                first[i] = len(ops) - 1

    _step(model, rank, 0)
    for p in model.parameters():
        p.grad = None
    _step(model, rank, 1, probe)
    for b in bufs:
        assert b.unsharded_grad.untyped_storage().nbytes() == 0, (
            "an unsharded gradient storage outlived the backward"
        )
        assert b.unsharded.untyped_storage().nbytes() == 0 and not b.unsharded_holds_grads, (
            "an unsharded parameter storage outlived the backward"
        )
    return ops, first, separate[0]


class _MaybeUnused(nn.Module):
    """A linear layer that rank 1 skips: its output still needs a gradient (through x)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x * 2 if dist.get_rank() == 1 else self.lin(x)


def _check(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))

    # 1. The embedding group holds gradients only after the embedding's backward; by
    #    default no group allocates a gradient storage beside its parameters.
    for in_params in (True, False):
        model = _build(fully_shard, "titan", mesh, grads_in_params=in_params)
        ops, first, separate = _grad_storage_timeline(model, rank)
        assert separate is not in_params, (in_params, separate)
        bufs = buffers_of(model)
        (emb,) = [i for i, b in enumerate(bufs) if b is buffer_of(model.tok_embeddings.weight)[0]]
        backward_of_embedding = ops.index("aten.embedding_dense_backward.default")
        assert first[emb] > backward_of_embedding, (
            f"grads_in_params={in_params}: the embedding group held a gradient after op "
            f"{first[emb]} ({ops[first[emb]]}), before the embedding's backward (op "
            f"{backward_of_embedding})"
        )
        assert len(first) == len(bufs), "a group never held a gradient"

    # 2. Groups unsharded at once in backward: no more than FSDP2 (same prefetch), and
    #    the gradients equal FSDP2's.
    for grouping in ("titan", "blocks"):
        most = {}
        models = {}
        for system, fs in (("raggedfsdp", fully_shard), ("fsdp2", torch_fully_shard)):
            models[system] = _build(fs, grouping, mesh)
            most[system] = _most_unsharded_in_backward(models[system], system, rank)
        assert most["raggedfsdp"] <= most["fsdp2"], (grouping, most)
        ours = dict(models["raggedfsdp"].named_parameters())
        for name, p in models["fsdp2"].named_parameters():
            a, b = ours[name].grad.full_tensor(), p.grad.full_tensor()
            assert torch.equal(a, b), f"{grouping}: {name}"

    # 3. A group with no gradient on rank 1 still reduces: zeros from rank 1, averaged
    # (FSDP2's rule for ranks that use different parameters: see test_unused_params.py).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), _MaybeUnused(), nn.Linear(8, 2))
    fully_shard(net[1], mesh=mesh)
    fully_shard(net, mesh=mesh)
    net.set_reduce_scatter_unused_params(True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    net(x).sum().backward()
    grads = [p.grad.full_tensor() for p in net[1].parameters()]
    # rank 0's gradient, over 2 ranks (AVG); rank 0 computes it again in one process
    torch.manual_seed(0)  # the same initial parameters as net's
    ref = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    ref(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).sum().backward()
    for g, r in zip(grads, ref[1].parameters()):
        assert torch.equal(g, r.grad / 2)  # (g + 0) / 2: the same bits
    assert all(isinstance(p.grad, DTensor) for p in net[1].parameters())


def test_gradient_storage_and_unsharded_groups():
    spawn(WORLD, _check)


# ---- a sharded model goes with its last reference ---------------------------------------------
def _train_and_drop(mesh, grouping: str, prefetch: bool, **kw) -> list:
    """Shard, train two steps (forward, backward, optimizer step), drop every reference
    but weak ones: to the model, each group, its DBuffer and its storages."""
    import weakref

    from raggedfsdp.optim import AdamW

    model = _build(fully_shard, grouping, mesh, **kw)
    blocks = list(model.transformer_blocks())
    if prefetch:  # explicit prefetch both ways: states that name each other
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    opt = AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = _batch(dist.get_rank(), step)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    views = buffers_of(model)
    groups = [v._group for v in views]
    held = [model, *groups, *(g.dbuf for g in groups), *(v.shard for v in views)]
    held += [g.dbuf.global_params.tensor for g in groups]
    refs = [weakref.ref(obj) for obj in held]
    del model, blocks, opt, groups, held
    return [refs, views]


def _freed_without_the_collector(rank, world):
    import gc

    mesh = init_device_mesh("cpu", (world,))
    _train_and_drop(mesh, "blocks", False)  # the first run imports torch._dynamo: its cycles
    gc.collect()
    cases = {
        "blocks": dict(grouping="blocks", prefetch=False),
        "titan, prefetch, no reshard after forward, gradient storage": dict(
            grouping="titan", prefetch=True, reshard_after_forward=False, grads_in_params=False
        ),
    }
    gc.disable()  # nothing here may wait for a collection
    try:
        for name, kw in cases.items():
            refs, views = _train_and_drop(mesh, **kw)
            alive = [type(r()).__name__ for r in refs if r() is not None]
            assert alive == [], f"{name}: still alive after the last reference: {alive}"
            # a view kept past its model says so (its group is gone with the model)
            with pytest.raises(RuntimeError, match=r"BufferView: its model was freed"):
                views[0].layout.describe()
    finally:
        gc.enable()


def test_a_sharded_model_is_freed_with_its_last_reference():
    """No reference cycle holds a trained sharded model: with the garbage collector off,
    dropping the model (and its optimizer) frees its groups and storages at once. See
    [Note: freed without the garbage collector]."""
    spawn(WORLD, _freed_without_the_collector)
