"""Training: the demo data (``data``); the ``train`` command lands here later."""

from raggedfsdp.train.data import (
    BYTE_VOCAB,
    DataConfig,
    TextCorpus,
    batches,
    get_batch,
    load_corpus,
    stdlib_dir,
)

__all__ = [
    "BYTE_VOCAB",
    "DataConfig",
    "TextCorpus",
    "batches",
    "get_batch",
    "load_corpus",
    "stdlib_dir",
]
