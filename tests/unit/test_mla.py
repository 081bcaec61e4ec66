"""DeepSeek-V3's multi-head latent attention: catalogue shapes, training, causality, math."""

import copy
import dataclasses
import math

import pytest
import torch

from raggedfsdp.models import Transformer, get_config, lm_loss, num_params, param_groups
from raggedfsdp.models.transformer import MLAttention
from tests.numerics import assert_close_to_reference

CPU = torch.device("cpu")

# moe-tiny (block 0 dense, block 1 MoE) with an MLA block of awkward small sizes.
TINY_MLA = dataclasses.replace(
    get_config("moe-tiny"),
    name="mla-tiny",
    n_kv_heads=3,
    attention="mla",
    q_lora_rank=24,
    kv_lora_rank=20,
    qk_nope_head_dim=10,
    qk_rope_head_dim=6,
    v_head_dim=14,
    n_shared_experts=1,
)


pytestmark = pytest.mark.numerics


@pytest.fixture(autouse=True)
def _two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _catalogue(config):
    return [(p.fqn, p.shape) for g in param_groups(config) for p in g.params]


def test_deepseek_v3_params_match_the_catalogue_on_meta():
    # One dense block (DeepSeek-V3's first 3 are dense) and one MoE block.
    config = dataclasses.replace(get_config("deepseek-v3"), n_layers=2, n_dense_layers=1)
    assert [g.kind for g in param_groups(config)] == ["embed", "dense", "moe", "head"]
    with torch.device("meta"):
        model = Transformer(config, max_seq_len=128)
    assert all(p.is_meta for p in model.parameters())
    got = [(fqn, tuple(p.shape)) for fqn, p in model.named_parameters()]
    assert got == _catalogue(config)
    assert dict(got) == dict(_catalogue(config))
    assert sum(p.numel() for p in model.parameters()) == num_params(config)
    assert isinstance(model.layers[0].attention, MLAttention) and not model.layers[0].is_moe
    assert model.layers[1].is_moe and model.layers[1].moe.shared_experts is not None
    assert model.layers[1].attention.wq_b.weight.shape == (128 * (128 + 64), 1536)
    assert model.rope.shape == (128, 64 // 2)  # rotary table over qk_rope_head_dim


def test_tiny_mla_matches_the_catalogue_and_meta_init_equals_cpu_init():
    cpu = Transformer(TINY_MLA, seed=5, max_seq_len=32)
    assert [(f, tuple(p.shape)) for f, p in cpu.named_parameters()] == _catalogue(TINY_MLA)
    with torch.device("meta"):
        meta = Transformer(TINY_MLA, seed=5, max_seq_len=32)
    meta.to_empty(device=CPU)
    meta.init_weights(5)
    want = dict(cpu.named_parameters())
    for fqn, p in meta.named_parameters():
        assert torch.equal(p, want[fqn]), fqn
    assert torch.equal(meta.rope, cpu.rope)
    attn = cpu.layers[0].attention
    assert torch.equal(attn.q_norm.weight, torch.ones(24, device=CPU))


def test_tiny_mla_trains_and_is_causal():
    model = Transformer(TINY_MLA, seed=0, max_seq_len=32)
    g = torch.Generator(device=CPU).manual_seed(0)
    tokens = torch.randint(0, 256, (2, 17), generator=g, device=CPU)
    logits = model(tokens[:, :-1])  # (2, 16, vocab)
    loss = lm_loss(logits, tokens[:, 1:])
    assert torch.isfinite(loss)
    loss.backward()
    for block in model.layers:
        for fqn, p in block.attention.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), fqn
            assert p.grad.abs().sum() > 0, fqn

    with torch.no_grad():
        t = 9
        changed = tokens[:, :-1].clone()
        changed[:, t] = (changed[:, t] + 1) % 256
        before, after = model(tokens[:, :-1]), model(changed)
    assert torch.equal(after[:, :t], before[:, :t])  # the same rows, the same ops
    assert not torch.allclose(after[:, t:], before[:, t:])


def _rotate(x, theta):
    """Rotate consecutive pairs of ``x`` (S, d) at positions 0..S-1, written out by hand."""
    S, d = x.shape
    pos = torch.arange(S, dtype=torch.float64, device=CPU)[:, None]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=CPU) / d)
    angle = (pos * freq).to(x.dtype)  # (S, d/2)
    cos, sin = angle.cos(), angle.sin()
    a, b = x[:, 0::2], x[:, 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).reshape(S, d)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_mla(attn, x, theta, eps):
    """MLA for ``x`` (S, D), one head at a time with explicit matmuls and softmax."""
    S = x.shape[0]
    nope, rd, vd = attn.nope_dim, attn.rope_dim, attn.v_head_dim
    q_all = _rms(x @ attn.wq_a.weight.T, attn.q_norm.weight, eps) @ attn.wq_b.weight.T
    kv_a = x @ attn.wkv_a.weight.T
    latent, k_pe = kv_a[:, : attn.kv_lora_rank], kv_a[:, attn.kv_lora_rank :]
    k_pe = _rotate(k_pe, theta)  # shared by every head
    kv_all = _rms(latent, attn.kv_norm.weight, eps) @ attn.wkv_b.weight.T
    mask = torch.ones(S, S, dtype=torch.bool, device=CPU).triu(1)  # True: a later key
    heads = []
    for h in range(attn.n_heads):
        q = q_all[:, h * (nope + rd) : (h + 1) * (nope + rd)]
        q = torch.cat([q[:, :nope], _rotate(q[:, nope:], theta)], dim=-1)
        kv = kv_all[:, h * (nope + vd) : (h + 1) * (nope + vd)]
        k = torch.cat([kv[:, :nope], k_pe], dim=-1)
        v = kv[:, nope:]
        scores = (q @ k.T) / math.sqrt(nope + rd)  # (S, S)
        scores = scores.masked_fill(mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)  # (S, vd)
    return torch.cat(heads, dim=-1) @ attn.wo.weight.T


def test_mla_equals_a_per_head_reference():
    model = Transformer(TINY_MLA, seed=1, max_seq_len=32)
    attn = model.layers[1].attention
    g = torch.Generator(device=CPU).manual_seed(2)
    with torch.no_grad():  # unit-scale weights, so the comparison is not of tiny numbers
        for p in attn.parameters():
            fan_in = p.shape[-1] if p.dim() == 2 else 1
            p.copy_(torch.randn(p.shape, generator=g, device=CPU) / math.sqrt(fan_in))
    x = torch.randn(2, 12, TINY_MLA.dim, generator=g, device=CPU)
    with torch.no_grad():
        got = attn(x, model.rope)  # rotary in fp32 whatever the dtype: no float64 path
        attn64 = copy.deepcopy(attn).double()
        want, want64 = (
            torch.stack([_reference_mla(a, xb, model.rope_theta, attn.q_norm.eps) for xb in xs])
            for a, xs in ((attn, x), (attn64, x.double()))
        )
    assert got.abs().mean() > 0.1
    assert_close_to_reference(got, want, want64, terms=TINY_MLA.dim)


def test_mla_config_errors():
    with pytest.raises(ValueError, match=r"'mla-tiny' has attention='mla' but q_lora_rank=0"):
        Transformer(dataclasses.replace(TINY_MLA, q_lora_rank=0))
    with pytest.raises(ValueError, match=r"qk_rope_head_dim must be even .* got 5"):
        Transformer(dataclasses.replace(TINY_MLA, qk_rope_head_dim=5))
