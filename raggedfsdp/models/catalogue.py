"""Real model shapes from published configurations, grouped as ``fully_shard`` groups them.

One frozen ``TransformerConfig`` describes a model family member (dense LLaMA-style
or MoE, GQA or MLA attention); ``param_groups(config)`` yields its parameters'
``(fqn, shape)`` per group: ``tok_embeddings``, one group per transformer block
(``layers.<i>``), and ``head`` (final norm + output projection), as torchtitan
applies ``fully_shard``. Nothing is downloaded and no tensor is allocated. A later
step builds small trainable ``nn.Module``s from the same configs and the same FQNs,
so shapes and modules live in one place.

FQNs follow torchtitan: ``layers.3.attention.wq.weight``, ``layers.3.moe.experts.w1``.
Fused MoE experts are stacks ``[E, out, in]`` (``ParamShape.stack``); GPT-OSS keeps
its published fused layout ``gate_up_proj [E, dim, 2 * ffn]`` and
``down_proj [E, ffn, dim]`` with per-expert biases.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from raggedfsdp.planner import TensorSpec, with_block_rows


@dataclass(frozen=True, kw_only=True)
class ParamShape:
    """One parameter: its FQN, shape, and whether dim 0 stacks members (experts).

    Args:
        fqn: fully qualified name, as ``named_parameters`` would give it.
        shape: the parameter's shape.
        stack: dim 0 indexes fused members (MoE experts). Default False.
        block_rows: a block size for this parameter alone, overriding the
            model-wide policy (rows, or ``"whole"``); None: use the policy.
    """

    fqn: str
    shape: tuple[int, ...]
    stack: bool = False
    block_rows: int | Literal["whole"] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class GroupShapes:
    """The parameters of one ``fully_shard`` group.

    Args:
        name: the group's module path (``"layers.0"``, ``"tok_embeddings"``, ``"head"``).
        kind: what the group is (``"embed"``, ``"dense"``, ``"moe"``, ``"head"``).
        params: its parameters, in module order.
    """

    name: str
    kind: str
    params: tuple[ParamShape, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def specs(self, block_rows: int | Literal["whole"]) -> list[TensorSpec]:
        """The planner's view of the group: a ``TensorSpec`` per parameter, its block
        ``block_rows`` rows (or whole), unless the parameter names its own block."""
        return [
            TensorSpec(name=p.fqn, shape=p.shape, block_rows=p.block_rows, stack=p.stack)
            if p.block_rows is not None  # the parameter's own block: strict
            else with_block_rows(TensorSpec(name=p.fqn, shape=p.shape, stack=p.stack), block_rows)
            for p in self.params
        ]


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A decoder-only transformer's shape hyperparameters (a published configuration).

    Args:
        name: the catalogue name (CLI ``--model``).
        source: where the numbers come from.
        vocab_size, dim, n_layers: vocabulary, hidden size, transformer blocks.
        n_heads, n_kv_heads, head_dim: attention heads (GQA); ``head_dim`` defaults
            to ``dim // n_heads``.
        attention: ``"gqa"`` or ``"mla"`` (DeepSeek multi-head latent attention).
        qkv_bias, o_bias, attn_sinks, qk_norm: optional attention parameters.
        q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim:
            MLA sizes (unused for GQA).
        ffn_dim: hidden size of a dense block's SwiGLU FFN.
        n_experts: routed experts per MoE block; 0 for a dense model.
        moe_ffn_dim: hidden size of one expert.
        n_shared_experts: always-on experts (one fused FFN of
            ``n_shared_experts * moe_ffn_dim``).
        n_dense_layers: the first blocks that are dense even in an MoE model.
        router_bias, expert_bias: bias parameters of the router and the experts.
        fused_gate_up: experts stored as GPT-OSS does (``gate_up_proj [E, dim, 2F]``,
            ``down_proj [E, F, dim]``) instead of torchtitan's ``w1, w2, w3``.
        top_k: routed experts per token (MoE only). Default 2.
        tie_embeddings: the output head reuses ``tok_embeddings.weight`` (the head
            group then holds only ``norm.weight``). Default False.
        norm: ``"rms"`` (RMSNorm, a scale) or ``"layer"`` (LayerNorm, a scale and a
            bias, as GPT-2) for the blocks' and the final norms. Default ``"rms"``.
        ffn: a dense block's FFN: ``"swiglu"`` (``w1, w2, w3``) or ``"gelu"``
            (``w2(gelu(w1 x))``, GPT-2's MLP). Default ``"swiglu"``.
        ffn_bias, output_bias: biases on the dense FFN's projections and on the
            output head. Default False.
        learned_positions: a learned table of this many positions added to the token
            embeddings (``pos_embeddings``, GPT-2's ``wpe``), in place of rotary
            embeddings; 0: rotary. Default 0.
        notes: anything a reader should know about the numbers.
    """

    name: str
    source: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int | None = None
    attention: Literal["gqa", "mla"] = "gqa"
    qkv_bias: bool = False
    o_bias: bool = False
    attn_sinks: bool = False
    qk_norm: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    ffn_dim: int = 0
    n_experts: int = 0
    moe_ffn_dim: int = 0
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    router_bias: bool = False
    expert_bias: bool = False
    fused_gate_up: bool = False
    top_k: int = 2
    tie_embeddings: bool = False
    norm: Literal["rms", "layer"] = "rms"
    ffn: Literal["swiglu", "gelu"] = "swiglu"
    ffn_bias: bool = False
    output_bias: bool = False
    learned_positions: int = 0
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.attention not in ("gqa", "mla"):
            raise ValueError(
                f"{self.name}: attention must be 'gqa' or 'mla', got {self.attention!r}"
            )
        for what, value, allowed in (
            ("norm", self.norm, ("rms", "layer")),
            ("ffn", self.ffn, ("swiglu", "gelu")),
        ):
            if value not in allowed:
                raise ValueError(f"{self.name}: {what} must be one of {allowed}, got {value!r}")
        if self.learned_positions < 0:
            raise ValueError(
                f"{self.name}: learned_positions must be >= 0 (0: rotary), "
                f"got {self.learned_positions}"
            )
        if self.n_experts and not self.moe_ffn_dim:
            raise ValueError(f"{self.name}: an MoE config needs moe_ffn_dim > 0")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"{self.name}: n_dense_layers > n_layers")

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i >= self.n_dense_layers


def _attention(c: TransformerConfig, p: str) -> Iterator[ParamShape]:
    D, H, hd = c.dim, c.n_heads, c.head_dim
    assert hd is not None
    if c.attention == "mla":
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        yield ParamShape(fqn=f"{p}.wq_a.weight", shape=(c.q_lora_rank, D))
        yield ParamShape(fqn=f"{p}.q_norm.weight", shape=(c.q_lora_rank,))
        yield ParamShape(fqn=f"{p}.wq_b.weight", shape=(H * qk, c.q_lora_rank))
        yield ParamShape(fqn=f"{p}.wkv_a.weight", shape=(c.kv_lora_rank + c.qk_rope_head_dim, D))
        yield ParamShape(fqn=f"{p}.kv_norm.weight", shape=(c.kv_lora_rank,))
        kv_b = H * (c.qk_nope_head_dim + c.v_head_dim)
        yield ParamShape(fqn=f"{p}.wkv_b.weight", shape=(kv_b, c.kv_lora_rank))
        yield ParamShape(fqn=f"{p}.wo.weight", shape=(D, H * c.v_head_dim))
        return
    KV = c.n_kv_heads
    for name, out in (("wq", H * hd), ("wk", KV * hd), ("wv", KV * hd)):
        yield ParamShape(fqn=f"{p}.{name}.weight", shape=(out, D))
        if c.qkv_bias:
            yield ParamShape(fqn=f"{p}.{name}.bias", shape=(out,))
    yield ParamShape(fqn=f"{p}.wo.weight", shape=(D, H * hd))
    if c.o_bias:
        yield ParamShape(fqn=f"{p}.wo.bias", shape=(D,))
    if c.qk_norm:
        yield ParamShape(fqn=f"{p}.q_norm.weight", shape=(hd,))
        yield ParamShape(fqn=f"{p}.k_norm.weight", shape=(hd,))
    if c.attn_sinks:
        yield ParamShape(fqn=f"{p}.sinks", shape=(H,))


def _ffn(p: str, D: int, F: int, kind: str = "swiglu", bias: bool = False) -> Iterator[ParamShape]:
    linears = [("w1", F, D), ("w2", D, F)] + ([("w3", F, D)] if kind == "swiglu" else [])
    for name, out, inp in linears:
        yield ParamShape(fqn=f"{p}.{name}.weight", shape=(out, inp))
        if bias:
            yield ParamShape(fqn=f"{p}.{name}.bias", shape=(out,))


def _norm(c: TransformerConfig, p: str) -> Iterator[ParamShape]:
    yield ParamShape(fqn=f"{p}.weight", shape=(c.dim,))
    if c.norm == "layer":
        yield ParamShape(fqn=f"{p}.bias", shape=(c.dim,))


def _moe(c: TransformerConfig, p: str) -> Iterator[ParamShape]:
    D, E, F = c.dim, c.n_experts, c.moe_ffn_dim
    yield ParamShape(fqn=f"{p}.router.gate.weight", shape=(E, D))
    if c.router_bias:
        yield ParamShape(fqn=f"{p}.router.gate.bias", shape=(E,))
    if c.fused_gate_up:
        yield ParamShape(fqn=f"{p}.experts.gate_up_proj", shape=(E, D, 2 * F), stack=True)
        if c.expert_bias:
            yield ParamShape(fqn=f"{p}.experts.gate_up_proj_bias", shape=(E, 2 * F), stack=True)
        yield ParamShape(fqn=f"{p}.experts.down_proj", shape=(E, F, D), stack=True)
        if c.expert_bias:
            yield ParamShape(fqn=f"{p}.experts.down_proj_bias", shape=(E, D), stack=True)
    else:
        yield ParamShape(fqn=f"{p}.experts.w1", shape=(E, F, D), stack=True)
        yield ParamShape(fqn=f"{p}.experts.w2", shape=(E, D, F), stack=True)
        yield ParamShape(fqn=f"{p}.experts.w3", shape=(E, F, D), stack=True)
    if c.n_shared_experts:
        yield from _ffn(f"{p}.shared_experts", D, c.n_shared_experts * F)


def param_groups(c: TransformerConfig) -> tuple[GroupShapes, ...]:
    """Every parameter of the model, grouped per ``fully_shard`` call, in module order."""
    D = c.dim
    embed = [ParamShape(fqn="tok_embeddings.weight", shape=(c.vocab_size, D))]
    if c.learned_positions:
        embed.append(ParamShape(fqn="pos_embeddings.weight", shape=(c.learned_positions, D)))
    groups = [GroupShapes(name="tok_embeddings", kind="embed", params=tuple(embed))]
    for i in range(c.n_layers):
        p = f"layers.{i}"
        params = list(_norm(c, f"{p}.attention_norm"))
        params += _attention(c, f"{p}.attention")
        params += _norm(c, f"{p}.ffn_norm")
        if c.is_moe_layer(i):
            params += _moe(c, f"{p}.moe")
            kind = "moe"
        else:
            params += _ffn(f"{p}.feed_forward", D, c.ffn_dim, c.ffn, c.ffn_bias)
            kind = "dense"
        groups.append(GroupShapes(name=p, kind=kind, params=tuple(params)))
    head = list(_norm(c, "norm"))
    if not c.tie_embeddings:  # tied: output.weight is tok_embeddings.weight, listed once
        head.append(ParamShape(fqn="output.weight", shape=(c.vocab_size, D)))
    if c.output_bias:
        head.append(ParamShape(fqn="output.bias", shape=(c.vocab_size,)))
    groups.append(GroupShapes(name="head", kind="head", params=tuple(head)))
    return tuple(groups)


def num_params(c: TransformerConfig) -> int:
    return sum(g.numel for g in param_groups(c))


# --- the catalogue ------------------------------------------------------------------------
_LLAMA3_VOCAB = 128256

_DEEPSEEK_V3 = TransformerConfig(
    name="deepseek-v3",
    source="deepseek-ai/DeepSeek-V3 config.json",
    vocab_size=129280,
    dim=7168,
    n_layers=61,
    n_heads=128,
    n_kv_heads=128,
    attention="mla",
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    ffn_dim=18432,
    n_experts=256,
    moe_ffn_dim=2048,
    n_shared_experts=1,
    n_dense_layers=3,
    notes="without the multi-token-prediction module (the published 671B count)",
)


CATALOGUE: dict[str, TransformerConfig] = {
    c.name: c
    for c in (
        TransformerConfig(
            name="llama3-8b",
            source="meta-llama/Meta-Llama-3-8B config.json",
            vocab_size=_LLAMA3_VOCAB,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
        ),
        TransformerConfig(
            name="llama3-70b",
            source="meta-llama/Meta-Llama-3-70B config.json",
            vocab_size=_LLAMA3_VOCAB,
            dim=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            ffn_dim=28672,
        ),
        TransformerConfig(
            name="llama3.1-405b",
            source="meta-llama/Llama-3.1-405B config.json",
            vocab_size=_LLAMA3_VOCAB,
            dim=16384,
            n_layers=126,
            n_heads=128,
            n_kv_heads=8,
            ffn_dim=53248,
        ),
        TransformerConfig(
            name="gpt-oss-120b",
            source="openai/gpt-oss-120b config.json",
            vocab_size=201088,
            dim=2880,
            n_layers=36,
            n_heads=64,
            n_kv_heads=8,
            head_dim=64,
            qkv_bias=True,
            o_bias=True,
            attn_sinks=True,
            n_experts=128,
            moe_ffn_dim=2880,
            router_bias=True,
            expert_bias=True,
            fused_gate_up=True,
        ),
        _DEEPSEEK_V3,
        TransformerConfig(
            name="qwen3-235b-a22b",
            source="Qwen/Qwen3-235B-A22B config.json",
            vocab_size=151936,
            dim=4096,
            n_layers=94,
            n_heads=64,
            n_kv_heads=4,
            head_dim=128,
            qk_norm=True,
            n_experts=128,
            moe_ffn_dim=1536,
        ),
        dataclasses.replace(
            _DEEPSEEK_V3,
            name="moe-2.4t",
            source="this catalogue: DeepSeek-V3's block scaled to 1024 experts",
            n_layers=56,
            n_experts=1024,
            notes=(
                "in the spirit of the paper's largest (2.4T) MoE: DeepSeek-V3's MLA block "
                "and 2048-wide experts, 1024 routed experts + 1 shared, 56 blocks (3 dense)"
            ),
        ),
    )
}


REAL_MODELS: tuple[str, ...] = tuple(CATALOGUE)
"""The published models above (the planner's acceptance sweep); small trainable
configs registered later (``raggedfsdp.models.small``) are not among them."""


def get_config(name: str) -> TransformerConfig:
    """The catalogued config called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; catalogued models: {', '.join(CATALOGUE)} "
            f"(or pass a JSON file of shapes)"
        ) from None
