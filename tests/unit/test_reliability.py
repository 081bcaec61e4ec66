"""Nothing lost, nothing silent: the checkpoint API in one process.

Each test is one guarantee of ``docs/reliability.md``: a non-finite state is never
saved over a good one; a root never gets a checkpoint older than one already there
(so ``keep_last`` never deletes the new one); a live save is never deleted by another
job; ``load`` refuses an optimizer of another class before changing anything; a bad
``extra`` and a full disk are errors that say what to do.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections import namedtuple

import pytest
import torch
from torch import nn

from raggedfsdp import checkpoint
from raggedfsdp.checkpoint import latest_checkpoint


class _Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 10)

    def forward(self, x):
        return self.lin(torch.tanh(self.emb(x)))


def _step(model, opt, n=1):
    for i in range(n):
        x = (torch.arange(8).view(2, 4) + i).remainder(10)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _state(model, opt):
    """Clones of the model's and the optimizer's tensors (and the optimizer's other values)."""
    sd = opt.state_dict()
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in sd["state"].items()
        },
        [dict(g) for g in sd["param_groups"]],
    )


def _assert_same(a, b):
    (ma, sa, ga), (mb, sb, gb) = a, b
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert sa.keys() == sb.keys() and ga == gb
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y


def _listing(root):
    return sorted(p.name for p in root.iterdir())


# ---- item 2: a non-finite state is never saved -------------------------------------------
def test_save_refuses_a_nonfinite_state_and_keeps_the_last_good_checkpoint(tmp_path):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    checkpoint.save(tmp_path, model, opt, step=1, keep_last=1)
    with torch.no_grad():
        model.lin.weight[3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"save: 'model.lin.weight' holds nan or inf on rank 0"):
        checkpoint.save(tmp_path, model, opt, step=2, keep_last=1)
    with torch.no_grad():
        model.lin.weight[3, 2] = 0.0
        opt.state[model.emb.weight]["exp_avg_sq"][0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"'optim.emb.weight.exp_avg_sq' holds nan or inf"):
        checkpoint.save(tmp_path, model, opt, step=2, keep_last=1, async_save=True)
    assert _listing(tmp_path) == ["step_00000001"]  # nothing written, the good one kept
    checkpoint.save(tmp_path, model, opt, step=2, keep_last=1, allow_nonfinite=True)
    assert _listing(tmp_path) == ["step_00000002"]


# ---- item 1: keep_last counts the run's own saves; a live job's save is never deleted ----
def test_a_root_holding_later_checkpoints_refuses_an_earlier_step(tmp_path):
    """Another run's steps 100 and 200 used to count as newer: keep_last=2 deleted the new
    step 5 at once, and load went on picking step 200."""
    other = _Net(seed=1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    for step in (100, 200):
        checkpoint.save(tmp_path, other, other_opt, step=step)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=r"holds a checkpoint of step 200, later than step 5: another run's"
    ):
        checkpoint.save(tmp_path, model, opt, step=5, keep_last=2)
    assert _listing(tmp_path) == ["step_00000100", "step_00000200"]
    for step in (201, 202, 203):  # later steps are the run's own: keep_last counts them
        checkpoint.save(tmp_path, model, opt, step=step, keep_last=2)
    assert _listing(tmp_path) == ["step_00000202", "step_00000203"]


def test_a_live_save_of_another_job_is_neither_deleted_nor_joined(tmp_path):
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save(tmp_path, model, opt, step=1)
    # Another live job is writing step 2: its .tmp directory exists and it holds the lock.
    (tmp_path / ".step_00000002.tmp").mkdir()
    (tmp_path / ".step_00000002.tmp" / "__0_0.distcp").write_bytes(b"being written")
    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(ValueError, match=r"another live process is saving into"):
            checkpoint.save(tmp_path, model, opt, step=3)
        assert _listing(tmp_path) == [".step_00000002.tmp", "step_00000001"]
    finally:
        os.close(fd)  # that job dies: its lock goes with it
    checkpoint.save(tmp_path, model, opt, step=3, keep_last=1)  # clears the dead job's debris
    assert _listing(tmp_path) == ["step_00000003"]


# ---- item 4: an optimizer of another class is refused before anything changes -----------
@pytest.mark.parametrize(
    "saved, fresh, message",
    [
        # used to succeed silently: AdamW's moments went into an SGD
        ("adamw", "sgd", r"optimizer is a torch.optim.adamw.AdamW, this one a torch.optim.sgd.SGD"),
        # used to copy the model in, then fail (KeyError: 'step') with the optimizer half-set
        ("sgd", "adamw", r"optimizer is a torch.optim.sgd.SGD, this one a torch.optim.adamw.AdamW"),
    ],
)
def test_load_refuses_an_optimizer_of_another_class_untouched(tmp_path, saved, fresh, message):
    build = {
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
    }
    model = _Net()
    opt = build[saved](model)
    _step(model, opt, 2)
    checkpoint.save(tmp_path, model, opt, step=2)
    target = _Net(seed=3)
    target_opt = build[fresh](target)  # fresh: no state yet
    before = _state(target, target_opt)
    with pytest.raises(ValueError, match=message + r"; build the optimizer as .*Nothing was"):
        checkpoint.load(tmp_path, target, target_opt)
    _assert_same(_state(target, target_opt), before)
    assert checkpoint.load(tmp_path, target)[0] == 2  # the model alone still loads


# ---- item 7: errors a user can act on ----------------------------------------------------
def test_an_unpicklable_extra_is_a_value_error(tmp_path):
    model = _Net()
    with pytest.raises(ValueError, match=r"extra .* cannot read back .*keep extra to tensors"):
        checkpoint.save(tmp_path, model, step=1, extra={"fn": lambda: 0})
    assert not tmp_path.joinpath("step_00000001").exists()


_Usage = namedtuple("_Usage", "total used free")


def test_a_full_disk_names_the_filesystem_and_the_space_needed(tmp_path, monkeypatch):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    checkpoint.save(tmp_path, model, opt, step=1)
    real = shutil.disk_usage

    # Before writing: the filesystem reports too little room.
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(10 << 20, 10 << 20, 4096))
    with pytest.raises(OSError, match=r"mounted at '.*' on .* has 0.0 MiB free, this checkpoint "
                       r"needs about 1.0 MiB .*Nothing was written") as info:  # fmt: skip
        checkpoint.save(tmp_path, model, opt, step=2)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(shutil, "disk_usage", real)

    # While writing: the device fills up under DCP's writer.
    from torch.distributed.checkpoint import filesystem

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", full)
    with pytest.raises(OSError, match=r"the filesystem mounted at '.*' on .* is full .*the "
                       r"previous one is still the latest") as info:  # fmt: skip
        checkpoint.save(tmp_path, model, opt, step=2)
    assert info.value.errno == errno.ENOSPC
    assert _listing(tmp_path) == ["step_00000001"]  # what was written is removed
    assert latest_checkpoint(tmp_path).name == "step_00000001"
