"""Derived tolerances: how far a distributed run may lie from its reference.

[Note: derived tolerances]
A distributed run does the reference's arithmetic in another order: each rank sums the
gradient of its own rows, the reduce-scatter sums the ranks' gradients, the loss is a
mean of the ranks' means. In exact arithmetic nothing changes; in floating point the
last bits of every gradient differ, and training carries those differences forward,
amplified by whatever the optimizer does with them (a Newton-Schulz iteration in bf16
turns a last-bit difference into a bf16 rounding flip). How much depends on the CPU's
kernels, so a tolerance that passed on one machine says nothing about another. Instead
every comparison of trained numbers here derives its bound from the reference itself:

1. **Where the arithmetic is the same, bitwise.** Given one process's gradients, an
   element-wise optimizer on a shard computes exactly what it computes on the whole
   tensor (tests that check this use ``torch.equal``). A run resumed from a checkpoint at
   the same layout is the uninterrupted run, bit for bit.
2. **Where it is not, the reference's own sensitivity.** The one-process reference runs
   again with every gradient moved up or down at random (``nudged_gradients``: a global
   optimizer step pre-hook, so every reference loop is perturbed without being
   rewritten), once per seed in ``SEEDS``. By how much: an element of a gradient is a sum
   over the step's tokens; one process reduces them with a tree of depth
   ``ceil(log2 n)``, the ranks each reduce theirs and the reduce-scatter adds the ``w``
   partial sums in a chain, and either order is within its depth of roundings of the sum
   of the terms' magnitudes. ``NUDGE_ROUNDINGS`` = 17 is that depth for the largest step
   any test here takes (``n`` = 384 tokens, 9 levels, over ``w`` = 8 ranks), each
   rounding ``u`` relative, of ``max(|g|, the mean |g| of its row)``: where the partial
   sums cancel, their size, not the small result's, sets the error (an embedding's row is
   one token's). Gradients reduced in bf16 take bf16's ``u`` (``unit=2**-8``). The
   *spread* is the largest difference between the plain and the nudged runs, over the
   steps and the seeds: what the reference itself does when its gradients are summed in
   another order.
3. **The bound** on the distributed run's largest difference from the reference is

       ``MULTIPLE * spread + floor``

   ``MULTIPLE`` = 4: the distributed run is one more draw of the same rounding noise, so
   its difference is of the spread's size; the factor covers a draw up to 4 times the
   largest of ``len(SEEDS)`` draws (two draws each within the spread of the reference
   differ by up to twice it; the rest is the scatter between draws). The *floor* is what a
   difference of summation order does to the number compared before any update has
   happened: for a loss, the mean of ``n`` fp32 terms computed by another reduction
   tree, at most ``2 * (ceil(log2 n) + w) * u * |L|`` (``u = 2**-24``; torch reduces
   pairwise, depth ``ceil(log2 n)``, then the ``w`` ranks' means are summed in a chain);
   for a parameter, one rounding of each of its updates, ``steps * u * max|p|``.

4. **An implementation against a reference written apart** (a model against its
   naive loop): both compute the same function in fp32 with other sums. The reference
   runs again in float64 (the exact value, to fp32's eyes); the implementation must lie
   within ``MULTIPLE`` times the fp32 reference's own error of it, plus the rounding
   floor of its widest sum (``assert_close_to_reference``: no more wrong than the
   reference, up to the factor, or than one reduction's rounding).

A genuine error (a lost gradient, a wrong scale, a missing step) moves the numbers by
orders of magnitude more than this bound; the tests that must catch such errors keep
a bound of this size, never a looser one.

``make test-numerics`` runs every test that compares numbers with other kernels
(``ATEN_CPU_CAPABILITY=default``: ATen's scalar kernels instead of AVX2;
``MKL_CBWR=COMPATIBLE``: MKL's portable GEMM code path), two intra-op threads and torch's
deterministic algorithms: the kernel choices that differ from one machine to another.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

U = 2.0**-24  # fp32 unit roundoff
NUDGE_ROUNDINGS = 17  # ceil(log2(384 tokens)) + 8 ranks: see the Note
SEEDS = (1, 2)
MULTIPLE = 4.0

# The intra-op threads every rank and reference runs on (``make test-numerics`` sets 2).
THREADS = int(os.environ.get("RAGGEDFSDP_TEST_THREADS", "1"))
DETERMINISTIC = os.environ.get("RAGGEDFSDP_TEST_DETERMINISTIC", "") == "1"


def configure_torch() -> None:
    """The thread count and algorithm choice of this run (see the module docstring)."""
    torch.set_num_threads(THREADS)
    if DETERMINISTIC:
        torch.use_deterministic_algorithms(True)


@contextmanager
def reference_threads() -> Iterator[None]:
    """Run a one-process reference on the threads the ranks use; restore afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ---- the perturbation ---------------------------------------------------------------------------
def _nudge_(grad: torch.Tensor, gen: torch.Generator, unit: float) -> None:
    """Move every element of ``grad`` (a plain or DTensor gradient) up or down, the
    direction drawn from ``gen``, by ``NUDGE_ROUNDINGS`` roundings (``unit`` relative
    each) of ``max(|g|, the mean |g| of its row)``.

    A sum's rounding is relative to its terms, not to its result: where the ranks'
    partial gradients cancel, the result is small and its error is that of the partials,
    whose size is the typical gradient of its row (an embedding's row is one token's).
    """
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    if local.numel() == 0:
        return
    up = torch.randint(0, 2, local.shape, generator=gen, device="cpu").to(local.device)
    size = local.abs().float()
    size = size.clamp(min=size.mean(dim=-1, keepdim=True) if size.dim() > 1 else size.mean())
    step = size * (NUDGE_ROUNDINGS * unit)
    local.add_(torch.where(up.bool(), step, -step).to(local.dtype))


@contextmanager
def nudged_gradients(seed: int, unit: float = U) -> Iterator[None]:
    """Within the block, every optimizer's step first nudges every gradient it is about
    to read (``_nudge_``), with signs drawn from ``seed``. A step given a ``closure``
    (PyTorch Lightning's Trainer computes the gradients inside ``step``) nudges them
    after the closure has made them.

    Args:
        seed: the directions.
        unit: the unit roundoff of the arithmetic that summed the gradients: ``U`` (fp32),
            or ``2**-8`` where they were reduced in bf16.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def nudge(optimizer):
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        _nudge_(p.grad, gen, unit)

    def hook(optimizer, args, kwargs):  # args: (optimizer, closure?)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            nudge(optimizer)
            return None

        def nudged_closure():
            loss = closure()
            nudge(optimizer)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": nudged_closure}
        return (optimizer, nudged_closure, *args[2:]), kwargs

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# ---- the reference and its spread --------------------------------------------------------------
@dataclass(frozen=True)
class Reference:
    """A reference run and how much it moves under nudged gradients.

    Attributes:
        series: per-step numbers of the plain run by name: ``"loss"`` always, others
            (``"grad_norm"``, ``"val_loss"``) where the test compares them.
        spread: name -> the largest ``|plain - nudged|`` over steps and seeds.
        params: the plain run's final parameters (fqn -> full tensor), or None.
        param_spread: fqn -> the largest ``|plain - nudged|`` element, over seeds.
    """

    series: dict[str, list[float]]
    spread: dict[str, float]
    params: dict[str, torch.Tensor] | None = None
    param_spread: dict[str, float] | None = None

    @property
    def losses(self) -> list[float]:
        return self.series["loss"]

    def bound(self, world: int, terms: int, series: str = "loss") -> float:
        """The bound on ``max |got - series|`` (rule 3 of [Note: derived tolerances]).

        Args:
            world: how many partial sums the distributed number adds up (ranks, or
                ranks x micro-batches).
            terms: the terms one step's number sums (tokens of a mean loss, elements
                of a norm).
            series: which series.
        """
        depth = math.ceil(math.log2(max(terms, 2))) + world
        floor = 2 * depth * U * max(abs(x) for x in self.series[series])
        return MULTIPLE * self.spread[series] + floor

    def param_bound(self, name: str, steps: int) -> float:
        """The bound on ``max |got - params[name]|`` after ``steps`` updates."""
        assert self.params is not None and self.param_spread is not None
        floor = steps * U * self.params[name].abs().max().item()
        return MULTIPLE * self.param_spread[name] + floor


def reference(
    run: Callable[[], object], seeds: tuple[int, ...] = SEEDS, unit: float = U
) -> Reference:
    """Run ``run`` plainly and once per seed under ``nudged_gradients``.

    Args:
        run: builds its model and trains it; returns the per-step losses, or
            ``(losses, {fqn: final full parameter})``, or a dict of per-step series
            (``"loss"`` among them) with the final parameters under ``"params"``. In a
            spawned rank it may be a distributed run (every rank nudges its own
            gradients with the same seed).
        seeds: the nudged runs (default ``SEEDS``).
        unit: the gradients' unit roundoff (``nudged_gradients``).
    """
    with reference_threads():
        plain = _split(run())
        nudged = []
        for seed in seeds:
            with nudged_gradients(seed, unit):
                nudged.append(_split(run()))
    series, params = plain
    spread = {
        k: max(abs(a - b) for other, _ in nudged for a, b in zip(v, other[k]))
        for k, v in series.items()
    }
    param_spread = None
    if params is not None:
        param_spread = {
            k: max((v - other[k]).abs().max().item() for _, other in nudged)
            for k, v in params.items()
        }
    return Reference(series, spread, params, param_spread)


def from_runs(plain: dict[str, list[float]], nudged: list[dict[str, list[float]]]) -> Reference:
    """A ``Reference`` of series already run (a CLI job plain and nudged, say)."""
    spread = {
        k: max(abs(a - b) for other in nudged for a, b in zip(v, other[k]))
        for k, v in plain.items()
    }
    return Reference({k: list(v) for k, v in plain.items()}, spread)


def _split(result) -> tuple[dict[str, list[float]], dict[str, torch.Tensor] | None]:
    if isinstance(result, dict):
        result = dict(result)
        params = result.pop("params", None)
    elif isinstance(result, tuple):
        losses, params = result
        result = {"loss": losses}
    else:
        result, params = {"loss": result}, None
    series = {k: [float(x) for x in v] for k, v in result.items()}
    if params is not None:
        params = {k: v.detach().clone() for k, v in params.items()}
    return series, params


# ---- the checks ---------------------------------------------------------------------------------
def assert_losses_match(
    got, ref: Reference, *, world: int, tokens: int, what: str = "", series: str = "loss"
) -> None:
    """``got``'s per-step numbers lie within ``ref.bound`` of the reference's.

    Args:
        got: per-step numbers of the run under test.
        ref: the reference.
        world: partial sums the run adds up (see ``Reference.bound``).
        tokens: terms one step's number sums.
        what: a prefix for the failure message.
        series: which of the reference's series (default the loss).
    """
    want = ref.series[series]
    assert len(got) == len(want), (len(got), len(want))
    worst = max(abs(a - b) for a, b in zip(got, want))
    bound = ref.bound(world, tokens, series)
    log_check(series, what, worst, ref.spread[series], bound)
    assert worst <= bound, (
        f"{what}{series} differs from the reference by {worst:.3g}, beyond the derived "
        f"bound {bound:.3g} ({MULTIPLE:g} x the nudged reference's spread "
        f"{ref.spread[series]:.3g} + the rounding floor): {list(got)} vs {want}"
    )


def assert_runs_agree(
    a, b, ref: Reference, *, world: int, tokens: int, what: str = "", series: str = "loss"
) -> None:
    """Two runs of the reference's computation (raggedfsdp and FSDP2 in the same ranks)
    agree within twice the bound: each lies within it of the reference."""
    worst = max(abs(x - y) for x, y in zip(a, b))
    bound = 2 * ref.bound(world, tokens, series)
    log_check(f"{series} (two runs)", what, worst, ref.spread[series], bound)
    assert worst <= bound, (
        f"{what}{series}: the two runs differ by {worst:.3g}, beyond twice the derived "
        f"bound {bound:.3g}: {list(a)} vs {list(b)}"
    )


def assert_param_matches(
    name: str, got: torch.Tensor, ref: Reference, *, steps: int, what: str = ""
) -> None:
    """``got`` (a full parameter) lies within ``ref.param_bound`` of the reference's."""
    assert ref.params is not None and ref.param_spread is not None
    worst = (got - ref.params[name]).abs().max().item()
    bound = ref.param_bound(name, steps)
    log_check("param", f"{what}{name}", worst, ref.param_spread[name], bound)
    assert worst <= bound, (
        f"{what}{name}: differs from the reference by {worst:.3g}, beyond the derived bound "
        f"{bound:.3g} ({MULTIPLE:g} x the nudged reference's spread "
        f"{ref.param_spread[name]:.3g} + {steps} roundings)"
    )


def assert_close_to_reference(
    got: torch.Tensor,
    want: torch.Tensor,
    want64: torch.Tensor,
    what: str = "",
    terms: int = 1,
) -> None:
    """``got``'s distance from the reference's float64 value ``want64`` is at most
    ``MULTIPLE`` times the fp32 reference's own, plus the rounding floor of the last
    reduction, ``2 * ceil(log2 terms) * U * max |want64|`` (rule 4 of [Note: derived
    tolerances]): the fp32 reference may be luckier than the implementation. (The
    implementation itself need not run in float64: models keep routers and rotations in
    fp32 on purpose.)

    Args:
        terms: the terms of the widest sum behind one output element (a matmul's inner
            dimension).
    """
    err_want = (want.double() - want64).abs().max().item()
    err_got = (got.double() - want64).abs().max().item()
    floor = 2 * math.ceil(math.log2(max(terms, 1))) * U * want64.abs().max().item()
    bound = MULTIPLE * err_want + floor
    log_check("against float64", what, err_got, err_want, bound)
    assert err_got <= bound, (
        f"{what}{err_got:.3g} from the float64 reference, beyond {MULTIPLE:g} x the fp32 "
        f"reference's own rounding error {err_want:.3g} + the floor {floor:.3g}"
    )


def log_check(kind: str, what: str, worst: float, spread: float, bound: float) -> None:
    """Append the check's figures to ``$RAGGEDFSDP_NUMERICS_LOG`` (JSON lines), if set:
    how close each check runs to its bound, on this machine's kernels."""
    path = os.environ.get("RAGGEDFSDP_NUMERICS_LOG")
    if path:
        import json

        row = dict(kind=kind, what=what, worst=worst, spread=spread, bound=bound)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
