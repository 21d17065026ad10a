"""Backend registry: names, lazy building, errors."""

import subprocess
import sys

import pytest

from drafter_attn.kernels import reference, registry
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem


@pytest.fixture
def scratch():
    """Names registered by a test are removed after it."""
    added = []
    yield added
    for name in added:
        registry.unregister(name)


def test_reference_backend():
    assert {"reference", "cupy"} <= set(registry.names())
    ref = registry.get("reference")
    assert isinstance(ref, registry.Backend) and ref.name == "reference"
    assert ref.paged_attention is reference.paged_attention and ref.store_arena is reference.store_arena
    problem = Problem(get_preset(MAIN_PRESET), "paged", 64, 8, 4096)
    assert ref.supports(problem) is None
    assert ref.tunables(problem) == {} and ref.default_params(problem) == {}
    assert ref.with_params() is ref and registry.get("reference") is ref
    with pytest.raises(ValueError, match="no tunable parameters"):
        ref.with_params(tile=64)


def test_unknown_backend_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known backends: .*cupy.*reference"):
        registry.get("nope")


def test_failed_import_says_what_to_install(scratch):
    scratch.append("broken")
    registry.register("broken", "drafter_attn.kernels.no_such_module:BACKEND", extra="pip install -e '.[cu13]'")
    assert "broken" in registry.names()
    with pytest.raises(registry.BackendUnavailable, match=r"backend 'broken' is unavailable.*No module named.*\[cu13\]"):
        registry.get("broken")


def test_cupy_is_registered_lazily():
    """Listing backends imports nothing heavy; asking for cupy builds it or says why not."""
    code = "import sys, kernels.registry as r; r.names(); assert 'cupy' not in sys.modules, 'cupy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    try:
        backend = registry.get("cupy")
    except registry.BackendUnavailable as exc:
        assert "cu13" in str(exc)
    else:
        assert isinstance(backend, registry.Backend)


def test_register_factories(scratch):
    scratch += ["by_path", "by_callable"]
    registry.register("by_path", "drafter_attn.kernels.registry:ReferenceBackend")  # a class: instantiated
    registry.register("by_callable", registry.ReferenceBackend)
    assert isinstance(registry.get("by_path"), registry.ReferenceBackend)
    assert isinstance(registry.get("by_callable"), registry.ReferenceBackend)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("by_path", registry.ReferenceBackend)
    with pytest.raises(ValueError, match="'module:attr'"):
        registry.register("bad", "drafter_attn.kernels.registry")
    scratch.append("not_a_backend")
    registry.register("not_a_backend", lambda: object())
    with pytest.raises(registry.BackendUnavailable, match="not a Backend"):
        registry.get("not_a_backend")


def test_from_spec_binds_parameters():
    pytest.importorskip("cupy")
    plain = registry.from_spec("cupy")
    assert plain is registry.get("cupy")
    bound = registry.from_spec("cupy: tile_n=32, stages=4, wgmma=0")
    assert dict(bound.overrides) == {"tile_n": 32, "stages": 4, "wgmma": False}
    assert bound.overrides == registry.from_spec("cupy:wgmma=false,stages=4,tile_n=32").overrides
    assert dict(registry.from_spec("cupy:wgmma=none").overrides) == {"wgmma": None}


def test_from_spec_errors():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        registry.from_spec("nope:tile_n=1")
    with pytest.raises(ValueError, match="'tile_n' is not key=value"):
        registry.from_spec("reference:tile_n")
    with pytest.raises(ValueError, match="no tunable parameters"):
        registry.from_spec("reference:tile_n=1")
