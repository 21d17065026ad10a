"""`tuner repeat` on the CPU: two runs of one sweep built through the database API, compared key
by key (winner flips, within noise or not, the spread of every candidate), with numbers computed
by hand; the figure, the JSON, the gate and the errors (issue 14's repeatability)."""

from __future__ import annotations

import json

import pytest

from drafter_attn.tuner import repeat
from drafter_attn.tuner.cli import main
from profile_fakes import H200, build_db, small_geometry

G = small_geometry()
T64, T32, T128 = {"tile_n": 64}, {"tile_n": 32}, {"tile_n": 128}


def _r(batch, params, median, lo=None, hi=None, **kw):
    """A row of key (G, page 16, batch, ctx 64): median and p10/p90 (default median -/+ 0.1)."""
    return dict(geometry=G, page=16, batch=batch, ctx=64, params=params, median_us=median,
                p10_us=median - 0.1 if lo is None else lo, p90_us=median + 0.1 if hi is None else hi, **kw)


RUN_A = [
    _r(2, T64, 10.0), _r(2, T32, 11.0), _r(2, T128, 12.0),          # same winner
    _r(4, T32, 20.0, 19.8, 20.2), _r(4, T128, 20.1, 19.9, 20.3), _r(4, T64, 30.0),  # a near tie
    _r(8, T64, 40.0), _r(8, T32, 44.0), _r(8, T128, 50.0),          # a real flip
    _r(16, T64, 80.0),                                               # only in A
]
RUN_B = [
    _r(2, T64, 10.1), _r(2, T32, 11.1), _r(2, T128, 11.88),
    _r(4, T32, 20.2, 20.0, 20.4), _r(4, T128, 20.0, 19.8, 20.2), _r(4, T64, 30.0),
    _r(8, T64, 46.0), _r(8, T32, 44.0), _r(8, T128, 50.0, status="failed_runtime"),
]


@pytest.fixture
def runs(tmp_path):
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    build_db(a, {"h": (H200, RUN_A)})
    build_db(b, {"h": (H200, RUN_B)})
    return a, b


def test_flips_noise_and_spread_by_hand(runs):
    rep = repeat.compare_paths(*runs)
    s, keys = rep["summary"], {it["key"].split(" B=")[1]: it for it in rep["keys"]}
    assert (s["keys"], s["keys_only_a"], s["keys_only_b"]) == (3, 1, 0)
    # B=8's tile_n=128 failed in B: compared over the two candidates both runs measured
    assert (s["candidates"], s["candidates_only_a"], s["candidates_only_b"]) == (8, 1, 0)
    assert not keys["2 ctx=64"]["flip"] and keys["2 ctx=64"]["within_noise"] is None
    near, real = keys["4 ctx=64"], keys["8 ctx=64"]
    # B=4 (two non-default sets; the default tile_n=64 is far behind): A picks tile_n=32 (20.0
    # vs 20.1), B tile_n=128 (20.0 vs 20.2); in each run the two p10-p90 ranges overlap
    # ([19.8, 20.2] and [19.9, 20.3]; [20.0, 20.4] and [19.8, 20.2])
    assert near["flip"] and near["within_noise"]
    assert (near["flip_a"], near["flip_b"]) == ("cupy[tile_n=32]", "cupy[tile_n=128]")
    assert near["flip_cost"] == pytest.approx(20.2 / 20.0 - 1)
    assert near["margin_a"] == pytest.approx(20.1 / 20.0 - 1)
    # B=8: 40 -> 46 us for A's winner, 44 for the other in both runs: separated in B
    assert real["flip"] and not real["within_noise"]
    assert real["flip_cost"] == pytest.approx(46 / 44 - 1) and real["winner_change"] == pytest.approx(0.15)
    assert s["same_winner"] == 1 and s["same_winner_share"] == pytest.approx(1 / 3)
    assert (s["flips"], s["flips_within_noise"]) == (2, 1)
    assert s["same_or_noise_share"] == pytest.approx(2 / 3)
    # |B/A - 1|: B=2 1%, 0.909%, 1%; B=4 1%, 0.4975%, 0; B=8 15%, 0 -> median of the middle two
    assert s["spread_median"] == pytest.approx((1 / 110 + 0.01) / 2)
    assert s["spread_max"] == pytest.approx(0.15)
    assert s["winner_spread_median"] == pytest.approx(0.01)  # A's winners: +1%, +1%, +15%
    assert s["flip_cost_max"] == pytest.approx(46 / 44 - 1)
    t = rep["targets"]
    assert not t["same_winner_met"] and t["spread_met"] and not t["met"]


def test_a_lead_within_the_tie_margin_is_no_flip(tmp_path):
    """B measures tile_n=32 0.5% ahead of the default (tile_n=64), A the reverse: by the tuned
    table's rule (the default kept unless beaten by more than TIE_MARGIN) both runs pick the
    default, where "the fastest wins" would flip."""
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    build_db(a, {"h": (H200, [_r(2, T64, 10.0), _r(2, T32, 10.05)])})
    build_db(b, {"h": (H200, [_r(2, T64, 10.05), _r(2, T32, 10.0)])})
    (key,) = repeat.compare_paths(a, b)["keys"]
    assert not key["flip"] and key["winner_a"] == key["winner_b"] == "cupy[tile_n=64]"


def test_other_workloads_stay_out_and_the_winners_difference_comes_first(tmp_path):
    """A context step's or a fewer-rows step's row (`bench prefill`, `bench decode --accepted`)
    is another workload, never a candidate's timing (a 1700% spread before). A's fastest
    candidate missing from B: among the common ones the default wins by the tie margin, and
    the key's differences start with it (the figure draws the first apart as the winner's)."""
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    build_db(a, {"h": (H200, [_r(2, T128, 10.0), _r(2, T32, 10.12), _r(2, T64, 10.15)])})
    build_db(b, {"h": (H200, [_r(2, T32, 10.12 * 1.02), _r(2, T64, 10.15 * 1.01),
                              _r(2, T64, 850.0, accepted=float(G.block_size + 48)),
                              _r(2, T64, 3.0, accepted=1.0)])})
    (key,) = repeat.compare_paths(a, b)["keys"]
    assert key["winner_a"] == key["winner_b"] == "cupy[tile_n=64]" and not key["flip"]
    assert key["diffs"] == pytest.approx([0.01, 0.02]) and key["winner_change"] == pytest.approx(0.01)
    assert key["spread_median"] == pytest.approx(0.015)


def test_two_sweeps_of_one_database(tmp_path):
    one = tmp_path / "merged.db"
    build_db(one, {"h": (H200, [dict(r, sweep_id="s1") for r in RUN_A] + [dict(r, sweep_id="s2") for r in RUN_B])})
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    build_db(a, {"h": (H200, RUN_A)})
    build_db(b, {"h": (H200, RUN_B)})
    merged = repeat.compare_paths(one, one, sweep_a="s1", sweep_b="s2")
    assert merged["summary"] == repeat.compare_paths(a, b)["summary"]
    with pytest.raises(repeat.RepeatError, match="same rows"):
        repeat.compare_paths(one, one)
    with pytest.raises(repeat.RepeatError, match=r"no ok rows of sweep 's9' \(its sweeps: s1, s2\)"):
        repeat.compare_paths(one, one, sweep_a="s9", sweep_b="s2")


def test_all_the_same_meets_the_targets(runs):
    a, _ = runs
    rep = repeat.compare(repeat.read_run(a), repeat.read_run(a))
    s = rep["summary"]
    assert s["same_winner_share"] == 1.0 and s["spread_median"] == 0.0 and s["flips"] == 0
    assert rep["targets"]["met"] and s["flip_cost_max"] is None


def test_cli_text_json_figure_and_gate(runs, tmp_path, capsys):
    a, b = runs
    fig = tmp_path / "out" / "repeat.png"
    assert main(["repeat", str(a), str(b), "--figure", str(fig)]) == 0
    out = capsys.readouterr().out
    assert "same winner: 1/3 keys (33.3%); 2 flips, 1 within noise" in out
    assert "targets: same winner >= 95%: NO (33.3%); median spread <= 2%: yes (0.95%)" in out
    assert "B=8 ctx=64: A cupy[tile_n=64] 40.00 us/layer -> B cupy[tile_n=32] 44.00 us/layer" in out
    assert "beyond noise" in out and "within noise" in out
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["repeat", str(a), str(b), "--gate"]) == 1
    assert "gate failed: same winner 33.3% (target >= 95%)" in capsys.readouterr().err
    assert main(["repeat", str(a), str(b), "--gate", "--min-same", "0.3", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["targets"]["met"] and doc["summary"]["flips"] == 2 and len(doc["keys"]) == 3


def test_cli_errors(runs, tmp_path, capsys):
    a, _ = runs
    other = tmp_path / "other.db"
    build_db(other, {"h": (H200, [dict(_r(2, T64, 10.0), ctx=128)])})
    assert main(["repeat", str(a), str(other)]) == 2
    assert "no candidate of any key in common" in capsys.readouterr().err
    assert main(["repeat", str(a), str(a)]) == 2
    assert "give two databases, or two sweeps" in capsys.readouterr().err
    assert main(["repeat", str(a), str(tmp_path / "missing.db")]) == 2
    assert "no profile database at" in capsys.readouterr().err


def test_the_repeat_spec_swept_twice_then_compared(tmp_path, monkeypatch):
    """scripts/repeatability.sh's steps on fake GPUs: the shipped repeat spec swept into two
    databases (the fake measure: a fixed time per candidate with 0.2% noise, another seed per
    run), then compared; every key and candidate pairs up. The fixed times are a hash of each
    candidate's parameters, 0.05% apart at the finest: with 1% noise about a quarter of the keys
    had their two best within the noise, so the same-winner share moved around 0.8 whenever a
    parameter was added; at 0.2% a flip needs two candidates within about 0.3%."""
    from drafter_attn.tuner.spec import load_spec
    from drafter_attn.tuner.sweep import run_sweep

    monkeypatch.setenv("FAKE_SM", "90")  # the spec's target; the workers inherit it
    cands = load_spec("sm90-repeat").candidates()
    for run, seed in (("a", 1), ("b", 2)):
        out = run_sweep(cands, tmp_path / f"{run}.db", devices=[None], measure="sweep_fakes:measure_noisy",
                        fingerprint="sweep_fakes:node_fingerprint", options=dict(seed=seed, noise=0.002),
                        progress=False)
        assert out.by_status == {"ok": 369}
    rep = repeat.compare_paths(tmp_path / "a.db", tmp_path / "b.db")
    s = rep["summary"]
    assert (s["keys"], s["candidates"], s["keys_only_a"], s["candidates_only_b"]) == (36, 369, 0, 0)
    assert 0.0006 < s["spread_median"] < 0.004  # |N(0, 0.2%) - N(0, 0.2%)|: median about 0.19%
    assert s["same_winner_share"] >= 0.8 and s["flips"] == s["keys"] - s["same_winner"]
