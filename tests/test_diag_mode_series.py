"""scripts/diag_mode_series.py's reading of a replay series against nvidia-smi's samples: the runs
of slow replays, the sample nearest a replay, and the median time by SM clock (CPU only)."""
import importlib.util
import sys
import time
from pathlib import Path

scripts = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(scripts))  # as when run: it takes diag_slow_rounds' helpers
spec = importlib.util.spec_from_file_location("diag_mode_series", scripts / "diag_mode_series.py")
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)


def test_runs_of_slow_replays():
    assert diag.runs([True, True, False, True, False, False, True, True, True]) == [2, 1, 3]
    assert diag.runs([False, False]) == [] and diag.runs([]) == []


def test_the_nearest_sample():
    s = [(1.0, "a"), (2.0, "b"), (3.0, "c")]
    assert diag.nearest(s, 2.4) == (2.0, "b") and diag.nearest(s, 2.6) == (3.0, "c")
    assert diag.nearest(s, -5) == (1.0, "a") and diag.nearest(s, 99) == (3.0, "c")


def test_report_bins_the_replays_by_the_clock_sampled_nearest_them(tmp_path, capsys):
    """A kernel that runs 100 us at 1980 MHz and 120 us at 1500: the report's by-clock medians
    say so, and its slow replays are the ones under the power cap."""
    t0 = time.mktime(time.strptime("2026/12/04 18:00:00", "%Y/%m/%d %H:%M:%S"))
    lines, rows = [], []
    for i in range(200):  # a sample and a replay every 10 ms; the clock drops halfway
        fast = i < 100
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t0 + i // 100)) + f".{(i % 100) * 10:03d}"
        lines.append(f"{stamp}, {1980 if fast else 1500}, 3201, {600 if fast else 700}.0, "
                     f"{'0x0000000000000000' if fast else '0x0000000000000004'}")
        rows.append(dict(spec="k", batch=4, ctx=131072, page=64, wall=t0 + i * 0.01, us=100.0 if fast else 120.0))
    (tmp_path / "smi.csv").write_text("\n".join(lines) + "\nnot a sample line\n")
    diag.report(rows, [("k", 4, 131072, 64)], tmp_path / "smi.csv")
    out = capsys.readouterr().out
    assert "median us by SM clock (MHz): 1500: 120.0, 1980: 100.0" in out
    assert "slow replays 100: SM clock median 1500 MHz" in out and "['0x0000000000000004']" in out
    assert "fast replays 100: SM clock median 1980 MHz" in out
