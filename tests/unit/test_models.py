"""The trainable models: catalogue FQNs and shapes, meta init, MoE routing, training."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from raggedfsdp.models import (
    SMALL_CONFIGS,
    Transformer,
    get_config,
    lm_loss,
    num_params,
    param_groups,
)
from raggedfsdp.models.transformer import MoE, apply_rotary, rotary_table
from raggedfsdp.train.data import DataConfig, get_batch, load_corpus
from tests.numerics import assert_close_to_reference

F32 = torch.float32

NAMES = sorted(SMALL_CONFIGS)


@pytest.fixture(autouse=True)
def _two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _tokens(batch=4, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq + 1), generator=g)


@pytest.mark.parametrize("name", NAMES)
def test_params_match_the_catalogue(name):
    config = get_config(name)
    model = Transformer(config)
    got = [(fqn, tuple(p.shape)) for fqn, p in model.named_parameters()]
    want = [(p.fqn, p.shape) for g in param_groups(config) for p in g.params]
    assert got == want
    assert sum(p.numel() for p in model.parameters()) == num_params(config)
    # every catalogue group is a module of the model (the fully_shard unit)
    for group in param_groups(config):
        if group.name.startswith("layers."):
            assert model.get_submodule(group.name) is model.layers[int(group.name.split(".")[1])]


def test_small_configs_are_registered_and_awkward():
    for name in ("llama-tiny", "llama-small", "moe-tiny", "moe-small"):
        c = get_config(name)
        assert c.vocab_size == 1001
    assert get_config("llama-tiny").dim == 96 and get_config("llama-tiny").n_heads == 3
    moe = get_config("moe-tiny")
    assert (moe.n_experts, moe.top_k) == (6, 2)
    assert [g.kind for g in param_groups(moe)] == ["embed", "dense", "moe", "head"]


def test_tied_embeddings_share_one_parameter():
    model = Transformer(get_config("llama-tiny-tied"))
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())
    head = [g for g in param_groups(model.config) if g.name == "head"][0]
    assert [p.fqn for p in head.params] == ["norm.weight"]


@pytest.mark.parametrize("name", NAMES)
def test_meta_init_equals_cpu_init(name):
    config = get_config(name)
    cpu = Transformer(config, seed=3, max_seq_len=64)
    with torch.device("meta"):
        meta = Transformer(config, seed=3, max_seq_len=64)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    assert (meta.output.weight is meta.tok_embeddings.weight) == config.tie_embeddings
    cpu_params = dict(cpu.named_parameters())
    for fqn, p in meta.named_parameters():
        assert torch.equal(p, cpu_params[fqn]), fqn
    assert torch.equal(meta.rope, cpu.rope)
    assert "rope" not in meta.state_dict()  # derived, not saved
    x = _tokens(seq=16)[:, :-1]
    torch.testing.assert_close(meta(x), cpu(x), rtol=0, atol=0)


def test_init_ignores_the_ambient_device():
    """The values are drawn on the CPU whatever ``with torch.device(...)`` is around.

    Found on a GPU: ``with torch.device("cuda"): Transformer(cfg)`` failed, its CPU
    generator meeting a tensor created on the ambient device. The meta device stands
    in for any device that is not the CPU.
    """
    config = get_config("moe-tiny")
    reference = Transformer(config, seed=4, max_seq_len=32)
    model = Transformer(config, seed=0, max_seq_len=32)
    with torch.device("meta"):
        model.init_weights(4)
    for (fqn, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), fqn
    assert torch.equal(model.rope, reference.rope)
    with torch.device("meta"):
        assert rotary_table(8, 4, 1e4).device == torch.device("cpu")


def test_init_depends_on_seed_only():
    config = get_config("moe-tiny")
    a, b, c = Transformer(config, seed=1), Transformer(config, seed=1), Transformer(config, seed=2)
    for (fqn, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), fqn
        if "norm" not in fqn:
            assert not torch.equal(pa, pc), fqn
    a.reset_parameters()
    assert torch.equal(
        a.layers[1].moe.experts.w1, Transformer(config, seed=0).layers[1].moe.experts.w1
    )


@pytest.mark.parametrize("name", ["llama-tiny", "moe-tiny", "llama-tiny-tied"])
def test_sgd_reduces_the_loss(name):
    model = Transformer(get_config(name), seed=0, max_seq_len=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    text = load_corpus(DataConfig(max_bytes=1 << 16)).train
    x, y = get_batch(text, seed=0, step=0, batch_size=8, seq_len=64)
    losses = []
    for _ in range(8):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # smooth, no spikes
    assert losses[-1] < losses[0] - 0.8, losses


def test_forward_backward_is_deterministic():
    config = get_config("moe-tiny")
    batch = _tokens()
    grads = []
    for _ in range(2):
        model = Transformer(config, seed=0)
        lm_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)


def _naive_moe(moe: MoE, x):
    """Token by token: softmax, top-k, renormalise, each chosen expert, weighted sum."""
    ex = moe.experts
    out = []
    for t in x.reshape(-1, x.shape[-1]):  # t: (D,)
        probs = F.softmax(moe.router.gate(t), dim=-1, dtype=torch.promote_types(t.dtype, F32))
        w, idx = torch.topk(probs, moe.router.top_k)
        w = w / w.sum()
        y = torch.zeros_like(t)
        for wi, e in zip(w, idx.tolist()):
            h = F.silu(ex.w1[e] @ t) * (ex.w3[e] @ t)
            y = y + wi * (ex.w2[e] @ h)
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(t)
        out.append(y)
    return torch.stack(out).view(x.shape)


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["moe-tiny", "moe-small"])
def test_moe_computes_every_routed_token(name):
    config = get_config(name)
    model = Transformer(config, seed=0)
    moe = next(b.moe for b in model.layers if b.is_moe)
    x = torch.randn(3, 17, config.dim, generator=torch.Generator().manual_seed(0))
    want = _naive_moe(moe, x)
    got = moe(x)
    want64 = _naive_moe(copy.deepcopy(moe).double(), x.double())
    assert_close_to_reference(got, want, want64, terms=max(moe.experts.w2.shape[-1], config.dim))
    # every expert is used by 51 tokens x top-2 here, so every expert gets a gradient
    got.square().sum().backward()
    per_expert = moe.experts.w1.grad.flatten(1).abs().sum(1)
    assert (per_expert > 0).all()
    assert moe.router.gate.weight.grad.abs().sum() > 0


@pytest.mark.numerics
def test_moe_with_top_k_equal_to_every_expert():
    config = dataclasses.replace(get_config("moe-tiny"), name="moe-all", top_k=6)
    moe = next(b.moe for b in Transformer(config).layers if b.is_moe)
    x = torch.randn(2, 5, config.dim, generator=torch.Generator().manual_seed(1))
    want64 = _naive_moe(copy.deepcopy(moe).double(), x.double())
    terms = max(moe.experts.w2.shape[-1], config.dim)
    assert_close_to_reference(moe(x), _naive_moe(moe, x), want64, terms=terms)


def test_errors():
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds max_seq_len=64"):
        Transformer(get_config("llama-tiny"), max_seq_len=64)(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens must be \(batch, seq\), got \(5,\)"):
        Transformer(get_config("llama-tiny"))(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"top_k must be in \[1, n_experts=6\], got 7"):
        Transformer(dataclasses.replace(get_config("moe-tiny"), top_k=7))
    with pytest.raises(ValueError, match=r"n_heads \(3\) must be a multiple of n_kv_heads \(2\)"):
        Transformer(dataclasses.replace(get_config("llama-tiny"), n_kv_heads=2))
    with pytest.raises(ValueError, match=r"max_seq_len must be >= 1, got 0"):
        Transformer(get_config("llama-tiny"), max_seq_len=0)
    with torch.device("meta"):
        with pytest.raises(NotImplementedError, match=r"'gpt-oss-120b' has attn_sinks=True"):
            Transformer(get_config("gpt-oss-120b"))


def test_rotary_scores_depend_on_relative_position_only():
    table = rotary_table(16, 8, 10000.0)  # (16, 4) complex
    assert table.dtype == torch.complex64  # FSDP2's cast_forward_inputs leaves it alone
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)

    def score(i, j):  # q at position i, k at position j
        qi = apply_rotary(q.expand(1, 16, 1, 8), table)[0, i, 0]
        kj = apply_rotary(k.expand(1, 16, 1, 8), table)[0, j, 0]
        return qi @ kj

    torch.testing.assert_close(score(5, 2), score(13, 10))
    torch.testing.assert_close(score(0, 0), q.flatten() @ k.flatten())
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_param_counts():
    counts = {name: num_params(SMALL_CONFIGS[name]) for name in NAMES}
    assert counts == {
        "llama-small": 1_968_192,
        "llama-tiny": 391_584,
        "llama-tiny-tied": 295_488,
        "moe-small": 2_144_448,
        "moe-tiny": 393_312,
    }
