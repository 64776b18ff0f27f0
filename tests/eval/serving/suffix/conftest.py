"""The suffix tests' numba kernels: compiled by one pytest-xdist worker, loaded from numba's cache by the others."""

import pytest
from helpers.suffix import compiled_kernels


@pytest.fixture(scope="session", autouse=True)
def suffix_kernels() -> None:
    compiled_kernels()
