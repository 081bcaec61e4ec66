"""FP8 all-gather with per-tile scales ([Note: FP8 all-gather]), at 1-4 gloo ranks.

- Exactness: both catalogue models (fp32 compute) give, step after step, the losses of
  one process that applies the same per-tile quantize-dequantize to its weights before
  each forward (within the bound derived from that process's own sensitivity,
  [Note: derived tolerances] in ``tests/numerics.py``; SGD on the fp32 masters), with
  4x32 tiles and fp32 scales (and, at 3 ranks, MX-style 1x32 tiles with fp32 and with
  E8M0 scales; at 4, on a 2 x 2 HSDP mesh too, gathering over the shard dim); the
  dequantized unsharded parameters every rank gathers are bit-identical to that
  process's, and so is each rank's piece decoded from its codes and scales as
  ``BufferView.fp8.piece`` gives them.
- Bytes (CommCounter): a model whose matrices are whole 32x32 tiles all-gathers at most
  0.52x the bytes of its bf16 all-gather (codes plus scales), with 32x32 fp32 scales and
  with MX (1x32, E8M0), its reduce-scatter bytes no more than bf16's; each FP8 buffer moves exactly
  ``m * send_bytes`` bytes (``S`` of codes, its scales at a 4-byte boundary).
- Casts, counted: in fp32, the only copy-like ops touching the buffers in a step are
  the dequantizing casts into FP8 buffers' global storages, one per FP8 all-gather, each
  matched by one quantizing ``div`` from the shard into the send buffer; and an FP8
  all-gather runs the same number of ops for every buffer (an attention's four matrices,
  a feed-forward's three): kernels per buffer, not per piece.
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
from torch.utils._python_dispatch import TorchDispatchMode

from raggedfsdp import Float8BlockAllGather, MixedPrecisionPolicy, fully_shard
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.tools.profiling import (
    COPY_OPS,
    CommCounter,
    CopyCounter,
    buffer_storages,
    one_rank_collective,
    storage_key,
)
from tests.dist import test_tp as ttp
from tests.harness import run_cases, spawn
from tests.numerics import assert_losses_match, reference, reference_threads

pytestmark = pytest.mark.numerics
SEQ, STEPS, ROWS = 16, 3, 12  # 12 rows: every rank of 1-4 takes the same count
F32, E8M0 = torch.float32, torch.float8_e8m0fnu
CASES = [("llama-tiny", (4, 32), F32), ("moe-tiny", (4, 32), F32)]  # at every world size
MX_WORLD = 3  # MX-style 1 x 32 tiles, fp32 and E8M0 scales: at 3 ranks
MX_CASES = [("llama-tiny", (1, 32), F32), ("llama-tiny", (1, 32), E8M0)]


def _data():
    gen = torch.Generator().manual_seed(8)
    return torch.randint(0, 1001, (STEPS, ROWS, SEQ + 1), generator=gen)


# ---- the reference: one process, written apart from the library ---------------------------
def _selected(shape, tile) -> bool:
    return len(shape) in (2, 3) and shape[-2] % tile[0] == 0 and shape[-1] % tile[1] == 0


def _qdq(w: torch.Tensor, tile, scale_dtype=F32) -> torch.Tensor:
    """Quantize-dequantize tile by tile: scale amax / 448 (at least 2**-126, fp32's least
    normal), or for E8M0 the least power of two >= amax / 448 (the same floor); codes
    float8_e4m3fn, decoded in fp32, then cast to ``w``'s dtype."""
    tr, tc = tile
    rows, cols = w.shape[-2:]
    x = w.detach().float().reshape(-1, rows // tr, tr, cols // tc, tc)  # member, tiles
    amax = x.abs().amax(dim=(2, 4), keepdim=True)
    if scale_dtype == F32:
        scale = (amax / 448).clamp(min=2.0**-126)
    else:  # s = f * 2**e with f in [0.5, 1): 2**(e - 1) when s is a power of two, else 2**e
        f, e = torch.frexp(amax / 448)
        scale = torch.ldexp(torch.ones_like(amax), torch.where(f == 0.5, e - 1, e))
        scale = scale.clamp(min=2.0**-126)  # zero tiles (and tiny ones): E8M0's least normal
    code = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (code.float() * scale).to(w.dtype).reshape(w.shape)


def _model(name):
    return Transformer(get_config(name), max_seq_len=SEQ, seed=0)


@functools.cache
def _reference(name, tile, scale_dtype, world):
    """The reference's losses and spread ([Note: derived tolerances] in
    ``tests/numerics.py``), and the names of the parameters gathered in FP8."""
    chosen = {n for n, p in _model(name).named_parameters() if _selected(p.shape, tile)}
    return reference(partial(_reference_run, name, tile, scale_dtype, world)), chosen


def _reference_run(name, tile, scale_dtype, world):
    """Per-step losses."""
    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    chosen = [p for p in model.parameters() if _selected(p.shape, tile)]
    assert chosen
    losses = []
    for step in range(STEPS):
        masters = [p.detach().clone() for p in chosen]
        with torch.no_grad():
            for p in chosen:
                p.copy_(_qdq(p, tile, scale_dtype))
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
    return losses


def _shard(model, mesh, tile, scale_dtype=F32, **kw):
    fp8 = Float8BlockAllGather(tile=tile, scale_dtype=scale_dtype)
    mp = MixedPrecisionPolicy(all_gather=fp8, **kw)
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def _check_exact(name, tile, scale_dtype, rank, world, ref, hsdp=False):
    ref_losses, chosen = ref
    if hsdp:  # 2 replicas of 2 shards: FP8 all-gathers over the shard dim
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = _shard(_model(name), mesh, tile, scale_dtype)
    assert any(b.fp8 is not None for b in buffers_of(model))
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
    assert_losses_match(losses, ref_losses, world=world, tokens=ROWS * SEQ)
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
            assert torch.equal(p.detach(), _qdq(masters[fqn], tile, scale_dtype)), fqn
    for m in modules:
        m.reshard()
    # each rank's codes and scales, read back as torch._scaled_mm would take them
    for b in buffers_of(model):
        if b.fp8 is None:
            continue
        send = b.fp8.quantize(b.shard, b.rank)
        names = {id(p): n for n, p in model.named_parameters()}
        for param in b.params:
            lo, hi = b.layout.local_range(param.fqn, b.rank)
            if hi == lo:
                continue
            codes, scales = b.fp8.piece(send, b.rank, param.fqn)
            tr, tc = tile
            expand = scales.float().repeat_interleave(tr, 0).repeat_interleave(tc, 1)
            want = _qdq(masters[names[id(param.param)]], tile, scale_dtype).flatten()[lo:hi]
            assert torch.equal((codes.float() * expand).flatten(), want), param.fqn
            assert scales.dtype == scale_dtype, scales.dtype


def _config_in_tiles():
    """A model whose every matrix is whole 32 x 32 tiles."""
    base = get_config("llama-tiny")
    return dataclasses.replace(base, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=1024)


def _check_bytes(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    rows = _data()[0][rank * ROWS // world :][: ROWS // world] % 1024
    stats = {}
    for fp8 in (None, ((32, 32), F32), ((1, 32), E8M0)):
        model = Transformer(_config_in_tiles(), max_seq_len=SEQ, seed=0)
        kw = dict(param_dtype=torch.bfloat16)
        if fp8:
            _shard(model, mesh, *fp8, **kw)
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
                per = b.fp8.send_bytes if b.fp8 is not None else b.layout.shard_size * 2
                expected += world * per * (1 if id(b) in root else 2)  # forward, backward
            assert stats[fp8]["all_gather"].output_bytes == expected
            # each buffer reduce-scatters m * S elements of bf16, once a step
            reduced = sum(world * b.layout.shard_size * 2 for b in bufs)
            assert stats[fp8]["reduce_scatter"].input_bytes == reduced, fp8
    bf16 = stats.pop(None)
    for fp8, got in stats.items():
        ratio = got["all_gather"].output_bytes / bf16["all_gather"].output_bytes
        assert ratio <= 0.52, (fp8, ratio)
        # the FP8 buffers' layouts pad no more than one bf16 buffer per group: the tiles
        # are whole blocks of whole rows, and the rest (norm weights) plans apart
        assert got["reduce_scatter"].input_bytes <= bf16["reduce_scatter"].input_bytes, fp8


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
    assert view.fp8 is not None and view.layout["w"].block_rows == 48
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


class _Ops(TorchDispatchMode):
    """The aten ops run under it that are not views (nor collectives: over one rank, the
    copy that stands for one)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace == "aten" and one_rank_collective() is None:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _check_casts(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = _model("llama-tiny")
    fp8 = MixedPrecisionPolicy(all_gather=Float8BlockAllGather(tile=(4, 32)))
    for block in model.transformer_blocks():  # groups of 4 matrices and of 3
        fully_shard(block.attention, mesh=mesh, mp_policy=fp8)
    _shard(model, mesh, (4, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    rows = _data()[0][rank * ROWS // world :][: ROWS // world]

    def step():
        lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    step()
    fp8 = [b for b in buffers_of(model) if b.fp8 is not None]
    shards = {storage_key(b.shard) for b in fp8}
    unsharded = {storage_key(b.unsharded) for b in fp8}
    assert len({len(b.layout.tensors) for b in fp8}) == 2  # 4 and 3 matrices
    with CopyCounter(ops=COPY_OPS | {"aten::div"}) as copies:
        step()
    near = [e for e in copies.touching(buffer_storages(model)) if e.within is None]
    casts = [e for e in near if e.op == "aten.copy_.default" and e.writes <= unsharded]
    divs = [e for e in near if e.op == "aten.div.out" and e.reads & shards]
    assert len(casts) + len(divs) == len(near), copies.summary(near)
    root = {id(b) for b in _root_views(model)}
    gathers = sum(1 if id(b) in root else 2 for b in fp8)  # forward, backward
    assert len(casts) == len(divs) == gathers, (copies.summary(near), gathers)
    # the ops of an FP8 all-gather do not depend on the tensors or pieces in the buffer
    counts = {}
    for block in model.transformer_blocks():
        for name, m in (("attention", block.attention), ("feed-forward", block)):
            m.reshard()
            with _Ops() as ops:
                m.unshard()
            m.reshard()
            counts[name] = len(ops.ops)
    assert len(set(counts.values())) == 1, counts


def _grid(rank, world, refs):
    cases = {
        f"exact {n} {t} {d}": partial(_check_exact, n, t, d, rank, world, refs[n, t, d])
        for n, t, d in refs
    }
    cases["casts"] = partial(_check_casts, rank, world)
    if world == 4:
        n, t, d = CASES[0]
        cases["hsdp"] = partial(_check_exact, n, t, d, rank, world, refs[n, t, d], hsdp=True)
        cases["bytes"] = partial(_check_bytes, rank, world)
        cases["errors"] = partial(_check_errors, rank, world)
        cases["blocks raised to tiles"] = partial(_check_blocks_raised_to_tiles, rank, world)
    run_cases(cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fp8_all_gather(world):
    cases = CASES + (MX_CASES if world == MX_WORLD else [])
    with reference_threads():  # tiny models: one thread is faster
        refs = {c: _reference(*c, world) for c in cases}
    spawn(world, _grid, refs, timeout=600)
