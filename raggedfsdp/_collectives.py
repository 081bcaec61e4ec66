"""The two in-place collectives by the name the installed torch gives them.

torch 2.13 calls them ``all_gather_single`` and ``reduce_scatter_single`` and deprecates
``all_gather_into_tensor`` / ``reduce_scatter_tensor``, the names older torch has (same
arguments, same ``c10d`` ops underneath). raggedfsdp is tested on 2.13; this keeps the
GPU check runnable on an accelerator machine's older torch (``RAGGEDFSDP_UNTESTED_TORCH``).
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
