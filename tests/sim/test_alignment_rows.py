"""A layer whose rows are not a multiple of the 128-byte alignment (a 260-wide fp32 row is
1,040 bytes) at 1,024 fake ranks: the default alignment becomes the finest its rows allow
(16 bytes, gcd(128, 1040)) where 128 bytes would cut it only every 8 rows, so the buffer
gathers one row per rank as FSDP2 does, not 8; an explicit alignment is kept."""

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from raggedfsdp import fully_shard
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.tools.simulate import fake_world

WORLD, ROWS, WIDTH = 1024, 64, 260  # 64 rows of 260 fp32 elements


def _layout(**kw):
    with fake_world(WORLD) as mesh, FakeTensorMode():
        layer = nn.Linear(WIDTH, ROWS, bias=False)
        fully_shard(layer, mesh=mesh, **kw)
        (buf,) = buffers_of(layer)
        return buf.layout


def test_default_alignment_follows_the_rows():
    layout = _layout()
    assert layout.shard_size == WIDTH  # one row per rank holding any
    assert layout.global_size == WORLD * WIDTH  # FSDP2's: 64 rows padded to 1,024 rows
    assert layout.shard_size * 4 % 16 == 0 and layout.alignment * 4 == 16


def test_an_explicit_alignment_is_kept():
    layout = _layout(alignment_bytes=128)
    assert layout.alignment == 32  # elements: 128 bytes
    assert layout.shard_size % 32 == 0 and layout.shard_size % WIDTH == 0  # 8 rows
    assert layout.global_size == WORLD * 8 * WIDTH
