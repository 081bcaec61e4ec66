"""The padding and block cuts of the peers' layouts, from their documented rules.

All three take the same groups and world size as the planner and count

* padding: elements the layout adds (all-gather output minus the parameters), and
* split blocks: shard boundaries that fall inside a block (``block_rows`` rows of the
  flattened tensor, as the planner defines it), i.e. where a block-wise method
  (8-bit optimizer states, FP8 tiles, Muon) would need extra communication.

Rules (torch 2.13, DeepSpeed 0.16):

* FSDP2 ``fully_shard``: every parameter is ``Shard(0)``: ``torch.chunk`` on dim 0
  into ``m`` chunks of ``ceil(d0 / m)`` dim-0 slices, each padded to that size
  (``_fsdp_param.py``: ``padded_sharded_param_size``).
* FSDP1 ``FlatParameter`` (``use_orig_params=True``): parameters concatenated, each
  start aligned to 16 bytes, the total padded to a multiple of ``m`` and split into
  ``m`` equal chunks (``_flat_param.py``: ``_get_aligned_numel``,
  ``_init_flat_param_and_metadata``).
* DeepSpeed ZeRO-3: every parameter flattened, padded to a multiple of ``m`` and
  split into ``m`` equal partitions (``partition_parameters.py``: ``_padding_size``,
  ``_partition_param``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from raggedfsdp.planner._spec import TensorSpec, dtype_name_and_itemsize

_FSDP1_ALIGN_BYTES = 16


@dataclass(frozen=True)
class PeerPadding:
    """Padding and split blocks of a peer's layout over some groups."""

    padding: int
    split_blocks: int
    total: int

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.total if self.total else 0.0

    def __add__(self, other: PeerPadding) -> PeerPadding:
        return PeerPadding(
            self.padding + other.padding,
            self.split_blocks + other.split_blocks,
            self.total + other.total,
        )


def _count_bad(k0: int, k1: int, step: int, origin: int, g: int) -> int:
    """How many ``k`` in ``[k0, k1]`` have ``(k * step - origin) % g != 0``. O(1)."""
    n = k1 - k0 + 1
    if n <= 0:
        return 0
    d = math.gcd(step, g)
    if origin % d:
        return n
    mod = g // d
    if mod == 1:
        return 0
    k_star = (origin // d) * pow(step // d, -1, mod) % mod  # k ≡ k_star (mod mod) is fine
    first = k0 + (k_star - k0) % mod
    good = 0 if first > k1 else (k1 - first) // mod + 1
    return n - good


def fsdp2_padding(specs: Iterable[TensorSpec], world_size: int) -> PeerPadding:
    """FSDP2's per-parameter ``Shard(0)`` layout (see the module docstring)."""
    pad = cuts = total = 0
    for s in specs:
        n = s.numel
        total += n
        d0 = s.shape[0] if s.shape else 1
        slice_elems = n // d0
        chunk = -(-d0 // world_size)  # dim-0 slices per rank
        pad += (chunk * world_size - d0) * slice_elems
        # boundaries c * chunk slices for c = 1 .. while inside the tensor
        inside = (d0 - 1) // chunk
        cuts += _count_bad(1, inside, chunk * slice_elems, 0, s.block_elems)
    return PeerPadding(pad, cuts, total)


def zero3_padding(specs: Iterable[TensorSpec], world_size: int) -> PeerPadding:
    """DeepSpeed ZeRO-3's per-parameter flat partitions (see the module docstring)."""
    pad = cuts = total = 0
    for s in specs:
        n = s.numel
        total += n
        part = -(-n // world_size)
        pad += part * world_size - n
        inside = (n - 1) // part
        cuts += _count_bad(1, inside, part, 0, s.block_elems)
    return PeerPadding(pad, cuts, total)


def fsdp1_padding(
    specs: Iterable[TensorSpec], world_size: int, dtype: object = "bfloat16"
) -> PeerPadding:
    """FSDP1's flat parameter for one group (see the module docstring)."""
    _, itemsize = dtype_name_and_itemsize(dtype)
    align = max(1, _FSDP1_ALIGN_BYTES // itemsize)
    specs = list(specs)
    offsets, pos = [], 0
    for s in specs:
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += s.numel
    padded = -(-pos // world_size) * world_size
    chunk = padded // world_size
    total = sum(s.numel for s in specs)
    cuts = 0
    for s, o in zip(specs, offsets, strict=True):
        k0, k1 = o // chunk + 1, (o + s.numel - 1) // chunk
        cuts += _count_bad(k0, k1, chunk, o, s.block_elems)
    return PeerPadding(padded - total, cuts, total)
