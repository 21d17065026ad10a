"""CPU: scripts/matrix_ids.py, which picks the GPU matrix's node ids of exactly the named specs
for scripts/gpu_variants.sh (MATRIX)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import matrix_ids  # noqa: E402


def test_a_spec_selects_its_own_cases_and_not_its_extensions():
    ids = ["tests/t.py::test_a[0-h32/8-d128-full-p8-[7]-paged-cupy:ws=3]",
           "tests/t.py::test_a[0-h32/8-d128-full-p8-[7]-paged-cupy:ws=3,tile_n=32]",
           "tests/t.py::test_b[cupy:ws=3-4]",
           "tests/t.py::test_c[cupy:ws=3,ws_rows=1]",
           "tests/t.py::test_d[cutlass]",
           "tests/t.py::test_e"]
    assert matrix_ids.select(ids, ["cupy:ws=3"]) == ids[:1] + ids[2:3]
    assert matrix_ids.select(ids, ["cupy:ws=3,tile_n=32", "cutlass"]) == [ids[1], ids[4]]
    assert matrix_ids.select(ids, ["cupy"]) == []


def test_it_selects_from_the_real_matrix():
    """Collected from tests/test_backends_gpu.py (pytest only collects, no GPU): every id
    selected for a BACKENDS spec names it, and more specs select more."""
    from tests.test_backends_gpu import BACKENDS

    spec = "cupy:ws=3,tile_n=32,stages=6,early_ids=1,one_trip=1,pair=1"
    assert spec in BACKENDS
    ids = matrix_ids.collect()
    one = matrix_ids.select(ids, [spec])
    assert len(one) > 100 and all(spec in i for i in one)
    assert {i.split("[")[0] for i in one} >= {"tests/test_backends_gpu.py::test_attention_matches_reference",
                                              "tests/test_backends_gpu.py::test_forced_split_counts"}
    two = matrix_ids.select(ids, [spec, "cupy:ws=2,stages=4,pair=1"])
    assert len(two) > len(one) and set(one) < set(two)
