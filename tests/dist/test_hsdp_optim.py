"""Muon and AdamW8bit on HSDP: 4 gloo ranks as a 2x2 ``(replicate, shard)`` mesh.

- Muon, given the same gradients, equals the single-process reference of
  ``test_muon.py`` (``torch.optim.Muon`` on whole matrices + ``torch.optim.AdamW``)
  step by step bit for bit, and the replicas stay bit-identical; trained on
  data, its per-step losses lie within the bound derived from the reference's own
  sensitivity ([Note: derived tolerances] in ``tests/numerics.py``).
- Muon's step sends nothing over the replicate dim: counted with ``CommCounter``
  by process group, the step's collectives are its all-to-alls over the shard dim,
  with the bytes of plain FSDP over the shard dim alone, while the replicate dim
  carries only the FSDP runtime's all-reduces (one of the shard gradients per buffer).
- AdamW8bit's codes, scales, fp32 moments and parameters are bit-identical to one
  process (as ``test_adamw8bit.py`` checks on 1-D meshes).
- The errors for meshes and placements these optimizers cannot handle.

One spawn runs every case; the references are computed once in the pytest process.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

from raggedfsdp import BlockPolicy, RaggedShard, fully_shard, parallelize
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.optim import AdamW8bit, Muon, adamw8bit_block_policy, muon_block_policy
from raggedfsdp.optim.muon import default_use_muon, muon_param_groups
from raggedfsdp.tools.profiling import CommCounter
from tests.dist import test_adamw8bit as t8
from tests.dist import test_muon as tm
from tests.harness import run_cases, spawn
from tests.numerics import assert_losses_match, reference, reference_threads

pytestmark = pytest.mark.numerics
WORLD, MESH, NAMES = 4, (2, 2), ("replicate", "shard")
MODELS = ["llama-tiny", "moe-tiny"]
MUON_STEPS = 4  # of the reference's 10 (given gradients)
TRAIN_STEPS = 4  # trained on data: losses within the derived bound
ADAM8_STEPS = 3


def _mesh():
    return init_device_mesh("cpu", MESH, mesh_dim_names=NAMES)


def _local_view(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` placed like ``like``: the rows of its shard rank."""
    shard_rank = like.device_mesh.get_local_rank(len(like.placements) - 1)
    return like.placements[-1].local_view(full, shard_rank)


def _shard(model_name, mesh, block_policy=None, seq=tm.SEQ, whole_matrices=False):
    """The catalogue model sharded on ``mesh``; ``whole_matrices``: with
    ``muon_block_policy`` for the shard dim's size."""
    model = Transformer(get_config(model_name), max_seq_len=seq, seed=0)
    if whole_matrices:
        block_policy = muon_block_policy(model, mesh.size(mesh.ndim - 1))
    parallelize(model, mesh, fully_shard=fully_shard, block_policy=block_policy)
    return model


def _assert_replicas_equal(model, mesh):
    """Every replica holds the very same bits: max == min over the replicate dim."""
    flat = torch.cat([p._local_tensor.reshape(-1) for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    group = mesh.get_group("replicate")
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    assert torch.equal(hi, lo), "the replicas' parameters differ"


# ---------------------------------------------------------------------------------------------
# Muon, given the reference's gradients
# ---------------------------------------------------------------------------------------------
def _set_grads(model, step):
    for name, p in model.named_parameters():
        local = _local_view(tm._grad(name, p.shape, step), p).clone()
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )


def _check_muon(model_name, ref, policy=False, **kw):
    mesh = _mesh()
    model = _shard(model_name, mesh, whole_matrices=policy)
    p = next(model.parameters())
    assert isinstance(p.placements[0], Replicate) and isinstance(p.placements[1], RaggedShard)
    opt = Muon(muon_param_groups(model, **tm.ADAMW), **tm.VARIANTS["default"], **kw)
    for step in range(MUON_STEPS):
        _set_grads(model, step)
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            want = _local_view(ref[step][name], p)
            assert torch.equal(p._local_tensor, want), f"step {step}: {name} differs"
    _assert_replicas_equal(model, mesh)
    stats = opt.last_step
    flops = torch.tensor([stats.ns_flops], dtype=torch.float64)
    dist.all_reduce(flops, group=mesh.get_group("shard"))
    assert flops.item() == sum(stats.ns_flops_per_rank), "each matrix once per replica"
    if policy:  # every matrix whole on one shard rank: no byte moves at all
        assert stats.comm_free == stats.matrices and stats.bytes_sent == 0


def _unsharded(model_name):
    return Transformer(get_config(model_name), max_seq_len=tm.SEQ, seed=0)


# ---------------------------------------------------------------------------------------------
# Muon, trained on data: per-step losses
# ---------------------------------------------------------------------------------------------
def _data():
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, 1001, (TRAIN_STEPS, 2 * WORLD, tm.SEQ + 1), generator=gen)


def _reference_losses(model_name: str):
    return reference(lambda: muon_reference_losses(_unsharded(model_name), _data()))


def muon_reference_losses(model, batches) -> list[float]:
    """One process, each whole batch: torch.optim.Muon on every matrix (each member of a
    stack its own, as in ``test_muon.py``) + torch.optim.AdamW on the rest."""
    named = dict(model.named_parameters())
    members = {  # fqn -> the reference Muon's 2-D parameters
        n: [nn.Parameter(m.detach().clone()) for m in (p.unbind(0) if p.dim() == 3 else [p])]
        for n, p in named.items()
        if default_use_muon(n, p)
    }
    muon = torch.optim.Muon([m for ms in members.values() for m in ms], **tm.VARIANTS["default"])
    rest = [p for n, p in named.items() if n not in members]
    adamw = torch.optim.AdamW(rest, foreach=False, **tm.ADAMW)
    losses = []
    for batch in batches:
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        for n, ms in members.items():
            g = named[n].grad
            for m, gm in zip(ms, g.unbind(0) if g.dim() == 3 else [g]):
                m.grad = gm.clone()
        muon.step()
        adamw.step()
        with torch.no_grad():
            for n, ms in members.items():
                named[n].copy_(torch.stack([m.detach() for m in ms]).view(named[n].shape))
        model.zero_grad()
        losses.append(loss.item())
    return losses


def _check_losses(model_name, rank, ref):
    mesh = _mesh()
    model = _shard(model_name, mesh)
    opt = Muon(muon_param_groups(model, **tm.ADAMW), **tm.VARIANTS["default"])
    losses = []
    for batch in _data():
        rows = batch[2 * rank : 2 * rank + 2]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    assert_losses_match(losses, ref, world=WORLD, tokens=2 * WORLD * tm.SEQ)
    _assert_replicas_equal(model, mesh)


# ---------------------------------------------------------------------------------------------
# Muon's bytes, by process group
# ---------------------------------------------------------------------------------------------
class _CommByGroup(CommCounter):
    """``CommCounter`` that also notes the ranks of each collective's process group."""

    def __init__(self):
        super().__init__()
        self.groups: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.events) > before:
            pgs = [
                a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.ScriptObject)
            ]
            pgs = [dist.ProcessGroup.unbox(a) for a in pgs if "ProcessGroup" in str(a._type())]
            assert len(pgs) == 1, (func, args)
            self.groups.append(tuple(dist.get_process_group_ranks(pgs[0])))
        return out

    def on(self, group) -> list:
        ranks = tuple(dist.get_process_group_ranks(group))
        return [e for e, g in zip(self.events, self.groups) if g == ranks]


def _train_step(model, opt, rank, step):
    rows = _data()[step][2 * rank : 2 * rank + 2]
    lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
    opt.step()
    opt.zero_grad()


def _check_bytes(model_name, rank):
    mesh = _mesh()
    replicate, shard = mesh.get_group("replicate"), mesh.get_group("shard")
    model = _shard(model_name, mesh)
    opt = Muon(muon_param_groups(model, **tm.ADAMW), **tm.VARIANTS["default"])
    _train_step(model, opt, rank, 0)  # warm up: states exist
    rows = _data()[1][2 * rank : 2 * rank + 2]
    with _CommByGroup() as fwd_bwd:
        lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
    with _CommByGroup() as step:
        opt.step()
    stats = opt.last_step
    assert stats.bytes_sent > 0, "the base layout splits matrices: Muon must communicate"
    # the optimizer step: Muon's all-to-alls over the shard dim, nothing else
    assert step.on(replicate) == [], step.on(replicate)
    assert len(step.on(shard)) == len(step.events) == stats.collectives
    assert {e.kind for e in step.events} == {"all_to_all"}
    assert sum(e.input_bytes for e in step.events) == stats.bytes_sent
    assert sum(e.output_bytes for e in step.events) == stats.bytes_received
    # the replicate dim: the FSDP runtime's all-reduces, one of the shard gradients per
    # buffer, and nothing else
    across = fwd_bwd.on(replicate)
    assert {e.kind for e in across} == {"all_reduce"}, across
    grads = sorted(b.shard_grad.numel() * b.shard_grad.element_size() for b in buffers_of(model))
    assert sorted(e.input_bytes for e in across) == grads, (across, grads)
    # the same bytes as plain FSDP on the shard dim alone (each replica its own copy)
    flat = _shard(model_name, mesh["shard"])
    flat_opt = Muon(muon_param_groups(flat, **tm.ADAMW), **tm.VARIANTS["default"])
    _train_step(flat, flat_opt, rank, 0)
    ours, plain = stats, flat_opt.last_step
    assert (ours.bytes_sent, ours.bytes_received, ours.collectives) == (
        plain.bytes_sent,
        plain.bytes_received,
        plain.collectives,
    )


# ---------------------------------------------------------------------------------------------
# AdamW8bit: bit-identical to one process
# ---------------------------------------------------------------------------------------------
def _reference_8bit(model_name: str, variant: str):
    """Per-step gradients and states, final parameters, of one process on plain tensors."""
    model = Transformer(get_config(model_name), max_seq_len=t8.SEQ, seed=0)
    opt = t8._optimizer(model, variant)
    grads, states = [], []
    for step in range(ADAM8_STEPS):
        ((x, y),) = t8._micro_batches(step, 1)
        lm_loss(model(x), y).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        states.append(t8._snapshot(model, opt))
    return grads, states, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_8bit(model_name, variant, rank, ref):
    grads, states, final = ref
    mesh = _mesh()
    model = _shard(model_name, mesh, adamw8bit_block_policy(), seq=t8.SEQ)
    opt = t8._optimizer(model, variant)
    fused = []
    step_buffer = opt._step_buffer
    opt._step_buffer = lambda *a: fused.append(step_buffer(*a)) or fused[-1]
    ((x, y),) = t8._micro_batches(0, 1, rank, WORLD)
    lm_loss(model(x), y).backward()  # every .grad a view of its buffer's gradient storage
    for step in range(ADAM8_STEPS):
        for name, p in model.named_parameters():
            p.grad._local_tensor.copy_(_local_view(grads[step][name], p))
        opt.step()
        for name, p in model.named_parameters():
            state = opt.state[p]
            keys = t8.STATE_KEYS if "exp_avg_codes" in state else ("exp_avg", "exp_avg_sq")
            assert set(state) - {"step"} == set(keys), (name, set(state))
            for key in keys:
                ours, theirs = state[key], states[step][name][key]
                assert ours.placements[0] == Replicate(), (name, key, ours.placements)
                want = _local_view(theirs, ours)
                assert torch.equal(ours._local_tensor, want), (f"step {step + 1}", name, key)
    assert all(fused) if variant == "fused" else not any(fused), fused
    for name, p in model.named_parameters():
        assert torch.equal(p._local_tensor, _local_view(final[name], p)), name
    _assert_replicas_equal(model, mesh)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def _placed(mesh, placements, full_rows=8):
    """A ``(full_rows, 4)`` zero DTensor parameter placed as given (rows split evenly)."""
    shard_dims = [d for d, pl in enumerate(placements) if isinstance(pl, RaggedShard)]
    rows = full_rows // (mesh.size(shard_dims[0]) if shard_dims else 1)
    local = torch.zeros(rows, 4)
    return nn.Parameter(
        DTensor.from_local(local, mesh, placements, shape=(full_rows, 4), stride=(4, 1))
    )


def _check_errors(rank):
    mesh = _mesh()
    ragged = RaggedShard(dims=(0,), local_units=(1, 1))
    # the RaggedShard on the replicate dim
    flipped = _placed(mesh, [ragged, Replicate()])
    with pytest.raises(NotImplementedError, match=r"RaggedShard on the mesh's last \(shard\) dim"):
        Muon([{"params": [flipped], "use_muon": True}])
    # AdamW8bit: a shard-dim cut inside a quantization block names the mesh dim
    model = _shard("llama-tiny", mesh, BlockPolicy(rows=1), seq=t8.SEQ)
    opt = AdamW8bit(model.parameters())
    ((x, y),) = t8._micro_batches(0, 1, rank, WORLD)
    lm_loss(model(x), y).backward()
    with pytest.raises(ValueError, match=r"on mesh dim 'shard'\).*does not divide its RaggedShard"):
        opt.step()


# ---------------------------------------------------------------------------------------------
def _grid(rank, world, refs):
    cases = {}
    for m in MODELS:
        cases[f"muon {m}"] = partial(_check_muon, m, refs["muon", m])
    cases["muon moe-tiny whole-matrix policy"] = partial(
        _check_muon, "moe-tiny", refs["muon", "moe-tiny"], policy=True
    )
    cases["muon llama-tiny replicated baseline"] = partial(
        _check_muon, "llama-tiny", refs["muon", "llama-tiny"], distributed="replicated"
    )
    for m in MODELS:
        cases[f"muon losses {m}"] = partial(_check_losses, m, rank, refs["losses", m])
    cases["muon bytes by mesh dim"] = partial(_check_bytes, "moe-tiny", rank)
    for m, v in refs["8bit"]:
        cases[f"adamw8bit {m} {v}"] = partial(_check_8bit, m, v, rank, refs["8bit"][m, v])
    cases["errors"] = partial(_check_errors, rank)
    run_cases(cases)
    dist.barrier()


def test_optimizers_on_hsdp():
    with reference_threads():
        refs = {("muon", m): tm._reference(m, "default")[:MUON_STEPS] for m in MODELS}
        refs.update({("losses", m): _reference_losses(m) for m in MODELS})
        variants = [("llama-tiny", "fused"), ("moe-tiny", "fused"), ("llama-tiny", "per-param")]
        refs["8bit"] = {mv: _reference_8bit(*mv) for mv in variants}
    spawn(WORLD, _grid, refs, timeout=300)
