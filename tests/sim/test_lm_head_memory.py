"""Per-rank peak of one AdamW step at 16,384 fake ranks, against FSDP2: a language model
whose head has a 32,000-element bias (vocabulary 32,000, width 64, two blocks; each block
and then the root passed to ``fully_shard``), built on ``meta`` and stepped under
``FakeTensorMode`` over torch's fake process group, measured by torch's ``MemTracker``.

While a 1-D tensor was one indivisible block, the bias set every rank's shard size of the
root group to 32,000 elements: 24x FSDP2's peak here (2,063 MiB against 85 MiB).
"""

import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import raggedfsdp
from raggedfsdp.tools.simulate import fake_world

VOCAB, DIM, WORLD = 32_000, 64, 16_384


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _peak(fully_shard) -> int:
    with fake_world(WORLD) as mesh, FakeTensorMode():
        with torch.device("meta"):
            model = _LM()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, VOCAB, (1, 128))

        def step():
            model(tokens).float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()

        step()  # the optimizer state exists from here, as in steady state
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        return max(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())


def test_peak_at_most_fsdp2s_with_a_large_bias():
    ours, fsdp2 = _peak(raggedfsdp.fully_shard), _peak(torch_fsdp.fully_shard)
    assert ours <= fsdp2, f"per-rank peak {ours / 2**20:.1f} MiB, FSDP2's {fsdp2 / 2**20:.1f} MiB"
