"""Hugging Face causal language models (``--model hf:DIR``): read the config, build the
model on ``meta``, name its decoder blocks, and fill the sharded parameters from the
directory's safetensors files, each rank reading its own rows.

``DIR`` is a local directory: ``config.json`` (any ``model_type`` that transformers builds
with ``AutoModelForCausalLM``), optionally ``*.safetensors`` weights. Nothing is ever
downloaded. transformers is optional: this module imports it only inside the functions
that need it, and says which extra to install when it is missing.

The recipe (``python -m raggedfsdp train`` and ``export`` follow it)::

    model = build_hf_model("hf:DIR")                       # meta: no storage
    parallelize(model, mesh, blocks=hf_blocks(model))      # each decoder layer, the root
    materialize_hf(model, "hf:DIR", device="cpu", seed=0)  # to_empty, then weights

[Note: reading Hugging Face weights]
Each rank reads only its own rows of each tensor from the safetensors files (safetensors'
``safe_open(...).get_slice``, which reads the byte range asked for); no rank ever holds a
full tensor, let alone the full model. The other way, rank 0 reading every tensor and
scattering it, makes rank 0 read the whole model and every other rank wait on it, and
costs a collective per tensor; reading in place costs nothing but each rank's own
bytes, and every rank can see the files on one machine (or a shared filesystem). Which
rows a rank holds comes from its parameter's placement: a ``RaggedShard`` (raggedfsdp)
gives rows ``[lo, hi)`` of the tensor viewed as ``(prod(shape[:k]), -1)``, ``k`` its
number of cut dims; FSDP2's ``Shard(0)`` gives torch.chunk's rows of dim 0; a replicated
or plain tensor is read whole. Stacked experts are two cut dims (``[E, out, in]`` cut
over ``E * out`` rows), so a rank's rows may start or end inside an expert: they are read
expert by expert, each the row range it holds.

A file may store a tensor under another layout than the module's: transformers 5 keeps
Mixture-of-Experts weights as one ``[E, out, in]`` stack per projection in the module
but saves them one matrix per expert (``mlp.experts.3.gate_proj.weight``), and fuses the
gate and up projections (``gate_up_proj``). The conversion transformers itself applies on
load (its checkpoint conversion mapping for the ``model_type``) is read here too: a stack
whose sources are per-expert matrices merged on dim 0 (``MergeModulelist(dim=0)``), then
optionally concatenated on dim 1 (``Concatenate(dim=1)``), is read row range by row
range from those matrices. Any other conversion is refused by name. Tensors stored as
the module holds them (what ``python -m raggedfsdp export --hf`` writes) are read as
they are.

Non-persistent buffers (the rotary frequencies) are computed again after ``to_empty``
by transformers' own ``init_weights``, with every parameter marked as initialised so
that it draws nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "HF_PREFIX",
    "HF_EXTRA",
    "build_hf_model",
    "check_hf_causal_lm",
    "hf_blocks",
    "hf_config",
    "check_hf_weights",
    "hf_directory",
    "hf_ffn_width",
    "hf_weight_files",
    "is_hf_model",
    "load_hf_weights",
    "logits_of",
    "materialize_hf",
    "named_hf_blocks",
]

HF_PREFIX = "hf:"
# What to install for transformers: the extra of pyproject.toml that holds it alone.
HF_EXTRA = "pip install 'raggedfsdp[hf]'"


def is_hf_model(model: str) -> bool:
    """``model`` names a Hugging Face directory (``hf:DIR``)."""
    return model.startswith(HF_PREFIX)


def hf_directory(model: str) -> Path:
    """``DIR`` of ``hf:DIR``."""
    return Path(model[len(HF_PREFIX) :])


def _import_transformers(model: str, who: str):
    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"{who}: --model {model} builds the model with Hugging Face transformers, which "
            f"is not installed; install it ({HF_EXTRA}, or pip install transformers) or pass "
            "a catalogue name"
        ) from None
    return transformers


def hf_config(model: str, *, who: str, layers: int | None = None) -> Any:
    """The transformers config of ``hf:DIR``, read from ``DIR/config.json`` alone, KV cache off.

    Args:
        model: ``hf:DIR``.
        who: the command named in errors (``"train"``, ``"simulate"``).
        layers: keep the first ``layers`` decoder layers. Default None: all.

    Raises:
        ValueError: ``DIR/config.json`` is missing or transformers cannot read it.
        ImportError: transformers is not installed.
    """
    directory = hf_directory(model)
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"{who}: --model {model}: {directory / 'config.json'} does not exist; pass "
            f"hf:DIR with DIR a directory holding a Hugging Face config.json"
        )
    transformers = _import_transformers(model, who)
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(
            f"{who}: --model {model}: transformers cannot read {directory / 'config.json'} "
            f"({type(e).__name__}: {e}); it needs a model_type that transformers knows"
        ) from None
    if layers is not None:
        config.num_hidden_layers = layers
    config.use_cache = False
    return config


def check_hf_causal_lm(model: str, *, who: str = "train") -> Any:
    """The config of ``hf:DIR`` if transformers builds it as a causal language model.

    Raises:
        ValueError: as ``hf_config``, or a ``model_type`` that is not a causal LM.
        ImportError: transformers is not installed.
    """
    config = hf_config(model, who=who)
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    where = hf_directory(model) / "config.json"
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{who}: --model {model}: model_type {config.model_type!r} of {where} is not a "
            "causal language model (AutoModelForCausalLM does not build it); pass a decoder "
            "such as llama, qwen3, qwen3_moe or gpt2"
        )
    if getattr(config, "is_encoder_decoder", False) or (
        config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ):
        head = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]
        raise NotImplementedError(
            f"{who}: --model {model}: model_type {config.model_type!r} of {where} is an "
            f"encoder (a masked or sequence-to-sequence model; its causal head {head} is not a "
            "decoder-only language model), which is not trained here; pass a decoder-only "
            "model such as llama, qwen3, qwen3_moe or gpt2"
        )
    return config


# The names transformers' configs give the feed-forward width, by architecture (GPT-2's
# ``n_inner``, None: 4 x ``n_embd``; T5's ``d_ff``; OPT's ``ffn_dim``).
_FFN_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size")


def hf_ffn_width(config: Any, hidden: int) -> int:
    """The dense feed-forward width of a config, whatever its architecture calls it
    (``_FFN_FIELDS``); ``4 * hidden`` (GPT-2's default) where it names none."""
    for name in _FFN_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * hidden


def build_hf_model(
    model: str,
    *,
    who: str = "train",
    layers: int | None = None,
    config: Any = None,
    dtype: torch.dtype | None = torch.float32,
) -> nn.Module:
    """``hf:DIR``'s causal LM on ``meta`` (``AutoModelForCausalLM.from_config``).

    Args:
        model: ``hf:DIR``.
        who: the command named in errors. Default ``"train"``.
        layers: keep the first ``layers`` decoder layers. Default None: all.
        config: the config, already read (``hf_config``). Default: read it.
        dtype: the parameters' dtype; None: the config's. Default fp32 (training keeps
            fp32 parameters; ``--bf16`` is a mixed-precision policy).
    """
    if config is None:
        config = hf_config(model, who=who, layers=layers)
    from transformers import AutoModelForCausalLM

    kwargs = {} if dtype is None else {"dtype": dtype}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def named_hf_blocks(
    model: nn.Module, *, also: tuple[type, ...] = ()
) -> list[tuple[str, nn.Module]]:
    """``(fqn, block)`` of the model's decoder blocks: the outermost modules of the classes
    in its ``_no_split_modules`` (the units Hugging Face itself names for wrapping) or of
    the types ``also`` (a checkpoint wrapper around one).

    Raises:
        ValueError: the model names no block class, or none of its modules is one.
    """
    classes = set(getattr(model, "_no_split_modules", None) or ())
    found: list[tuple[str, nn.Module]] = []
    for fqn, m in model.named_modules():
        inside = any(fqn.startswith(f"{outer}.") for outer, _ in found)
        if not inside and (isinstance(m, also) or type(m).__name__ in classes):
            found.append((fqn, m))
    if not found:
        raise ValueError(
            f"found no transformer blocks in {type(model).__name__} (its _no_split_modules "
            f"are {sorted(classes)}); a Hugging Face model must name its block class there"
        )
    return found


def hf_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks, ``fully_shard``-ed one by one before the root (``parallelize``)."""
    return [block for _, block in named_hf_blocks(model)]


def logits_of(output: Any) -> Tensor:
    """Logits ``(B, S, vocab)`` of a forward's output (a Hugging Face output's ``logits``)."""
    return output.logits if hasattr(output, "logits") else output


# ================================================================================================
# Weights
# ================================================================================================
def hf_weight_files(directory: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of ``directory``, sorted (empty: no weights)."""
    return sorted(Path(directory).glob("*.safetensors"))


@torch.no_grad()
def materialize_hf(
    model: nn.Module, source: str, *, device: torch.device | str, seed: int, weights: str = "auto"
) -> str:
    """Give the sharded model storage on ``device`` and its values, in place.

    Args:
        model: built by ``build_hf_model`` and sharded (``parallelize``), still on ``meta``.
        source: ``hf:DIR``.
        device: where the parameters live.
        seed: the seed of a random init (``torch.manual_seed``, then transformers'
            ``init_weights``; raggedfsdp draws each full tensor, so the values do not
            depend on the world size: [Note: random init of RaggedShard]).
        weights: ``"file"`` (read ``DIR``'s safetensors), ``"init"`` (random), ``"none"``
            (the buffers only: a checkpoint fills the parameters next) or ``"auto"``
            (``"file"`` where ``DIR`` holds safetensors files, else ``"init"``).
            Default ``"auto"``.

    Returns:
        What was done: ``"file"``, ``"init"`` or ``"none"``.
    """
    if weights == "auto":
        weights = "file" if hf_weight_files(hf_directory(source)) else "init"
    if weights not in ("file", "init", "none"):
        raise ValueError(
            f"materialize_hf: weights must be 'auto', 'file', 'init' or 'none', got {weights!r}"
        )
    model.to_empty(device=device)
    if weights == "init":
        torch.manual_seed(seed)
        model.init_weights()
        return weights
    # buffers only: see [Note: reading Hugging Face weights]
    params = list(model.parameters())
    for p in params:
        p._is_hf_initialized = True
    try:
        model.init_weights()
    finally:
        for p in params:
            del p._is_hf_initialized
    if weights == "file":
        load_hf_weights(model, hf_directory(source))
    return weights


@dataclasses.dataclass(frozen=True)
class _Part:
    """Rows ``[0, rows)`` of one member of a stack come from file tensor ``key``."""

    key: str
    rows: int


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where a module tensor of ``shape`` is in the files: as it is (``members`` None), or a
    stack whose member ``e`` is the concatenation on its dim 0 of ``members[e]``'s parts."""

    key: str  # the module's FQN
    shape: tuple[int, ...]
    members: tuple[tuple[_Part, ...], ...] | None = None


INDEX = "model.safetensors.index.json"


def _unreadable(path: Path, err: BaseException) -> ValueError:
    return ValueError(
        f"load_hf_weights: '{path}' is not a readable safetensors file ({type(err).__name__}: "
        f"{err}): truncated or damaged; save the weights again (save_pretrained) or copy the "
        "file again, or remove every *.safetensors file to start from a random init"
    )


class _Files:
    """The safetensors files of a directory: every tensor's file, under the name the module
    gives it (transformers' renamings of ``model_type`` applied), the handles opened once.

    Raises:
        ValueError: a shard that ``model.safetensors.index.json`` lists is missing, a file
            that is not readable safetensors (each named), or a tensor in two files.
    """

    def __init__(self, directory: Path, stack: contextlib.ExitStack, renamings=()):
        from safetensors import safe_open

        self.handles: dict[str, Any] = {}  # module name -> handle
        self.names: dict[str, str] = {}  # module name -> the file's name
        self.paths: dict[str, Path] = {}  # module name -> file
        index = directory / INDEX
        if index.is_file():
            try:
                listed = set(json.loads(index.read_text())["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"load_hf_weights: '{index}' is not a safetensors index ({e}); save the "
                    "weights again (save_pretrained), or remove the index"
                ) from None
            missing = sorted(f for f in listed if not (directory / f).is_file())
            if missing:
                raise ValueError(
                    f"load_hf_weights: '{index}' lists {len(missing)} shard file(s) that "
                    f"'{directory}' lacks: {missing[:4]}; copy them there (a download or copy "
                    "that stopped early?)"
                )
        for path in hf_weight_files(directory):
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                keys = list(handle.keys())
            except Exception as e:  # safetensors' own error type, from its Rust side
                raise _unreadable(path, e) from None
            for key in keys:
                name = _renamed(key, renamings)
                if name in self.handles:
                    raise ValueError(
                        f"load_hf_weights: tensor {name!r} is in two safetensors files of "
                        f"'{directory}' ('{self.paths[name].name}', '{path.name}'); keep one "
                        "copy of each tensor"
                    )
                self.handles[name], self.names[name], self.paths[name] = handle, key, path
        self.read = 0  # elements read

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handles[key].get_slice(self.names[key]).get_shape())

    def slice(self, key: str, *index) -> Tensor:
        handle, name = self.handles[key], self.names[key]
        try:
            out = handle.get_slice(name)[index] if index else handle.get_tensor(name)
        except Exception as e:  # a file damaged after its header
            raise _unreadable(self.paths[key], e) from None
        self.read += out.numel()
        return out


def _renamed(key: str, renamings) -> str:
    """``key`` as transformers renames it on load (its ``WeightRenaming``s, in order)."""
    for renaming in renamings:
        key = renaming.rename_source_key(key)[0]
    return key


def _conversions(model_type: str) -> tuple[list, list]:
    """transformers' checkpoint conversions for ``model_type``: ``(renamings,
    converters)`` (none in older versions).

    Raises:
        NotImplementedError: a conversion of another kind, named.
    """
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return [], []
    renamings, converters = [], []
    for c in get_checkpoint_conversion_mapping(model_type) or []:
        if hasattr(c, "operations") and len(c.target_patterns) == 1:
            converters.append(c)
        elif type(c).__name__ == "WeightRenaming" and hasattr(c, "rename_source_key"):
            renamings.append(c)
        else:
            raise NotImplementedError(
                f"load_hf_weights: transformers loads model_type {model_type!r} through "
                f"{type(c).__name__}({c.source_patterns} -> {c.target_patterns}), which is not "
                "read here; save the weights under the module's own names (what python -m "
                "raggedfsdp export --hf writes)"
            )
    return renamings, converters


def _stacked(fqn: str, shape: tuple[int, ...], files: _Files, converters: list) -> _Source | None:
    """The stack ``fqn`` as a conversion of per-member file tensors, or None if none fits."""
    for conv in converters:
        target = conv.target_patterns[0]
        if not fqn.endswith(target if target.startswith(".") else "." + target):
            continue
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in conv.operations]
        if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            raise NotImplementedError(
                f"load_hf_weights: {fqn!r} is stored through transformers' conversion "
                f"{ops} from {conv.source_patterns}, which is not read row by row yet (read: "
                "MergeModulelist(dim=0), then optionally Concatenate(dim=1)); export the "
                "weights as the module holds them"
            )
        if len(shape) != 3:
            return None
        prefix = fqn[: -len(target)]
        members = []
        for e in range(shape[0]):
            parts = []
            for pattern in conv.source_patterns:
                key = prefix + pattern.replace("*", str(e), 1)
                if key not in files.handles:
                    return None
                got = files.shape(key)
                if len(got) != 2 or got[1] != shape[2]:
                    raise ValueError(
                        f"load_hf_weights: {key!r} has shape {got}, not (rows, {shape[2]}) as a "
                        f"member of {fqn!r} of shape {shape} needs; the weights do not match "
                        "config.json"
                    )
                parts.append(_Part(key, got[0]))
            if (rows := sum(p.rows for p in parts)) != shape[1]:
                raise ValueError(
                    f"load_hf_weights: member {e} of {fqn!r} {shape} gets {rows} "
                    f"rows from {[p.key for p in parts]}, not {shape[1]}; the weights do not "
                    "match config.json"
                )
            members.append(tuple(parts))
        return _Source(fqn, shape, tuple(members))
    return None


def _local_rows(t: Tensor) -> tuple[int, int, int]:
    """``(k, lo, hi)``: ``t``'s local tensor is rows ``[lo, hi)`` of its full tensor viewed as
    ``(prod(shape[:k]), -1)`` (``k = 0``: one row, the whole tensor). See [Note: reading
    Hugging Face weights]."""
    if not isinstance(t, DTensor):
        return 0, 0, 1
    from raggedfsdp.tensor import ragged_axis, ragged_piece

    shape = tuple(t.shape)
    if ragged_axis(t.placements) is not None:
        piece = ragged_piece(shape, t.device_mesh, t.placements)
        if piece.shape != shape:
            raise NotImplementedError(
                f"load_hf_weights: a RaggedShard under another Shard ({t.placements}): tensor "
                "parallel Hugging Face models are not loaded yet; use a 1-D or HSDP mesh"
            )
        lo, hi = piece.rs.local_row_range(piece.shape, piece.coord)
        return len(piece.rs.dims), lo, hi
    cut = [(i, p) for i, p in enumerate(t.placements) if not p.is_replicate()]
    if not cut:
        return 0, 0, 1
    (axis, p), *rest = cut
    if rest or not (isinstance(p, Shard) and p.dim == 0):
        raise NotImplementedError(
            f"load_hf_weights: placements {t.placements} are not read yet (read: RaggedShard, "
            "Shard(0), Replicate); shard the model with fully_shard alone"
        )
    mesh = t.device_mesh
    size, start = Shard.local_shard_size_and_offset(
        shape[0], mesh.size(axis), mesh.get_local_rank(axis)
    )
    return 1, start, start + size


def _read_rows(src: _Source, k: int, lo: int, hi: int, files: _Files) -> Tensor:
    """Rows ``[lo, hi)`` of ``src`` viewed as ``(prod(shape[:k]), -1)``, read from the files."""
    shape = src.shape
    if k == 0:
        if src.members is None:
            return files.slice(src.key)
        k, lo, hi = 1, 0, shape[0]
    if k > 2:
        raise NotImplementedError(
            f"load_hf_weights: {src.key!r} {shape} is cut over {k} dims; at most 2 are read"
        )
    if k == 1 and src.members is None:
        return files.slice(src.key, slice(lo, hi)).reshape(hi - lo, math.prod(shape[1:]))
    if k == 1:  # whole members
        lo, hi = lo * shape[1], hi * shape[1]
    inner, row = shape[1], math.prod(shape[2:])
    pieces = [torch.empty(0, row)]  # a rank may hold no row
    for e in range(lo // inner, -(-hi // inner)):
        a, b = max(lo - e * inner, 0), min(hi - e * inner, inner)
        if src.members is None:
            pieces.append(files.slice(src.key, e, slice(a, b)).reshape(b - a, row))
            continue
        offset = 0
        for part in src.members[e]:
            x, y = max(a, offset), min(b, offset + part.rows)
            if x < y:
                pieces.append(files.slice(part.key, slice(x - offset, y - offset)))
            offset += part.rows
    return torch.cat([p.reshape(-1, row) for p in pieces])


def _named_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters and persistent buffers of ``model``: what its files must hold."""
    named = list(model.named_parameters())
    persistent = {
        f"{mod}.{name}" if mod else name
        for mod, m in model.named_modules()
        for name, _ in m.named_buffers(recurse=False)
        if name not in m._non_persistent_buffers_set
    }
    return named + [(n, b) for n, b in model.named_buffers() if n in persistent]


def _plan(named, files: _Files, converters: list, directory: Path) -> dict[str, _Source]:
    """Where each of ``named`` is in the files.

    Raises:
        ValueError: a tensor missing from the files (the first few named), or of
            another shape than the module's.
    """
    sources, missing = {}, []
    for fqn, t in named:
        shape = tuple(t.shape)
        if fqn in files.handles:
            got = files.shape(fqn)
            if got != shape:
                raise ValueError(
                    f"load_hf_weights: {fqn!r} has shape {got} in '{files.paths[fqn]}', the "
                    f"module's is {shape}; the weights do not match config.json"
                )
            sources[fqn] = _Source(fqn, shape)
        elif (found := _stacked(fqn, shape, files, converters)) is not None:
            sources[fqn] = found
        else:
            missing.append(fqn)
    if missing:
        raise ValueError(
            f"load_hf_weights: the safetensors files of '{directory}' hold no tensor for "
            f"{len(missing)} of the model's: {missing[:4]}; pass a directory whose weights "
            "match its config.json, or one without *.safetensors files (random init)"
        )
    return sources


def check_hf_weights(model: nn.Module, directory: str | Path) -> None:
    """What ``load_hf_weights`` checks before it reads a value, on a model without storage
    (``meta``): every index-listed shard present, every file readable safetensors, a tensor
    for each of the model's (under transformers' renamings and conversions) of its shape.
    Reads the files' headers only. Does nothing where ``directory`` holds no weights.

    Raises:
        ValueError: as ``load_hf_weights``, naming the file.
        NotImplementedError: a conversion that is not read here.
    """
    directory = Path(directory)
    if not hf_weight_files(directory) and not (directory / INDEX).is_file():
        return
    config = getattr(model, "config", None)
    renamings, converters = _conversions(getattr(config, "model_type", ""))
    with contextlib.ExitStack() as stack:
        _plan(_named_tensors(model), _Files(directory, stack, renamings), converters, directory)


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory: str | Path) -> int:
    """Fill every parameter and persistent buffer of ``model`` from ``directory``'s
    safetensors files, each rank reading only the rows it holds. See [Note: reading
    Hugging Face weights].

    Args:
        model: a Hugging Face model, sharded or not, with storage (after ``to_empty``).
        directory: the files' directory.

    Returns:
        The elements this rank read (its parameters' local elements, and its buffers').

    Raises:
        ValueError: no safetensors file, a shard the index lists missing, a file that is
            not readable safetensors, a tensor of the model missing from the files (the
            first few named), one whose shape differs from the module's, or one holding
            nan or inf (each naming the file).
        NotImplementedError: a conversion or placement that is not read row by row.
    """
    directory = Path(directory)
    if not hf_weight_files(directory):
        raise ValueError(
            f"load_hf_weights: '{directory}' holds no *.safetensors file; save the weights "
            "with save_pretrained (safetensors), or start from a random init"
        )
    named = _named_tensors(model)
    config = getattr(model, "config", None)
    renamings, converters = _conversions(getattr(config, "model_type", ""))
    with contextlib.ExitStack() as stack:
        files = _Files(directory, stack, renamings)
        sources = _plan(named, files, converters, directory)
        for fqn, t in named:
            local = t.to_local() if isinstance(t, DTensor) else t
            k, lo, hi = _local_rows(t)
            rows = _read_rows(sources[fqn], k, lo, hi, files)
            if rows.is_floating_point() and not bool(torch.isfinite(rows).all()):
                source = sources[fqn]
                keys = (
                    [source.key]
                    if source.members is None
                    else [part.key for parts in source.members for part in parts]
                )
                where = sorted({files.paths[key].name for key in keys})
                raise ValueError(
                    f"load_hf_weights: {fqn!r} holds nan or inf values in '{directory}' "
                    f"({', '.join(where)}): the weights are damaged, not the training; save "
                    "them again from a healthy model, or remove the *.safetensors files to "
                    "start from a random init"
                )
            local.copy_(rows.reshape(local.shape))
        return files.read
