"""The demo dataset: loading, the deterministic split, world-size-invariant batches."""

import os

import pytest
import torch

from raggedfsdp.train.data import DataConfig, batches, get_batch, load_corpus, stdlib_dir


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(DataConfig(max_bytes=1 << 20))


def test_stdlib_corpus_is_deterministic(corpus):
    assert corpus.source == str(stdlib_dir())
    assert corpus.train.dtype == torch.uint8 and corpus.train.dim() == 1
    assert corpus.train.numel() + corpus.val.numel() == 1 << 20
    assert 0.02 < corpus.val.numel() / (1 << 20) < 0.3
    again = load_corpus(DataConfig(max_bytes=1 << 20))
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    # Python source, not binary
    assert b"def " in bytes(corpus.train[:100_000].tolist())


def test_split_is_by_file_and_stable_under_the_cap(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_bytes(f"<{i:02d}>".encode() * 10)  # 40 bytes
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 10)  # binary: skipped
    (tmp_path / ".hidden").write_bytes(b"x" * 10)  # hidden: skipped
    full = load_corpus(DataConfig(path=str(tmp_path), val_fraction=0.25))
    assert full.n_files == 40
    assert full.train.numel() + full.val.numel() == 40 * 40
    assert full.train.numel() % 40 == 0 and full.val.numel() > 0
    val_files = {bytes(full.val[i : i + 4].tolist()) for i in range(0, full.val.numel(), 40)}
    train_files = {bytes(full.train[i : i + 4].tolist()) for i in range(0, full.train.numel(), 40)}
    assert not val_files & train_files
    # a cap keeps the split of the files it still reads
    half = load_corpus(DataConfig(path=str(tmp_path), val_fraction=0.25, max_bytes=20 * 40))
    assert half.n_files == 20
    half_val = {bytes(half.val[i : i + 4].tolist()) for i in range(0, half.val.numel(), 40)}
    assert half_val == {f for f in val_files if int(f[1:3]) < 20}


def test_single_file_splits_its_bytes(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(256)) * 4)
    c = load_corpus(DataConfig(path=str(path), val_fraction=0.25))
    assert c.n_files == 1
    assert (c.train.numel(), c.val.numel()) == (768, 256)
    assert torch.equal(torch.cat([c.train, c.val]), torch.arange(256).repeat(4).to(torch.uint8))
    capped = load_corpus(DataConfig(path=str(path), max_bytes=100, val_fraction=0.1))
    assert (capped.train.numel(), capped.val.numel()) == (90, 10)


def test_batch_is_deterministic_and_shifted(corpus):
    kw = dict(seed=7, batch_size=8, seq_len=64)
    x0, y0 = get_batch(corpus.train, step=3, **kw)
    x1, y1 = get_batch(corpus.train, step=3, **kw)
    assert x0.shape == (8, 64) and x0.dtype == torch.long
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert int(x0.max()) < 256
    assert not torch.equal(x0, get_batch(corpus.train, step=4, **kw)[0])
    assert not torch.equal(x0, get_batch(corpus.train, step=3, **{**kw, "seed": 8})[0])


def test_batch_ignores_the_ambient_device(corpus):
    """The batch is drawn on the CPU whatever ``with torch.device(...)`` is around.

    The meta device stands in for an accelerator (where the CPU generator failed).
    """
    kw = dict(seed=7, step=2, batch_size=4, seq_len=32)
    x, y = get_batch(corpus.train, **kw)
    with torch.device("meta"):
        x1, y1 = get_batch(corpus.train, **kw)
    assert torch.equal(x, x1) and torch.equal(y, y1)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_global_batch_does_not_depend_on_world_size(corpus, world):
    kw = dict(seed=1, batch_size=12, seq_len=32)
    for step in (0, 1, 17):
        ref_x, ref_y = get_batch(corpus.train, step=step, **kw)
        parts = [
            get_batch(corpus.train, step=step, rank=r, world_size=world, **kw) for r in range(world)
        ]
        assert all(x.shape == (12 // world, 32) for x, _ in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), ref_x)
        assert torch.equal(torch.cat([y for _, y in parts]), ref_y)


def test_batches_resume_at_a_step(corpus):
    kw = dict(seed=0, batch_size=4, seq_len=16, rank=1, world_size=2)
    run = list(batches(corpus.val, num_steps=5, **kw))
    resumed = list(batches(corpus.val, start_step=3, num_steps=2, **kw))
    assert len(run) == 5
    for (a, b), (c, d) in zip(run[3:], resumed):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_batch_errors(corpus):
    data = corpus.train
    with pytest.raises(ValueError, match=r"batch_size 6 is not divisible by world_size 4"):
        get_batch(data, seed=0, step=0, batch_size=6, seq_len=8, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        get_batch(data, seed=0, step=0, batch_size=4, seq_len=8, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"seq_len must be >= 1, got 0"):
        get_batch(data, seed=0, step=0, batch_size=4, seq_len=0)
    with pytest.raises(ValueError, match=r"step must be >= 0, got -1"):
        get_batch(data, seed=0, step=-1, batch_size=4, seq_len=8)
    with pytest.raises(ValueError, match=r"data has 10 bytes, fewer than seq_len \+ 1 = 17"):
        get_batch(data[:10], seed=0, step=0, batch_size=4, seq_len=16)


def test_data_errors(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist; pass a text file or a folder"):
        load_corpus(DataConfig(path=str(tmp_path / "missing.txt")))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds 0 bytes of text"):
        load_corpus(DataConfig(path=str(tmp_path / "empty.txt")))
    empty_dir = tmp_path / "d"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match=r"holds 0 bytes of text"):
        load_corpus(DataConfig(path=str(empty_dir)))
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_bytes(b"hello")
        locked.chmod(0)
        with pytest.raises(ValueError, match=r"cannot read .*locked.txt"):
            load_corpus(DataConfig(path=str(locked)))
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got 1.0"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match=r"max_bytes must be >= 2"):
        DataConfig(max_bytes=1)
