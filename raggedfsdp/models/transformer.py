"""Trainable LLaMA-style and MoE transformers built from a catalogue ``TransformerConfig``.

The modules follow torchtitan's layout, so ``named_parameters()`` gives exactly the FQNs
and shapes that ``catalogue.param_groups(config)`` lists (a unit test checks it)::

    tok_embeddings                      Embedding(vocab, dim)
    pos_embeddings                      Embedding(learned_positions, dim) (GPT-2 style only)
    layers.<i>                          TransformerBlock (one fully_shard group each)
      attention_norm, ffn_norm          RMSNorm(dim) (or LayerNorm(dim): ``norm="layer"``)
      attention.{wq, wk, wv, wo}        GQA with rotary (or learned) position embeddings
      attention.{wq_a, q_norm, wq_b,    or DeepSeek-V3's multi-head latent attention
                 wkv_a, kv_norm,        (``attention="mla"``, ``MLAttention``)
                 wkv_b, wo}
      feed_forward.{w1, w2, w3}         dense SwiGLU        (a dense block; ``ffn="gelu"``:
                                        GPT-2's w2(gelu(w1 x)), no w3)
      moe.router.gate                   Linear(dim, E)      (an MoE block)
      moe.experts.{w1, w2, w3}          stacked [E, F, dim], [E, dim, F], [E, F, dim]
      moe.shared_experts.{w1, w2, w3}   always-on SwiGLU    (if n_shared_experts)
    norm, output                        RMSNorm(dim), Linear(dim, vocab) (or tied)

A GPT-2-style config (``norm="layer"``, ``ffn="gelu"``, ``qkv_bias``, ``o_bias``,
``ffn_bias``, ``learned_positions``) builds LayerNorms with biases, biased projections
and a learned position table added to the token embeddings, without rotation.

Usage, torchtitan style::

    with torch.device("meta"):
        model = Transformer(config)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)

[Note: deterministic init]
``init_weights(seed)`` draws every parameter's *full* value from its own CPU generator
seeded by ``(seed, fqn)``, then writes the rank's part of it. So the values do not
depend on module construction order, on the global RNG, on the device the model was
built on, or on how (or whether) the parameters are sharded: building on CPU with a
seed, or on ``meta`` then ``to_empty`` + ``init_weights`` with the same seed, or
sharding with any world size, gives the same model.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from raggedfsdp.models.catalogue import TransformerConfig

__all__ = [
    "Transformer",
    "TransformerBlock",
    "Attention",
    "MLAttention",
    "FeedForward",
    "MoE",
    "lm_loss",
]


def _check_supported(c: TransformerConfig) -> None:
    """Raise for configs these modules cannot build (valid in the catalogue, not trainable)."""
    unsupported = [
        ("attn_sinks=True", c.attn_sinks),
        ("fused_gate_up=True", c.fused_gate_up),
        ("expert_bias=True", c.expert_bias),
    ]
    for what, bad in unsupported:
        if bad:
            raise NotImplementedError(
                f"Transformer: config {c.name!r} has {what}, which the trainable modules do "
                f"not implement; its shapes can still be planned through the catalogue"
            )
    if c.attention == "mla":
        _check_mla(c)
        if c.learned_positions:
            raise ValueError(
                f"Transformer: config {c.name!r} has attention='mla' and learned_positions="
                f"{c.learned_positions}; MLA rotates its qk_rope_head_dim part: set "
                f"learned_positions=0 or attention='gqa'"
            )
    elif c.n_heads % c.n_kv_heads:
        raise ValueError(
            f"Transformer: config {c.name!r}: n_heads ({c.n_heads}) must be a multiple of "
            f"n_kv_heads ({c.n_kv_heads}) for grouped-query attention"
        )
    rope_dim = _rope_dim(c)
    if rope_dim % 2 and not c.learned_positions:
        what = "qk_rope_head_dim" if c.attention == "mla" else "head_dim"
        raise ValueError(
            f"Transformer: config {c.name!r}: {what} must be even for rotary embeddings, "
            f"got {rope_dim}"
        )
    if c.n_experts and not 1 <= c.top_k <= c.n_experts:
        raise ValueError(
            f"Transformer: config {c.name!r}: top_k must be in [1, n_experts={c.n_experts}], "
            f"got {c.top_k}"
        )
    if any(not c.is_moe_layer(i) for i in range(c.n_layers)) and c.ffn_dim < 1:
        raise ValueError(f"Transformer: config {c.name!r} has dense blocks but ffn_dim < 1")


def _check_mla(c: TransformerConfig) -> None:
    """Raise for an MLA config whose sizes ``MLAttention`` cannot build."""
    sizes = {
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
    }
    for what, value in sizes.items():
        if value < 1:
            raise ValueError(
                f"Transformer: config {c.name!r} has attention='mla' but {what}={value}; "
                f"MLA needs {what} >= 1 (set it as the published config does)"
            )
    if c.qk_nope_head_dim < 0:
        raise ValueError(
            f"Transformer: config {c.name!r}: qk_nope_head_dim must be >= 0, "
            f"got {c.qk_nope_head_dim}"
        )


def _rope_dim(c: TransformerConfig) -> int:
    """Width of the rotated part of a query / key head: the rotary table's head dim."""
    if c.attention == "mla":
        return c.qk_rope_head_dim  # See [Note: multi-head latent attention]
    assert c.head_dim is not None
    return c.head_dim


# --- building blocks ---------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no bias), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_table(seq_len: int, head_dim: int, theta: float) -> Tensor:
    """Rotations ``exp(i pos theta^(-2j / head_dim))``: complex64 ``(seq_len, head_dim // 2)``.

    Complex on purpose: a mixed-precision policy that casts floating-point forward
    inputs (FSDP2's ``cast_forward_inputs``) leaves a complex table in full precision.
    """
    cpu = torch.device("cpu")  # a CPU value whatever device is ambient; the caller moves it
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=cpu), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rotary(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate consecutive pairs of ``x`` (B, S, heads, hd) by ``rope`` (>= S, hd/2), in fp32."""
    B, S, H, hd = x.shape
    xc = torch.view_as_complex(x.float().reshape(B, S, H, hd // 2, 2))  # (B, S, H, hd/2)
    out = torch.view_as_real(xc * rope[:S, None, :])  # (B, S, H, hd/2, 2)
    return out.reshape(B, S, H, hd).type_as(x)


def _norm(c: TransformerConfig, norm_eps: float) -> nn.Module:
    """A block's or the final norm: ``RMSNorm`` or, for ``norm="layer"``, ``nn.LayerNorm``."""
    return RMSNorm(c.dim, norm_eps) if c.norm == "rms" else nn.LayerNorm(c.dim, norm_eps)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings (optional q/k norm, biases).

    ``rope`` None (a config with ``learned_positions``): no rotation."""

    def __init__(self, c: TransformerConfig, norm_eps: float) -> None:
        super().__init__()
        assert c.head_dim is not None
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        D, hd = c.dim, c.head_dim
        self.wq = nn.Linear(D, c.n_heads * hd, bias=c.qkv_bias)
        self.wk = nn.Linear(D, c.n_kv_heads * hd, bias=c.qkv_bias)
        self.wv = nn.Linear(D, c.n_kv_heads * hd, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * hd, D, bias=c.o_bias)
        self.q_norm = RMSNorm(hd, norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(hd, norm_eps) if c.qk_norm else None

    def forward(self, x: Tensor, rope: Tensor | None) -> Tensor:
        B, S, _ = x.shape  # x: (B, S, D)
        # -1 heads: under tensor parallelism (wq/wk/wv column-wise) a rank holds its heads
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if q.shape[-1] % self.head_dim or k.shape[-1] % self.head_dim:
            raise ValueError(
                f"Attention: this rank's query / key projections give {q.shape[-1]} / "
                f"{k.shape[-1]} features, not whole heads of {self.head_dim}; under tensor "
                f"parallelism the tp size must divide n_heads ({self.n_heads}) and n_kv_heads "
                f"({self.n_kv_heads}): choose a tp size that divides both"
            )
        q = q.view(B, S, -1, self.head_dim)
        k = k.view(B, S, -1, self.head_dim)
        v = v.view(B, S, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        rep = q.shape[2] // k.shape[2]
        if rep > 1:  # GQA: each kv head serves `rep` consecutive query heads
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        # (B, heads, S, hd)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class MLAttention(nn.Module):
    """DeepSeek-V3's causal multi-head latent attention (MLA) with decoupled rotary keys.

    [Note: multi-head latent attention] Queries and keys/values each pass through a
    low-rank bottleneck with an RMSNorm on the latent; only a ``qk_rope_head_dim``
    slice of each query / key head is rotated, and the rotated key is one head shared
    by all query heads::

        q               = wq_b(q_norm(wq_a(x)))        (B, S, H, nope + rope)
        q_nope | q_pe   = split(q)                     q_pe rotated
        latent | k_pe   = wkv_a(x)                     (B, S, kv_lora_rank | rope)
        k_pe                                           rotated, broadcast to every head
        k_nope | v      = wkv_b(kv_norm(latent))       (B, S, H, nope | v_head_dim)
        out             = wo(softmax(q k^T / sqrt(nope + rope), causal) v)

    with ``q = [q_nope, q_pe]`` and ``k = [k_nope, k_pe]`` per head. The module is
    written for training: it materialises per-head ``k_nope`` and ``v`` instead of
    absorbing ``wkv_b`` into the query (DeepSeek's inference trick). No YaRN rotary
    scaling. Under tensor parallelism (``wq_b`` / ``wkv_b`` column-wise, ``wo``
    row-wise) a rank holds whole heads; ``wq_a``, ``wkv_a`` and the norms stay whole.

    Args:
        c: an MLA config (``attention="mla"``).
        norm_eps: epsilon of ``q_norm`` and ``kv_norm``.
    """

    def __init__(self, c: TransformerConfig, norm_eps: float) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.kv_lora_rank = c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        qk = self.nope_dim + self.rope_dim  # a query / key head's width
        self.softmax_scale = qk**-0.5
        D, H = c.dim, c.n_heads
        # Registration order is the catalogue's: see catalogue._attention.
        self.wq_a = nn.Linear(D, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, H * qk, bias=False)
        self.wkv_a = nn.Linear(D, c.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(c.kv_lora_rank, H * (self.nope_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(H * self.v_head_dim, D, bias=False)

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        """``x`` (B, S, D), ``rope`` (>= S, qk_rope_head_dim / 2) complex; returns (B, S, D)."""
        B, S, _ = x.shape
        nope, rd, vd = self.nope_dim, self.rope_dim, self.v_head_dim
        # -1 heads: under tensor parallelism (wq_b/wkv_b column-wise) a rank holds its heads
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, S, -1, nope + rd)
        q_nope, q_pe = torch.split(q, [nope, rd], dim=-1)  # (B, S, H, nope), (B, S, H, rd)
        latent, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, rd], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(B, S, -1, nope + vd)
        k_nope, v = torch.split(kv, [nope, vd], dim=-1)  # (B, S, H, nope), (B, S, H, vd)
        q_pe = apply_rotary(q_pe, rope)
        k_pe = apply_rotary(k_pe.unsqueeze(2), rope)  # (B, S, 1, rd): one key for all heads
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, S, H, nope + rd)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        # (B, H, S, vd)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.softmax_scale,
        )
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; or, with ``kind="gelu"``, ``w2(gelu(w1 x))``."""

    def __init__(self, dim: int, hidden: int, kind: str = "swiglu", bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias) if kind == "swiglu" else None

    def forward(self, x: Tensor) -> Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Softmax router: scores every expert, keeps the top k, renormalises their weights."""

    def __init__(self, dim: int, n_experts: int, top_k: int, bias: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=bias)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Route ``x`` (T, D): returns expert ids (T, k) and their weights (T, k), fp32."""
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        return experts, weights / weights.sum(dim=-1, keepdim=True)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as one stacked parameter per projection.

    ``w1 (E, F, D)``, ``w2 (E, D, F)``, ``w3 (E, F, D)``: row layout ``[out, in]`` per
    expert as ``nn.Linear`` has it, so one expert's row is one row of the stack.
    """

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """``x`` (N, D) sorted by expert, ``counts[e]`` rows for expert e; returns (N, D)."""
        if isinstance(self.w1, DTensor):  # sharded over an ep mesh: see expert_parallel()
            return _ep_experts(self, x, counts)
        outs = []
        for xe, w1, w2, w3 in zip(
            torch.split(x, counts), self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0)
        ):
            outs.append(F.linear(F.silu(F.linear(xe, w1)) * F.linear(xe, w3), w2))
        return torch.cat(outs)


def expert_parallel(moe: MoE, ep_mesh) -> None:
    """Shard ``moe``'s stacked experts ``Shard(0)`` over the 1-D ``ep_mesh`` (in place).

    [Note: expert parallelism] Rank ``r`` of ``ep_mesh`` keeps experts
    ``[r E / ep, (r + 1) E / ep)``; ``forward`` then sends each token (one row per
    routing assignment, sorted by expert) to the rank holding its expert with one
    all-to-all, runs the local experts on what it received, and returns the results
    with a second all-to-all (both differentiable). The router and the rest of the
    model stay replicated. Every rank of ``ep_mesh`` must run forward together. With
    ``fully_shard(moe.experts, mesh=...)`` over the data-parallel ranks outside
    ``ep_mesh`` and ``fully_shard`` of the block over all data-parallel ranks, the
    experts' gradients sum the tokens of every ep rank, so divide them by the whole
    data-parallel size (``set_gradient_divide_factor``) for the single-process mean.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    e = moe.experts
    if e.n_experts % ep_mesh.size():
        raise ValueError(
            f"expert_parallel: {e.n_experts} experts do not split evenly over {ep_mesh.size()} "
            "ep ranks; choose an ep size that divides the expert count"
        )
    for name in ("w1", "w2", "w3"):
        param = getattr(e, name)
        sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(e, name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _ep_experts(experts: GroupedExperts, x: Tensor, counts: list[int]) -> Tensor:
    """``experts(x, counts)`` with the experts sharded over an ep mesh: see
    [Note: expert parallelism]. ``x`` (N, D) is sorted by expert, ``counts`` has E entries."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    mesh = experts.w1.device_mesh
    group, ep = mesh.get_group(0), mesh.size(0)
    local = experts.n_experts // ep
    send = torch.tensor(counts, dtype=torch.int64, device=x.device).view(ep, local)
    recv = torch.empty_like(send)  # recv[src, e]: rows from rank src for my expert e
    dist.all_to_all_single(recv, send, group=group)
    recv_counts = recv.tolist()
    send_rows = send.sum(dim=1).tolist()
    recv_rows = [sum(row) for row in recv_counts]
    got = wait_tensor(all_to_all_single_autograd(x.contiguous(), recv_rows, send_rows, group))
    # got: by source rank, then expert
    # Regroup by local expert: for each expert, its rows from every source in rank order.
    starts, pos = [], 0
    for row in recv_counts:
        starts.append([pos + sum(row[:e]) for e in range(local)])
        pos += sum(row)
    index = [
        i
        for e in range(local)
        for src in range(ep)
        for i in range(starts[src][e], starts[src][e] + recv_counts[src][e])
    ]
    perm = torch.tensor(index, dtype=torch.int64, device=x.device)
    per_expert = [sum(recv_counts[src][e] for src in range(ep)) for e in range(local)]
    outs = []
    w1, w2, w3 = (getattr(experts, n).to_local() for n in ("w1", "w2", "w3"))
    for xe, a, b, c in zip(torch.split(got[perm], per_expert), w1, w2, w3):
        outs.append(F.linear(F.silu(F.linear(xe, a)) * F.linear(xe, c), b))
    done = torch.cat(outs)[torch.argsort(perm)]  # back to source order
    back = all_to_all_single_autograd(done.contiguous(), send_rows, recv_rows, group)
    return wait_tensor(back)  # (N, D), in x's order


class MoE(nn.Module):
    """Top-k routed experts (+ optional shared experts); every routed token is computed.

    No capacity limit and no token dropping. The computation is deterministic: tokens
    are sorted by expert (stable), each expert runs once on its contiguous rows, and the
    results are un-permuted by a gather and summed over k in a fixed order (no atomics).
    """

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.router = Router(c.dim, c.n_experts, c.top_k, c.router_bias)
        self.experts = GroupedExperts(c.dim, c.moe_ffn_dim, c.n_experts)
        self.shared_experts = (
            FeedForward(c.dim, c.n_shared_experts * c.moe_ffn_dim) if c.n_shared_experts else None
        )

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, D)
        T, k = x.shape[0], self.router.top_k
        experts, weights = self.router(x)  # (T, k) each
        flat = experts.reshape(-1)  # (T*k,) assignment j -> token j // k
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.experts.n_experts).tolist()
        routed = self.experts(x[order // k], counts)  # (T*k, D), in `order`
        routed = routed[torch.argsort(order)].view(T, k, -1)  # back to assignment order
        out = (routed * weights.unsqueeze(-1).to(routed.dtype)).sum(dim=1)  # (T, D)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))`` (dense or MoE)."""

    def __init__(self, c: TransformerConfig, layer_id: int, norm_eps: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = _norm(c, norm_eps)
        self.attention = (
            MLAttention(c, norm_eps) if c.attention == "mla" else Attention(c, norm_eps)
        )
        self.ffn_norm = _norm(c, norm_eps)
        self.is_moe = c.is_moe_layer(layer_id)
        if self.is_moe:
            self.moe = MoE(c)
        else:
            self.feed_forward = FeedForward(c.dim, c.ffn_dim, c.ffn, c.ffn_bias)

    def forward(self, x: Tensor, rope: Tensor | None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))


# --- the model ---------------------------------------------------------------------------
class Transformer(nn.Module):
    """A decoder-only LM (dense LLaMA-style or MoE) with the catalogue's FQNs and shapes.

    Args:
        config: the shape config (``raggedfsdp.models.get_config("llama-tiny")``).
        max_seq_len: longest sequence ``forward`` accepts (the rotary table's length; at
            most ``config.learned_positions`` if that is set). Default 256.
        seed: the init seed used when the model is built on a real device; on ``meta``
            nothing is initialised: call ``to_empty`` then ``init_weights(seed)``.
            Default 0. See [Note: deterministic init].
        rope_theta: rotary base. Default 10000.0.
        norm_eps: RMSNorm epsilon. Default 1e-5.

    Raises:
        ValueError: an inconsistent config or a bad argument.
        NotImplementedError: a catalogue feature these modules do not build (attention
            sinks, GPT-OSS fused experts, expert biases).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        max_seq_len: int = 256,
        seed: int = 0,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        _check_supported(config)
        if max_seq_len < 1:
            raise ValueError(f"Transformer: max_seq_len must be >= 1, got {max_seq_len}")
        if config.learned_positions and max_seq_len > config.learned_positions:
            raise ValueError(
                f"Transformer: max_seq_len={max_seq_len} exceeds config {config.name!r}'s "
                f"learned_positions={config.learned_positions}; pass max_seq_len <= "
                f"{config.learned_positions}"
            )
        self.config = config
        self.max_seq_len = max_seq_len
        self.rope_theta = rope_theta
        c = config
        device = torch.get_default_device()  # e.g. set by `with torch.device("meta"):`
        with torch.device("meta"):  # skip nn's default init: init_weights does it once
            self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
            if c.learned_positions:
                self.pos_embeddings = nn.Embedding(c.learned_positions, c.dim)
            self.layers = nn.ModuleList(TransformerBlock(c, i, norm_eps) for i in range(c.n_layers))
            self.norm = _norm(c, norm_eps)
            self.output = nn.Linear(c.dim, c.vocab_size, bias=c.output_bias)
            if c.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight
            # Derived, not state: recomputed by init_weights, never saved. Its head dim is
            # the rotated width: head_dim (GQA) or qk_rope_head_dim (MLA). None: learned
            # positions, no rotation.
            rope = None
            if not c.learned_positions:
                rope = torch.empty(
                    max_seq_len, _rope_dim(c) // 2, dtype=torch.complex64, device="meta"
                )  # (S, rope_dim/2)
            self.register_buffer("rope", rope, persistent=False)
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights(seed)

    def transformer_blocks(self) -> list[TransformerBlock]:
        """The blocks to ``fully_shard`` one by one before the root (``self.layers``)."""
        return list(self.layers)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(B, S, vocab)`` for ``tokens`` ``(B, S)`` (int64 ids < vocab_size)."""
        if tokens.dim() != 2:
            raise ValueError(f"Transformer: tokens must be (batch, seq), got {tuple(tokens.shape)}")
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(
                f"Transformer: sequence length {tokens.shape[1]} exceeds max_seq_len="
                f"{self.max_seq_len}; build the model with a larger max_seq_len"
            )
        h = self.tok_embeddings(tokens)  # (B, S, D)
        if self.config.learned_positions:
            positions = torch.arange(tokens.shape[1], device=tokens.device)  # (S,)
            h = h + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h, self.rope)
        h = self.norm(h)
        if self.config.tie_embeddings:
            # One unit-scale embedding serves both ends: as T5 does with a tied head, scale
            # the head's input so that logits start at unit scale (and SGD stays stable).
            h = h * self.config.dim**-0.5
        return self.output(h)

    # --- initialisation ------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter and the rotary table deterministically.

        Works on plain parameters and on sharded DTensor parameters (each rank writes
        its own part of the same full value). See [Note: deterministic init].

        Args:
            seed: the init seed. Default 0.
        """
        c = self.config
        if c.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # nn.Module.to_empty() replaces each module's parameter separately, which unties
            # a plain (unsharded) model; tie again.
            self.output.weight = self.tok_embeddings.weight
        if self.rope is not None:
            self.rope.copy_(rotary_table(self.max_seq_len, _rope_dim(c), self.rope_theta))
        for fqn, param in self.named_parameters():
            _write_full(param, _init_value(fqn, tuple(param.shape), c, seed))

    def reset_parameters(self) -> None:
        """``init_weights(0)``: the nn.Module convention."""
        self.init_weights(0)


def _init_std(fqn: str, c: TransformerConfig) -> float | None:
    """Std of the truncated normal for ``fqn``; None for norm scales (ones) and biases (zeros).

    torchtitan's scheme: 0.02 for input projections, a depth-scaled 0.02 / sqrt(2 (i + 1))
    for the projections that write the residual stream, dim^-1/2 for the output head, and
    1.0 for the embedding (tied too: ``forward`` then scales the head's input by dim^-1/2).
    """
    name = fqn.rsplit(".", 1)[-1]
    if "norm." in fqn or name == "bias":
        return None
    if fqn == "tok_embeddings.weight":
        return 1.0
    if fqn == "pos_embeddings.weight":
        return 0.02
    if fqn == "output.weight":
        return c.dim**-0.5
    layer = int(fqn.split(".")[1])
    depth_std = 0.02 / math.sqrt(2 * (layer + 1))
    if fqn.endswith(("attention.wo.weight", ".w2.weight", ".w3.weight", ".w2", ".w3")):
        return depth_std
    return 0.02


def _init_value(fqn: str, shape: tuple[int, ...], c: TransformerConfig, seed: int) -> Tensor:
    """The full fp32 CPU value of parameter ``fqn``: a function of (seed, fqn, shape) only."""
    std = _init_std(fqn, c)
    if std is None:
        fill = 0.0 if fqn.endswith(".bias") else 1.0
        return torch.full(shape, fill, device="cpu")
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    # Normal truncated at +-3 std by inverse CDF, in one pass (torch's trunc_normal_ loops).
    lo, hi = (math.erf(z / math.sqrt(2.0)) for z in (-3.0, 3.0))  # 2 * cdf(z) - 1
    value = torch.empty(shape, device="cpu").uniform_(lo, hi, generator=gen).erfinv_()
    return value.mul_(std * math.sqrt(2.0)).clamp_(-3 * std, 3 * std)


def _write_full(param: Tensor, full: Tensor) -> None:
    """Write ``full`` (the whole value) into ``param``, or its local part if it is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full value, so no communication.
        part = distribute_tensor(
            full.to(param.device, param.dtype),
            param.device_mesh,
            param.placements,
            src_data_rank=None,
        )
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(full)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy (fp32) of ``logits`` (B, S, V) against ``targets`` (B, S)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
