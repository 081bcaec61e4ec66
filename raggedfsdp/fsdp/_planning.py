"""How one ``fully_shard`` call's parameters become buffers: one kind of buffer per mesh,
FP8-gathered and subclass-hooked parameters and each dtype apart, the alignment, the
planner's split (see [Note: multi-buffer groups] in ``raggedfsdp/planner/multi.py``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.tensor import Shard

from raggedfsdp.fsdp._fp8 import Float8BlockAllGather, check_master_dtype
from raggedfsdp.fsdp._group_set import GroupSet
from raggedfsdp.fsdp._mesh import dp_key
from raggedfsdp.fsdp._param_group import ParamGroup, group_specs
from raggedfsdp.fsdp._policy import BlockPolicy, BlockRows, MixedPrecisionPolicy
from raggedfsdp.fsdp._records import CommSettings
from raggedfsdp.fsdp._subclass import subclass_params
from raggedfsdp.fsdp._trace import logger
from raggedfsdp.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    MAX_UNSHARDED_RATIO,
    BufferLayout,
    gap_eligible,
    plan_buffers,
)


@dataclasses.dataclass(frozen=True)
class GroupOptions:
    """What every buffer of one ``fully_shard`` call is planned and built with (``settings``
    by reference: the one ``CommSettings`` of the call)."""

    mp_policy: MixedPrecisionPolicy
    block_policy: BlockPolicy | Callable[[str, nn.Parameter], BlockRows] | None
    alignment_bytes: int | None
    max_buffers: int
    alpha: int | None  # buffer_alpha_bytes
    gaps: bool | str  # member_gaps
    name: str
    offload: bool
    pin_memory: bool
    grads_in_params: bool
    settings: CommSettings


def _plan_groups(refs, originals, meshes, spmds, options: GroupOptions) -> GroupSet | None:
    """The call's buffers, one ``GroupSet`` (None where it manages no parameter)."""
    name = options.name
    group = None
    # [Note: a mesh per parameter] Parameters that shard_placement_fn gives their own mesh
    # (torch's ShardPlacementResult) are planned apart, one buffer kind per data-parallel
    # mesh (compared by process groups, as FSDP2 groups them); the call's groups are one
    # GroupSet whose buffers live on different meshes.
    by_mesh: dict[tuple, list[int]] = {}
    for i, param_mesh in enumerate(meshes):
        whole = spmds[i]
        by_mesh.setdefault((*dp_key(param_mesh), whole and whole.full), []).append(i)
    parts = []
    for k, mine in enumerate(by_mesh.values()):
        part_name = name if len(by_mesh) == 1 else f"{name}[mesh {k}]"
        plan_part = functools.partial(  # kept by the groups: see [Note: re-tied parameters]
            _new_group,
            mesh=meshes[mine[0]],
            spmd=spmds[mine[0]],
            options=dataclasses.replace(options, name=part_name),
        )
        parts.append(plan_part([refs[i] for i in mine], [originals[i] for i in mine]))
        for g in parts[-1]:
            g.replan = plan_part
    if parts:
        buffers = [g for part in parts for g in part]
        group = GroupSet(buffers, buffers[0].name if len(buffers) == 1 else name)
    return group


def _aligned_where_rows_allow(specs, itemsize: int, at) -> Sequence[BufferLayout]:
    """The default alignment (``alignment_bytes=None``): ``DEFAULT_ALIGNMENT_BYTES``, unless
    the group's blocks are not whole multiples of it and that alignment bloats a buffer.

    [Note: alignment where rows allow] A shard start (a multiple of ``S``) and a tensor's
    offset are both multiples of the alignment, so a cut inside a tensor whose blocks are
    not a multiple of it falls only every lcm(alignment, block) elements: a 260-element
    fp32 row under 128-byte alignment is cut every 8 rows, and at thousands of ranks such
    a buffer gathers many times its elements where FSDP2 gathers one row per rank. Where
    the aligned plan holds a buffer over ``MAX_UNSHARDED_RATIO`` times its elements, the
    group is planned again at the finest alignment its blocks allow (the gcd of the
    alignment and every block's bytes, at least one element), and the plan that holds
    fewer elements wins. Groups whose blocks are multiples of the alignment (the weights
    of real models) are never affected; an explicit ``alignment_bytes`` is used as given.
    """
    aligned = at(DEFAULT_ALIGNMENT_BYTES)
    if not any(lay.global_size > MAX_UNSHARDED_RATIO * lay.total_numel for lay in aligned):
        return aligned
    finer = DEFAULT_ALIGNMENT_BYTES
    for s in specs:
        finer = math.gcd(finer, s.block_elems * itemsize)
    finer = max(finer, itemsize)
    if finer == DEFAULT_ALIGNMENT_BYTES:
        return aligned
    relaxed = at(finer)
    if sum(lay.global_size for lay in relaxed) < sum(lay.global_size for lay in aligned):
        logger.debug(
            "fully_shard: %d-byte alignment instead of %d: the group's blocks are not "
            "multiples of it (see [Note: alignment where rows allow])",
            finer,
            DEFAULT_ALIGNMENT_BYTES,
        )
        return relaxed
    return aligned


def _leaves_a_rank_empty(layout: BufferLayout, world: int) -> bool:
    """Whether some rank holds none of a tensor that has a row for every rank."""
    return any(t.shape[0] >= world and 0 in layout.local_units(t.name) for t in layout.tensors)


def _check_gaps_beside_tp(refs, specs, gaps) -> None:
    """Member gaps lay a stack out member by member, each member whole on its rank. A stack
    that tensor parallelism shards over its members (expert parallelism: ``Shard(0)``)
    keeps whole members locally, so it takes gaps; one sharded inside its members
    (``Shard(1)``, ``Shard(2)``) is not supported yet."""
    for ref, spec in zip(refs, specs):
        if ref.tp is None or not gap_eligible(spec):
            continue
        inside = [p for p in ref.tp.placements if not (p.is_replicate() or p == Shard(0))]
        if inside:
            raise NotImplementedError(
                f"fully_shard: member_gaps={gaps!r} with {ref.fqn!r}, a stack of "
                f"{spec.members} members that tensor parallelism shards inside its members "
                f"({inside[0]!r}), is not supported yet; pass member_gaps=False (a stack sharded "
                "over its members, Shard(0) as expert parallelism does, takes gaps)"
            )


def _new_group(refs, originals, mesh, spmd, options):
    """The buffers of one mesh of a ``fully_shard`` call: one ``ParamGroup`` per buffer
    (several where the planner splits the group: see [Note: multi-buffer groups]).
    ``spmd``: the whole mesh of a ``dp_mesh_dims`` call, or None; ``options``: the call's
    ``GroupOptions``."""
    mp_policy, alignment_bytes, gaps = options.mp_policy, options.alignment_bytes, options.gaps
    specs, dtypes = group_specs(refs, originals, mesh, options.block_policy, spmd)
    if gaps:
        _check_gaps_beside_tp(refs, specs, gaps)
    fp8 = mp_policy.all_gather
    selected = (
        _fp8_selected(refs, specs, dtypes, fp8, options.offload) if fp8 is not None else set()
    )
    if selected:  # see [Note: FP8 all-gather]: selected tensors plan apart from the rest
        specs = [
            dataclasses.replace(s, block_rows=fp8.block_rows_for(s.block_rows))
            if i in selected
            else s
            for i, s in enumerate(specs)
        ]
    # Tensor subclasses with FSDP2's hooks plan apart too: [Note: tensor-subclass all-gather]
    hooked = subclass_params(refs, originals, specs, fp8_selected=selected, offload=options.offload)
    plain = set(range(len(specs))) - selected - hooked
    world = mesh.size(mesh.ndim - 1)

    def plan(part: list, how: Float8BlockAllGather | None) -> Sequence[BufferLayout]:
        dtype = dtypes[index[part[0].name]]

        def at(align: int) -> tuple[BufferLayout, ...]:
            return plan_buffers(
                part,
                world,
                max_buffers=options.max_buffers,
                alpha_bytes=options.alpha,
                dtype=dtype,
                member_gaps=gaps if how is None else False,
                alignment_bytes=align,
            ).layouts

        if how is not None:
            return at(
                how.alignment_bytes(
                    DEFAULT_ALIGNMENT_BYTES if alignment_bytes is None else alignment_bytes, dtype
                )
            )
        if alignment_bytes is not None:
            return at(alignment_bytes)
        return _aligned_where_rows_allow(part, dtype.itemsize, at)

    index = {ref.fqn: i for i, ref in enumerate(refs)}
    # [Note: mixed dtypes] A buffer holds one dtype: each kind of buffer below is planned
    # once per dtype of its parameters, so a group of several dtypes (a frozen bf16 base
    # beside fp32 adapters) has one buffer, collective and cast path per dtype.
    kinds = [(selected, fp8, False), (hooked, None, True), (plain, None, False)]
    by_dtype = [
        ({i for i in part if dtypes[i] == dt}, how, hooks)
        for part, how, hooks in kinds
        for dt in dict.fromkeys(dtypes[i] for i in sorted(part))
    ]
    layouts: list[tuple[BufferLayout, Float8BlockAllGather | None, bool]] = []
    for part, how, by_hooks in by_dtype:
        part_specs = [s for i, s in enumerate(specs) if i in part]
        if not part_specs:
            continue
        planned = plan(part_specs, how)
        if by_hooks and any(_leaves_a_rank_empty(layout, world) for layout in planned):
            # A subclass's fsdp_pre_all_gather runs on every rank's rows, and may not take
            # none (torchao's dynamic float8 scale takes an amax of them): each such
            # parameter gets a buffer of its own, its rows spread over every rank, as
            # FSDP2's even chunks are (one more all-gather per parameter).
            planned = [layout for spec in part_specs for layout in plan([spec], how)]
        layouts += [(layout, how, by_hooks) for layout in planned]
    _log_layouts(options.name, [layout for layout, _, _ in layouts], world)

    def build(part_refs, part_originals, layout, how, by_hooks, name) -> ParamGroup:
        return ParamGroup(
            part_refs,
            part_originals,
            mesh,
            mp_policy,
            layout,
            options.settings,
            name=name,
            offload=options.offload,
            pin_memory=options.pin_memory,
            grads_in_params=options.grads_in_params,
            fp8=how,
            subclass=by_hooks,
        )

    if len(layouts) == 1:
        layout, how, by_hooks = layouts[0]
        return [build(refs, originals, layout, how, by_hooks, options.name)]
    groups = []
    for k, (layout, how, by_hooks) in enumerate(layouts):
        mine = sorted(index[t.name] for t in layout.tensors)  # module order
        parts = ([refs[i] for i in mine], [originals[i] for i in mine])
        groups.append(build(*parts, layout, how, by_hooks, f"{options.name}[buffer {k}]"))
    return groups


def _log_layouts(name: str, layouts: list[BufferLayout], world: int) -> None:
    """Each planned buffer's padding, at debug level."""
    for layout in layouts:
        logger.debug(
            "fully_shard %s: a buffer of %d tensors over %d ranks: S = %d elements per rank, "
            "padding %d of %d (%.2f%%)",
            name,
            len(layout.tensors),
            world,
            layout.shard_size,
            layout.padding,
            layout.global_size,
            100.0 * layout.padding / max(layout.global_size, 1),
        )


def _fp8_selected(refs, specs, dtypes, fp8: Float8BlockAllGather, offload: bool) -> set[int]:
    """Indices of the parameters an FP8 all-gather gathers (see [Note: FP8 all-gather]).

    Raises:
        NotImplementedError: FP8 with tensor parallelism or CPU offload (not yet).
        ValueError: a master dtype without an FP8 path.
    """
    if offload:
        raise NotImplementedError(
            "fully_shard: FP8 all-gather (MixedPrecisionPolicy.all_gather) with CPU offload "
            "is not supported yet; drop one of them"
        )
    tp = [ref.fqn for ref in refs if ref.tp is not None and ref.tp.model_parallel]
    if tp:
        raise NotImplementedError(
            f"fully_shard: FP8 all-gather (MixedPrecisionPolicy.all_gather) on a tensor-"
            f"parallel mesh dimension is not supported yet (parameters {tp[:3]}...); use it on "
            "FSDP or HSDP meshes, or leave all_gather unset for this module"
        )
    chosen = {i for i, s in enumerate(specs) if fp8.selects(s.shape)}
    for i in sorted(chosen):
        check_master_dtype(specs[i].name, dtypes[i])
    return chosen
