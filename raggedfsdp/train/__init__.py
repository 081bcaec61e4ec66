"""The application: ``python -m raggedfsdp train`` (``cli.train``, ``loop``), its data and reports.

``data``: the demo corpus and its world-size-invariant batches. ``report``: the metrics
a run writes, its loss curves, and the units the demo and the benchmarks print.
"""

from raggedfsdp.train import data, report
from raggedfsdp.train.data import *  # noqa: F403  (its __all__)
from raggedfsdp.train.report import *  # noqa: F403  (its __all__)

__all__ = [*data.__all__, *report.__all__]
