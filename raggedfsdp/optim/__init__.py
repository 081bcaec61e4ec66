"""Optimizers that work on whole raggedfsdp buffers."""

from raggedfsdp.optim.adamw import AdamW
from raggedfsdp.optim.adamw8bit import AdamW8bit, adamw8bit_block_policy
from raggedfsdp.optim.muon import Muon, muon_block_policy, muon_param_groups

__all__ = [
    "AdamW",
    "AdamW8bit",
    "Muon",
    "adamw8bit_block_policy",
    "muon_block_policy",
    "muon_param_groups",
]
