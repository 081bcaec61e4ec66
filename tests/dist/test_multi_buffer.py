"""Multi-buffer groups ([Note: multi-buffer groups]) on 3 and 4 gloo ranks, with the split
forced (``buffer_alpha_bytes`` negative: every cut the planner finds is taken).

- Both catalogue models trained 7 steps give one process's per-step losses within the
  bound derived from that process's own sensitivity ([Note: derived tolerances] in
  ``tests/numerics.py``) with torch SGD (final parameters too) and torch AdamW; 3 steps
  with raggedfsdp's AdamW8bit and Muon (4 ranks). Each block's parameters really lie in
  several buffers.
- Given one process's gradients, 10 steps: AdamW8bit's codes, scales, fp32 moments and
  parameters are bit-identical to that process's AdamW8bit, and Muon's parameters are
  bit-identical to that process's Muon, at 3 and 4 ranks, on both models.
- fp32: no copy reads or writes the buffers around the collectives; each buffer
  all-gathers and reduce-scatters once per group per step.
- A checkpoint saved with multi-buffer groups resumes on its own layout bit for bit, and
  loads into one-buffer groups and back with the uninterrupted losses within the derived
  bound (the reduce-scatter sums an element's ranks in an order that depends on where
  its buffer puts it: 1 ulp apart here).

Every case also forces member gaps (``member_gaps="always"``): moe-tiny's stacks of
experts lie with padding between members, each rank holding whole members as a strided
view of its shard (``_assert_gapped``); llama-tiny has no stacks. The checkpoints cross
between gapped and plain layouts.
"""

from __future__ import annotations

import functools
import tempfile
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, init_device_mesh

import raggedfsdp
from raggedfsdp import checkpoint
from raggedfsdp.tensor import ragged_piece
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.optim import AdamW8bit, Muon, adamw8bit_block_policy, muon_param_groups
from raggedfsdp.tools.profiling import CommCounter, CopyCounter, buffer_storages
from tests.harness import run_cases, spawn
from tests.numerics import assert_losses_match, assert_param_matches, reference, reference_threads

pytestmark = pytest.mark.numerics
SEQ, STEPS, ROWS = 16, 7, 12  # 7: the checkpoint case's last step; 12 rows: 3 or 4 ranks
ROUNDED_STEPS = 3  # AdamW8bit and Muon: see the module docstring
GIVEN_STEPS = 10  # steps given one process's gradients
MODELS = ("llama-tiny", "moe-tiny")
OPTIMS = ("sgd", "adamw", "adamw8bit", "muon")
# take every cut found, and gap every stack of experts (moe-tiny's w1/w2/w3)
SPLIT = dict(max_buffers=3, buffer_alpha_bytes=-(1 << 30), member_gaps="always")


def _data():
    gen = torch.Generator().manual_seed(21)
    return torch.randint(0, 1001, (STEPS, ROWS, SEQ + 1), generator=gen)


def _optimizer(model, name):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.3)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if name == "adamw8bit":
        return AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1, block_size=32)
    return Muon(muon_param_groups(model, lr=3e-3), lr=0.02)


def _model(name, mesh, opt_name, split=True):
    model = Transformer(get_config(name), max_seq_len=SEQ, seed=0)
    if mesh is None:
        return model
    kw = dict(SPLIT) if split else dict(max_buffers=1)
    if opt_name == "adamw8bit":
        kw["block_policy"] = adamw8bit_block_policy(32)
    for block in model.transformer_blocks():
        raggedfsdp.fully_shard(block, mesh=mesh, **kw)
    return raggedfsdp.fully_shard(model, mesh=mesh, **kw)


def _train(model, opt, steps, rank, world):
    losses = []
    for step in steps:
        batch = _data()[step]
        rows = batch if world is None else batch[rank * ROWS // world :][: ROWS // world]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if world is not None:
            dist.all_reduce(loss)
            loss = loss / world
        losses.append(float(loss))
    return losses


def _steps(opt_name):
    return STEPS if opt_name in ("sgd", "adamw") else ROUNDED_STEPS


def _full(model):
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in model.named_parameters()
    }


def _check_parity(name, opt_name, rank, world, ref):
    mesh = init_device_mesh("cpu", (world,))
    model = _model(name, mesh, opt_name)
    views = buffers_of(model.layers[0])
    assert len(views) >= 2, [len(v.params) for v in views]  # the block's group is split
    _assert_gapped(model)
    steps = _steps(opt_name)
    losses = _train(model, _optimizer(model, opt_name), range(steps), rank, world)
    assert_losses_match(losses, ref, world=world, tokens=ROWS * SEQ, what=f"{opt_name}: ")
    if opt_name == "sgd":
        for k, v in _full(model).items():
            assert_param_matches(k, v, ref, steps=steps)


def _assert_gapped(model):
    """Every stack of experts lies with gaps between its members, each rank holding
    whole members as a strided view of its shard (none in llama-tiny)."""
    for n, p in model.named_parameters():
        if p.dim() != 3:
            continue
        buf, s = raggedfsdp.fsdp.buffer_of(p)
        placed = buf.layout[s.fqn]
        assert placed.members == p.shape[0] and placed.member_gap > 0, (n, placed)
        local = p._local_tensor
        assert local.shape[1:] == p.shape[1:] and s.view(buf.shard).data_ptr() == local.data_ptr()
        if local.shape[0] > 1:
            assert local.stride(0) == placed.member_stride > local[0].numel(), n


def _piece(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local tensor of ``full`` placed like ``like``."""
    return ragged_piece(full.shape, like.device_mesh, like.placements).rows(full)


def _given_grads_reference(name, opt_name):
    model = _model(name, None, opt_name)
    return given_grads_run(model, _optimizer(model, opt_name), GIVEN_STEPS, seed=5)


def given_grads_run(model, opt, steps: int, seed: int):
    """One process's optimizer given random gradients: per-step gradients and states,
    and the final parameters (full tensors, by name)."""
    params = dict(model.named_parameters())
    grads, states = [], []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        grads.append({n: p.grad.clone() for n, p in params.items()})
        opt.step()
        states.append(
            {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}
        )
    return grads, states, {n: p.detach().clone() for n, p in params.items()}


def _check_given_grads(name, opt_name, rank, world, ref):
    """AdamW8bit bit-identical (codes, scales, moments, parameters), Muon's parameters too."""
    grads, states, final = ref
    model = _model(name, init_device_mesh("cpu", (world,)), opt_name)
    assert len(buffers_of(model.layers[0])) >= 2  # the block's group is split
    _assert_gapped(model)
    opt = _optimizer(model, opt_name)
    rows = _data()[0][rank * ROWS // world :][: ROWS // world]
    lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()  # every .grad a view of its storage
    for step in range(GIVEN_STEPS):
        for n, p in model.named_parameters():
            p.grad._local_tensor.copy_(_piece(grads[step][n], p))
        opt.step()
        if opt_name != "adamw8bit":
            continue
        for n, p in model.named_parameters():
            for key, theirs in states[step][n].items():
                if key == "step":
                    continue
                ours = opt.state[p][key]  # placed like the parameter (scales: by block)
                assert ours.shape == theirs.shape, (n, key, ours.shape, theirs.shape)
                assert torch.equal(ours._local_tensor, _piece(theirs, ours)), (step, n, key)
    for n, p in model.named_parameters():  # the same ops on the same values: the same bits
        assert torch.equal(p._local_tensor, _piece(final[n], p)), n


def _check_copies_and_bytes(name, rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = _model(name, mesh, "sgd")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):  # the second step: forward order recorded, state made
        rows = _data()[step][rank::world][:1]
        with CopyCounter() as copies, CommCounter() as comms:
            lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
    near = [e for e in copies.touching(buffer_storages(model)) if e.within is None]
    assert near == [], copies.summary(near)
    views = buffers_of(model)
    blocks = [v for b in model.transformer_blocks() for v in buffers_of(b)]
    root = [v for v in views if v not in blocks]
    counts = comms.summary()
    # blocks gather in forward and again in backward, the root once; each buffer once
    assert counts["all_gather"].count == 2 * len(blocks) + len(root)
    assert counts["reduce_scatter"].count == len(views)
    gathered = 2 * sum(v.layout.global_size * 4 for v in blocks)
    gathered += sum(v.layout.global_size * 4 for v in root)
    assert counts["all_gather"].output_bytes == gathered


def _check_checkpoint(name, rank, world, root):
    """Save with split groups after 3 steps; load into one-buffer groups, train 2 steps,
    save; load that back into split groups: every resumed loss equals the uninterrupted."""
    mesh = init_device_mesh("cpu", (world,))
    model = _model(name, mesh, "adamw")
    _assert_gapped(model)
    opt = _optimizer(model, "adamw")
    _train(model, opt, range(3), rank, world)
    checkpoint.save(f"{root}/{name}/a", model, opt, step=3)
    uninterrupted = _train(model, opt, range(3, 7), rank, world)

    one = _model(name, mesh, "adamw", split=False)
    assert all(len(buffers_of(b)) == 1 for b in one.transformer_blocks())
    one_opt = _optimizer(one, "adamw")
    checkpoint.load(f"{root}/{name}/a", one, one_opt)
    resumed = _train(one, one_opt, range(3, 5), rank, world)
    checkpoint.save(f"{root}/{name}/b", one, one_opt, step=5)
    again = _model(name, mesh, "adamw")
    again_opt = _optimizer(again, "adamw")
    checkpoint.load(f"{root}/{name}/b", again, again_opt)
    resumed += _train(again, again_opt, range(5, 7), rank, world)

    def from_a():  # the uninterrupted run, resumed on its own layout
        model = _model(name, mesh, "adamw")
        opt = _optimizer(model, "adamw")
        checkpoint.load(f"{root}/{name}/a", model, opt)
        return _train(model, opt, range(3, 7), rank, world)

    ref = reference(from_a)
    assert ref.losses == uninterrupted, (ref.losses, uninterrupted)  # same layout: bitwise
    assert_losses_match(resumed, ref, world=world, tokens=ROWS * SEQ, what="resumed: ")


def _check_errors(world):
    mesh = init_device_mesh("cpu", (world,))
    model = Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0)
    for bad, match in [
        (dict(max_buffers=0), r"max_buffers must be an int >= 1, got 0; pass 1"),
        (dict(member_gaps="yes"), r"member_gaps must be True, False or 'always', got 'yes'"),
        (
            dict(buffer_alpha_bytes=1.5),
            r"buffer_alpha_bytes must be an int \(bytes\) or None, got 1.5",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            raggedfsdp.fully_shard(model, mesh=mesh, **bad)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # untouched


def _grid(rank, world, refs, root):
    optims = OPTIMS if world == 4 else ("sgd", "adamw")  # 3 ranks: the exact two
    cases = {
        f"parity {m} {o}": partial(_check_parity, m, o, rank, world, refs[m, o])
        for m in MODELS
        for o in optims
    }
    for m in MODELS:
        for o in ("adamw8bit", "muon"):
            ref = refs[m, o, "given"]
            cases[f"given grads {m} {o}"] = partial(_check_given_grads, m, o, rank, world, ref)
    if world == 4:
        for m in MODELS:
            cases[f"copies and bytes {m}"] = partial(_check_copies_and_bytes, m, rank, world)
        for m in MODELS:
            cases[f"checkpoint {m}"] = partial(_check_checkpoint, m, rank, world, root)
        cases["errors"] = partial(_check_errors, world)
    run_cases(cases)


@functools.cache
def _references() -> dict:
    """One process's per-step losses (and SGD's final parameters) for every case."""
    refs = {}
    for m in MODELS:
        for o in OPTIMS:

            def run(m=m, o=o):
                model = _model(m, None, o)
                losses = _train(model, _optimizer(model, o), range(_steps(o)), 0, None)
                return (losses, _full(model)) if o == "sgd" else losses

            refs[m, o] = reference(run)
        for o in ("adamw8bit", "muon"):
            refs[m, o, "given"] = _given_grads_reference(m, o)
    return refs


@pytest.mark.parametrize("world", [3, 4])
def test_multi_buffer_groups(world):
    with reference_threads():  # tiny models: one thread is faster
        refs = _references()
    with tempfile.TemporaryDirectory() as root:
        spawn(world, _grid, refs, root, timeout=600)
