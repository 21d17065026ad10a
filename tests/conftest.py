"""Shared pytest set-up: GPU tests (marker `gpu`) skip cleanly on machines without CUDA."""

import os

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


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private cubin cache for the requesting test module (unless $DRAFTER_CACHE_DIR names
    one): compile tests see their own builds, not what another module left."""
    with pytest.MonkeyPatch.context() as mp:
        if "DRAFTER_CACHE_DIR" not in os.environ:
            mp.setenv("DRAFTER_CACHE_DIR", str(tmp_path_factory.mktemp("cubins")))
        yield
