"""Small trainable configs (dense and MoE, ``tiny`` and ``small``), registered in the catalogue.

Dims are awkward on purpose so that block-aware sharding meets uneven cases: vocab 1001
(the byte-level data uses ids 0..255; the rest are simply never seen), hidden 96,
3 heads over 1 kv head, FFN widths that are not powers of two, 6 experts with top-2.

===============  ===  ======  =======  ===  ======  =========  ==============================
name             dim  blocks  q / kv   ffn  E x F   params     notes
===============  ===  ======  =======  ===  ======  =========  ==============================
llama-tiny       96   2       3 / 1    260  -         391,584
llama-tiny-tied  96   2       3 / 1    260  -         295,488  output tied to tok_embeddings
llama-small      192  4       6 / 2    516  -       1,968,192
moe-tiny         96   2       3 / 1    260  6 x 44    393,312  block 0 dense, block 1 MoE
moe-small        192  4       6 / 2    516  6 x 88  2,144,448  blocks 1-3 MoE + 1 shared
===============  ===  ======  =======  ===  ======  =========  ==============================

Heads are 32 wide; MoE blocks route each token to its top 2 of 6 experts.

Importing this module adds the configs to ``catalogue.CATALOGUE`` (``raggedfsdp.models``
imports it), so ``get_config("llama-tiny")`` and ``--model llama-tiny`` find them.
"""

from __future__ import annotations

import dataclasses

from raggedfsdp.models.catalogue import CATALOGUE, TransformerConfig

__all__ = ["SMALL_CONFIGS"]

_SOURCE = "raggedfsdp.models.small: trains on 2 CPU cores"
_VOCAB = 1001

_LLAMA_TINY = TransformerConfig(
    name="llama-tiny",
    source=_SOURCE,
    vocab_size=_VOCAB,
    dim=96,
    n_layers=2,
    n_heads=3,
    n_kv_heads=1,
    ffn_dim=260,
)
# The small ones: twice the width, twice the depth.
_LLAMA_SMALL = dataclasses.replace(
    _LLAMA_TINY, name="llama-small", dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=516
)
# The MoE ones: their LLaMA's attention and dense first block, then routed experts.
_MOE_TINY = dataclasses.replace(
    _LLAMA_TINY, name="moe-tiny", n_experts=6, moe_ffn_dim=44, top_k=2, n_dense_layers=1
)
_MOE_SMALL = dataclasses.replace(
    _LLAMA_SMALL,
    name="moe-small",
    n_experts=6,
    moe_ffn_dim=88,
    top_k=2,
    n_shared_experts=1,
    n_dense_layers=1,
)

SMALL_CONFIGS: dict[str, TransformerConfig] = {
    c.name: c
    for c in (
        _LLAMA_TINY,
        dataclasses.replace(_LLAMA_TINY, name="llama-tiny-tied", tie_embeddings=True),
        _LLAMA_SMALL,
        _MOE_TINY,
        _MOE_SMALL,
    )
}

CATALOGUE.update(SMALL_CONFIGS)
