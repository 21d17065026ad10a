"""`tuner refine`: a tuned table's winners as candidates again, with parameters changed (CPU)."""

from __future__ import annotations

import json
import sqlite3
import types
from pathlib import Path

import pytest

from drafter_attn.tuner import cli
from drafter_attn.tuner.refine import refine_candidates

ROOT = Path(__file__).resolve().parents[1]
TABLE, DB = ROOT / "profiles" / "sm90.json", ROOT / "profiles" / "sm90.db"


@pytest.fixture
def sweeps(monkeypatch) -> list[dict]:
    """`tuner refine`'s sweeps, recorded instead of run: each call's candidates and keywords."""
    calls: list[dict] = []

    def fake_sweep(candidates, path, **kw):
        calls.append(dict(kw, candidates=list(candidates)))
        return types.SimpleNamespace(sweep_id="x", summary=lambda: "faked")

    monkeypatch.setattr("drafter_attn.tuner.sweep.run_sweep", fake_sweep)
    return calls


def _winners(where=()):
    entries = json.loads(TABLE.read_text())["entries"]
    return [e for e in entries if e["impl"] == "cupy" and all(e["params"].get(w) for w in where)]


def test_nothing_changed_gives_the_keys_the_winners_were_measured_under():
    """Resolved from a table entry, a winner's candidate is the one the sweep measured: its key
    is a row of the shipped database."""
    cands, skipped = refine_candidates(TABLE, {}, ("ws",))
    keys = {row[0] for row in sqlite3.connect(f"file:{DB}?mode=ro", uri=True).execute(
        "SELECT DISTINCT candidate_key FROM results")}
    assert cands and not skipped
    assert {c.key() for c in cands} <= keys
    assert all(c.target == "sm90" and c.preset for c in cands)


def test_a_knob_over_the_ws_winners():
    cands, skipped = refine_candidates(TABLE, {"q_step": True}, ("ws",))
    assert not skipped
    assert all(c.params_dict["q_step"] and c.params_dict["ws"] for c in cands)
    winners = _winners(("ws",))
    assert len(cands) == len({(e["layout"], e["page_size"], e["batch"], e["ctx_len"], e["num_q_heads"],
                               e["mask"]) for e in winners})
    # the rest of each winner's parameters kept
    by_shape = {(c.problem.layout, c.problem.page_size, c.problem.batch, c.problem.ctx_len,
                 c.problem.geometry.num_q_heads, c.problem.geometry.mask): c.params_dict for c in cands}
    for e in winners:
        p = by_shape[(e["layout"], e["page_size"], e["batch"], e["ctx_len"], e["num_q_heads"], e["mask"])]
        named = [k for k in e["params"] if k in p and k != "q_step"]  # (a later knob: its default)
        assert {k: p[k] for k in named} == {k: e["params"][k] for k in named}


def test_winners_a_knob_does_not_apply_to_are_named_and_left_out():
    cands, skipped = refine_candidates(TABLE, {"q_step": True})
    assert len(cands) < len(_winners())
    assert skipped and all("ws=2..4" in line for line in skipped)


def test_an_unknown_parameter_is_refused():
    with pytest.raises(ValueError, match="no_such_knob"):
        refine_candidates(TABLE, {"no_such_knob": 1}, ("ws",))


def test_cli_dry_run_lists_them(capsys):
    assert cli.main(["refine", str(TABLE), "--set", "q_step=1", "--where", "ws", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert lines and all("q_step=True" in ln and "@sm90" in ln for ln in lines)
    assert f"{len(lines)} candidates" in err


def test_max_batch_keeps_the_small_batches():
    """`--max-batch` (a knob of the split combine, whose calls split at small batch): only the
    winners of at most that many requests, every one of them where the knob applies."""
    cands, skipped = refine_candidates(TABLE, {"one_trip": True}, max_batch=8)
    assert not skipped
    assert cands and all(c.problem.batch <= 8 and c.params_dict["one_trip"] for c in cands)
    small = {(e["layout"], e["page_size"], e["batch"], e["ctx_len"], e["num_q_heads"], e["mask"])
             for e in _winners() if e["batch"] <= 8}
    assert len(cands) == len(small) < len(_winners())
    assert cli.main(["refine", str(TABLE), "--set", "one_trip=1", "--max-batch", "8", "--dry-run"]) == 0


def test_min_batch_keeps_the_batches_that_split_in_two():
    """`--min-batch` with `--max-batch` (pair=1 pays only where it takes the combine away): the
    ws winners of exactly that many requests, each with the knob, the rest left out."""
    cands, skipped = refine_candidates(TABLE, {"pair": True}, ("ws",), max_batch=8, min_batch=8)
    assert cands and all(c.problem.batch == 8 and c.params_dict["pair"] for c in cands)
    eight = {(e["layout"], e["page_size"], e["batch"], e["ctx_len"], e["num_q_heads"], e["mask"])
             for e in _winners(("ws",)) if e["batch"] == 8 and not e["params"].get("ws_rows")}
    assert len(cands) == len(eight) and all("ws_rows" in line for line in skipped)
    assert cli.main(["refine", str(TABLE), "--set", "pair=1", "--where", "ws", "--min-batch", "8",
                     "--max-batch", "8", "--dry-run"]) == 0


def test_with_winners_puts_each_winner_and_its_runners_up_right_before_its_refined_candidate():
    plain, _ = refine_candidates(TABLE, {"one_trip": True}, ("ws",), max_batch=8)
    both, _ = refine_candidates(TABLE, {"one_trip": True}, ("ws",), max_batch=8, with_winners=True)
    won = {c.key() for c in refine_candidates(TABLE, {}, ("ws",), max_batch=8)[0]}
    keys = [c.key() for c in both]
    assert len(keys) == len(set(keys))  # a winner that already has the knob is its own candidate
    assert {c.key() for c in plain} <= set(keys) and won <= set(keys)
    refined = {c.key() for c in plain} - won  # (a winner that has the knob is refined as itself)
    contenders = set(keys) - refined
    assert won <= contenders and len(contenders) > len(won)  # the alternatives came along
    # winners and runners-up are rows the shipped database holds (as they were measured), and
    # each problem's contenders come together, its refined candidate last
    db_keys = {row[0] for row in sqlite3.connect(f"file:{DB}?mode=ro", uri=True).execute(
        "SELECT DISTINCT candidate_key FROM results")}
    assert contenders <= db_keys
    for i, c in enumerate(both):
        if c.key() in refined:
            assert i > 0 and both[i - 1].key() in contenders and both[i - 1].problem == c.problem
    # one block a problem: a problem's candidates never interleave with another's
    order = [c.problem for c in both]
    for p in set(order):
        at = [i for i, q in enumerate(order) if q == p]
        assert at == list(range(at[0], at[-1] + 1))


def test_the_cli_measures_the_winners_again_only_when_asked(sweeps, tmp_path):
    base = ["refine", str(TABLE), "--set", "one_trip=1", "--max-batch", "8", "--db", str(tmp_path / "r.db")]
    assert cli.main(base) == 0
    assert sweeps[-1]["fresh"] == set()
    n_plain = len(sweeps[-1]["candidates"])
    assert cli.main(base + ["--with-winners"]) == 0
    pairs, _ = refine_candidates(TABLE, {"one_trip": True}, (), max_batch=8, with_winners=True)
    assert sweeps[-1]["fresh"] == {c.key() for c in pairs} and len(sweeps[-1]["candidates"]) == len(pairs) > n_plain


def test_ctx_and_preset_filters_keep_those_keys_only():
    """`--min-ctx`, `--max-ctx` and `--preset`: the winners of those keys, no others."""
    main = "qwen3-8b-dflash-b16"
    cands, _ = refine_candidates(TABLE, {}, with_winners=True, min_ctx=128 * 1024, max_batch=4, preset=main)
    want = {(e["layout"], e["page_size"], e["batch"], e["ctx_len"]) for e in _winners()
            if e["ctx_len"] >= 128 * 1024 and e["batch"] <= 4 and e["provenance"]["preset"] == main}
    got = {(c.problem.layout, c.problem.page_size, c.problem.batch, c.problem.ctx_len) for c in cands}
    assert want and got == want
    assert all(c.preset == main for c in cands)
    short, _ = refine_candidates(TABLE, {}, with_winners=True, max_ctx=8192)
    assert short and all(c.problem.ctx_len <= 8192 for c in short)
    assert not {c.key() for c in short} & {c.key() for c in cands}


def test_with_winners_alone_measures_the_contenders_and_nothing_new(sweeps, tmp_path):
    """No --set: the winners and their runners-up as they were measured, every one a row the
    shipped database holds, all of them fresh; neither option: refused before any work."""
    base = ["refine", str(TABLE), "--min-ctx", "128k", "--preset", "qwen3-8b-dflash-b16",
            "--db", str(tmp_path / "r.db")]
    assert cli.main(base + ["--with-winners"]) == 0
    db_keys = {row[0] for row in sqlite3.connect(f"file:{DB}?mode=ro", uri=True).execute(
        "SELECT DISTINCT candidate_key FROM results")}
    (run,) = sweeps
    keys = {c.key() for c in run["candidates"]}
    assert keys and keys == set(run["fresh"]) and keys <= db_keys
    assert cli.main(base) == 2 and len(sweeps) == 1
    assert cli.main(base + ["--with-winners", "--preset", "no-such-model"]) == 2 and len(sweeps) == 1
    with pytest.raises(SystemExit):
        cli.main(base + ["--with-winners", "--min-ctx", "lots"])


def test_sustain_makes_the_candidates_sustained(sweeps, tmp_path):
    """`--sustain S` makes every candidate a sustained one (its own key, its wire carrying the
    load tuner.measure times it after), each measured fresh; without it they are a burst's,
    keyed as before."""
    base = ["refine", str(TABLE), "--with-winners", "--min-ctx", "128k", "--db", str(tmp_path / "r.db")]
    assert cli.main(base) == 0 and cli.main(base + ["--sustain", "0.75"]) == 0
    burst, sustained = sweeps
    assert burst["options"] == sustained["options"] == dict(reps=0, nsys=False)
    assert {c.sustain_s for c in burst["candidates"]} == {0.0}
    assert {c.sustain_s for c in sustained["candidates"]} == {0.75}
    assert [c.sustained(0) for c in sustained["candidates"]] == burst["candidates"]
    keys = {c.key() for c in sustained["candidates"]}
    assert not keys & {c.key() for c in burst["candidates"]}
    # the bursts are measured again side by side; the sustained keys have no older rows, and a
    # second run of the same refine resumes them
    assert burst["fresh"] == {c.key() for c in burst["candidates"]} and sustained["fresh"] == set()
    assert all(c.to_wire()["sustain_s"] == 0.75 for c in sustained["candidates"])


def test_sustain_load_makes_candidates_of_their_own(sweeps, tmp_path, capsys):
    """`--sustain-load gemm` times the candidates under a co-runner's load: keys of their own
    (neither a burst's nor an own-load sustained one's), the load on the wire; `self` is the
    own-load candidate as before; a load without --sustain is refused before anything runs."""
    base = ["refine", str(TABLE), "--with-winners", "--min-ctx", "128k", "--db", str(tmp_path / "r.db"),
            "--sustain", "0.75"]
    assert cli.main(base) == 0 and cli.main(base + ["--sustain-load", "self"]) == 0
    assert cli.main(base + ["--sustain-load", "gemm"]) == 0
    own, same, coload = sweeps
    assert own["candidates"] == same["candidates"]
    assert {c.sustain_load for c in coload["candidates"]} == {"gemm"}
    assert all(c.to_wire()["sustain_load"] == "gemm" and c.to_wire()["sustain_s"] == 0.75
               for c in coload["candidates"])
    assert not {c.key() for c in coload["candidates"]} & {c.key() for c in own["candidates"]}
    assert coload["fresh"] == set()  # sustained: a second run resumes
    assert cli.main(base[:-2] + ["--sustain-load", "gemm"]) == 2
    assert "needs --sustain" in capsys.readouterr().err and len(sweeps) == 3
    with pytest.raises(SystemExit):
        cli.main(base + ["--sustain-load", "heavy"])


def test_again_measures_sustained_candidates_again(sweeps, tmp_path, capsys):
    """`--again` (with --with-winners): sustained candidates are measured again too, where they
    have rows, so that no key is decided on rows timed two ways; alone it is refused."""
    base = ["refine", str(TABLE), "--with-winners", "--min-ctx", "128k", "--db", str(tmp_path / "r.db"),
            "--sustain", "0.75", "--sustain-load", "gemm"]
    assert cli.main(base + ["--again"]) == 0
    (run,) = sweeps
    assert run["fresh"] == {c.key() for c in run["candidates"]} and run["fresh"]
    assert cli.main(["refine", str(TABLE), "--set", "stages=3", "--again", "--db", str(tmp_path / "r.db")]) == 2
    assert "--again measures the winners and runners-up again: give --with-winners" in capsys.readouterr().err


def test_with_default_adds_the_runtimes_untuned_kernel(sweeps, tmp_path):
    """--with-default: each selected key's default parameters too (what the runtime runs
    without a table), resolved at that key and SM, once per key; alone it is enough to run."""
    from drafter_attn.kernels import registry
    from drafter_attn.tuner.spec import problem_from_key

    found, _ = refine_candidates(TABLE, {}, ("ws",), max_batch=1, min_ctx=131072, with_default=True)
    plain, _ = refine_candidates(TABLE, {}, ("ws",), max_batch=1, min_ctx=131072)
    extra = [c for c in found if c.key() not in {p.key() for p in plain}]
    keys = {json.dumps(c.problem.key(), sort_keys=True) for c in plain}
    assert extra and len(extra) == len(keys)  # one default a key (the winners are not defaults)
    backend = registry.get("cupy")
    for c in extra:
        e = next(e for e in _winners(("ws",)) if problem_from_key(e) == c.problem)
        assert c.params_dict == registry.resolve_params(backend, c.problem, e["sm"], {})
        assert not c.params_dict["ws"]
    base = ["refine", str(TABLE), "--where", "ws", "--max-batch", "1", "--min-ctx", "128k",
            "--db", str(tmp_path / "r.db")]
    assert cli.main(base + ["--with-default"]) == 0
    assert {c.key() for c in sweeps[-1]["candidates"]} == {c.key() for c in found}


def test_min_tokens_keeps_the_heavy_keys(sweeps, tmp_path):
    """--min-tokens keeps the winners of keys whose batch x context reaches it."""
    base = ["refine", str(TABLE), "--with-winners", "--db", str(tmp_path / "r.db"), "--dry-run"]
    assert cli.main(base + ["--min-tokens", "256k"]) == 0
    from drafter_attn.tuner.refine import refine_candidates

    found, _ = refine_candidates(TABLE, {}, with_winners=True, min_tokens=262144)
    assert found and all(c.problem.batch * c.problem.ctx_len >= 262144 for c in found)
    every, _ = refine_candidates(TABLE, {}, with_winners=True)
    assert {c.key() for c in found} == {c.key() for c in every
                                        if c.problem.batch * c.problem.ctx_len >= 262144}
    with pytest.raises(SystemExit):
        cli.main(base + ["--sustain", "-1"])
