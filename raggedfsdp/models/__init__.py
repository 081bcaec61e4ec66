"""Model shapes: the catalogue of real models and user JSON files (see ``catalogue``)."""

from raggedfsdp.models._json import load_config_json, load_model_json
from raggedfsdp.models.catalogue import (
    CATALOGUE,
    GroupShapes,
    ParamShape,
    TransformerConfig,
    get_config,
    num_params,
    param_groups,
)
from raggedfsdp.models.gpt import GPT_CONFIGS  # registers gpt2 in CATALOGUE
from raggedfsdp.models.small import SMALL_CONFIGS  # registers the small configs in CATALOGUE
from raggedfsdp.models.transformer import Transformer, lm_loss

__all__ = [
    "CATALOGUE",
    "GPT_CONFIGS",
    "GroupShapes",
    "ParamShape",
    "SMALL_CONFIGS",
    "Transformer",
    "TransformerConfig",
    "get_config",
    "lm_loss",
    "load_config_json",
    "load_model_json",
    "num_params",
    "param_groups",
]
