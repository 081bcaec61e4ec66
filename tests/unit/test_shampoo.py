"""Shampoo on one device: a blocked Shampoo reference written here from the equations,
a cross-check against a published implementation, the block policy, the errors.

The reference (``reference_step``) is Blocked Shampoo as Gupta et al. 2018 (``L^(-1/4) G
R^(-1/4)``), Anil et al. 2020 (blocking, grafting, exponential moving averages of the
statistics, a ridge ``eps I``, roots every few steps) and Shi et al. 2023 (Adam grafting
per block, bias-corrected statistics, decoupled weight decay, heavy-ball / Nesterov
momentum), written per matrix from the full tensors with no knowledge of any sharding.
Blocks are ``row_block`` rows by at most ``block_size`` columns (each dim cut as
``torch.split``), a function of the shape and the settings only.
It performs the same per-block operations in the same order as ``raggedfsdp.optim.
Shampoo``, so given the same gradients the two agree bit for bit (``torch.equal``).

Cross-check: Meta's ``distributed_shampoo`` (the AlgoPerf entry) is not published on
PyPI (``pip download distributed-shampoo`` finds nothing; it installs from GitHub only),
so the check is against ``pytorch_optimizer.ScalableShampoo`` (``pytorch-optimizer``
4.1.0, installed ``--no-deps``: its port of Google's scalable Shampoo, Anil et al.).
Their definitions agree with no grafting, ``beta2 = 1`` (summed statistics), no
momentum, preconditioning from step 1 and roots every step; what differs: it starts
the statistics at ``eps I`` where here ``eps I`` is added before each root (the same
matrix up to rounding), and it takes the root by SVD where here it is ``eigh``. In
float64 the two give the same parameters to the rounding of those decompositions.
Elsewhere they differ by design: its grafting is SGD / AdaGrad / RMSProp over the whole
layer (here Adam per block or per matrix), its statistics are not bias-corrected, its
momentum is applied before grafting.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from raggedfsdp.optim import Shampoo, shampoo_block_policy

pytestmark = pytest.mark.numerics

HYPER = dict(
    lr=0.01,
    momentum=0.9,
    nesterov=True,
    beta2=0.99,
    epsilon=1e-8,
    weight_decay=0.1,
    precondition_frequency=3,
    start_preconditioning_step=2,
    graft_beta2=0.999,
    graft_eps=1e-8,
)


# ---------------------------------------------------------------------------------------------
# The reference: blocked Shampoo from the equations, one device, full tensors
# ---------------------------------------------------------------------------------------------
def _split(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _inv_quarter_root(stat, correction, eps, dtype):
    """``(stat / c + eps I)^(-1/4)`` by eigendecomposition (eigenvalues floored at eps)."""
    a = stat.to(dtype, copy=True)
    if correction != 1.0:
        a.div_(correction)
    a.diagonal().add_(eps)
    lam, q = torch.linalg.eigh(a)
    return (q * lam.clamp_min(eps).pow(-0.25)) @ q.T


def reference_init(params: dict[str, torch.Tensor], block_size: int, row_block: int) -> dict:
    """Per matrix member, per block (``row_block`` rows by at most ``block_size``
    columns): L, R, their roots; per parameter: m, v, step."""
    state = {}
    for name, p in params.items():
        dt = torch.float64 if p.dtype == torch.float64 else torch.float32
        members = p.shape[0] if p.dim() == 3 else 1
        rows, cols = p.shape[-2:]
        blocks = {}
        for e in range(members):
            for r0, r1 in _split(rows, row_block):
                for c0, c1 in _split(cols, block_size):
                    m, n = r1 - r0, c1 - c0
                    blocks[e, r0, c0] = [torch.zeros(m, m, dtype=dt) for _ in (0, 1)] + [
                        torch.zeros(n, n, dtype=dt) for _ in (0, 1)
                    ]
        state[name] = dict(
            step=0,
            m=torch.zeros(p.shape, dtype=dt),
            v=torch.zeros(p.shape, dtype=dt),
            blocks=blocks,
        )
    return state


def reference_step(
    params, grads, state, h, block_size, row_block, grafting="block", root_dtype=None
):
    """One step of blocked Shampoo on full tensors ``params`` (in place): blocks of
    ``row_block`` rows by ``block_size`` columns (the last of each dim shorter)."""
    for name, x in params.items():
        s, grad = state[name], grads[name]
        dt = s["m"].dtype
        root_dtype = root_dtype or torch.float32
        s["step"] += 1
        t = s["step"]
        g = grad.to(dt)
        if grafting is not None:
            b = h["graft_beta2"]
            s["v"].mul_(b).addcmul_(g, g, value=1 - b)
            graft = g / ((s["v"] / (1 - b**t)).sqrt() + h["graft_eps"])
        else:
            graft = g.clone()
        start, freq = h["start_preconditioning_step"], h["precondition_frequency"]
        precondition = t >= start
        direction = torch.empty(x.shape, dtype=dt) if precondition else graft
        beta2, eps = h["beta2"], h["epsilon"]
        w = 1.0 if beta2 == 1.0 else 1 - beta2
        corr = 1.0 if beta2 == 1.0 else 1 - beta2**t
        members = x.shape[0] if x.dim() == 3 else 1
        rows, cols = x.shape[-2:]
        for e in range(members):
            ge = g[e] if x.dim() == 3 else g
            de = direction[e] if x.dim() == 3 else direction
            ae = graft[e] if x.dim() == 3 else graft
            for r0, r1 in _split(rows, row_block):
                for c0, c1 in _split(cols, block_size):
                    L, Lr, R, Rr = s["blocks"][e, r0, c0]
                    gb = ge[r0:r1, c0:c1].contiguous().clone()
                    L.addmm_(gb, gb.T, beta=beta2, alpha=w)  # L <- beta2 L + (1 - beta2) G G^T
                    R.addmm_(gb.T, gb, beta=beta2, alpha=w)
                    if not precondition:
                        continue
                    if (t - start) % freq == 0:
                        Lr.copy_(_inv_quarter_root(L, corr, eps, root_dtype))
                        Rr.copy_(_inv_quarter_root(R, corr, eps, root_dtype))
                    pb = (Lr @ gb) @ Rr
                    if grafting == "block":
                        a = ae[r0:r1, c0:c1].contiguous().clone()
                        pb.mul_(a.norm() / pb.norm().clamp_min(torch.finfo(dt).tiny))
                    de[r0:r1, c0:c1].copy_(pb)
            if precondition and grafting == "parameter":
                scale = ae.clone().norm() / de.clone().norm().clamp_min(torch.finfo(dt).tiny)
                de.mul_(scale)
        mu = h["momentum"]
        if mu:
            s["m"].mul_(mu).add_(direction)
            direction = direction.add(s["m"], alpha=mu) if h["nesterov"] else s["m"]
        x.mul_(1 - h["lr"] * h["weight_decay"])
        x.add_(direction, alpha=-h["lr"])


def gradient(name: str, shape, step: int, dtype=torch.float32) -> torch.Tensor:
    seed = sum(map(ord, name)) * 1000 + step
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


SHAPES = {"a": (70, 45), "stack": (3, 40, 24), "small": (5, 7)}


def _run_pair(block_size, grafting, steps=7, hyper=HYPER, row_block=None, **kw):
    """``row_block=None``: Shampoo's default, ``block_size`` rows (square blocks)."""
    torch.manual_seed(0)
    ref = {n: torch.randn(s) for n, s in SHAPES.items()}
    ours = {n: nn.Parameter(t.clone()) for n, t in ref.items()}
    opt = Shampoo(
        [{"params": list(ours.values()), "use_shampoo": True}],
        block_size=block_size,
        row_block=row_block,
        grafting=grafting,
        **hyper,
        **kw,
    )
    rows = block_size if row_block is None else row_block
    state = reference_init(ref, block_size, rows)
    for step in range(steps):
        grads = {n: gradient(n, s, step) for n, s in SHAPES.items()}
        for n, p in ours.items():
            p.grad = grads[n].clone()
        opt.step()
        reference_step(ref, grads, state, hyper, block_size, rows, grafting, kw.get("root_dtype"))
        for n in SHAPES:
            assert torch.equal(ours[n].detach(), ref[n]), f"step {step}: {n} differs"
    return opt


@pytest.mark.parametrize("grafting", ["block", "parameter", None])
@pytest.mark.parametrize("block_size, row_block", [(16, 16), (16, 6), (1024, None), (64, 1)])
def test_equals_reference_bitwise(block_size, row_block, grafting):
    _run_pair(block_size, grafting, row_block=row_block)


def test_equals_reference_variants():
    """beta2 = 1 (summed statistics), no momentum / heavy ball, fp64 roots."""
    _run_pair(16, "block", hyper={**HYPER, "beta2": 1.0, "momentum": 0.0}, row_block=4)
    _run_pair(
        16, "parameter", hyper={**HYPER, "nesterov": False}, row_block=8, root_dtype=torch.float64
    )


def test_cross_check_pytorch_optimizer():
    """Against ``pytorch_optimizer.ScalableShampoo`` where the definitions agree (see the
    module docstring), in float64: 8 steps of a 40 x 24 matrix with blocks of 16."""
    po = pytest.importorskip("pytorch_optimizer")
    from pytorch_optimizer.optimizer.shampoo import LayerWiseGrafting

    eps, lr = 1e-6, 0.05
    torch.manual_seed(1)
    x0 = torch.randn(40, 24, dtype=torch.float64)
    theirs, ours = nn.Parameter(x0.clone()), nn.Parameter(x0.clone())
    peer = po.ScalableShampoo(
        [theirs],
        lr=lr,
        betas=(0.0, 0.5),
        nesterov=False,
        start_preconditioning_step=1,
        preconditioning_compute_steps=1,
        block_size=16,
        shape_interpretation=False,
        graft_type=LayerWiseGrafting.NONE,
        matrix_eps=eps,
        use_svd=True,
    )
    # Its constructor refuses beta2 = 1, but its statistics define it (summed, "w2 = 1 if
    # beta2 == 1"), and it reads beta2 from the group when it makes the state.
    peer.param_groups[0]["betas"] = (0.0, 1.0)
    opt = Shampoo(
        [ours],
        lr=lr,
        momentum=0.0,
        beta2=1.0,
        epsilon=eps,
        block_size=16,
        precondition_frequency=1,
        start_preconditioning_step=1,
        grafting=None,
        root_dtype=torch.float64,
        use_shampoo=lambda fqn, p: True,
    )
    worst = 0.0
    for step in range(8):
        g = gradient("x", x0.shape, step, torch.float64)
        theirs.grad, ours.grad = g.clone(), g.clone()
        peer.step()
        opt.step()
        moved = (theirs.detach() - x0).abs().max()
        worst = max(worst, float((theirs.detach() - ours.detach()).abs().max() / moved))
    # Bound: both take a fourth root of the same fp64 matrix (up to where eps I is
    # added), by SVD and by eigh; the statistics' condition number here is < 1e4, so
    # the roots agree to ~1e4 * 2^-52 relative, and each step's update to a few times
    # that. 1e-9 of the total movement leaves a 1000x margin over 8 steps.
    assert worst < 1e-9, worst


def test_block_policy():
    policy = shampoo_block_policy(32)
    assert policy("w", nn.Parameter(torch.zeros(96, 260))) == 32
    assert policy("w", nn.Parameter(torch.zeros(260, 96))) == "whole"  # 32 does not divide 260
    assert policy("w", nn.Parameter(torch.zeros(20, 96))) == "whole"  # one row block
    assert policy("experts.w1", nn.Parameter(torch.zeros(6, 64, 8))) == 32
    assert policy("attention_norm.weight", nn.Parameter(torch.zeros(96))) == 1
    assert policy("tok_embeddings.weight", nn.Parameter(torch.zeros(1000, 96))) == 1
    whole = shampoo_block_policy(32, whole_matrices=True)
    assert whole("w", nn.Parameter(torch.zeros(96, 260))) == "whole"
    rows = shampoo_block_policy(64, row_block=8)  # the RaggedShard block is row_block rows
    assert rows("w", nn.Parameter(torch.zeros(96, 260))) == 8
    assert rows("w", nn.Parameter(torch.zeros(260, 96))) == "whole"  # 8 does not divide 260
    assert shampoo_block_policy().row_block == 1024  # the default: square blocks
    assert shampoo_block_policy(32).row_block == 32
    with pytest.raises(ValueError, match="ShampooBlockPolicy: block_size must be a positive int"):
        shampoo_block_policy(0)
    with pytest.raises(ValueError, match=r"ShampooBlockPolicy: row_block must be an int in \[1, "):
        shampoo_block_policy(32, row_block=64)


def test_adamw_part_and_state_shapes():
    """1-D parameters step with AdamW (torch's numbers); statistics are per block."""
    w, b = nn.Parameter(torch.randn(40, 24)), nn.Parameter(torch.randn(24))
    b_ref = nn.Parameter(b.detach().clone())
    opt = Shampoo([w, b], block_size=16, use_shampoo=lambda n, p: p.dim() == 2)
    ref = torch.optim.AdamW([b_ref], foreach=False, lr=1e-3, weight_decay=0.01)
    for step in range(3):
        w.grad, b.grad = gradient("w", w.shape, step), gradient("b", b.shape, step)
        b_ref.grad = b.grad.clone()
        opt.step()
        ref.step()
        assert torch.equal(b.detach(), b_ref.detach())
    s = opt.state[w]
    # blocks: rows 16, 16, 8 x cols 16, 8: L = 2*(3*16^2 + ... ) per column block
    assert s["left"].numel() == 2 * (16 * 16 + 16 * 16 + 8 * 8)
    assert s["right"].numel() == 3 * (16 * 16 + 8 * 8)
    assert set(s) == {
        "step",
        "momentum_buffer",
        "graft_exp_avg_sq",
        "left",
        "right",
        "left_root",
        "right_root",
    }


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(lr=-1.0), "Shampoo: lr must be >= 0"),
        (dict(beta2=0.0), r"Shampoo: beta2 must be in \(0, 1\]"),
        (dict(momentum=1.0), r"Shampoo: momentum must be in \[0, 1\)"),
        (dict(epsilon=0.0), "Shampoo: epsilon must be > 0"),
        (dict(precondition_frequency=0), "Shampoo: precondition_frequency must be an int >= 1"),
        (dict(block_size=0), "Shampoo: block_size must be a positive int"),
        (dict(row_block=0), r"Shampoo: row_block must be an int in \[1, block_size=1024\]"),
        (dict(block_size=16, row_block=32), r"row_block must be an int in \[1, block_size=16\]"),
        (dict(grafting="sgd"), "Shampoo: grafting must be one of"),
        (dict(root_dtype=torch.float16), "Shampoo: root_dtype must be torch.float32"),
        (dict(adamw_lr=-1.0), r"Shampoo \(AdamW group\): lr must be >= 0"),
    ],
)
def test_bad_hyperparameters(kw, match):
    params = [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match=match):
        Shampoo(params, **kw)


def test_vector_refused():
    with pytest.raises(ValueError, match=r"parameter '#0 of group 0' has shape \(4,\)"):
        Shampoo([{"params": [nn.Parameter(torch.zeros(4))], "use_shampoo": True}])


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--mesh", "tp=2", "--model", "llama-small", "--optim", "shampoo"],
            r"--optim shampoo does not compose with tensor parallelism",
        ),
        (["--backend", "fsdp2", "--optim", "shampoo"], r"--optim shampoo runs on the raggedfsdp"),
    ],
)
def test_train_refusals(argv, match, capsys, tmp_path):
    from raggedfsdp.cli.train import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--max-bytes", "100000", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--shampoo-block-size", "64"], r"--shampoo-block-size applies to --optim shampoo only"),
        (["--optim", "shampoo", "--shampoo-block-size", "0"], r"--shampoo-block-size must be >= 1"),
        (
            ["--optim", "shampoo", "--shampoo-block-size", "16", "--shampoo-row-block", "32"],
            r"--shampoo-row-block must be in \[1, --shampoo-block-size 16\]",
        ),
        (
            ["--optim", "shampoo", "--start-preconditioning-step", "0"],
            r"--start-preconditioning-step must be >= 1",
        ),
    ],
)
def test_train_shampoo_flags_refused(argv, match, capsys, tmp_path):
    from raggedfsdp.cli.train import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--max-bytes", "100000", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("steps, said", [(5, True), (20, False)])
def test_train_says_when_shampoo_never_preconditions(steps, said, capsys, tmp_path):
    """A run shorter than the first preconditioned step (20 by default) is told so."""
    from raggedfsdp.cli.train import main

    argv = ["--optim", "shampoo", "--steps", str(steps), "--max-bytes", "100000"]
    assert main([*argv, "--out", str(tmp_path / "out")], launch=lambda args: 0) == 0
    err = capsys.readouterr().err
    note = f"the run has {steps} steps, fewer than the first preconditioned step 20"
    assert (note in err) == said, err


def test_plain_tensors_are_communication_free_and_groups_fixed_once_planned():
    """Parameters whole on every rank: one group, communication-free; once the owners are
    planned (a step, or ``modes()``), a new Shampoo group would move them: refused."""
    w, v = nn.Parameter(torch.randn(40, 24)), nn.Parameter(torch.randn(3, 8, 8))
    opt = Shampoo([{"params": [w, v], "use_shampoo": True}], block_size=16)
    assert opt.modes() == {"": "communication-free"}
    assert [len(b) for b in opt.plan_of("").params] == [3 * 2, 3]  # 40 x 24, 3 x (8 x 8)
    with pytest.raises(NotImplementedError, match=r"add_param_group after the first step"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))], "use_shampoo": True})
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))], "use_shampoo": False})
