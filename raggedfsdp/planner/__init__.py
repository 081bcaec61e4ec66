"""The buffer planner: pack one param group's tensors into a flat buffer shared by m ranks.

The planner is pure: it needs no process group, allocates no tensor and never
imports torch. Given the group's tensors (shape, block size), the world size ``m``
and an alignment, it returns a ``BufferLayout``: a shard size ``S`` and an offset
per tensor in a global buffer of ``m * S`` elements, rank ``k`` owning
``[k * S, (k + 1) * S)``, such that

1. no shard boundary ``k * S`` splits a block (a block = ``block_rows`` whole rows; a
   1-D tensor's rows are its elements, see [Note: 1-D tensors]);
2. every tensor is contiguous, padding sits only between tensors;
3. every rank holds exactly ``S`` elements (symmetric collectives);
4. ``S`` and every offset are multiples of the alignment;
5. ``S`` is as small as the search can find, and never below ``lower_bound``.

Five ranks, four tensors (``A``: 6x4, blocks of one row = 4 elements; ``B``: 5
elements, one block (``block_rows="whole"``; a 1-D tensor is otherwise cut between
elements); ``C``: 3x2, blocks of one row = 2 elements; ``D``: 3 elements, one block),
alignment 1. Each rank holds ``S = 8`` elements, ``.`` is padding::

    offset   0       8       16      24      32      40
    buffer   AAAAAAAAAAAAAAAAAAAAAAAABBBBB.CCCCCCDDD.
    ranks    |  r0   |  r1   |  r2   |  r3   |  r4   |

    A holds two whole shards, so S must be a multiple of its block (4): it is.
    B (one block) must not straddle a boundary: it sits inside rank 3.
    C starts at 30, not 29, so the boundary 32 falls on a block start of C
    (C's first row on rank 3, its other two rows on rank 4).
    S = 8, m * S = 40, tensors 38 elements, padding 2 (5.3%) = the lower bound
    ceil(38 / 5) = 8. RaggedShard units of C (one row each): (0, 0, 0, 1, 2).

[Note: the search]
For a fixed order and a candidate ``S``, placing each tensor at its earliest valid
offset is optimal (an earlier end never removes an option), and that offset has a
closed form: a tensor fits before the next boundary ``b``, or straddles ``b`` with
a block start on it; a tensor holding two boundaries needs ``S`` to be a multiple
of its block (it contains a whole shard). The paper runs this as a DP over blocks;
here it is O(1) per tensor, and later tensors may also fill the padding holes left
by earlier ones (``search.greedy``), which never makes the end later. ``S`` is
searched over sizes that are multiples of the alignment and of the block of every
tensor long enough (``>= 2S``) to contain a whole shard: from the lower bound up,
one alignment unit at a time for ``_LINEAR_STEPS`` sizes, then galloping and
bisection; at each size several tensor orders are tried (module order, by size, by
block, reversed, seeded shuffles) and the first that fits is kept. The exact
problem is NP-hard (PARTITION is the case ``m = 2`` with one-block tensors);
``plan_exact`` solves small instances with HiGHS for reference.

[Note: 1-D tensors]
A 1-D tensor (a bias, a norm weight) is divisible, as FSDP2's ``Shard(0)`` cuts it:
its rows are its elements and its default block is one element. Nothing finer is
lost by not using the alignment unit ``a`` as its block: ``S`` and every offset are
multiples of ``a``, so every cut already falls a multiple of ``a`` from the
tensor's start, and a one-element block also lets the last, shorter run of a
length that ``a`` does not divide sit anywhere (a tensor shorter than ``a`` is
never cut: no aligned boundary falls inside it). The lower bound keeps its form,
``max(ceil(total / m), largest block)`` rounded to the alignment and to the block of
every run long enough to hold a whole shard, with ``g_t = 1`` for such a tensor: it
no longer forces ``S >= n`` (a 32,000-element LM-head bias did, padding a 4 M-element
group to ``m * 32,000`` elements at 16,384 ranks), nor any lcm rounding. A block
policy that names the tensor (``"whole"``, or a count of elements) still gets it.

[Note: member gaps]
A stack (``TensorSpec(stack=True)``, fused experts ``[E, out, in]``) can be laid out
with ``member_gap`` padding elements after each member but the last; its unsharded
view is still a view, ``as_strided`` with dim-0 stride ``member numel + gap``
(``BufferLayout.unsharded_view_args``). A gapped stack is cut only between members
(its block is the whole member; a boundary falls on a member start or in a gap), so
every rank holds whole members: its ``RaggedShard`` cuts dim 0 (``dims=(0,)``, one
unit per member) and its local tensor ``(n, out, in)`` is a view of the shard with the
same member stride (``BufferLayout.local_view_args``). A member cut by a boundary would
need a copy (the tail of one member, a gap and the head of the next are not one strided
tensor), which the runtime never makes. The gap tried is the one that packs
``S // member`` members per shard (boundaries then repeat at the same member position,
which frees ``S`` from being a multiple of the stack's block next to other tensors'
blocks: the lcm rounding behind the paper's padding spikes), for every eligible stack
at once, against the gap-free layout, and the smaller ``S`` wins. A stack whose member
is larger than a shard, or is not a whole number of its blocks, is never gapped. Gaps
are opt-in (``member_gaps=True``); ``member_gaps="always"`` gaps every stack whose
member fits in a shard even where that pads more, to exercise the layout. Measured on
the catalogue (``benchmarks/results/planner.md``): they lower the padding of one
buffer per group, and nothing once ``max_buffers`` splits the group.
"""

from raggedfsdp.planner._layout import BufferLayout, TensorPlacement
from raggedfsdp.planner._peers import PeerPadding, fsdp1_padding, fsdp2_padding, zero3_padding
from raggedfsdp.planner._plan import (
    DEFAULT_ALIGNMENT_BYTES,
    GroupPlan,
    clear_plan_cache,
    gap_eligible,
    plan_buffer,
    plan_groups,
)
from raggedfsdp.planner._spec import WHOLE, TensorSpec, dtype_name_and_itemsize, with_block_rows
from raggedfsdp.planner.exact import plan_exact
from raggedfsdp.planner.multi import (
    DEFAULT_MAX_BUFFERS,
    MAX_UNSHARDED_RATIO,
    MultiPlan,
    default_alpha_bytes,
    plan_buffers,
    split_objective,
)

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "DEFAULT_MAX_BUFFERS",
    "MAX_UNSHARDED_RATIO",
    "MultiPlan",
    "WHOLE",
    "BufferLayout",
    "GroupPlan",
    "PeerPadding",
    "TensorPlacement",
    "TensorSpec",
    "clear_plan_cache",
    "default_alpha_bytes",
    "dtype_name_and_itemsize",
    "fsdp1_padding",
    "fsdp2_padding",
    "gap_eligible",
    "plan_buffer",
    "plan_buffers",
    "plan_exact",
    "plan_groups",
    "split_objective",
    "with_block_rows",
    "zero3_padding",
]
