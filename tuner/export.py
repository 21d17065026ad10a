"""Tuned tables: export from the profile database, and diff two of them.

`export_table` reads the database through tuner.db, keeps the winner per (SM, problem) with the
rules of `kernels.dispatch` (the runtime reads what this writes) and adds provenance per entry,
including the git commit whose kernel sources were measured (found by hashing kernels/cuda at
each commit that changed it, as kernels.nvrtc.sources_digest hashes the working tree).

`diff_tables` lists winner flips and slowdowns beyond a threshold between two tables.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from fnmatch import fnmatch
from pathlib import Path

from drafter_attn.kernels import dispatch
from drafter_attn.tuner.db import ProfileDB

REPO = Path(__file__).resolve().parent.parent
CUDA_DIR = "kernels/cuda"


# ---------------------------------------------------------------------------------------------
# commits


def _git(*args: str, repo: Path = REPO, text: bool = True):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=text, check=True,
                          timeout=60).stdout


def head_commit(repo: Path = REPO) -> str | None:
    """The checked-out commit (with "+dirty" when tracked files changed), or None outside git."""
    try:
        head = _git("rev-parse", "HEAD", repo=repo).strip()
        dirty = _git("status", "--porcelain", "--untracked-files=no", repo=repo).strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def digest_of(files: dict[str, bytes]) -> str:
    """drafter_attn.kernels.nvrtc.sources_digest's hash over {file name: contents} (*.cu* files by name)."""
    h = hashlib.sha256()
    for name in sorted(n for n in files if fnmatch(n, "*.cu*")):
        h.update(name.encode())
        h.update(files[name])
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _source_commits(repo: Path, limit: int) -> dict[str, str]:
    """sources digest -> the oldest commit holding exactly those kernel sources (the commit
    that introduced them), over the last `limit` commits that changed kernels/cuda."""
    try:
        commits = _git("log", f"-{limit}", "--format=%H", "--", CUDA_DIR, repo=repo).split()
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[str, str] = {}
    for commit in commits:  # newest first: an older commit of the same digest overwrites
        try:
            listing = _git("ls-tree", commit, f"{CUDA_DIR}/", repo=repo).splitlines()
        except subprocess.SubprocessError:
            continue
        files = {}
        for line in listing:
            meta, _, path = line.partition("\t")
            if meta.split()[1] == "blob":
                files[path.rsplit("/", 1)[-1]] = _git("show", f"{commit}:{path}", repo=repo, text=False)
        out[digest_of(files)] = commit
    return out


def commit_for_sources(sources_hash: str | None, repo: Path = REPO, limit: int = 200) -> str | None:
    """The git commit whose kernel sources hash to `sources_hash`, or None (uncommitted sources,
    another repository, no git)."""
    if not sources_hash:
        return None
    return _source_commits(repo, limit).get(sources_hash)


# ---------------------------------------------------------------------------------------------
# export


def export_table(db_path, sms=None, *, include_predicted: bool = False, resolve_commits: bool = True) -> dict:
    """The tuned table of `db_path` (SMs `sms`, default all): winners with provenance."""
    sql = dispatch.DB_ROWS_SQL
    args: list = []
    if sms:
        sql += f" AND e.sm IN ({', '.join('?' * len(sms))})"
        args += list(sms)
    with ProfileDB(db_path, readonly=True) as db:
        rows = db.query(sql, args)
    entries = dispatch.select_entries(rows, include_predicted=include_predicted)
    if resolve_commits:
        for e in entries:
            e["provenance"]["commit"] = commit_for_sources(e["provenance"]["sources_hash"])
    source = {"generator": "tuner export", "db": str(Path(db_path).resolve()), "commit": head_commit(),
              "sms": sorted({e["sm"] for e in entries}), "requested_sms": list(sms) if sms else None,
              "include_predicted": include_predicted,
              "rows": len(rows), "entries": len(entries)}
    return dispatch.make_table(entries, source)


def write_table(table: dict, out) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(out)
    return out


def read_table(path) -> dict:
    """A tuned table, validated (TableError when corrupt or foreign)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise dispatch.TableError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise dispatch.TableError(f"{path} is not a JSON tuned table: {exc}") from None
    dispatch.validate_table(doc, str(path))
    return doc


# ---------------------------------------------------------------------------------------------
# diff


def entry_key(e: dict) -> tuple:
    return (e["sm"], *(e.get(f) for f in dispatch.SHAPE_FIELDS), e["batch"], e["ctx_len"])


def describe_key(key: tuple) -> str:
    return dispatch._describe(key)


def _winner(e: dict) -> str:
    return e["impl"] + dispatch._fmt(e["params"])


def _latency(e: dict) -> float:
    return e.get("per_layer_us") or e["median_us"] / (e.get("num_layers") or 1)


def diff_tables(a: dict, b: dict, threshold: float = 0.05) -> dict:
    """What changed from table `a` to table `b`: winner flips (another implementation or
    parameter set wins), slowdowns (the winner's step latency per layer grew by more than
    `threshold`, a fraction), speedups (shrank by more), entries only in one of them."""
    ea = {entry_key(e): e for e in a["entries"]}
    eb = {entry_key(e): e for e in b["entries"]}
    flips, slowdowns, speedups = [], [], []
    for key in sorted(set(ea) & set(eb), key=lambda k: tuple(-1 if v is None else v for v in k)):
        x, y = ea[key], eb[key]
        change = _latency(y) / _latency(x) - 1.0
        item = {"key": describe_key(key), "a": _winner(x), "b": _winner(y), "a_us": _latency(x),
                "b_us": _latency(y), "change": change}
        if (x["impl"], x["params"]) != (y["impl"], y["params"]):
            flips.append(item)
        if change > threshold:
            slowdowns.append(item)
        elif change < -threshold:
            speedups.append(item)
    only = lambda s, t: [describe_key(k) for k in sorted(set(s) - set(t),  # noqa: E731
                                                         key=lambda k: tuple(-1 if v is None else v for v in k))]
    return {"threshold": threshold, "common": len(set(ea) & set(eb)), "flips": flips,
            "slowdowns": slowdowns, "speedups": speedups, "only_a": only(ea, eb), "only_b": only(eb, ea)}


def diff_text(d: dict, a_name: str = "A", b_name: str = "B") -> str:
    lines = [f"{d['common']} problems in both; {len(d['flips'])} winner flips, {len(d['slowdowns'])} "
             f"slowdowns and {len(d['speedups'])} speedups beyond {d['threshold']:.1%}; "
             f"{len(d['only_a'])} only in {a_name}, {len(d['only_b'])} only in {b_name}"]
    for title, items in (("winner flips", d["flips"]), ("slowdowns", d["slowdowns"]),
                         ("speedups", d["speedups"])):
        if items:
            lines.append(f"{title}:")
            for it in items:
                lines.append(f"  {it['key']}: {it['a']} {it['a_us']:.2f} us -> {it['b']} "
                             f"{it['b_us']:.2f} us ({it['change']:+.1%})")
    for title, keys in ((f"only in {a_name}", d["only_a"]), (f"only in {b_name}", d["only_b"])):
        if keys:
            lines.append(f"{title}:")
            lines += [f"  {k}" for k in keys]
    return "\n".join(lines)
