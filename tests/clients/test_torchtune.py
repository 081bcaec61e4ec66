"""torchtune 0.6.1's distributed finetune recipes on raggedfsdp, against FSDP2.

torchtune's own recipes, ``full_finetune_distributed`` and ``lora_finetune_distributed``
(the files its wheel installs in ``recipes/``, loaded by path as ``tune run`` loads
them), each run as its ``recipe_main`` runs it (``Recipe(cfg)``, ``setup(cfg)``,
``train()``) from a config like the shipped ones, on 2 gloo ranks, twice in the same
processes: with the name torchtune shards through,
``torchtune.training._distributed.fully_shard`` (its ``shard_model`` calls it), as
imported (torch's FSDP2), then bound to ``raggedfsdp.fully_shard``. Nothing else differs.

Everything is made in the test's temporary folder, nothing downloaded: a byte-level
tiktoken file (the 256 bytes, no merges) and a ``tokenizer.json``-style file of Llama 3's
named special tokens numbered from 256, for torchtune's own ``llama3_tokenizer``; a
JSON-lines text dataset read by torchtune's ``text_completion_dataset``; a tiny
``llama3`` (2 layers, width 32, vocabulary 267: the bytes and 11 special tokens) saved
as the base checkpoint that the ``FullModelTorchTuneCheckpointer`` loads. The configs
keep the shipped ones' defaults (fused AdamW, ``CEWithChunkedOutputLoss``,
``fsdp_reshard_after_forward``, no activation checkpointing) but fp32 (the shipped dtype
is bf16), the CPU, and the sizes.

Cases:

- **full finetune**: two epochs of two steps; the recipe saves a checkpoint at each
  epoch's end (after epoch 0 with the optimizer and recipe state); a second run with
  ``resume_from_checkpoint: true`` and ``checkpoint_files: [epoch_0/...]`` trains epoch
  1 again, as torchtune documents resuming.
- **full finetune, optimizer in backward** (``optimizer_in_bwd: true``): one optimizer
  per parameter stepped from a post-accumulate-grad hook.
- **LoRA finetune**: ``lora_llama3`` (LoRA on q/v projections), two steps. The recipe
  builds the model on ``meta``, shards it, then ``to_empty`` + ``initialize_parameters``
  on each ``LoRALinear`` (inside a sharded group) and loads the base weights.

Checked: the losses torchtune logs (its ``DiskLogger``'s file, rank 0's, the mean over
all tokens of both ranks), the resumed ones and the final parameters lie within the
bound derived from FSDP2's own run nudged on the same ranks ([Note: derived tolerances]
in ``tests/numerics.py``); each backend's resumed losses equal its uninterrupted ones
bitwise; FSDP2's loss fell.

Shims, each applied to both backends alike, none knowing about raggedfsdp:

1. **Process group.** The suite's harness (``tests/harness.py``) starts gloo; the full
   recipe's ``__init__`` calls ``init_process_group`` itself (the LoRA one leaves it to
   ``recipe_main``), so the recipe module's name is bound to one that skips an existing
   group; ``cleanup()`` (which destroys it) is replaced by closing the metric logger.
2. **Memory statistics on the CPU.** Both recipes call ``training.get_memory_stats`` on
   rank 0 after building the model, which raises on a CPU ("Logging memory stats is not
   supported on CPU devices"), and ``training.cleanup_before_training``, which calls
   ``torch.cpu.empty_cache`` / ``reset_peak_memory_stats`` (torch 2.13 has neither):
   the first returns zeros, the second only collects garbage.
3. **Same LoRA initial weights.** On the CPU torch's DTensor has no RNG tracker, so
   ``initialize_parameters``'s Kaiming draw into a sharded ``lora_a`` depends on how it is
   sharded (FSDP2's even rows, raggedfsdp's own). After ``setup`` the shim draws each
   ``lora_a`` full tensor from one seeded generator (torchtune's init: Kaiming uniform,
   ``a=sqrt(5)``) and copies its piece into the parameter (``distribute_tensor`` to its
   mesh and placements), checked by ``full_tensor()``; ``lora_b`` stays the recipe's zeros.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import os
import random
from functools import partial

import pytest

from tests.harness import run_cases, spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtune") is None,
    reason="torchtune is not installed: `make test-clients` installs the clients extra",
)

WORLD = 2
BATCH = 2  # per rank
STEPS_PER_EPOCH = 2
MAX_SEQ = 64
LAYERS, DIM, HEADS, KV_HEADS, HIDDEN = 2, 32, 4, 2, 64
LORA_RANK = 4


# ---- local assets ---------------------------------------------------------------------------
def _special_tokens() -> dict[str, int]:
    """Llama 3's named special tokens (no reserved ones), numbered after the 256 bytes."""
    from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS

    names = [k for k in LLAMA3_SPECIAL_TOKENS if "reserved" not in k]
    return {name: 256 + i for i, name in enumerate(names)}


def _vocab() -> int:
    return 256 + len(_special_tokens())


def _model_kwargs() -> dict:
    return dict(
        vocab_size=_vocab(),
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        embed_dim=DIM,
        max_seq_len=MAX_SEQ,
        intermediate_dim=HIDDEN,
    )


def _make_assets(folder: str) -> None:
    """The tokenizer files, the dataset and the base checkpoint (module docstring)."""
    import torch
    from torchtune.models.llama3 import llama3

    with open(os.path.join(folder, "bytes.tiktoken"), "w") as f:
        for i in range(256):
            f.write(f"{base64.b64encode(bytes([i])).decode()} {i}\n")
    added = [{"id": i, "content": name} for name, i in _special_tokens().items()]
    with open(os.path.join(folder, "special_tokens.json"), "w") as f:
        json.dump({"added_tokens": added}, f)

    rng = random.Random(0)
    words = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa"]
    with open(os.path.join(folder, "data.json"), "w") as f:
        for _ in range(WORLD * BATCH * STEPS_PER_EPOCH):  # one epoch
            text = " ".join(rng.choices(words, k=rng.randint(8, 14)))
            f.write(json.dumps({"text": text}) + "\n")

    base = os.path.join(folder, "base")
    os.makedirs(base)
    torch.manual_seed(0)
    torch.save(llama3(**_model_kwargs()).state_dict(), os.path.join(base, "model.pt"))


def _config(kind: str, assets: str, out: str, **overrides):
    """A config like the shipped llama3_2 ``*_finetune_distributed`` ones (module
    docstring), ``kind`` "full" or "lora"."""
    from omegaconf import OmegaConf

    model = {"_component_": "torchtune.models.llama3.llama3", **_model_kwargs()}
    if kind == "lora":
        model.update(
            _component_="torchtune.models.llama3.lora_llama3",
            lora_attn_modules=["q_proj", "v_proj"],
            apply_lora_to_mlp=False,
            apply_lora_to_output=False,
            lora_rank=LORA_RANK,
            lora_alpha=2 * LORA_RANK,
            lora_dropout=0.0,
        )
    cfg = {
        "output_dir": out,
        "tokenizer": {
            "_component_": "torchtune.models.llama3.llama3_tokenizer",
            "path": os.path.join(assets, "bytes.tiktoken"),
            "special_tokens_path": os.path.join(assets, "special_tokens.json"),
            "max_seq_len": MAX_SEQ,
        },
        "dataset": {
            "_component_": "torchtune.datasets.text_completion_dataset",
            "source": "json",
            "data_files": os.path.join(assets, "data.json"),
            "column": "text",
            "split": "train",
            "packed": False,
        },
        "seed": 0,
        "shuffle": False,
        "model": model,
        "checkpointer": {
            "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
            "checkpoint_dir": os.path.join(assets, "base"),
            "checkpoint_files": ["model.pt"],
            "recipe_checkpoint": None,
            "output_dir": out,
            "model_type": "LLAMA3",
        },
        "resume_from_checkpoint": False,
        "batch_size": BATCH,
        "epochs": 2 if kind == "full" else 1,
        "max_steps_per_epoch": STEPS_PER_EPOCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "_component_": "torch.optim.AdamW",
            "lr": 1e-2 if kind == "full" else 3e-2,
            "fused": True,
        },
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "clip_grad_norm": None,
        "compile": False,
        "optimizer_in_bwd": False,
        "device": "cpu",
        "dtype": "fp32",
        "enable_activation_checkpointing": False,
        "enable_activation_offloading": False,
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.DiskLogger",
            "log_dir": os.path.join(out, "logs"),
            "filename": "log.txt",
        },
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,
    }
    if kind == "lora":
        cfg["save_adapter_weights_only"] = False
        cfg["lr_scheduler"] = {
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 0,
        }
    cfg.update(overrides)
    return OmegaConf.create(cfg)


# ---- the recipes, as `tune run` finds them --------------------------------------------------
def _recipe_module(name: str):
    """The recipe file ``recipes/<name>.py`` beside the ``torchtune`` package, loaded once
    per process (its ``recipes/__init__.py`` refuses a package import; ``tune run`` runs
    the file by path)."""
    import importlib.util
    import sys
    from pathlib import Path

    import torchtune

    key = f"torchtune_recipe_{name}"
    if key not in sys.modules:
        path = Path(torchtune.__file__).parent.parent / "recipes" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


# ---- the shims (both backends alike) --------------------------------------------------------
def _apply_cpu_shims() -> None:
    import gc

    import torch.distributed as dist
    from torchtune import training

    # 1. the harness's process group stands
    def init_process_group(*args, **kwargs):
        if not dist.is_initialized():
            dist.init_process_group(*args, **kwargs)

    _recipe_module("full_finetune_distributed").init_process_group = init_process_group

    # 2. memory statistics on the CPU
    def get_memory_stats(device, reset_stats=True):
        return dict(peak_memory_active=0.0, peak_memory_alloc=0.0, peak_memory_reserved=0.0)

    training.get_memory_stats = get_memory_stats
    training.cleanup_before_training = gc.collect


def _same_lora_init(model, seed: int) -> None:
    """Shim 3: every ``lora_a`` from one seeded full draw; ``lora_b`` is checked to hold
    the recipe's zeros (its ``initialize_parameters`` after ``to_empty`` was seen)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:
                assert not param.full_tensor().any(), f"{name}: not the recipe's zeros"
            if "lora_a" not in name:
                continue
            assert isinstance(param, DTensor), name
            bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5))
            full = (torch.rand(param.shape, generator=gen) * 2 - 1) * bound
            local = distribute_tensor(full, param.device_mesh, param.placements).to_local()
            param.to_local().copy_(local)
            assert torch.equal(param.full_tensor(), full), f"{name}: the copy did not land"


# ---- one recipe run -------------------------------------------------------------------------
def _recipe(kind: str, cfg) -> dict:
    """``recipe_main`` less its process-group set-up and tear-down (shim 1).

    Returns:
        ``{"loss": [logged per-step losses], "params": {fqn: full tensor}}``.
    """
    import torch.distributed as dist

    if kind == "lora":
        Recipe = _recipe_module("lora_finetune_distributed").LoRAFinetuneRecipeDistributed
    else:
        Recipe = _recipe_module("full_finetune_distributed").FullFinetuneRecipeDistributed

    recipe = Recipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    if kind == "lora":
        _same_lora_init(recipe._model, seed=1)
    recipe.train()
    losses = None
    if dist.get_rank() == 0:
        recipe._metric_logger.close()
        with open(os.path.join(cfg.metric_logger.log_dir, "log.txt")) as f:
            losses = [float(w[len("loss:") :]) for w in f.read().split() if w.startswith("loss:")]
    shared = [losses]
    dist.broadcast_object_list(shared, src=0)
    params = {k: v.detach().full_tensor() for k, v in recipe._model.named_parameters()}
    return {"loss": shared[0], "params": params}


def _full_then_resume(assets: str, out: str, **overrides) -> dict:
    """Two epochs; then the same job resumed from epoch 0's checkpoint."""
    import torch.distributed as dist

    done = _recipe("full", _config("full", assets, out, **overrides))
    dist.barrier()
    shard = sorted(os.listdir(os.path.join(out, "epoch_0")))
    weights = [f for f in shard if f.startswith("model-") and f.endswith(".bin")]
    assert len(weights) == 1, shard
    resumed = _recipe("full", _resume_config(assets, out, f"epoch_0/{weights[0]}", **overrides))
    return {"loss": done["loss"], "resumed": resumed["loss"], "params": done["params"]}


def _resume_config(assets: str, out: str, weights: str, **overrides):
    cfg = _config("full", assets, out, resume_from_checkpoint=True, **overrides)
    cfg.checkpointer.checkpoint_files = [weights]
    cfg.metric_logger.log_dir = os.path.join(out, "logs_resumed")
    return cfg


# ---- the grid -------------------------------------------------------------------------------
CASES = {
    "full_finetune": ("full", {}),
    "full_finetune_optimizer_in_bwd": ("full", {"optimizer_in_bwd": True}),
    "lora_finetune": ("lora", {}),
}


def _against_fsdp2(name: str, assets: str, folder: str) -> None:
    import torch.distributed as dist
    import torchtune.training._distributed as tt_distributed

    import raggedfsdp
    from tests.numerics import assert_losses_match, assert_param_matches, reference

    kind, overrides = CASES[name]
    runs = iter(range(100))
    torch_fully_shard = tt_distributed.fully_shard

    def run(fully_shard):
        out = os.path.join(folder, f"{name}_{next(runs)}")
        tt_distributed.fully_shard = fully_shard  # the switch, by import alone
        try:
            if kind == "lora":
                return _recipe("lora", _config("lora", assets, out, **overrides))
            return _full_then_resume(assets, out, **overrides)
        finally:
            tt_distributed.fully_shard = torch_fully_shard
            dist.barrier()

    ref = reference(partial(run, torch_fully_shard))
    ours = run(raggedfsdp.fully_shard)
    what = f"{name}, against FSDP2: "
    tokens = WORLD * BATCH * MAX_SEQ  # at most, per step
    for series in ref.series:
        assert_losses_match(ours[series], ref, world=WORLD, tokens=tokens, what=what, series=series)
    steps = len(ref.losses)
    for fqn, p in ours["params"].items():
        assert_param_matches(fqn, p, ref, steps=steps, what=what)
    if "resumed" in ref.series:
        for backend, got in (("FSDP2", ref.series), ("raggedfsdp", ours)):
            assert got["resumed"] == got["loss"][STEPS_PER_EPOCH:], (
                f"{what}{backend}'s resumed losses {got['resumed']} are not its "
                f"uninterrupted steps {got['loss'][STEPS_PER_EPOCH:]}"
            )
    assert ref.losses[-1] < ref.losses[0], f"{what}FSDP2's loss did not fall: {ref.losses}"


def _grid(rank: int, world: int, assets: str, folder: str) -> None:
    os.environ.update(
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=os.path.join(folder, f"hf_cache_rank{rank}"),
    )
    _apply_cpu_shims()
    run_cases({name: partial(_against_fsdp2, name, assets, folder) for name in CASES})


def test_torchtune_recipes_against_fsdp2(tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    _make_assets(str(assets))
    spawn(WORLD, _grid, str(assets), str(tmp_path), timeout=600)
