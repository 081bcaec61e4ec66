"""Where ``python -m raggedfsdp train`` runs: ``--device``, the process-group backend torch
pairs with it, each rank's device, and the precision a device trains in by default.

[Note: train devices]
``--device auto`` is the accelerator torch finds (``torch.accelerator``: CUDA, XPU,
MPS, ...) when one is available, else the CPU; ``--device cpu`` or an accelerator's
type (``cuda``, ``xpu``, ...) names one, and an accelerator that is absent is refused
before any rank starts. The launcher resolves ``auto`` and the default precision once
and hands the ranks the concrete answers, so every rank and the run's record
(``run.json``) agree on them.

- **Backend**: the one torch pairs with the device type
  (``torch.distributed.get_default_backend_for_device``: NCCL for CUDA, gloo for the
  CPU, XCCL for XPU, ...).
- **One rank per device**: the rank with ``LOCAL_RANK`` k uses the accelerator's device
  k (``torch.accelerator.set_device_index``), so ``--nproc`` may not exceed the devices
  this machine has (``torch.accelerator.device_count``).
- **Precision**: on an accelerator, bf16 parameters with fp32 gradient reduction
  (``--bf16``) unless ``--no-bf16`` says fp32; on the CPU, fp32 unless ``--bf16``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = [
    "AUTO",
    "accelerator_type",
    "backend_for",
    "default_bf16",
    "rank_device",
    "resolve_device",
    "resolve_train_device",
]

AUTO = "auto"


def accelerator_type() -> str | None:
    """The type of the accelerator available to this process (``"cuda"``, ...), or None."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return None if acc is None else acc.type


def resolve_device(requested: str) -> str:
    """The device type ``--device requested`` trains on.

    Args:
        requested: ``"auto"``, ``"cpu"`` or an accelerator's device type.

    Returns:
        ``"cpu"`` or the type of the accelerator available here.

    Raises:
        ValueError: not a device type; an index (``cuda:1``: ranks take theirs from
            ``LOCAL_RANK``); or an accelerator this machine does not have.
    """
    if requested == AUTO:
        return accelerator_type() or "cpu"
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"train: --device must be auto, cpu or an accelerator's device type (cuda, xpu, "
            f"mps, ...), got {requested!r}"
        ) from None
    if device.index is not None:
        raise ValueError(
            f"train: --device {requested!r} names a device index; pass the type alone "
            f"(--device {device.type}): each rank uses the device of its LOCAL_RANK"
        )
    if device.type == "cpu":
        return "cpu"
    found = accelerator_type()
    if device.type != found:
        have = f"its accelerator is {found}" if found else "it has no accelerator torch can use"
        raise ValueError(
            f"train: --device {requested}: this machine cannot train on {device.type} ({have}, "
            f"torch {torch.__version__}); pass --device auto or --device cpu"
        )
    return device.type


def backend_for(device_type: str) -> str:
    """The process-group backend torch pairs with ``device_type`` (``"nccl"`` for
    ``"cuda"``, ``"gloo"`` for ``"cpu"``).

    Raises:
        ValueError: torch pairs no backend with that device type.
    """
    try:
        return dist.get_default_backend_for_device(device_type)
    except ValueError:
        known = ", ".join(f"{d}: {b}" for d, b in dist.Backend.default_device_backend_map.items())
        raise ValueError(
            f"train: torch pairs no process-group backend with device type {device_type!r} "
            f"(it knows {known}); pass --device cpu"
        ) from None


def default_bf16(device_type: str) -> bool:
    """Whether a run on ``device_type`` trains in bf16 when neither ``--bf16`` nor
    ``--no-bf16`` is given: on an accelerator, yes; on the CPU, no."""
    return device_type != "cpu"


def resolve_train_device(args) -> None:
    """Replace ``args.device`` by the device type it resolves to and a ``None``
    ``args.bf16`` by its default there, and check ``--nproc`` against the devices
    (see [Note: train devices]).

    Raises:
        ValueError: the device cannot be used (``resolve_device``), torch pairs no backend
            with it, or ``--nproc`` exceeds this machine's devices of that type.
    """
    args.device = resolve_device(args.device)
    backend_for(args.device)
    if args.bf16 is None:
        args.bf16 = default_bf16(args.device)
    if args.device != "cpu":
        count = torch.accelerator.device_count()
        if args.nproc > count:
            raise ValueError(
                f"train: --nproc {args.nproc} on --device {args.device}: one rank per device, "
                f"and this machine has {count} {args.device} device{'s' * (count != 1)}; pass "
                f"--nproc {count} or fewer (or --device cpu)"
            )


def rank_device(device_type: str) -> torch.device:
    """This rank's device, made current: the CPU, or the accelerator's device of
    ``LOCAL_RANK`` (set by torchrun; 0 without it)."""
    if device_type == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)
