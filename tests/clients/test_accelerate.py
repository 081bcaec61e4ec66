"""Hugging Face accelerate's FSDP2 loading with ``cpu_ram_efficient_loading`` on raggedfsdp.

A tiny Llama (``LlamaConfig``: vocabulary 128, hidden 32, 2 layers, 4 heads, intermediate
64; no download), saved with ``save_pretrained`` to the test's temporary folder. On 2 gloo
ranks, the same recipe runs twice in the same processes, FSDP2's first, before raggedfsdp
is imported:

1. an ``Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
   cpu_ram_efficient_loading=True, auto_wrap_policy="transformer_based_wrap",
   reshard_after_forward=True))``;
2. the model as ``cpu_ram_efficient_loading`` expects it: real weights on rank 0 only
   (``LlamaForCausalLM.from_pretrained``), the parameters of every other rank on ``meta``
   (``LlamaForCausalLM(config)`` under ``accelerate.init_empty_weights()``; its buffers,
   the rotary frequencies, stay real, as accelerate needs them);
3. accelerate's own ``accelerate.utils.fsdp_utils.fsdp2_prepare_model(accelerator, model)``:
   the model to ``meta``, ``fully_shard`` on each ``LlamaDecoderLayer``, the embedding, the
   final norm with ``lm_head``, then the root, then ``fsdp2_load_full_state_dict``
   (rank 0 broadcasts each full tensor, each rank passes it to ``distribute_tensor``, then
   ``model.load_state_dict(sharded_sd, assign=True)``), then the non-persistent buffers
   put back;
4. three AdamW steps on one fixed token batch, each rank its own rows, the global loss
   all-reduced (the same batch each step, so the loss must fall).

The two runs differ in one name only: accelerate imports ``fully_shard`` inside
``fsdp2_prepare_model`` (``from torch.distributed.fsdp import FSDPModule,
MixedPrecisionPolicy, fully_shard``), so the second run binds
``torch.distributed.fsdp.fully_shard`` to ``raggedfsdp.fully_shard`` for the call and puts
it back after. ``FSDPModule`` stays torch's: raggedfsdp's modules are its subclasses.

Checked: after loading, every parameter's ``full_tensor()`` equals the saved weights
bitwise (what rank 0 loaded), and under raggedfsdp every parameter is a ``DTensor`` whose
local tensor lies in the shard storage of one of the model's flat buffers
(``raggedfsdp.fsdp.buffers_of``), so the assigning load did not leave parameters outside
them; the losses and the trained weights equal FSDP2's (fp32: ``TOL``).

Set up by hand instead of accelerate, and why. accelerate enables FSDP only for
accelerator distributed types: ``AcceleratorState`` makes ``distributed_type`` ``FSDP``
and keeps the plugin (``state.fsdp_plugin``) only when it is ``MULTI_GPU`` / ``MULTI_NPU``
/ ... , never ``MULTI_CPU``, so on a CPU ``Accelerator.prepare`` never shards and
``state.fsdp_plugin`` is unset. The test therefore

- sets the variables a launcher (``torchrun`` or ``accelerate launch``) would set,
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, so that
  ``Accelerator(cpu=True)`` sees ``MULTI_CPU`` and takes its rank and world from the gloo
  process group that the suite's harness (``tests/harness.py``) has already started
  (accelerate initialises none when one exists);
- passes the plugin to ``Accelerator`` as a user would (which sets
  ``ACCELERATE_USE_FSDP`` and ``FSDP_CPU_RAM_EFFICIENT_LOADING``) and then assigns
  ``accelerator.state.fsdp_plugin = plugin``: of what ``fsdp2_prepare_model`` reads
  from the accelerator (the plugin, ``is_main_process``, ``mixed_precision``, ``device``,
  ``torch_device_mesh``), the one attribute the CPU gate leaves unset;
- calls ``fsdp2_prepare_model`` itself, as ``Accelerator._prepare_fsdp2`` does under
  ``prepare`` (the optimizer is made after it, so there are no parameters to swap);
- builds the non-zero ranks' model under ``init_empty_weights``: transformers 5.23's
  ``from_pretrained`` reads the checkpoint on every rank even with
  ``FSDP_CPU_RAM_EFFICIENT_LOADING`` set (it only skips materialising the keys it did not
  load), so without it the other ranks would hold real weights and the test would not
  cover the ``meta`` model that ``cpu_ram_efficient_loading`` is for.

Nothing of this knows about raggedfsdp, and all of it is the same for both runs.
"""

from __future__ import annotations

import os

import pytest

from tests.harness import spawn

for _package in ("accelerate", "transformers"):
    pytest.importorskip(
        _package,
        reason=f"{_package} is not installed: `make test-clients` installs the clients extra",
    )

WORLD = 2
STEPS = 3
ROWS = 2  # per rank
SEQ = 16
VOCAB = 128
TOL = 1e-5


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _launcher_env(rank: int, world: int) -> None:
    """What ``torchrun`` / ``accelerate launch`` would export (see the module docstring)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )


def _accelerator():
    """An ``Accelerator`` on the CPU carrying an FSDP2 plugin with
    ``cpu_ram_efficient_loading`` (see the module docstring for the one assignment)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=True,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    accelerator.state.fsdp_plugin = plugin  # the CPU gate leaves it unset
    assert os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING") == "True"
    return accelerator


def _build(accelerator, path: str):
    """Rank 0: the checkpoint's weights; every other rank: parameters on ``meta``."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    if accelerator.is_main_process:
        model = LlamaForCausalLM.from_pretrained(path)
        assert all(p.device.type == "cpu" for p in model.parameters())
    else:
        with init_empty_weights():
            model = LlamaForCausalLM(_config())
        assert all(p.is_meta for p in model.parameters())
        assert not any(b.is_meta for b in model.buffers())
    return model


def _check_in_buffers(model) -> None:
    """Every parameter is a DTensor whose local tensor lies in a flat buffer's shard."""
    from torch.distributed.tensor import DTensor

    from raggedfsdp.fsdp import buffers_of

    bufs = buffers_of(model)
    assert bufs, "no raggedfsdp buffers in the prepared model"
    storages = {buf.shard.untyped_storage().data_ptr() for buf in bufs}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name}: a {type(p).__name__}, not a DTensor"
        local = p.to_local()
        assert not local.is_meta, f"{name}: still on meta after loading"
        ptr = local.untyped_storage().data_ptr()
        assert ptr in storages, f"{name}: its local tensor is not a view of a flat buffer"


def _run(rank: int, world: int, path: str, full_sd: dict, batch, ragged: bool) -> dict:
    import torch
    import torch.distributed as dist
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.tensor import DTensor

    accelerator = _accelerator()
    assert accelerator.process_index == rank and accelerator.num_processes == world
    model = _build(accelerator, path)
    model = fsdp2_prepare_model(accelerator, model)

    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name}: not sharded"
        assert torch.equal(p.full_tensor(), full_sd[name]), f"{name}: loaded value differs"
    if ragged:
        _check_in_buffers(model)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    model.train()
    ids = batch[rank]
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _against_fsdp2(rank: int, world: int, path: str, full_sd: dict) -> None:
    import torch
    import torch.distributed.fsdp as torch_fsdp

    _launcher_env(rank, world)
    gen = torch.Generator().manual_seed(3)
    batch = torch.randint(3, VOCAB, (world, ROWS, SEQ), generator=gen)

    ref = _run(rank, world, path, full_sd, batch, ragged=False)

    import raggedfsdp  # after FSDP2's run

    torch_fully_shard = torch_fsdp.fully_shard
    torch_fsdp.fully_shard = raggedfsdp.fully_shard  # the name fsdp2_prepare_model imports
    try:
        ours = _run(rank, world, path, full_sd, batch, ragged=True)
    finally:
        torch_fsdp.fully_shard = torch_fully_shard

    worst = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))
    assert worst <= TOL, f"losses differ by {worst:.3g}: {ours['losses']} vs {ref['losses']}"
    assert all(b < a for a, b in zip(ref["losses"], ref["losses"][1:])), (
        f"FSDP2's loss did not fall: {ref['losses']}"
    )
    for name, p in ref["params"].items():
        torch.testing.assert_close(ours["params"][name], p, atol=TOL, rtol=TOL, msg=name)


def test_accelerate_cpu_ram_efficient_loading_against_fsdp2(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    model.save_pretrained(tmp_path)
    full_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spawn(WORLD, _against_fsdp2, str(tmp_path), full_sd, timeout=300)
