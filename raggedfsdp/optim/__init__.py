"""Optimizers that work on whole raggedfsdp buffers."""

from raggedfsdp.optim.adamw import AdamW

__all__ = ["AdamW"]
