"""What a ``python -m raggedfsdp train`` job needs of its machine, checked before a rank starts:
memory for a training step (``check_memory``), a run folder it can write and room for a
checkpoint (``check_storage``). Both refuse with a ``ValueError`` naming the arguments,
the figures and the fix; neither writes anything but a probe file it removes at once.

[Note: step memory estimate]
A step that cannot fit in memory used to fail inside the ranks, seconds or minutes in:
with a raw allocator traceback, or killed by the kernel's out-of-memory killer without
a word. The launcher estimates the step from the model's config and the arguments and
refuses what cannot fit. The estimate is a lower bound: every term is memory that a rank
holds at once at the peak of a step (the loss, where the forward's activations, the
logits and the batch all live), so a refused job could never run, and a job the tests
or the demo make (a few MiB) is never refused. A job close to the limit still passes
and may fail; the launcher then names the signal that killed its rank.

For each rank, with ``b = --batch-size / D`` rows (D data-parallel ranks: W / tp) of
``s = --seq-len`` tokens, ``n = b * s`` tokens and ``a`` bytes per activation (2 with
``--bf16``, else 4)::

    runtime      128 MiB                      the interpreter and torch (~140 MiB of
                                              private memory after importing them)
    data         the corpus bytes             every rank reads the whole corpus
    batch        8 * b * (s + 1)              the int64 ids of its rows
    states       P / H * (4 + 4 + o)          fp32 parameter and gradient shards, o bytes
                                              of optimizer state per parameter (adamw 8,
                                              muon 4, adamw8bit 2, sgd 0); H = W / R
                                              ranks share one copy (R replicas under HSDP)
    unsharded    (P_root + P_block / t) * 2a  the root's and the largest block's gathered
                                              parameters and their unreduced gradients
                                              (t: the block's tp or ep split)
    activations  n * a * sum over blocks of   what autograd keeps per block: its input, the
                 (4 * dim + 3 * f)            two norms' outputs, the attention's output
                                              (4 dim); the feed-forward's gate, up and
                                              product (3 f: ffn_dim / tp, or top_k + shared
                                              experts' widths in an MoE block)
    logits       8 * n * vocab                the fp32 logits and the loss's log-softmax

    this machine = --nproc * (the sum)

The limit is this machine's physical memory (``SC_PAGE_SIZE * SC_PHYS_PAGES``), or the
memory limit of this process's cgroup where that is lower (a container's: its OOM
killer strikes there). Not ``MemAvailable``: it moves with what other processes hold,
so a refusal based on it would depend on the neighbours of the moment and turn away a
job that fits a minute later; a step above ``MemAvailable`` (but within the limit) is
only warned about.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from raggedfsdp.models import get_config, num_params, param_groups

if TYPE_CHECKING:
    from raggedfsdp.models.mesh import MeshSpec

__all__ = [
    "StepMemory",
    "check_memory",
    "check_storage",
    "estimate_step_memory",
    "largest_batch",
    "memory_limit",
]

MiB = 1 << 20
RUNTIME_BYTES = 128 * MiB  # per rank; see [Note: step memory estimate]
# Bytes of optimizer state per parameter (a lower bound where a part of the model takes
# more: Muon's embeddings, head and vectors keep AdamW's two states).
OPTIM_STATE_BYTES = {
    "adamw": 8,
    "flat-adamw": 8,
    "muon": 4,
    # momentum and the graft's second moment (8), then per r x b block L, R and their
    # roots: 2 (r^2 + b^2) fp32 over r b elements, 8 (r / b + b / r) >= 16 bytes per
    # element (square blocks, the default; 65 for 128 x 1024): the estimate is a lower bound
    "shampoo": 24,
    "adamw8bit": 2,
    "sgd": 0,
}
_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def _size(n: float) -> str:
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB")):
        if n >= unit:
            return f"{n / unit:,.1f} {name}"
    return f"{n / MiB:,.1f} MiB"


# ---- memory ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepMemory:
    """Bytes one rank holds at the peak of a training step, by what holds them; see
    [Note: step memory estimate].

    Args:
        runtime, data, batch, states, unsharded, activations, logits: the terms of the
            Note, per rank.
        nproc: the ranks on this machine.
    """

    runtime: int
    data: int
    batch: int
    states: int
    unsharded: int
    activations: int
    logits: int
    nproc: int

    def __post_init__(self) -> None:
        terms = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        assert all(v >= 0 for v in terms.values()), terms

    @property
    def per_rank(self) -> int:
        return self.fixed + self.batch + self.activations + self.logits

    @property
    def fixed(self) -> int:
        """What a rank holds whatever its batch."""
        return self.runtime + self.data + self.states + self.unsharded

    @property
    def machine(self) -> int:
        """All ranks of this machine."""
        return self.nproc * self.per_rank

    def breakdown(self) -> str:
        names = ("runtime", "data", "batch", "states", "unsharded", "activations", "logits")
        return ", ".join(f"{n} {_size(getattr(self, n))}" for n in names if getattr(self, n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSize:
    """What the estimates read of a model: its elements, those of its root group (embedding
    and head) and of its largest block, the activation elements one token keeps per step
    (``4 dim + 3 ffn`` per block, the FFN being the experts a token is routed to in an MoE
    block) and its vocabulary."""

    numel: int
    root: int
    largest_block: int
    per_token: int
    vocab: int


def model_size(args, mesh: MeshSpec) -> ModelSize:
    """``ModelSize`` of ``--model``: a catalogue model from its config, a Hugging Face one
    (``hf:DIR``) from its modules on ``meta`` and its config."""
    if args.model.startswith("hf:"):
        return _hf_size(args.model)
    config = get_config(args.model)
    groups = param_groups(config)
    per_token = 0
    for i in range(config.n_layers):
        if config.is_moe_layer(i):
            ffn = (config.top_k + config.n_shared_experts) * config.moe_ffn_dim
        else:
            ffn = config.ffn_dim // mesh.tp
        per_token += 4 * config.dim + 3 * ffn
    return ModelSize(
        numel=num_params(config),
        root=sum(g.numel for g in groups if g.kind in ("embed", "head")),
        largest_block=max(g.numel for g in groups if g.kind not in ("embed", "head")),
        per_token=per_token,
        vocab=config.vocab_size,
    )


def _hf_size(model: str) -> ModelSize:
    from raggedfsdp.models.hf import build_hf_model, hf_blocks, hf_ffn_width

    module = build_hf_model(model)  # on meta: shapes only
    config = module.config
    numel = sum(p.numel() for p in module.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in hf_blocks(module)]
    # measured from the modules where the config's names differ by architecture
    hidden = module.get_input_embeddings().weight.shape[-1]
    routed = getattr(config, "num_experts_per_tok", 0) or 0
    moe_ffn = getattr(config, "moe_intermediate_size", 0) or 0
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    ffn = routed * moe_ffn + shared if routed and moe_ffn else hf_ffn_width(config, hidden)
    return ModelSize(
        numel=numel,
        root=numel - sum(blocks),
        largest_block=max(blocks),
        per_token=len(blocks) * (4 * hidden + 3 * ffn),
        vocab=module.get_input_embeddings().weight.shape[0],
    )


def estimate_step_memory(args, mesh: MeshSpec, data_bytes: int = 0) -> StepMemory:
    """A lower bound of the memory a training step takes on one rank, and on this machine.

    Args:
        args: the checked arguments (model, batch, sequence, optimizer, precision, ranks).
        mesh: their ``--mesh`` (``checks.parse_train_mesh``).
        data_bytes: the corpus's bytes (every rank holds them). Default 0.

    Returns:
        The terms of [Note: step memory estimate].
    """
    size = model_size(args, mesh)
    a = 2 if args.bf16 else 4
    rows = args.batch_size // mesh.data_ranks
    tokens = rows * args.seq_len
    holders = mesh.world // (mesh.replicate or 1)
    return StepMemory(
        runtime=RUNTIME_BYTES,
        data=data_bytes,
        batch=8 * rows * (args.seq_len + 1),
        states=size.numel * (8 + OPTIM_STATE_BYTES[args.optim]) // holders,
        unsharded=(size.root + size.largest_block // (mesh.tp * mesh.ep)) * 2 * a,
        activations=tokens * a * size.per_token,
        logits=8 * tokens * size.vocab,
        nproc=args.nproc,
    )


def memory_limit(cgroup_files=_CGROUP_LIMITS) -> tuple[int, str]:
    """This machine's memory for the job, and what sets it. See [Note: step memory estimate].

    Args:
        cgroup_files: files holding a cgroup's limit in bytes (or ``max``: none). Default:
            cgroup v2's ``memory.max`` and v1's ``memory.limit_in_bytes``.

    Returns:
        ``(bytes, where)``: the physical memory, or a lower cgroup limit.
    """
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    where = "this machine's physical memory"
    for path in cgroup_files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < limit:
            limit, where = int(text), f"the memory limit of this container's cgroup, {path}"
    return limit, where


def _available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def largest_batch(args, mesh: MeshSpec, limit: int, data_bytes: int = 0) -> int:
    """The largest ``--batch-size`` whose estimate fits in ``limit`` bytes (0: none does).

    The estimate is affine in the rows per rank, so the answer is exact for it; the batch
    is a multiple of the data-parallel ranks, as ``--batch-size`` must be.
    """
    step = mesh.data_ranks

    def machine(batch: int) -> int:
        batched = argparse.Namespace(**{**vars(args), "batch_size": batch})
        return estimate_step_memory(batched, mesh, data_bytes).machine

    per_row = machine(2 * step) - machine(step)
    fixed = machine(step) - per_row
    return max(0, (limit - fixed) // per_row) * step


def check_memory(args, mesh: MeshSpec, data_bytes: int = 0) -> StepMemory:
    """Refuse a job whose training step cannot fit in this machine's memory.

    See [Note: step memory estimate]. Prints a warning (and goes on) when the step fits
    in the machine but not in the memory available now.

    Args:
        args: the checked arguments.
        mesh: their ``--mesh``.
        data_bytes: the corpus's bytes. Default 0.

    Returns:
        The estimate.

    Raises:
        ValueError: the estimate for this machine's ranks exceeds ``memory_limit()``,
            naming ``--batch-size``, ``--seq-len`` and ``--nproc``, the estimate, the
            limit, and the largest batch that fits (or fewer ranks where none does).
    """
    estimate = estimate_step_memory(args, mesh, data_bytes)
    limit, where = memory_limit()
    if estimate.machine > limit:
        most = largest_batch(args, mesh, limit, data_bytes)
        if most:
            fix = (
                f"lower --batch-size (at most {most} fits by this estimate) or --seq-len, or "
                "spread the ranks over more machines (--nnodes)"
            )
        else:
            fix = (
                f"start fewer ranks (--nproc): each holds about {_size(estimate.fixed)} before "
                "its batch"
            )
        rows = args.batch_size // mesh.data_ranks
        raise ValueError(
            f"train: --batch-size {args.batch_size} ({rows} rows of --seq-len {args.seq_len} "
            f"on each of --nproc {args.nproc} ranks) needs about {_size(estimate.machine)} of "
            f"memory for a training step on this machine (estimate: {estimate.breakdown()} "
            f"per rank, for {args.model}), more than its {_size(limit)} ({where}); {fix}"
        )
    available = _available()
    if available is not None and estimate.machine > available:
        print(
            f"train: warning: a training step needs about {_size(estimate.machine)} on this "
            f"machine, more than the {_size(available)} available now (MemAvailable): the "
            "kernel may kill a rank if other processes keep their memory",
            file=sys.stderr,
        )
    return estimate


# ---- the run folder: writable, room for a checkpoint --------------------------------------------
def _existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(folder: Path) -> OSError | None:
    """Create and remove a file in ``folder``: the error that stops it, if any."""
    probe = folder / f".train-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        return err
    os.close(fd)
    os.unlink(probe)
    return None


def checkpoint_bytes(args, mesh: MeshSpec) -> tuple[int, int]:
    """``(bytes, parameters)``: one checkpoint of the model (all ranks' shards): its fp32
    parameters and the optimizer's states, once (replicas save one copy)."""
    n = model_size(args, mesh).numel
    return n * (4 + OPTIM_STATE_BYTES[args.optim]), n


def check_storage(args, mesh: MeshSpec) -> None:
    """Refuse a run folder this job cannot write, or without room for one checkpoint.

    Writes and removes a probe file in ``--out`` (or in its nearest existing parent, where
    ``--out`` is still to be created) and in its checkpoint folder, if that exists. With
    ``--ckpt-every K``, the filesystem of ``--out`` must hold this machine's share of one
    checkpoint (its ``--nproc`` of the job's ranks write their shards; ``checkpoint.save``
    checks again before each save).

    Raises:
        ValueError: naming ``--out`` (or its checkpoint folder), the error or the bytes
            needed and free, and the fix.
    """
    from raggedfsdp.train.rundir import CKPT

    out = Path(args.out)
    fix = (
        "make it writable to continue the run there"
        if args.resume
        else "pass an --out you can write to"
    )
    folder = _existing(out)
    err = _probe(folder)
    if err is not None:
        what = (
            f"--out '{out}' is not writable"
            if folder == Path(os.path.abspath(out))
            else f"--out '{out}' cannot be created: '{folder}' is not writable"
        )
        raise ValueError(f"train: {what} ({err.strerror}); {fix}")
    ckpt = out / CKPT
    if ckpt.is_dir() and (err := _probe(ckpt)) is not None:
        raise ValueError(
            f"train: the checkpoint folder '{ckpt}' is not writable ({err.strerror}); {fix}"
        )
    if not args.ckpt_every:
        return
    whole, n = checkpoint_bytes(args, mesh)
    needed = whole * args.nproc // mesh.world
    free = shutil.disk_usage(folder).free
    if free < needed:
        share = (
            f"; this machine's {args.nproc} of {mesh.world} ranks write {_size(needed)} of it"
            if args.nproc < mesh.world
            else ""
        )
        raise ValueError(
            f"train: --ckpt-every {args.ckpt_every}: a checkpoint of {args.model} with --optim "
            f"{args.optim} takes about {_size(whole)} ({n:,} parameters x "
            f"{whole // n} bytes: the parameters and the optimizer's states){share}, but the "
            f"filesystem of --out '{out}' has {_size(free)} free; free some space, pass "
            "another --out, or --ckpt-every 0 (no checkpoints)"
        )
