"""Carry measurements across a kernel-source edit that leaves their machine code unchanged.

The runtime trusts a profile row only for the kernel sources it was measured on (the hash of
kernels/cuda, `kernels.nvrtc.sources_digest`). An edit that changes no kernel a row ran (a
comment; a path behind a define those rows never set) would otherwise turn every row into a
miss until the whole profile is measured again. `rekey` proves it row by row: it compiles every
kernel each row's measurement loaded (its attention and store variants, from the row's resolved
parameters) twice, with the old revision's kernels package (its sources *and* its host code that
turns parameters into defines) and with today's, and moves the rows whose machine code is the
same (every kernel's SASS and registers, stack, shared and local memory; tuner/kernel_digests.py)
to an environment of today's hash. Rows with any changed or uncompilable kernel
stay where they were: stale, measured again by the next sweep (which skips the moved rows, as
it skips any row its environment already holds). Each run is recorded in the database's `meta`
table ("rekey <time>").

A parameter added to a backend since a row was measured (cupy's `tma`, 2026-12-01) is missing
from that row's resolved parameters, so its candidate key matches no candidate of today's sweeps
and every such row would be measured again. `complete_params` fills it in, for rows on today's
sources, with the value today's package resolves from the row's own parameters: the value under
which the rekey just proved the row's machine code unchanged (a parameter added with a default
that keeps the old code).

What it does not prove, like the hash itself: host-side launch choices outside the kernels
(split counts, grids) and the compiler on the measuring machine (the code is compared as this
machine's NVRTC builds it; another NVRTC version could in principle treat the changed lines
differently).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from drafter_attn.tuner import db as dbm
from drafter_attn.tuner.export import REPO, commit_for_sources, digest_of, sources_at

DIGESTS_SCRIPT = Path(__file__).resolve().parent / "kernel_digests.py"
_ROW_SQL = """
SELECT r.id, r.env_id, r.candidate_key, r.impl, r.params, r.preset, e.sm,
       r.num_q_heads, r.num_kv_heads, r.head_dim, r.block_size, r.mask, r.window, r.num_layers,
       r.dtype, r.layout, r.page_size, r.batch, r.ctx_len
FROM results r JOIN environments e USING (env_id) WHERE e.sources_hash = ?
"""


def kernel_digests(rows: list[dict], root: Path | None = None, jobs: int | None = None) -> dict:
    """{row id: machine-code digest or "error: ..."} from tuner/kernel_digests.py, run against this
    installation or against the kernels package under `root`."""
    cmd = [sys.executable, str(DIGESTS_SCRIPT)]
    if root is not None:
        cmd += ["--root", str(root)]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    wire = [{**r, "params": json.loads(r["params"])} for r in rows]
    done = subprocess.run(cmd, input=json.dumps(wire), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed:\n{done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(done.stdout).items()}


def export_package(commit: str, dest: Path, repo: Path = REPO) -> Path:
    """kernels/ of `commit` as dest/drafter_attn/kernels (what kernel_digests.py --root takes)."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--prefix=drafter_attn/", commit,
                              "kernels"], capture_output=True, check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=120)
    return dest


def rekey(db_path, old_root: Path, old_hash: str, *, new_hash: str | None = None,
          source: str = "", jobs: int | None = None, dry_run: bool = False) -> dict:
    """Move the rows of `db_path` measured on sources `old_hash` (whose kernels package lies
    under `old_root`) whose kernels compile byte-identical today to an environment of today's
    hash (`new_hash`, default this checkout's). Returns what moved and what stayed."""
    from drafter_attn.kernels import nvrtc

    new_hash = new_hash or nvrtc.sources_digest()
    summary = {"from_hash": old_hash, "to_hash": new_hash, "from": source,
               "nvrtc": ".".join(map(str, nvrtc.nvrtc_version())), "moved": 0, "stale": 0,
               "stale_kinds": {}, "dry_run": dry_run}
    if old_hash == new_hash:
        return {**summary, "note": "the sources are the same: nothing to do"}
    with dbm.ProfileDB(db_path, create=False, readonly=dry_run) as db:  # a dry run writes nothing
        rows = db.query(_ROW_SQL, (old_hash,))
        if not rows:
            return {**summary, "note": f"no rows measured on sources {old_hash[:12]}"}
        old = kernel_digests(rows, old_root, jobs)
        new = kernel_digests(rows, None, jobs)
        unchanged = {rid for rid, code in new.items() if code == old[rid] and not code.startswith("error")}
        same = [r for r in rows if r["id"] in unchanged]
        summary["stale_kinds"] = dict(Counter(
            f"{r['preset'] or 'custom'} {r['impl']}: "
            f"{(new[r['id']] if new[r['id']].startswith('error') else 'kernels changed')[:120]}"
            for r in rows if r["id"] not in unchanged))
        summary["stale"] = len(rows) - len(same)
        summary["moved"] = len(same)
        if dry_run or not same:
            return summary
        with db.transaction():
            targets = {}
            for env in db.query("SELECT * FROM environments WHERE sources_hash = ?", (old_hash,)):
                fp = {**json.loads(env["fingerprint"]), "sources_hash": new_hash}
                targets[env["env_id"]] = db.add_environment(fp)
            # keys measured again on today's sources before this run: those rows stand. Every
            # row of a key measured more than once on the old sources moves (`tuner refine
            # --with-winners` measures a candidate again; the export takes its newest row).
            before = _keys_on(db, set(targets.values()))
            moved = 0
            for r in same:
                target = targets[r["env_id"]]
                if (target, r["candidate_key"]) in before:
                    continue
                db.conn.execute("UPDATE results SET env_id = ? WHERE id = ?", (target, r["id"]))
                moved += 1
            summary["moved"] = moved
            summary["envs"] = targets
            db.conn.execute("INSERT INTO meta (key, value) VALUES (?, ?)",
                            (f"rekey {dbm.now()}", dbm.canonical_json(summary)))
    return summary


def _keys_on(db, env_ids) -> set[tuple[str, str]]:
    """(environment, candidate key) of every row of these environments."""
    env_ids = list(env_ids)
    rows = db.query("SELECT env_id, candidate_key FROM results WHERE env_id IN "
                    f"({', '.join('?' * len(env_ids))})", env_ids) if env_ids else []
    return {(r["env_id"], r["candidate_key"]) for r in rows}


def complete_params(db_path, *, dry_run: bool = False) -> dict:
    """Fill in, on the rows measured on today's kernel sources, every parameter their backend
    has today that their resolved parameters lack, with the value today's package resolves from
    the row's own parameters (`with_params(**row).params_for(problem, sm)`, as
    tuner/kernel_digests.py compiles the row), and re-key them as today's sweeps key that
    candidate. Every such row is completed, also where another row already holds that key (a
    candidate measured again, before or after the parameter came): the export takes the newest
    row of each candidate, so an old row completed never displaces a newer one, and one left
    incomplete would compete as a candidate of its own. Returns {"completed": rows, "added":
    {parameter: rows}}."""
    import dataclasses

    from drafter_attn.kernels import nvrtc, registry
    from drafter_attn.kernels.spec import Geometry, Problem

    out = {"completed": 0, "added": Counter(), "dry_run": dry_run}
    sql = _ROW_SQL.replace("r.ctx_len", "r.ctx_len, r.problem_key, r.accepted, r.sustain_s, r.sustain_load")
    if dry_run:  # a dry run writes nothing, not even a migration: an older file has no such rows
        with dbm.ProfileDB(db_path, readonly=True) as db:
            if db.schema_version() < dbm.SCHEMA_VERSION:
                return out
    with dbm.ProfileDB(db_path, create=False, readonly=dry_run) as db:
        rows = db.query(sql, (nvrtc.sources_digest(),))
        updates = []
        for r in rows:
            try:
                backend = registry.get(r["impl"])
            except Exception:  # a backend this install cannot build: nothing to resolve with
                continue
            if getattr(backend, "family", None) is None:
                continue
            params = json.loads(r["params"])
            g = Geometry(r["num_q_heads"], r["num_kv_heads"], r["head_dim"], r["block_size"],
                         r["mask"], r["window"], r["num_layers"] or 1, r["dtype"])
            problem = Problem(g, r["layout"], r["page_size"], r["batch"], r["ctx_len"])
            try:
                full = dataclasses.asdict(backend.with_params(**params).params_for(problem, r["sm"]))
            except (TypeError, ValueError):
                continue
            missing = {k: v for k, v in full.items() if k not in params}
            if not missing:
                continue
            done = {**params, **missing}
            key = dbm.candidate_key(json.loads(r["problem_key"]), r["accepted"], r["impl"], done,
                                    r["sustain_s"], r["sustain_load"])
            updates.append((r, done, key, missing))
        if dry_run:
            out["completed"] = len(updates)
            out["added"] = dict(Counter(k for *_, m in updates for k in m))
            return out
        with db.transaction():
            for r, done, key, missing in updates:
                db.conn.execute("UPDATE results SET params = ?, candidate_key = ? WHERE id = ?",
                                (dbm.canonical_json(done), key, r["id"]))
                out["completed"] += 1
                out["added"].update(missing.keys())
            out["added"] = dict(out["added"])
            if out["completed"]:
                db.conn.execute("INSERT INTO meta (key, value) VALUES (?, ?)",
                                (f"complete_params {dbm.now()}", dbm.canonical_json(out)))
    return out


def rekey_from_commit(db_path, commit: str, repo: Path = REPO, **kw) -> dict:
    """`rekey` with the old kernels taken from git commit `commit` of `repo`."""
    try:
        old_hash = digest_of(sources_at(commit, repo))
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", "") or exc
        raise RuntimeError(f"cannot read kernels/cuda at {commit!r} in {repo} (git: "
                           f"{str(err).strip()[:200]})") from None
    with tempfile.TemporaryDirectory(prefix="rekey-") as tmp:
        export_package(commit, Path(tmp), repo)
        return rekey(db_path, Path(tmp), old_hash, source=f"commit {commit}", **kw)


def stale_sources(db_path) -> dict[str, int]:
    """{sources hash: rows} of the rows of `db_path` measured on other kernel sources than today's."""
    from drafter_attn.kernels import nvrtc

    today = nvrtc.sources_digest()
    with dbm.ProfileDB(db_path, readonly=True) as db:
        found = db.query("SELECT e.sources_hash AS h, COUNT(*) AS n FROM results r "
                         "JOIN environments e USING (env_id) GROUP BY e.sources_hash")
    return {r["h"]: r["n"] for r in found if r["h"] and r["h"] != today}


def rekey_stale(db_path, repo: Path = REPO, **kw) -> list[dict]:
    """`rekey_from_commit` for every stale sources hash of `db_path` whose commit git finds (the
    commit that introduced those sources); a hash git does not know is reported, not guessed."""
    out = []
    for old_hash, rows in stale_sources(db_path).items():
        commit = commit_for_sources(old_hash, repo)
        if commit is None:
            out.append({"from_hash": old_hash, "rows": rows,
                        "note": f"{rows} rows on sources {old_hash[:12]}: no commit of this "
                                f"repository has them; give --from"})
            continue
        out.append(rekey_from_commit(db_path, commit, repo, **kw))
    return out


def summary_text(s: dict) -> str:
    if "note" in s:
        return s["note"]
    lines = [f"{'would move' if s['dry_run'] else 'moved'} {s['moved']} rows from sources "
             f"{s['from_hash'][:12]} ({s['from'] or '?'}) to {s['to_hash'][:12]}; {s['stale']} stay "
             f"stale (measure them again)"]
    lines += [f"  {n:5d}  {k}" for k, n in sorted(s["stale_kinds"].items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)
