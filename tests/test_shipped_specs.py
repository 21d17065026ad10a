"""The sweep specs shipped in tuner/specs: each loads, and every candidate of its SM-targeted
ones is a variant its backend takes on that SM (a candidate refused there would only ever be
recorded as an error row, on GPU time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from drafter_attn.kernels import registry
from drafter_attn.tuner.spec import load_spec, target_sm

SPECS = sorted((Path(__file__).resolve().parents[1] / "tuner" / "specs").glob("*.toml"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_spec_candidates_are_supported(path):
    candidates = list(load_spec(str(path)).candidates())
    assert candidates
    for c in candidates:
        sm = target_sm(c.target)
        if sm is None:
            continue
        impl = registry.from_spec(registry.format_spec(c.impl, c.params_dict))
        assert impl.supports(c.problem, sm) is None, c.label()
