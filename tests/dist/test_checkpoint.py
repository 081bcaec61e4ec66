"""Checkpoints of fully_shard models: resume across world sizes and block policies with
the losses of the uninterrupted run, crash safety under SIGKILL, corruption, errors on
every rank, async save and safetensors export.

Every run trains ``STEPS`` steps of world-size-invariant global batches; a checkpoint
is taken after ``SAVE_AT`` steps. The uninterrupted run is one process (no process
group), in the pytest process, run again with nudged gradients for its own sensitivity.
Each source saves every (model, optimizer) config once and records the whole saved
state; each target spawn loads them all, checks its part of the state bit for bit, and
trains the remaining steps against the uninterrupted run: another world size or block
policy sums gradients in another order, so the losses lie within the bound derived from
that sensitivity ([Note: derived tolerances] in ``tests/numerics.py``).

Spawns (the slow part), in order::

    pytest process   world 1 (a plain model, no process group): the reference (plain and
                     nudged), saves
    spawn(3)         saves at world 3
    spawn(4)         saves at world 4, 1-row and "128-row" blocks; loads 3->4, 1->4, 128->1
    spawn(2)         loads 4->2; errors raised on every rank; safetensors export
    spawn(3)         loads 4->3
    pytest process   loads 4->1; the exported files into one process
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import time
from functools import partial

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, init_device_mesh

import raggedfsdp
from raggedfsdp import BlockPolicy, checkpoint, fully_shard
from raggedfsdp.checkpoint import CorruptCheckpointError
from raggedfsdp.checkpoint import files as checkpoint_files
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.optim import AdamW8bit, Muon, adamw8bit_block_policy, muon_param_groups
from raggedfsdp.train.data import get_batch
from tests.dist.test_fully_shard import BATCH, SEQ, _data, _micro_batches
from tests.harness import run_cases, spawn
from tests.numerics import Reference, assert_losses_match, reference, reference_threads

STEPS, SAVE_AT = 7, 4
MODELS = ("llama-tiny", "moe-tiny")
FINE = BlockPolicy()  # 1-row blocks
# "128-row blocks": the tiny models have 32, 96, 260 and 1001 rows (experts: members of
# 44 and 96 rows), none a multiple of 128. Parameters with fewer rows are one whole block
# (whole_if_fewer_rows; expert stacks are named: the policy counts a stack's rows, not a
# member's), and the two larger take the divisor nearest 128 (130 of 260, 143 of 1001).
COARSE = BlockPolicy(
    rows=128,
    overrides=(
        ("feed_forward.w1.weight", 130),
        ("feed_forward.w3.weight", 130),
        ("tok_embeddings.weight", 143),
        ("output.weight", 143),
        ("experts.w1", "whole"),
        ("experts.w2", "whole"),
        ("experts.w3", "whole"),
    ),
)
OPTIMS = ("adamw", "flat", "muon", "8bit")
CONFIGS = [(m, o) for m in MODELS for o in OPTIMS]
ASYNC = {"flat", "8bit"}  # these save with async_save=True while the next steps run
# Learning rates: a run on m ranks sums gradients in another order than one process, and
# an optimizer may amplify that noise (Muon's bf16 Newton-Schulz rounds differently,
# an 8-bit code flips), and the derived bound grows with it. Modest rates keep the
# bound small, so that it still tells a resumed run from a wrong one.
LR = {"adamw": 1e-2, "flat": 1e-2, "muon": 2e-3, "8bit": 1e-3}


def _policy(kind, optim):
    """The block policy of ``kind`` ("fine" or "coarse") that ``optim`` can train with.

    AdamW8bit needs whole quantization blocks on every rank: its fine policy is
    ``adamw8bit_block_policy()`` and its coarse one ``"whole"`` tensors.
    """
    if optim == "8bit":
        return adamw8bit_block_policy() if kind == "fine" else BlockPolicy(rows="whole")
    return FINE if kind == "fine" else COARSE


# ---- building and training --------------------------------------------------------------
def _model(name, mesh=None, policy=None):
    model = Transformer(get_config(name), max_seq_len=SEQ, seed=0)
    if mesh is not None:
        for block in model.transformer_blocks():
            fully_shard(block, mesh=mesh, block_policy=policy)
        fully_shard(model, mesh=mesh, block_policy=policy)
    return model


def _optimizer(kind, model):
    lr = LR[kind]
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    if kind == "flat":  # two groups: no decay on norms (a per-parameter decay)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
        return raggedfsdp.optim.AdamW(groups, lr=lr, weight_decay=0.1)
    if kind == "muon":
        return Muon(muon_param_groups(model, lr=lr / 2, weight_decay=0.1), lr=lr)
    if kind == "8bit":
        return AdamW8bit(model.parameters(), lr=lr, weight_decay=0.1)
    raise AssertionError(kind)


def _train(model, opt, steps, rank=0, world=1):
    losses = []
    for step in steps:
        ((x, y),) = _micro_batches(step, 1, rank, world)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _named_state(model, opt) -> dict[str, object]:
    """Every value of the model and optimizer by name (tensors as they are: local)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            out[f"optim.{names[id(p)]}.{key}"] = value
    out["param_groups"] = [
        {k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]
    ]
    return out


def _full_state(model, opt) -> dict[str, object]:
    """``_named_state`` with every tensor gathered whole (a test-only record)."""

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    return {k: full(v) if torch.is_tensor(v) else v for k, v in _named_state(model, opt).items()}


def _assert_same_state(model, opt, expected, what):
    """This rank's part of every value equals the recorded whole value, bit for bit."""
    got = _named_state(model, opt)
    assert got.keys() == expected.keys(), (what, sorted(got.keys() ^ expected.keys())[:5])
    for key, value in expected.items():
        ours = got[key]
        if isinstance(ours, DTensor):
            rank = ours.device_mesh.get_local_rank(0)
            ours, value = ours._local_tensor, ours.placements[0].local_view(value, rank)
        if torch.is_tensor(value):
            same = ours.dtype == value.dtype and torch.equal(ours, value)
            assert same, f"{what}: {key} differs after load"
        else:
            assert ours == value, f"{what}: {key} differs after load"


def _check_losses(losses, ref: Reference, start: int, world: int, what: str) -> float:
    """The losses of steps ``start, start + 1, ...`` lie within the derived bound of the
    reference's (its spread: the largest over all its steps); returns the largest
    difference."""
    part = Reference({"loss": ref.losses[start : start + len(losses)]}, ref.spread)
    assert_losses_match(losses, part, world=world, tokens=BATCH * SEQ, what=what)
    return max(abs(a - b) for a, b in zip(losses, part.losses))


def _record(base, src, model_name, optim, state):
    torch.save(state, base / "expected" / f"{src}-{model_name}-{optim}.pt")


def _recorded(base, src, model_name, optim):
    return torch.load(base / "expected" / f"{src}-{model_name}-{optim}.pt", weights_only=False)


def _uninterrupted(model_name, optim, steps, save=None):
    """One process, no process group: the losses of ``steps`` steps; with ``save``, calls
    ``save(model, opt)`` after ``SAVE_AT`` of them."""
    model = _model(model_name)
    opt = _optimizer(optim, model)
    if save is None:
        return _train(model, opt, range(steps))
    losses = _train(model, opt, range(SAVE_AT))
    save(model, opt)
    return losses + _train(model, opt, range(SAVE_AT, steps))


def _save_plain(base, model_name, optim, model, opt):
    path = base / "ckpt" / "1-plain" / f"{model_name}-{optim}"
    extra = {"source": "1-plain", "rng": torch.ones(3, dtype=torch.uint8)}
    checkpoint.save(path, model, opt, step=SAVE_AT, extra=extra)
    _record(base, "1-plain", model_name, optim, _full_state(model, opt))


def _reference(base) -> dict[tuple[str, str], Reference]:
    """The uninterrupted runs and their sensitivity (``reference``: the plain run first,
    then the nudged ones); the plain run saves the 1-plain sources."""
    ref = {}
    for model_name, optim in CONFIGS:
        save = [partial(_save_plain, base, model_name, optim)]  # taken by the first run
        ref[model_name, optim] = reference(partial(_saving_once, model_name, optim, save))
    return ref


def _saving_once(model_name, optim, save: list):
    return _uninterrupted(model_name, optim, STEPS, save.pop() if save else None)


# ---- source: train, save after SAVE_AT steps ----------------------------------------------
def _save_source(base, src, model_name, optim, mesh, policy, rank, world, ref):
    """Save after SAVE_AT steps; an async save overlaps the run's next steps."""
    model = _model(model_name, mesh, _policy(policy, optim))
    opt = _optimizer(optim, model)
    losses = _train(model, opt, range(SAVE_AT), rank, world)
    state = _full_state(model, opt)
    start = time.perf_counter()
    handle = checkpoint.save(
        base / "ckpt" / src / f"{model_name}-{optim}",
        model,
        opt,
        step=SAVE_AT,
        extra={"source": src, "rng": torch.ones(3, dtype=torch.uint8)},
        async_save=optim in ASYNC,
    )
    blocked = time.perf_counter() - start
    if optim in ASYNC:  # these steps must not leak into the snapshot being written
        losses += _train(model, opt, range(SAVE_AT, STEPS), rank, world)
    handle.wait()
    total = time.perf_counter() - start
    worst = _check_losses(losses, ref[model_name, optim], 0, world, f"{src} {model_name} {optim}: ")
    if rank == 0:
        _record(base, src, model_name, optim, state)
        print(
            f"save {src} {model_name} {optim}: blocked {blocked * 1e3:.0f} ms "
            f"(async: {optim in ASYNC}), committed after {total * 1e3:.0f} ms; "
            f"vs one process {worst:.3g}"
        )


def _load_target(base, src, dst, model_name, optim, mesh, policy, rank, world, ref):
    model = _model(model_name, mesh, _policy(policy, optim))
    opt = _optimizer(optim, model)
    start = time.perf_counter()
    step, extra = checkpoint.load(base / "ckpt" / src / f"{model_name}-{optim}", model, opt)
    took = time.perf_counter() - start
    assert step == SAVE_AT and extra["source"] == src and torch.equal(extra["rng"], torch.ones(3))
    _assert_same_state(model, opt, _recorded(base, src, model_name, optim), f"{src}->{dst}")
    losses = _train(model, opt, range(SAVE_AT, STEPS), rank, world)
    what = f"{src}->{dst} {model_name} {optim}: "
    worst = _check_losses(losses, ref[model_name, optim], SAVE_AT, world, what)
    if rank == 0:
        print(f"load {src}->{dst} {model_name} {optim}: {took * 1e3:.0f} ms; loss diff {worst:.3g}")


def _sources(rank, world, base, ref, policies):
    mesh = init_device_mesh("cpu", (world,))
    run_cases(
        {
            f"save {world}-{policy} {m} {o}": partial(
                _save_source, base, f"{world}-{policy}", m, o, mesh, policy, rank, world, ref
            )
            for policy in policies
            for m, o in CONFIGS
        }
    )


def _targets(rank, world, base, ref, pairs):
    mesh = init_device_mesh("cpu", (world,))
    run_cases(
        {
            f"load {src}->{world}-{policy} {m} {o}": partial(
                _load_target, base, src, f"{world}-{policy}", m, o, mesh, policy, rank, world, ref
            )
            for src, policy in pairs
            for m, o in CONFIGS
        }
    )


def _world4(rank, world, base, ref):
    _sources(rank, world, base, ref, ["fine", "coarse"])
    _targets(
        rank, world, base, ref, [("3-fine", "fine"), ("1-plain", "fine"), ("4-coarse", "fine")]
    )


def _one_process_targets(base, ref):
    for m, o in CONFIGS:
        _load_target(base, "4-fine", "1-plain", m, o, None, "fine", 0, 1, ref)


@pytest.fixture
def one_thread():
    """The pytest process's own runs: tiny models, where one thread is faster (and a busy
    machine does not slow it down)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.numerics
def test_resume_matches_uninterrupted_run(tmp_path, one_thread):
    """4->2, 4->3, 3->4, 1->4, 4->1 and 128-row -> 1-row blocks, both models, AdamW (torch's
    and the flat one), Muon and AdamW8bit: the loaded state is the saved one bit for bit, and
    the losses after resume are the uninterrupted run's, within the derived bound; the
    exported files give the sharded model's logits bit for bit."""
    (tmp_path / "expected").mkdir()
    ref = _reference(tmp_path)
    spawn(3, _sources, tmp_path, ref, ["fine"], timeout=600)
    spawn(4, _world4, tmp_path, ref, timeout=600)
    _damaged_copy(tmp_path)
    spawn(2, _world2, tmp_path, ref, timeout=600)
    spawn(3, _targets, tmp_path, ref, [("4-fine", "fine")], timeout=600)
    _one_process_targets(tmp_path, ref)
    _check_exports(tmp_path)


def _damaged_copy(base):
    """A copy of a 4-rank checkpoint with one byte of rank 3's data file flipped."""
    step = base / "ckpt" / "4-fine" / "llama-tiny-adamw" / f"step_{SAVE_AT:08d}"
    shutil.copytree(step, base / "damaged")
    data = base / "damaged" / "__3_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))


# ---- crash safety: SIGKILL at every step of a save ----------------------------------------
# Points of a save (``files.fault_point``) (see [Note: commit protocol]) plus two inside DCP: half-way through
# a data file, and with every data file written but no DCP metadata.
CRASH_POINTS = [
    "tmp_created",
    "mid_file",
    "before_metadata",
    "data_written",
    "marker_written",
    "committed",
    "cleanup",
]
COMMITTED = {"committed", "cleanup"}  # killed after the rename: the new checkpoint counts


def _die(*_, **__):
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point):
    """Make this process SIGKILL itself at ``point`` of the next save."""
    from torch.distributed.checkpoint import filesystem

    if point == "mid_file":

        def half_then_die(transforms, stream, *args, **kwargs):
            stream.write(b"\x00" * 4096)  # a data file cut short
            stream.flush()
            _die()

        filesystem._write_item = half_then_die
    elif point == "before_metadata":
        filesystem.FileSystemWriter.finish = _die
    else:
        checkpoint_files.fault_hook = lambda name: _die() if name == point else None


def _crash_child(root, point):
    torch.set_num_threads(1)
    model = _model("llama-tiny")
    opt = _optimizer("adamw", model)
    _train(model, opt, range(2))
    _arm(point)
    checkpoint.save(root, model, opt, step=2, keep_last=1)
    raise AssertionError(f"{point}: the save finished, the process should be dead")


def _check_after_crash(root, point, model, opt, saved):
    found = [s for s, _ in checkpoint_files.checkpoints(root)]
    expected_step = 2 if point in COMMITTED else 1
    assert found[-1] == expected_step, (point, found)
    fresh = _model("llama-tiny")
    fresh_opt = _optimizer("adamw", fresh)
    step, _ = checkpoint.load(root, fresh, fresh_opt)
    assert step == expected_step, point
    if step == 1:
        _assert_same_state(fresh, fresh_opt, saved, point)
    # the next save completes and clears what the killed one left
    checkpoint.save(root, model, opt, step=3, keep_last=1)
    assert [p.name for p in root.iterdir()] == ["step_00000003"], point


def test_a_killed_save_is_never_picked_up(tmp_path, one_thread):
    """SIGKILL at each point: the previous checkpoint stays the one ``load`` picks and loads
    (or, after the rename, the new one); the next save clears the left-overs."""
    model = _model("llama-tiny")
    opt = _optimizer("adamw", model)
    _train(model, opt, range(1))
    checkpoint.save(tmp_path / "base", model, opt, step=1)
    saved = _full_state(model, opt)
    ctx = multiprocessing.get_context("spawn")
    children = {}
    for point in CRASH_POINTS:
        shutil.copytree(tmp_path / "base", tmp_path / point)
        children[point] = ctx.Process(target=_crash_child, args=(tmp_path / point, point))
        children[point].start()
    for point, child in children.items():
        child.join(timeout=300)
        assert child.exitcode == -signal.SIGKILL, (point, child.exitcode)
    left = {p: sorted(e.name for e in (tmp_path / p).iterdir()) for p in CRASH_POINTS}
    assert left["mid_file"] == [".step_00000002.tmp", "step_00000001"]
    assert left["committed"] == ["step_00000001", "step_00000002"]
    assert left["cleanup"] == [".step_00000001.trash", "step_00000002"]
    for point in CRASH_POINTS:
        _check_after_crash(tmp_path / point, point, model, opt, saved)


def _ranks_killed_mid_file(rank, world, root):
    model = _model("moe-tiny", init_device_mesh("cpu", (world,)))
    opt = _optimizer("flat", model)
    _train(model, opt, range(1), rank, world)
    checkpoint.save(root, model, opt, step=1)
    torch.save(_full_state(model, opt), root.parent / f"saved-{rank}.pt")
    _train(model, opt, range(1, 2), rank, world)
    _arm("mid_file")
    checkpoint.save(root, model, opt, step=2)


def test_ranks_killed_mid_write(tmp_path, one_thread):
    """Two ranks SIGKILLed half-way through their data files: step 1 stays the latest."""
    with pytest.raises(AssertionError, match="died with exit code -9"):
        spawn(2, _ranks_killed_mid_file, tmp_path / "ckpt", timeout=300)
    assert [s for s, _ in checkpoint_files.checkpoints(tmp_path / "ckpt")] == [1]
    model = _model("moe-tiny")
    opt = _optimizer("flat", model)
    assert checkpoint.load(tmp_path / "ckpt", model, opt)[0] == 1
    saved = torch.load(tmp_path / "saved-0.pt", weights_only=False)
    _assert_same_state(model, opt, saved, "2 ranks killed mid-file")


# ---- errors on several ranks, and safetensors export --------------------------------------
def _logits(model):
    x, _ = get_batch(_data(), seed=1, step=0, batch_size=BATCH, seq_len=SEQ)
    with torch.no_grad():
        return model(x)


def _check_errors_on_every_rank(base, rank, world):
    """Each rank raises the same error, and the model and optimizer keep their values."""
    mesh = init_device_mesh("cpu", (world,))
    source = base / "ckpt" / "4-fine" / "llama-tiny-adamw"
    cases = {
        # a checkpoint of another model: every rank finds the mismatch
        "moe-tiny": (source, ValueError, r"model keys missing from the checkpoint: \['layers.1."),
        # a file only rank 1 verifies (rank r checks files r, r + world, ...) is damaged
        "damaged": (base / "damaged", CorruptCheckpointError, "'__3_0.distcp' does not match"),
        "nothing": (base / "ckpt", ValueError, "holds no step_XXXXXXXX directory"),
    }
    for name, (path, error, message) in cases.items():
        model = _model("moe-tiny" if name == "moe-tiny" else "llama-tiny", mesh)
        opt = _optimizer("adamw", model)
        _train(model, opt, range(1), rank, world)
        before = _full_state(model, opt)
        with pytest.raises(error, match=message):
            checkpoint.load(path, model, opt)
        _assert_same_state(model, opt, before, f"untouched after {name}")


def _export(base, rank, world):
    """Export the models loaded from 4 ranks, and a tied one; rank 0 records their logits."""
    mesh = init_device_mesh("cpu", (world,))
    for name in ("llama-tiny", "moe-tiny", "llama-tiny-tied"):
        model = _model(name, mesh)
        if name != "llama-tiny-tied":
            checkpoint.load(base / "ckpt" / "4-fine" / f"{name}-adamw", model)
        start = time.perf_counter()
        checkpoint.export_safetensors(model, base / "export" / name)
        took = time.perf_counter() - start
        logits = _logits(model)
        if rank == 0:
            torch.save(logits, base / "export" / f"{name}.logits.pt")
            print(f"export {name} from {world} ranks: {took * 1e3:.0f} ms")


def _world2(rank, world, base, ref):
    _targets(rank, world, base, ref, [("4-fine", "fine")])
    run_cases(
        {
            "errors on every rank": partial(_check_errors_on_every_rank, base, rank, world),
            "export": partial(_export, base, rank, world),
        }
    )


def _check_exports(base):
    """The exported files load with ``safetensors`` into one process: the logits of the
    ranks' sharded model, bit for bit (each rank's forward runs on the whole parameters:
    the same arithmetic)."""
    for name in ("llama-tiny", "moe-tiny", "llama-tiny-tied"):
        directory = base / "export" / name
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        tensors = {}
        for filename in sorted(set(index["weight_map"].values())):
            tensors.update(safetensors.torch.load_file(directory / filename))
        assert sorted(tensors) == sorted(index["weight_map"])
        model = Transformer(get_config(name), max_seq_len=SEQ, seed=123)  # other values
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        aliases = index["metadata"]["aliases"]
        assert missing == list(aliases) and unexpected == [], (name, missing, unexpected)
        if name == "llama-tiny-tied":
            assert aliases == {"output.weight": "tok_embeddings.weight"}
            assert len(set(index["weight_map"].values())) == 3  # the root, 2 blocks
        expected = torch.load(base / "export" / f"{name}.logits.pt")
        with reference_threads():  # the ranks' threads: MKL may split a GEMM by them
            assert torch.equal(_logits(model), expected), name
