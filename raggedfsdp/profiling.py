"""Moved to ``raggedfsdp.tools.profiling``: this old path imports that module itself, with a
``DeprecationWarning``, until the next release (docs/architecture.md, "Moved modules")."""

import importlib
import sys
import warnings

NEW = "raggedfsdp.tools.profiling"
warnings.warn(
    f"{__name__} moved to {NEW}; import it from there (the old path goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = importlib.import_module(NEW)
