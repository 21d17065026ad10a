"""Shared pytest set-up: GPU tests (marker `gpu`) skip cleanly on machines without CUDA."""

import pytest
import torch

from helpers import make_generator


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen() -> torch.Generator:
    return make_generator(0)
