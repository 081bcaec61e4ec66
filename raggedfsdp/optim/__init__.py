"""Optimizers that work on whole raggedfsdp buffers."""

from raggedfsdp.optim.adamw import AdamW
from raggedfsdp.optim.muon import Muon, muon_block_policy, muon_param_groups

__all__ = ["AdamW", "Muon", "muon_block_policy", "muon_param_groups"]
