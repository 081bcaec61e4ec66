"""GPT-2-style configs, registered in the catalogue: LayerNorms with biases, biased
projections, a GELU MLP and learned position embeddings (``TransformerConfig``'s
``norm="layer"``, ``ffn="gelu"``, ``qkv_bias``, ``o_bias``, ``ffn_bias``,
``learned_positions``).

====  ===  ======  =====  ====  =========  =========  ===================================
name  dim  blocks  heads  ffn   vocab      positions  params
====  ===  ======  =====  ====  =========  =========  ===================================
gpt2  768  12      12     3072  50,257     1,024      124,439,808 (output tied, no bias)
====  ===  ======  =====  ====  =========  =========  ===================================

Every parameter's shape is GPT-2's (``openai-community/gpt2``); its fused ``c_attn``
is three projections here (``wq``, ``wk``, ``wv``, the same elements). Importing this
module adds the configs to ``catalogue.CATALOGUE`` (``raggedfsdp.models`` imports it),
so ``--model gpt2`` finds them.
"""

from __future__ import annotations

from raggedfsdp.models.catalogue import CATALOGUE, TransformerConfig

__all__ = ["GPT_CONFIGS"]

GPT_CONFIGS: dict[str, TransformerConfig] = {
    c.name: c
    for c in (
        TransformerConfig(
            name="gpt2",
            source="openai-community/gpt2 config.json",
            vocab_size=50257,
            dim=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=12,
            ffn_dim=3072,
            qkv_bias=True,
            o_bias=True,
            norm="layer",
            ffn="gelu",
            ffn_bias=True,
            learned_positions=1024,
            tie_embeddings=True,
        ),
    )
}

CATALOGUE.update(GPT_CONFIGS)
