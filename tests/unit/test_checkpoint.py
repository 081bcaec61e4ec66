"""Checkpoints in one process (no process group): the directory protocol, discovery,
checksums, and every error of save / load, with the model and optimizer untouched."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from torch import nn

from raggedfsdp import checkpoint
from raggedfsdp.checkpoint import CorruptCheckpointError
from raggedfsdp.checkpoint import files as ckpt_files


# ---- the directory protocol ---------------------------------------------------------------
def _fake_checkpoint(root, step, files=None):
    d = ckpt_files.step_dir(root, step)
    d.mkdir(parents=True)
    files = files or {"a.bin": b"hello"}
    for name, data in files.items():
        (d / name).write_bytes(data)
    digests = {name: ckpt_files.file_digest(d / name) for name in files}
    (d / ckpt_files.MARKER).write_bytes(ckpt_files.marker_bytes(step, 1, digests))
    return d


def test_names_and_digest(tmp_path):
    assert ckpt_files.step_dir(tmp_path, 42).name == "step_00000042"
    assert ckpt_files.tmp_dir(tmp_path, 42).name == ".step_00000042.tmp"
    assert ckpt_files.step_dir(tmp_path, 123456789).name == "step_123456789"
    f = tmp_path / "x"
    ckpt_files.write_file(f, b"abc" * 1000)
    assert f.read_bytes() == b"abc" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["x"]  # no temporary left
    assert ckpt_files.file_digest(f) == {
        "size": 3000,
        "sha256": hashlib.sha256(b"abc" * 1000).hexdigest(),
    }


def test_discovery_picks_the_newest_complete_checkpoint(tmp_path):
    _fake_checkpoint(tmp_path, 9)
    _fake_checkpoint(tmp_path, 10)
    (tmp_path / "step_00000011").mkdir()  # no marker: not a checkpoint
    (tmp_path / ".step_00000012.tmp").mkdir()  # a save in progress or killed
    (tmp_path / ".step_00000008.trash").mkdir()  # a deletion in progress
    (tmp_path / "notes.txt").write_text("x")
    assert [s for s, _ in ckpt_files.checkpoints(tmp_path)] == [9, 10]
    assert ckpt_files.resolve(tmp_path) == (10, ckpt_files.step_dir(tmp_path, 10))
    assert ckpt_files.resolve(tmp_path / "step_00000009") == (9, ckpt_files.step_dir(tmp_path, 9))
    assert checkpoint.latest_checkpoint(tmp_path) == ckpt_files.step_dir(tmp_path, 10)
    assert checkpoint.latest_checkpoint(tmp_path / "nowhere") is None
    assert [p.name for p in ckpt_files.stale_dirs(tmp_path)] == [
        ".step_00000008.trash",
        ".step_00000012.tmp",
    ]


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match="no complete checkpoint at .*it does not exist"):
        ckpt_files.resolve(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no step_XXXXXXXX directory"):
        ckpt_files.resolve(tmp_path)
    (tmp_path / ".step_00000003.tmp").mkdir()
    with pytest.raises(ValueError, match=r"only interrupted saves \['.step_00000003.tmp'\]"):
        ckpt_files.resolve(tmp_path)
    (tmp_path / "step_00000004").mkdir()
    with pytest.raises(ValueError, match="has no checkpoint.json .an interrupted save"):
        ckpt_files.resolve(tmp_path / "step_00000004")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="it is not a directory"):
        ckpt_files.resolve(tmp_path / "file")


def test_corrupted_marker_is_an_error_not_a_fallback(tmp_path):
    _fake_checkpoint(tmp_path, 1)
    newest = _fake_checkpoint(tmp_path, 2)
    (newest / ckpt_files.MARKER).write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="step_00000002.*marker checkpoint.json"):
        ckpt_files.resolve(tmp_path)
    (newest / ckpt_files.MARKER).write_text(json.dumps({"format": "other"}))
    with pytest.raises(CorruptCheckpointError, match="not a valid raggedfsdp-checkpoint/1"):
        ckpt_files.resolve(newest)


def test_verify_detects_missing_truncated_and_corrupted_files(tmp_path):
    d = _fake_checkpoint(tmp_path, 1, {"a": b"0123456789", "b": b"x" * 100})
    files = ckpt_files.read_marker(d)["files"]
    assert ckpt_files.verify(d, files, ["a", "b"]) is None
    (d / "b").write_bytes(b"x" * 99)
    assert "has 99 bytes, the marker recorded 100 (truncated?)" in ckpt_files.verify(d, files, "ab")
    (d / "b").write_bytes(b"x" * 99 + b"y")
    assert "'b' does not match its recorded sha256" in ckpt_files.verify(d, files, "ab")
    (d / "a").unlink()
    assert ckpt_files.verify(d, files, "ab") == "file 'a' is missing"


def test_remove_hides_first_then_deletes(tmp_path):
    d = _fake_checkpoint(tmp_path, 5)
    seen = []

    def hook(point):  # at the hook, the checkpoint is already out of sight
        seen.append((point, d.exists(), (tmp_path / ".step_00000005.trash").exists()))

    ckpt_files.remove(d, hook=hook)
    assert seen == [("cleanup", False, True)]
    assert list(tmp_path.iterdir()) == []


# ---- save / load in one process -----------------------------------------------------------
class _Net(nn.Module):
    def __init__(self, width=6, tied=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(10, width)
        self.lin = nn.Linear(width, width)
        self.head = nn.Linear(width, 10, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("count", torch.tensor([3.0]))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(self.emb(x))))


def _step(model, opt, n=2):
    for i in range(n):
        x = torch.arange(8).remainder(10).view(2, 4) + i
        model(x.remainder(10)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in opt.state_dict()["state"].items()
        },
        [dict(g) for g in opt.state_dict()["param_groups"]],
    )


def _same(a, b):
    ma, sa, ga = a
    mb, sb, gb = b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert sa.keys() == sb.keys() and ga == gb
    for i in sa:
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y


def test_round_trip_tied_sgd_momentum_and_extra(tmp_path):
    model = _Net(tied=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    rng = torch.get_rng_state()
    handle = checkpoint.save(tmp_path, model, opt, step=7, extra={"rng": rng, "pos": [1, 2]})
    assert handle.done() and handle.wait() == tmp_path / "step_00000007"
    saved = _snapshot(model, opt)
    fresh = _Net(tied=True, seed=1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)  # lr is restored
    step, extra = checkpoint.load(tmp_path, fresh, fresh_opt)
    assert step == 7 and torch.equal(extra["rng"], rng) and extra["pos"] == [1, 2]
    _same(_snapshot(fresh, fresh_opt), saved)
    assert fresh.head.weight is fresh.emb.weight  # still tied: loaded in place
    _step(model, opt)
    _step(fresh, fresh_opt)
    _same(_snapshot(fresh, fresh_opt), _snapshot(model, opt))
    record = ckpt_files.read_marker(tmp_path / "step_00000007")
    assert record["step"] == 7 and set(record["files"]) >= {".metadata", "train_state.pt"}


def test_keep_last_and_the_model_only(tmp_path):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters())
    for step in range(1, 6):
        _step(model, opt, 1)
        checkpoint.save(tmp_path, model, opt, step=step, keep_last=2)
    assert [s for s, _ in ckpt_files.checkpoints(tmp_path)] == [4, 5]
    checkpoint.save(tmp_path, model, step=6, keep_last=None)  # no optimizer
    checkpoint.save(tmp_path, model, opt, step=7, keep_last=None)
    assert [s for s, _ in ckpt_files.checkpoints(tmp_path)] == [4, 5, 6, 7]
    fresh = _Net(seed=3)
    assert checkpoint.load(tmp_path / "step_00000006", fresh) == (6, None)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    with pytest.raises(ValueError, match="holds no optimizer state; pass optimizer=None"):
        checkpoint.load(tmp_path / "step_00000006", fresh, torch.optim.AdamW(fresh.parameters()))


def test_save_errors(tmp_path):
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="save: step must be an int >= 0, got -1"):
        checkpoint.save(tmp_path, model, step=-1)
    with pytest.raises(ValueError, match="save: keep_last must be an int >= 1 or None"):
        checkpoint.save(tmp_path, model, step=1, keep_last=0)
    with pytest.raises(ValueError, match="extra .* torch.load.weights_only=True. cannot read back"):
        checkpoint.save(tmp_path, model, step=1, extra={"f": object()})
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizer holds 2 parameters that are not the model's"):
        checkpoint.save(tmp_path, model, torch.optim.SGD(other.parameters(), lr=1), step=1)
    checkpoint.save(tmp_path, model, opt, step=1)
    with pytest.raises(ValueError, match="a checkpoint of step 1 already exists"):
        checkpoint.save(tmp_path, model, opt, step=1)
    assert [s for s, _ in ckpt_files.checkpoints(tmp_path)] == [1]
    assert ckpt_files.stale_dirs(tmp_path) == []


def _mismatch_cases():
    class Wider(_Net):
        def __init__(self):
            super().__init__(width=8)

    class Renamed(_Net):
        def __init__(self):
            super().__init__()
            self.lin2 = self.lin
            del self.lin

        def forward(self, x):
            return self.head(self.lin2(self.emb(x)))

    class Half(_Net):
        def __init__(self):
            super().__init__()
            self.lin.to(torch.float64)

        def forward(self, x):
            return self.head(self.lin(self.emb(x).double()).float())

    return {
        "shape": (
            Wider,
            r"shape mismatches: \['emb.weight' checkpoint \(10, 6\) vs live \(10, 8\)",
        ),
        "keys": (
            Renamed,
            r"model keys missing from the checkpoint: \['lin2.weight', 'lin2.bias'\]; "
            r"checkpoint keys the model does not have: \['lin.weight', 'lin.bias'\]",
        ),
        "dtype": (Half, r"dtype mismatches: \['lin.weight' checkpoint torch.float32 vs live"),
    }


@pytest.mark.parametrize("case", ["shape", "keys", "dtype"])
def test_load_mismatch_names_fqns_and_leaves_everything_untouched(tmp_path, case):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    checkpoint.save(tmp_path, model, opt, step=2)
    cls, message = _mismatch_cases()[case]
    target = cls()
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    _step(target, target_opt, 1)
    before = _snapshot(target, target_opt)
    with pytest.raises(ValueError, match=message):
        checkpoint.load(tmp_path, target, target_opt)
    _same(_snapshot(target, target_opt), before)


def test_load_optimizer_mismatches(tmp_path):
    model = _Net()
    decay = [model.lin.weight, model.head.weight, model.emb.weight]
    opt = torch.optim.AdamW([{"params": decay}, {"params": [model.lin.bias], "weight_decay": 0}])
    _step(model, opt)
    checkpoint.save(tmp_path, model, opt, step=2)
    cases = {
        "one group": (
            torch.optim.AdamW(model.parameters()),
            "the optimizer has 1 param groups, the checkpoint 2",
        ),
        "fewer params": (
            torch.optim.AdamW([{"params": decay[:2]}, {"params": [model.lin.bias]}]),
            r"param group 0: parameters not in the optimizer \['emb.weight'\]",
        ),
        "other state": (
            torch.optim.AdamW([{"params": decay}, {"params": [model.lin.bias]}], amsgrad=True),
            r"optimizer state 'lin.weight' has keys \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', "
            r"'step'\], the checkpoint \['exp_avg', 'exp_avg_sq', 'step'\]",
        ),
        "other class": (
            torch.optim.SGD([{"params": decay}, {"params": [model.lin.bias]}], lr=1, momentum=0.9),
            r"the checkpoint's optimizer is a torch.optim.adamw.AdamW, this one a "
            r"torch.optim.sgd.SGD; build the optimizer as AdamW",
        ),
    }
    for name, (target_opt, message) in cases.items():
        if name in ("other state", "other class"):
            _step(model, target_opt, 1)
        before = _snapshot(model, target_opt)
        with pytest.raises(ValueError, match=message):
            checkpoint.load(tmp_path, model, target_opt)
        _same(_snapshot(model, target_opt), before)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "metadata", "structure"])
def test_load_detects_damaged_files(tmp_path, damage):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    checkpoint.save(tmp_path, model, opt, step=2)
    d = tmp_path / "step_00000002"
    data = next(d.glob("*.distcp"))
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
        message = f"'{data.name}' does not match its recorded sha256 .corrupted."
    elif damage == "truncate":
        raw = data.read_bytes()
        data.write_bytes(raw[: len(raw) // 3])
        message = f"'{data.name}' has {len(raw) // 3} bytes, the marker recorded {len(raw)}"
    elif damage == "delete":
        data.unlink()
        message = f"file '{data.name}' is missing"
    elif damage == "metadata":
        (d / ".metadata").write_bytes(b"\0" * (d / ".metadata").stat().st_size)
        message = "'.metadata' does not match"
    else:
        (d / "train_state.pt").write_bytes(b"junk")
        message = "'train_state.pt' has 4 bytes"
    target = _Net(seed=2)
    target_opt = torch.optim.AdamW(target.parameters())
    before = _snapshot(target, target_opt)
    with pytest.raises(
        CorruptCheckpointError, match=f"is damaged: (file )?{message}.*nothing was loaded"
    ):
        checkpoint.load(tmp_path, target, target_opt)
    _same(_snapshot(target, target_opt), before)
    if damage == "flip":  # verify=False skips the checksums (and reads the flipped value)
        checkpoint.load(tmp_path, target, target_opt, verify=False)


def test_load_without_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="load: no complete checkpoint at .*does not exist"):
        checkpoint.load(tmp_path / "none", _Net())


# ---- async save, a fresh optimizer that must be primed, export ----------------------------
def test_async_save_writes_the_state_of_its_call(tmp_path):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    (tmp_path / ".step_00000002.tmp").mkdir()  # left by a killed save of the same step
    (tmp_path / ".step_00000002.tmp" / "junk").write_text("x")
    saved = _snapshot(model, opt)
    handle = checkpoint.save(tmp_path, model, opt, step=2, async_save=True)
    _step(model, opt)  # runs while the save writes: must not leak into it
    assert handle.wait() == tmp_path / "step_00000002" and handle.done()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
    fresh = _Net(seed=4)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    checkpoint.load(tmp_path, fresh, fresh_opt)
    _same(_snapshot(fresh, fresh_opt), saved)


def test_a_failed_async_save_raises_from_wait(tmp_path):
    model = _Net()
    (tmp_path / "file").write_text("x")  # the root cannot be created under a file
    handle = checkpoint.save(tmp_path / "file" / "ckpt", model, step=1, async_save=True)
    with pytest.raises(RuntimeError, match="the checkpoint of step 1 was not written"):
        handle.wait()
    checkpoint.save(tmp_path / "ok", model, step=1)  # the next save is not blocked by it


def test_a_fresh_8bit_optimizer_is_primed_or_left_as_it_was(tmp_path):
    from raggedfsdp.optim import AdamW8bit

    model = _Net(width=512)  # emb (10, 512), lin (512, 512): 8-bit moments
    opt = AdamW8bit(model.parameters(), lr=1e-2)
    _step(model, opt)
    checkpoint.save(tmp_path, model, opt, step=2)
    saved = _snapshot(model, opt)
    fresh = _Net(width=512, seed=5)
    fresh_opt = AdamW8bit(fresh.parameters(), lr=1e-2)  # no state yet: scales need priming
    checkpoint.load(tmp_path, fresh, fresh_opt)
    _same(_snapshot(fresh, fresh_opt), saved)
    # another quantization block: its scales do not fit; nothing changes
    other = _Net(width=512, seed=6)
    other_opt = AdamW8bit(other.parameters(), lr=1e-2, block_size=128)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"does not fit the optimizer: shape mismatches: \['emb"):
        checkpoint.load(tmp_path, other, other_opt)
    assert len(other_opt.state) == 0
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_export_safetensors_one_process(tmp_path):
    from safetensors.torch import load_file

    model = _Net(tied=True)
    out = checkpoint.export_safetensors(model, tmp_path / "hf", dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["aliases"] == {"head.weight": "emb.weight"}
    tensors = load_file(out / "model-00001-of-00001.safetensors")
    assert sorted(tensors) == ["count", "emb.weight", "lin.bias", "lin.weight"]
    assert (
        tensors["emb.weight"].dtype == torch.bfloat16 and tensors["count"].dtype == torch.bfloat16
    )
    assert torch.equal(tensors["lin.weight"], model.lin.weight.detach().bfloat16())
    renamed = checkpoint.export_safetensors(
        model, tmp_path / "renamed", name_map=lambda fqn: "model." + fqn
    )
    assert "model.lin.weight" in load_file(renamed / "model-00001-of-00001.safetensors")
    with pytest.raises(ValueError, match="export_safetensors: '.*hf' exists; pass a new directory"):
        checkpoint.export_safetensors(model, tmp_path / "hf")
    with pytest.raises(ValueError, match="name_map gives 'x' to two tensors"):
        checkpoint.export_safetensors(model, tmp_path / "dup", name_map=lambda fqn: "x")
    assert not (tmp_path / "dup").exists()


def test_directory_locks_tell_a_live_holder_from_an_unlockable_filesystem(
    tmp_path, monkeypatch, capsys
):
    import errno
    import fcntl

    from raggedfsdp.train.rundir import OutLock

    # flock locks belong to an open file: a second open of the directory conflicts
    with ckpt_files.RootLock(tmp_path):
        with pytest.raises(ValueError, match="save: another live process is saving into"):
            ckpt_files.RootLock(tmp_path).acquire()
        with pytest.raises(ValueError, match="train: another live job is writing --out"):
            OutLock(tmp_path).acquire()
    with ckpt_files.RootLock(tmp_path):  # released on exit: free again
        pass

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(ckpt_files.RootLock, "_warned", False)
    with pytest.warns(UserWarning, match=r"cannot be locked \(No locks available\)"):
        with ckpt_files.RootLock(tmp_path):
            pass
    lock = OutLock(tmp_path)
    lock.acquire()  # goes on unlocked, saying so
    lock.release()
    assert "cannot be locked (No locks available)" in capsys.readouterr().err
