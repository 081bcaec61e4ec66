"""The model of ``python -m raggedfsdp simulate``: where it comes from, how it is built on
``meta`` and how it is ``fully_shard``-ed. The simulation itself is ``raggedfsdp.tools.simulate``.

[Note: simulated model sources]
``SimConfig.model`` names one of three sources:

- a **catalogue name** (``llama3-70b``, ``gpt2``): ``raggedfsdp.models.get_config``;
- a **JSON config file** (a path ending in ``.json``): a ``TransformerConfig``'s fields
  (``raggedfsdp.models.load_config_json``, which names a bad field and its fix);
- ``hf:DIR``, a **Hugging Face config** (``DIR/config.json``): built on ``meta`` by
  ``AutoModelForCausalLM.from_config`` (never downloaded; needs ``transformers``, the
  ``hf`` extra), its blocks the modules of its ``_no_split_modules`` classes (the
  classes Hugging Face itself names as the units to wrap), KV cache off; see
  ``raggedfsdp.models.hf``, which ``train`` uses too.

The first two build ``raggedfsdp.models.Transformer``; all three are ``fully_shard``-ed
the same way: each block, then the root.
"""

from __future__ import annotations

import dataclasses
import types
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from raggedfsdp.models.hf import (
    HF_PREFIX,
    build_hf_model,
    hf_config,
    hf_directory,
    logits_of,
    named_hf_blocks,
)
from raggedfsdp.models.parallelize import parallelize

if TYPE_CHECKING:
    from raggedfsdp.models import TransformerConfig

__all__ = [
    "blocks_of",
    "build_model",
    "buildable_config",
    "check_model",
    "logits_of",
    "shard_model",
]


class ModelRequest(Protocol):
    """What ``build_model`` reads of a ``raggedfsdp.tools.simulate.SimConfig``."""

    model: str
    layers: int | None
    width: int
    seq: int
    ac: bool


def _is_file(model: str) -> bool:
    return model.endswith(".json")


def _base_config(model: str) -> TransformerConfig:
    """The config a catalogue name or a JSON config file names."""
    from raggedfsdp.models import get_config, load_config_json

    return load_config_json(model) if _is_file(model) else get_config(model)


def check_model(model: str, seq: int, grouping: str, width: int) -> None:
    """Raise what building ``model`` would, before any work (See [Note: simulated model
    sources]).

    Raises:
        ValueError: an unknown name, a bad JSON config file or Hugging Face directory, or
            ``seq`` longer than the model's learned positions.
        ImportError: ``hf:DIR`` without ``transformers`` installed.
        NotImplementedError: ``hf:DIR`` with ``grouping="torchtitan"`` or ``width > 1``.
    """
    if model.startswith(HF_PREFIX):
        config = _hf_config(model, None)
        if grouping != "blocks" or width > 1:
            raise NotImplementedError(
                f"simulate: a Hugging Face model ({model}) is sharded block by block at its "
                f"own widths; drop grouping={grouping!r} / width={width} (the torchtitan "
                "grouping and narrower widths are for catalogue and JSON configs)"
            )
        positions = getattr(config, "max_position_embeddings", None)
        name = f"{model}'s max_position_embeddings"
    else:
        from raggedfsdp.models import Transformer

        config = _base_config(model)
        positions = config.learned_positions or None
        name = f"model {config.name!r}'s learned_positions"
        with torch.device("meta"):  # what the modules cannot build raises here, cheaply
            layers = min(config.n_layers, config.n_dense_layers + 1)  # a dense and an MoE one
            built, _ = buildable_config(model, layers, width)
            Transformer(built, max_seq_len=min(seq, positions or seq))
    if positions is not None and seq > positions:
        raise ValueError(
            f"simulate: seq={seq} exceeds {name}={positions}; pass seq <= {positions} "
            f"(--seq {positions})"
        )


def buildable_config(name: str, layers: int | None = None, width: int = 1):
    """The catalogue config (or JSON config file) ``name`` as
    ``raggedfsdp.models.Transformer`` can build it.

    Args:
        name: a catalogue name or a JSON config file.
        layers: blocks to keep (the first ``layers``); None keeps them all. Default None.
        width: divide dim, heads and FFN widths by this (vocab too). Default 1.

    Returns:
        ``(config, note)``: the config, and what was changed to build it ("" if nothing).
        A cut MoE model keeps at least one MoE block (its leading dense blocks give way).
    """
    c = base = _base_config(name)
    notes = []
    if c.fused_gate_up or c.expert_bias or c.attn_sinks:
        c = dataclasses.replace(c, fused_gate_up=False, expert_bias=False, attn_sinks=False)
        notes.append("unfused experts w1/w2/w3, no expert biases, no attention sinks")
    if layers is not None and layers != c.n_layers:
        dense = min(c.n_dense_layers, layers - 1 if c.n_experts else layers)
        c = dataclasses.replace(c, n_layers=layers, n_dense_layers=max(dense, 0))
        notes.append(
            f"{layers} of {base.n_layers} blocks"
            + (f" ({c.n_dense_layers} dense)" if c.n_experts and c.n_dense_layers else "")
        )
    if width > 1:
        head_dim = max(2, (c.head_dim or c.dim // c.n_heads) // width // 2 * 2)
        heads = max(c.n_kv_heads // width, 1) * max(c.n_heads // c.n_kv_heads, 1)
        c = dataclasses.replace(
            c,
            dim=max(c.dim // width, 8),
            n_heads=heads,
            n_kv_heads=max(c.n_kv_heads // width, 1),
            head_dim=head_dim,
            ffn_dim=max(c.ffn_dim // width, 1) if c.ffn_dim else 0,
            moe_ffn_dim=max(c.moe_ffn_dim // width, 1) if c.moe_ffn_dim else 0,
            vocab_size=max(c.vocab_size // width, 16),
        )
        if c.attention == "mla":  # the latent ranks and head dims shrink alike
            c = dataclasses.replace(
                c,
                q_lora_rank=max(c.q_lora_rank // width, 1),
                kv_lora_rank=max(c.kv_lora_rank // width, 1),
                qk_nope_head_dim=max(c.qk_nope_head_dim // width, 1),
                qk_rope_head_dim=max(c.qk_rope_head_dim // width // 2 * 2, 2),
                v_head_dim=max(c.v_head_dim // width, 1),
            )
        notes.append(f"widths divided by {width}")
    return c, "; ".join(notes)


def _balanced_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``MoE.forward`` with every expert given an even share of the routed tokens.

    The real forward reads the routing counts on the host (``.tolist()``), which a fake
    tensor has no value for. The shapes and ops here are those of a balanced router.
    """
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (T, D)
    T, k, E = x.shape[0], self.router.top_k, self.experts.n_experts
    experts, weights = self.router(x)  # (T, k) each
    order = torch.argsort(experts.reshape(-1), stable=True)  # (T*k,)
    counts = [T * k // E + (e < T * k % E) for e in range(E)]
    routed = self.experts(x[order // k], counts)  # (T*k, D)
    routed = routed[torch.argsort(order)].view(T, k, -1)
    out = (routed * weights.unsqueeze(-1).to(routed.dtype)).sum(dim=1)  # (T, D)
    if self.shared_experts is not None:
        out = out + self.shared_experts(x)
    return out.view(shape)


# ================================================================================================
# Hugging Face configs (raggedfsdp.models.hf)
# ================================================================================================
def _hf_config(model: str, layers: int | None) -> Any:
    """The transformers config of ``hf:DIR`` (``DIR/config.json`` only), KV cache off."""
    return hf_config(model, who="simulate", layers=layers)


def _build_hf(model: str, layers: int | None) -> tuple[nn.Module, str]:
    # the config's own dtype: the simulator measures the model as it is stored
    module = build_hf_model(model, config=_hf_config(model, layers), dtype=None)
    note = f"Hugging Face {type(module).__name__} from {hf_directory(model)}/config.json"
    return module, note


# ================================================================================================
# Build and shard
# ================================================================================================
def build_model(cfg: ModelRequest) -> tuple[nn.Module, str]:
    """The model on ``meta``: routing made balanced, blocks checkpoint-wrapped if ``cfg.ac``.
    See [Note: simulated model sources]."""
    from raggedfsdp.models import Transformer
    from raggedfsdp.models.transformer import MoE

    if cfg.model.startswith(HF_PREFIX):
        model, note = _build_hf(cfg.model, cfg.layers)
    else:
        config, note = buildable_config(cfg.model, cfg.layers, cfg.width)
        with torch.device("meta"):
            model = Transformer(config, max_seq_len=cfg.seq)
    for m in model.modules():
        if isinstance(m, MoE):
            m.forward = types.MethodType(_balanced_moe_forward, m)
    if cfg.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for fqn, block in _named_blocks(model):
            parent, _, name = fqn.rpartition(".")
            model.get_submodule(parent).register_module(name, checkpoint_wrapper(block))
    return model, note


def _named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(fqn, block)`` of the model's transformer blocks, outermost first match each."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from raggedfsdp.models import Transformer

    if isinstance(model, Transformer):
        return [(f"layers.{i}", block) for i, block in enumerate(model.layers)]
    try:
        return named_hf_blocks(model, also=(CheckpointWrapper,))
    except ValueError as e:
        raise ValueError(f"simulate: {e}") from None


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The blocks ``fully_shard``-ed one by one before the root (checkpoint-wrapped if so)."""
    return [block for _, block in _named_blocks(model)]


def shard_model(model: nn.Module, mesh, system: str, mp: str, grouping: str = "blocks") -> None:
    """``fully_shard`` the model by ``system``, grouped as ``SimConfig.grouping`` says
    (``raggedfsdp.models.parallelize``)."""
    if system == "raggedfsdp":
        from raggedfsdp import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kwargs: dict[str, Any] = {}
    if mp == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    parallelize(
        model, mesh, fully_shard=fully_shard, blocks=blocks_of(model), grouping=grouping, **kwargs
    )
