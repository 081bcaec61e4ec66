"""FP8 all-gather with per-tile scales ([Note: FP8 all-gather]), at 1-4 gloo ranks.

- Exactness: both catalogue models (fp32 compute) give, step after step, the losses of
  one process that applies the same per-tile quantize-dequantize to its weights before
  each forward (within 1e-6; SGD on the fp32 masters), with 4x32 tiles (and MX-style
  1x32 ones at 3 ranks); the dequantized unsharded parameters every rank gathers are
  bit-identical to that process's (so are the codes and scales they decode).
- Bytes (CommCounter): a model whose matrices are whole 32x32 tiles all-gathers at most
  0.52x the bytes of its bf16 all-gather (codes plus scales), its reduce-scatter bytes
  unchanged; each FP8 buffer moves exactly ``m * (S + 4 T)`` bytes.
- Block policies are raised to whole tiles (the lcm; a plan never cuts a tile): a
  12-row policy on 48-row members with 16-row tiles plans 48-row blocks and gathers
  exactly.
- Clear errors: a master dtype without an FP8 path, FP8 beside tensor parallelism, a bad
  tile.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, init_device_mesh

from raggedfsdp import Float8BlockAllGather, MixedPrecisionPolicy, fully_shard
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.profiling import CommCounter
from tests.dist import test_tp as ttp
from tests.harness import run_cases, spawn

SEQ, STEPS, ROWS = 16, 3, 12  # 12 rows: every rank of 1-4 takes the same count
CASES = [("llama-tiny", (4, 32)), ("moe-tiny", (4, 32))]  # at every world size
MX_WORLD = 3  # MX-style 1 x 32 tiles: at 3 ranks


def _data():
    gen = torch.Generator().manual_seed(8)
    return torch.randint(0, 1001, (STEPS, ROWS, SEQ + 1), generator=gen)


# ---- the reference: one process, written apart from the library ---------------------------
def _selected(shape, tile) -> bool:
    return len(shape) in (2, 3) and shape[-2] % tile[0] == 0 and shape[-1] % tile[1] == 0


def _qdq(w: torch.Tensor, tile) -> torch.Tensor:
    """Quantize-dequantize tile by tile: scale amax / 448 (1 for a zero tile), codes
    float8_e4m3fn, decoded in fp32, then cast to ``w``'s dtype."""
    tr, tc = tile
    rows, cols = w.shape[-2:]
    x = w.detach().float().reshape(-1, rows // tr, tr, cols // tc, tc)  # member, tiles
    amax = x.abs().amax(dim=(2, 4), keepdim=True)
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    code = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (code.float() * scale).to(w.dtype).reshape(w.shape)


def _model(name):
    return Transformer(get_config(name), max_seq_len=SEQ, seed=0)


@functools.cache
def _reference(name, tile, world):
    """Per-step losses, and the names of the parameters gathered in FP8."""
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    chosen = [p for p in model.parameters() if _selected(p.shape, tile)]
    assert chosen
    losses = []
    for step in range(STEPS):
        masters = [p.detach().clone() for p in chosen]
        with torch.no_grad():
            for p in chosen:
                p.copy_(_qdq(p, tile))
        # each rank's rows apart, as the ranks do (their mean's gradient is the batch's)
        chunks = _data()[step].chunk(world)
        per = [lm_loss(model(rows[:, :-1]), rows[:, 1:]) for rows in chunks]
        (sum(per) / world).backward()
        with torch.no_grad():  # the step updates the masters, with the QDQ forward's grads
            for p, master in zip(chosen, masters):
                p.copy_(master)
        opt.step()
        opt.zero_grad()
        losses.append(sum(float(x.detach()) for x in per) / world)  # in float64, as the ranks' mean
    return losses, {n for n, p in model.named_parameters() if _selected(p.shape, tile)}


def _shard(model, mesh, tile, **kw):
    mp = MixedPrecisionPolicy(all_gather=Float8BlockAllGather(tile=tile), **kw)
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def _check_exact(name, tile, rank, world, ref):
    ref_losses, chosen = ref
    mesh = init_device_mesh("cpu", (world,))
    model = _shard(_model(name), mesh, tile)
    assert any(b._group.fp8 is not None for b in buffers_of(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    losses = []
    for step in range(STEPS):
        rows = _data()[step][rank * ROWS // world :][: ROWS // world]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().double()  # the ranks' mean in float64: no rounding of its own
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= 1e-6, f"losses differ by {worst:.3g}: {losses} {ref_losses}"
    # what every rank gathers: the one-process quantize-dequantize of the same masters,
    # bit for bit (the masters themselves differ from the reference's in the last bits:
    # the gradients were summed in another order)
    masters = {n: p.full_tensor() for n, p in model.named_parameters() if n in chosen}
    modules = [*model.transformer_blocks(), model]
    for m in modules:
        m.unshard()
    for fqn, p in model.named_parameters():
        if fqn in chosen:
            assert not isinstance(p, DTensor), fqn  # the gathered (unsharded) parameter
            assert torch.equal(p.detach(), _qdq(masters[fqn], tile)), fqn
    for m in modules:
        m.reshard()


def _config_in_tiles():
    """A model whose every matrix is whole 32 x 32 tiles."""
    base = get_config("llama-tiny")
    return dataclasses.replace(base, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=1024)


def _check_bytes(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    rows = _data()[0][rank * ROWS // world :][: ROWS // world] % 1024
    stats = {}
    for fp8 in (False, True):
        model = Transformer(_config_in_tiles(), max_seq_len=SEQ, seed=0)
        kw = dict(param_dtype=torch.bfloat16)
        if fp8:
            _shard(model, mesh, (32, 32), **kw)
        else:
            mp = MixedPrecisionPolicy(**kw)
            for block in model.transformer_blocks():
                fully_shard(block, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        with CommCounter() as comms:
            lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        stats[fp8] = comms.summary()
        if fp8:  # each buffer's all-gather, by hand: FP8 buffers m (S + 4T) bytes
            bufs = buffers_of(model)
            root = {id(b) for b in _root_views(model)}
            expected = 0
            for b in bufs:
                group = b._group
                per = group.fp8.send_bytes if group.fp8 is not None else b.layout.shard_size * 2
                expected += world * per * (1 if id(b) in root else 2)  # forward, backward
            assert stats[fp8]["all_gather"].output_bytes == expected
    ratio = stats[True]["all_gather"].output_bytes / stats[False]["all_gather"].output_bytes
    assert ratio <= 0.52, ratio
    assert stats[True]["reduce_scatter"].input_bytes == stats[False]["reduce_scatter"].input_bytes


def _root_views(model):
    """The root's buffers (gathered once a step: the root is not resharded after forward)."""
    inner = {id(b) for block in model.transformer_blocks() for b in buffers_of(block)}
    return [b for b in buffers_of(model) if id(b) not in inner]


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(4)
        self.w = torch.nn.Parameter(torch.randn(4, 48, 64, generator=gen))


def _check_blocks_raised_to_tiles(rank, world):
    """A block policy of 12 rows on a stack of 48-row members, 16-row tiles: fully_shard
    plans 48-row blocks (the lcm: both divide the member's rows, so no plan can cut a
    tile), and every rank gathers the one-process quantize-dequantize."""
    mesh = init_device_mesh("cpu", (world,))
    module = _Stack()
    master = module.w.detach().clone()
    policy = MixedPrecisionPolicy(all_gather=Float8BlockAllGather(tile=(16, 32)))
    fully_shard(module, mesh=mesh, mp_policy=policy, block_policy=lambda fqn, p: 12)
    (view,) = buffers_of(module)
    assert view._group.fp8 is not None and view.layout["w"].block_rows == 48
    module.unshard()
    assert torch.equal(module.w.detach(), _qdq(master, (16, 32)))
    module.reshard()


def _check_errors(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    with pytest.raises(ValueError, match=r"tile must be a tuple of two positive ints"):
        Float8BlockAllGather(tile=(0, 32))
    with pytest.raises(ValueError, match=r"all_gather must be a Float8BlockAllGather"):
        MixedPrecisionPolicy(all_gather="fp8")
    policy = MixedPrecisionPolicy(all_gather=Float8BlockAllGather(tile=(16, 32)))
    with pytest.raises(ValueError, match=r"FP8 all-gather of 'weight': its dtype torch.float64"):
        fully_shard(torch.nn.Linear(64, 48).double(), mesh=mesh, mp_policy=policy)
    # FP8 beside tensor parallelism: refused, the model left as it was
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    block = Transformer(ttp._config("llama-tiny"), max_seq_len=SEQ, seed=0).layers[0]
    ttp.parallelize_module(block, tp_mesh["tp"], ttp._plan("llama-tiny"))
    held = dict(block.named_parameters())
    with pytest.raises(NotImplementedError, match=r"on a tensor-parallel mesh dimension"):
        fully_shard(block, mesh=tp_mesh["dp"], mp_policy=policy)
    assert all(p is held[n] for n, p in block.named_parameters())
    dist.barrier()


def _grid(rank, world, refs):
    cases = {
        f"exact {n} {t}": partial(_check_exact, n, t, rank, world, refs[n, t]) for n, t in refs
    }
    if world == 4:
        cases["bytes"] = partial(_check_bytes, rank, world)
        cases["errors"] = partial(_check_errors, rank, world)
        cases["blocks raised to tiles"] = partial(_check_blocks_raised_to_tiles, rank, world)
    run_cases(cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fp8_all_gather(world):
    cases = CASES + ([("llama-tiny", (1, 32))] if world == MX_WORLD else [])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster (the same bits either way)
    try:
        refs = {(n, t): _reference(n, t, world) for n, t in cases}
    finally:
        torch.set_num_threads(threads)
    spawn(world, _grid, refs, timeout=600)
