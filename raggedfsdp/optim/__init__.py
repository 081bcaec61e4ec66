"""Optimizers that work on whole raggedfsdp buffers."""

from raggedfsdp.optim.adamw import AdamW
from raggedfsdp.optim.adamw8bit import AdamW8bit, adamw8bit_block_policy
from raggedfsdp.optim.muon import Muon, muon_block_policy, muon_param_groups
from raggedfsdp.optim.shampoo import Shampoo, shampoo_auto_policy, shampoo_block_policy

__all__ = [
    "AdamW",
    "AdamW8bit",
    "Muon",
    "Shampoo",
    "adamw8bit_block_policy",
    "muon_block_policy",
    "muon_param_groups",
    "shampoo_auto_policy",
    "shampoo_block_policy",
]
