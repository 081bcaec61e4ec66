"""Hypothesis runs the same examples on every run (``derandomize``), so a CI verdict can be
reproduced from the commit alone; ``pytest --hypothesis-profile=explore`` draws new ones
(a failure it finds is printed with the example, to be pinned as a test)."""

from hypothesis import settings

settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("reproducible")


def pytest_configure(config):
    from tests.numerics import DETERMINISTIC

    if DETERMINISTIC:  # `make test-numerics`: here as in every rank (tests/harness.py)
        import torch

        torch.use_deterministic_algorithms(True)
    config.addinivalue_line(
        "markers",
        "numerics: compares trained numbers against a reference under a derived bound "
        "(tests/numerics.py); `make test-numerics` reruns these with other kernels",
    )
