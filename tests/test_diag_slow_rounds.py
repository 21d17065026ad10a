"""scripts/diag_slow_rounds.py's verdict (the lease check of scripts/gpu_profile_specs.sh): which
timing rounds count as slow."""
import importlib.util
import sys
from pathlib import Path

scripts = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(scripts))  # as when run: it takes diag_page_order's inputs
path = scripts / "diag_slow_rounds.py"
spec = importlib.util.spec_from_file_location("diag_slow_rounds", path)
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)


def test_a_round_is_slow_past_three_percent_over_the_fastest():
    # the page-128 lease of 2026-12-04: rounds at the arena's 246 us and slow ones at 255-261
    assert diag.slow_rounds([246.6, 248.6, 255.4]) == [2]
    assert diag.slow_rounds([244.7, 255.3, 261.0]) == [1, 2]
    assert diag.slow_rounds([244.4, 245.3, 245.4]) == []
    assert diag.slow_rounds([100.0, 103.0, 103.01]) == [2]  # 3% exactly is not slow
    assert diag.slow_rounds([100.0, 110.0], slack=1.2) == []
