import time, statistics, torch
from torch.distributed.tensor import init_device_mesh
import raggedfsdp
from raggedfsdp.fsdp import _state as st
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from tests.harness import spawn

def run(rank, world):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = Transformer(get_config("llama-small"), max_seq_len=64, seed=0)
    for b in model.transformer_blocks():
        raggedfsdp.fully_shard(b, mesh=mesh)
    raggedfsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, 1000, (2, 65))
    def step():
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward(); opt.step(); opt.zero_grad()
    for _ in range(3): step()
    orig = st._any_rank_got_grad
    local = lambda pending: [r.got_grad or not r.requires_grad for g in pending for r in g.refs]
    times = {"with": [], "without": []}
    for i in range(40):
        which = "with" if i % 2 == 0 else "without"
        st._any_rank_got_grad = orig if which == "with" else local
        t0 = time.perf_counter(); step(); times[which].append(time.perf_counter() - t0)
    st._any_rank_got_grad = orig
    if rank == 0:
        w, wo = statistics.median(times["with"]), statistics.median(times["without"])
        print(f"step median with the flag all-reduce {w*1e3:.1f} ms, without {wo*1e3:.1f} ms, ratio {w/wo:.4f}")

if __name__ == "__main__":
    spawn(2, run)
