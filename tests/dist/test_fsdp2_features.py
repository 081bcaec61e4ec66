"""Every FSDP2 feature that raggedfsdp could silently drop, listed by introspection of torch
2.13 and checked against FSDP2 on 2 gloo ranks: each either behaves as FSDP2 (a hook sees
the same values, in the same order; gradients and parameters end the same) or raises
naming it.

The lists: every hook registration of ``nn.Module`` and ``torch.Tensor``, every global
module hook of ``torch.nn.modules.module``, autograd's graph hooks, every field of
torch's ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``. ``FSDPModule``'s methods are
checked in ``test_fsdp2_dropin.py`` and the tensor-subclass all-gather protocol in
``test_subclass_all_gather.py``; a new torch that adds a hook or a field fails
``test_every_feature_is_listed`` until it is checked here.

Bitwise on 2 ranks: both backends gather the same parameters, so each rank computes the
same values with the same kernels; a reduction of two addends is one sum whichever order,
and the average's halving is exact.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn.modules.module as module_hooks
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

import raggedfsdp
from tests.dist.test_fsdp2_patterns import _MLP, _data, _shard
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics


class _Recorder:
    """What the hooks saw, in order: ``(key, kind, value)`` with DTensors as their full
    value (a collective: every rank's hooks run in the same order)."""

    def __init__(self):
        self.seen: list[tuple[str, str, object]] = []

    def __call__(self, key: str, value) -> None:
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                self(f"{key}[{i}]", v)
            return
        if isinstance(value, DTensor):
            self.seen.append((key, "DTensor", value.full_tensor().detach().clone()))
        elif isinstance(value, torch.Tensor):
            self.seen.append((key, type(value).__name__, value.detach().clone()))
        else:
            self.seen.append((key, type(value).__name__, value))


def _run(fully_shard, install, shard_kw, rank, before: bool = False):
    """Two SGD steps of the MLP with ``install(model, rec)``'s hooks (registered after
    ``fully_shard``, or before with ``before``); what the hooks saw, the losses, the
    final parameters."""
    mesh = init_device_mesh("cpu", (2,))
    rec = _Recorder()
    model = _MLP()
    undo = []
    if before:
        undo = install(model, rec) or []
    _shard(fully_shard, model, mesh, **shard_kw)
    if not before:
        undo = install(model, rec) or []
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    mp = shard_kw.get("mp_policy")
    if mp is not None and not mp.cast_forward_inputs:  # the caller casts the inputs
        dtype = mp.param_dtype
    else:
        dtype = torch.float32
    try:
        for x in _data(rank):
            loss = model(x.to(dtype)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        rec("state_dict", [v for _, v in sorted(model.state_dict().items())])
        model.load_state_dict(model.state_dict())
    finally:
        for handle in undo:
            handle.remove()
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return rec.seen, losses, params


def _same(rank, world, install, shard_kw=None, before=False):
    shard_kw = shard_kw or {}
    want = _run(torch_fsdp.fully_shard, install, shard_kw, rank, before)
    got = _run(raggedfsdp.fully_shard, install, shard_kw, rank, before)
    (seen_w, losses_w, params_w), (seen_g, losses_g, params_g) = want, got
    keys_w = [(k, kind) for k, kind, _ in seen_w]
    keys_g = [(k, kind) for k, kind, _ in seen_g]
    assert keys_g == keys_w, f"the hooks saw {keys_g}\n FSDP2's saw {keys_w}"
    for (key, _, a), (_, _, b) in zip(seen_g, seen_w):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype)
            assert torch.equal(a, b), f"{key}: differs from FSDP2's by {(a - b).abs().max():.3g}"
        else:
            assert a == b, (key, a, b)
    assert [x.item() for x in losses_g] == [x.item() for x in losses_w]
    for name in params_w:
        assert torch.equal(params_g[name], params_w[name]), name


# ---- hooks ------------------------------------------------------------------------------------
def _on_l2(register):
    """Install ``register(l2, rec)`` (returns its handle)."""

    def install(model, rec):
        return [register(model.l2, rec)]

    return install


def _in_forward(register):
    """Register ``register(l2, rec)`` at each forward of l2 (on the parameters l2 then
    holds), removed at the next."""

    def install(model, rec):
        live = []

        def pre(module, args):
            for h in live:
                h.remove()
            live[:] = [register(module, rec)]

        return [model.l2.register_forward_pre_hook(pre)]

    return install


def _global(register):
    def install(model, rec):
        return [register(rec), _ResetGlobalBackwardKind()]

    return install


class _ResetGlobalBackwardKind:
    """torch remembers whether a global module backward hook was full or not after the hook
    is removed, and refuses the other kind from then on: forget it with the hook."""

    def remove(self):
        module_hooks._global_is_full_backward_hook = None


def _multi_grad(module, rec):
    params = [module.weight, module.bias]
    return torch.autograd.graph.register_multi_grad_hook(
        params, lambda grads: rec("multi_grad", [g for g in grads if g is not None])
    )


def _state_dict_reads(model, rec):
    return [
        model.l2.register_state_dict_pre_hook(lambda m, prefix, keep: rec("pre", prefix)),
        model.l2.register_state_dict_post_hook(
            lambda m, sd, prefix, local: rec("post", [v for _, v in sorted(sd.items())])
        ),
        model.l2._register_state_dict_hook(lambda m, sd, prefix, local: rec("private", sorted(sd))),
    ]


def _load_state_dict_reads(model, rec):
    def pre(module, sd, prefix, *rest):
        rec("pre", [v for k, v in sorted(sd.items()) if k.startswith(prefix)])

    return [
        model.l2.register_load_state_dict_pre_hook(pre),
        model.l2._register_load_state_dict_pre_hook(pre, with_module=True),
        model.l2.register_load_state_dict_post_hook(
            lambda m, keys: rec("post", [m.weight, m.bias])
        ),
    ]


def _saved_on_cpu(model, rec):
    ctx = torch.autograd.graph.save_on_cpu()
    ctx.__enter__()

    class Exit:
        def remove(self):
            ctx.__exit__(None, None, None)

    return [Exit()]


def _registration(register):
    """A global registration hook, installed before the model is built and sharded."""

    def install(model, rec):
        return [register(lambda *args: rec("registered", [a for a in args[1:]]))]

    return install


HOOKS = {
    # nn.Module
    "register_forward_pre_hook": _on_l2(
        lambda m, rec: m.register_forward_pre_hook(lambda mod, a: rec("w", mod.weight))
    ),
    "register_forward_hook": _on_l2(
        lambda m, rec: m.register_forward_hook(lambda mod, a, out: rec("w,out", [mod.weight, out]))
    ),
    "register_full_backward_pre_hook": _on_l2(
        lambda m, rec: m.register_full_backward_pre_hook(
            lambda mod, go: rec("w,go", [mod.weight, *go])
        )
    ),
    "register_full_backward_hook": _on_l2(
        lambda m, rec: m.register_full_backward_hook(
            lambda mod, gi, go: rec("w,gi,go", [mod.weight, *gi, *go])
        )
    ),
    "register_backward_hook": _on_l2(
        lambda m, rec: m.register_backward_hook(lambda mod, gi, go: rec("go", [*go]))
    ),
    "register_state_dict_pre_hook": _state_dict_reads,
    "register_state_dict_post_hook": _state_dict_reads,
    "_register_state_dict_hook": _state_dict_reads,
    "register_load_state_dict_pre_hook": _load_state_dict_reads,
    "_register_load_state_dict_pre_hook": _load_state_dict_reads,
    "register_load_state_dict_post_hook": _load_state_dict_reads,
    # torch.Tensor, on the unsharded parameter (registered in forward) and the sharded one
    "Tensor.register_hook": _in_forward(
        lambda m, rec: m.weight.register_hook(lambda g: rec("g,w", [g, m.weight]))
    ),
    "Tensor.register_post_accumulate_grad_hook": _in_forward(
        lambda m, rec: m.weight.register_post_accumulate_grad_hook(
            lambda p: rec("p.grad", [p.grad])
        )
    ),
    "Tensor.register_hook on the sharded parameter": _on_l2(
        lambda m, rec: m.weight.register_hook(lambda g: rec("g", g))
    ),
    "Tensor.register_post_accumulate_grad_hook on the sharded parameter": _on_l2(
        lambda m, rec: m.weight.register_post_accumulate_grad_hook(
            lambda p: rec("p,p.grad", [p, p.grad])
        )
    ),
    # torch.autograd.graph
    "register_multi_grad_hook": _in_forward(_multi_grad),
    "saved_tensors_hooks": _saved_on_cpu,
    # torch.nn.modules.module (global)
    "register_module_forward_pre_hook": _global(
        lambda rec: module_hooks.register_module_forward_pre_hook(
            lambda mod, a: rec(type(mod).__name__, a)
        )
    ),
    "register_module_forward_hook": _global(
        lambda rec: module_hooks.register_module_forward_hook(
            lambda mod, a, out: rec(type(mod).__name__, out)
        )
    ),
    "register_module_full_backward_pre_hook": _global(
        lambda rec: module_hooks.register_module_full_backward_pre_hook(
            lambda mod, go: rec(type(mod).__name__, [*go])
        )
    ),
    "register_module_full_backward_hook": _global(
        lambda rec: module_hooks.register_module_full_backward_hook(
            lambda mod, gi, go: rec(type(mod).__name__, [*gi, *go])
        )
    ),
    "register_module_backward_hook": _global(
        lambda rec: module_hooks.register_module_backward_hook(
            lambda mod, gi, go: rec(type(mod).__name__, [*go])
        )
    ),
}
# Registration hooks see modules, parameters and buffers as they are registered (while
# the model is built and sharded): the names and the types of what is registered.
REGISTRATION_HOOKS = {
    f"register_module_{kind}_registration_hook": getattr(
        module_hooks, f"register_module_{kind}_registration_hook"
    )
    for kind in ("module", "parameter", "buffer")
}
POLICIES = {
    "MixedPrecisionPolicy.param_dtype": {
        "mp_policy": torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    },
    "MixedPrecisionPolicy.reduce_dtype": {
        "mp_policy": torch_fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    },
    "MixedPrecisionPolicy.output_dtype": {
        "mp_policy": torch_fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, output_dtype=torch.float32
        )
    },
    "MixedPrecisionPolicy.cast_forward_inputs": {
        "mp_policy": torch_fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, cast_forward_inputs=False, output_dtype=torch.bfloat16
        )
    },
    "CPUOffloadPolicy.pin_memory": {"offload_policy": torch_fsdp.CPUOffloadPolicy(False)},
}


def test_every_feature_is_listed():
    module = {n for n in dir(nn.Module) if "hook" in n and n.startswith(("register", "_register"))}
    tensor = {f"Tensor.{n}" for n in dir(torch.Tensor) if n.startswith("register") and "hook" in n}
    glob = {n for n in dir(module_hooks) if n.startswith("register_module")}
    graph = {n for n in dir(torch.autograd.graph) if n.endswith("hook") or n.endswith("hooks")}
    graph -= {"disable_saved_tensors_hooks", "_register_logging_hooks_on_whole_graph"}
    fields = {
        f"{cls.__name__}.{f.name}"
        for cls in (torch_fsdp.MixedPrecisionPolicy, torch_fsdp.CPUOffloadPolicy)
        for f in dataclasses.fields(cls)
    }
    listed = set(HOOKS) | set(REGISTRATION_HOOKS) | set(POLICIES)
    missing = sorted((module | tensor | glob | graph | fields) - listed)
    assert not missing, f"FSDP2 features not checked against FSDP2 here: {missing}"


def _hooks_case(rank, world):
    cases = {name: partial(_same, rank, world, install) for name, install in HOOKS.items()}
    for name, register in REGISTRATION_HOOKS.items():
        cases[name] = partial(_same, rank, world, _registration(register), before=True)
    for name, kw in POLICIES.items():
        cases[name] = partial(_same, rank, world, lambda m, rec: None, kw)
    run_cases(cases)


def test_every_feature_behaves_as_fsdp2():
    spawn(2, _hooks_case, timeout=600)
