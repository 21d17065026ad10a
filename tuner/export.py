"""Tuned tables: export from the profile database, and diff two of them.

`export_table` reads the database through tuner.db, keeps the winner per (SM, problem) with the
rules of `kernels.tuned_table` (the runtime reads what this writes) and adds provenance per
entry: the GPU, the kernel-source hash and the library versions the runtime compares at load,
and the git commit whose kernel sources were measured (found by hashing kernels/cuda at each
commit that changed it, as kernels.nvrtc.sources_digest hashes the working tree).

`diff_tables` lists winner flips and slowdowns beyond a threshold between two tables.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from fnmatch import fnmatch
from pathlib import Path

from drafter_attn.kernels import dispatcher, tuned_table
from drafter_attn.tuner.cli_checks import write_whole

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
            out[digest_of(sources_at(commit, repo))] = commit
        except subprocess.SubprocessError:
            continue
    return out


def sources_at(commit: str, repo: Path = REPO) -> dict[str, bytes]:
    """{file name: contents} of kernels/cuda at `commit` (SubprocessError if git cannot say)."""
    files = {}
    for line in _git("ls-tree", commit, f"{CUDA_DIR}/", repo=repo).splitlines():
        meta, _, path = line.partition("\t")
        if meta.split()[1] == "blob":
            files[path.rsplit("/", 1)[-1]] = _git("show", f"{commit}:{path}", repo=repo, text=False)
    return files


def commit_for_sources(sources_hash: str | None, repo: Path = REPO, limit: int = 200) -> str | None:
    """The git commit whose kernel sources hash to `sources_hash`, or None (uncommitted sources,
    another repository, no git)."""
    if not sources_hash:
        return None
    return _source_commits(repo, limit).get(sources_hash)


# ---------------------------------------------------------------------------------------------
# export


TODAYS = "today"  # export_table's default `sources_hash` (see there)


def export_table(db_path, sms=None, *, include_predicted: bool = False, resolve_commits: bool = True,
                 gpu_classes: dict | None = None, sources_hash: str | None = TODAYS,
                 regime: str = "burst") -> dict:
    """The tuned table of `db_path` (SMs `sms`, default all): winners with provenance. Rows
    that cannot be read are left out with a warning. `gpu_classes` ({class: [GPU names]})
    declares GPUs that may use each other's entries. `regime` (kernels.tuned_table.REGIMES):
    which timings decide each key.

    Each GPU's rows (or a class's, where `gpu_classes` puts it in one) decide its own entries
    (`tuned_table.select_entries`): the runtime uses an entry only on the GPU it was measured on,
    so an H100's key won by an H200 row would be a miss on the H100 with H100 rows there.
    `sources_hash`: only rows
    measured on those kernel sources; None: every row; TODAYS (the default): this checkout's
    sources where any row was measured on them (the runtime here runs no others: an older
    sources' row winning a key would leave the key a miss), else every row."""
    # read-only (immutable where the file's folder is), as the runtime reads it: exporting
    # never writes to the database, and works on an installed package's read-only profiles
    rows = [r for r in tuned_table.read_db_rows(db_path) if not sms or r["sm"] in sms]
    if sources_hash == TODAYS:
        from drafter_attn.kernels import nvrtc

        today = nvrtc.sources_digest()
        sources_hash = today if any(r["sources_hash"] == today for r in rows) else None
    if sources_hash is not None:
        rows = [r for r in rows if r["sources_hash"] == sources_hash]
    entries = tuned_table.select_entries(rows, include_predicted=include_predicted, regime=regime,
                                         where=f"profile database {db_path}", gpu_classes=gpu_classes)
    if resolve_commits:
        for e in entries:
            e["provenance"]["commit"] = commit_for_sources(e["provenance"]["sources_hash"])
    source = {"generator": "tuner export", "db": str(Path(db_path).resolve()), "commit": head_commit(),
              "sms": sorted({e["sm"] for e in entries}), "requested_sms": list(sms) if sms else None,
              "include_predicted": include_predicted, "sources_hash": sources_hash, "regime": regime,
              "gpus": sorted({str(e["provenance"]["gpu"]) for e in entries}),
              "rows": len(rows), "entries": len(entries)}
    return tuned_table.make_table(entries, source, gpu_classes=gpu_classes)


def write_table(table: dict, out) -> Path:
    """`table` as JSON at `out`, written whole (a temporary file of its own, then renamed: two
    exports at once or a full disk never leave a truncated table)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(table, indent=1) + "\n"
    return write_whole(out, lambda tmp: tmp.write_text(text))


def read_table(path) -> dict:
    """A tuned table, validated (TableError when corrupt or foreign), with its entries typed
    (kernels.tuned_table.Entry); unusable entries are left out with a warning."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise tuned_table.TableError(f"cannot read {path}: {exc.strerror or exc}") from None
    doc = tuned_table.parse_json(text, str(path))
    raw = tuned_table.validate_table(doc, str(path))
    return {**doc, "entries": tuned_table.parse_entries(raw, str(path), include_predicted=True)}


# ---------------------------------------------------------------------------------------------
# diff


describe_key = dispatcher.describe_key


def _gpu(e: tuned_table.Entry, table: dict) -> str | None:
    """The GPU an entry was measured on, or the class of the table's `gpu_classes` holding it."""
    return tuned_table.gpu_group((e.get("provenance") or {}).get("gpu"), table.get("gpu_classes"))


def _winner(e: tuned_table.Entry) -> str:
    return e.winner.impl + dispatcher.fmt_params(e.winner.params)


def _typed(table: dict) -> list:
    return tuned_table.parse_entries(table["entries"], "tuned table", include_predicted=True)


def _param_defaults(impl: str) -> dict:
    """{parameter: its default} of backend `impl`; {} where it cannot be built here."""
    from drafter_attn.kernels import registry

    try:
        return {name: default for name, (_, default, _) in registry.param_schema(registry.get(impl)).items()}
    except Exception:  # an uninstallable backend: compare its parameters as they are
        return {}


def _same_winner(x, y) -> bool:
    """One implementation and parameter set. A parameter that only one side names (added to the
    backend after the other was measured) counts as the same when it is at its default there:
    that is the code the other side ran (`tuner rekey` carries rows on that proof)."""
    px, py = dict(x.params), dict(y.params)
    if x.impl != y.impl or px == py:
        return x.impl == y.impl
    defaults = _param_defaults(x.impl)
    fill = lambda p: {**{k: defaults[k] for k in (px.keys() | py.keys()) - p.keys() if k in defaults}, **p}  # noqa: E731
    return fill(px) == fill(py)


def diff_tables(a: dict, b: dict, threshold: float = 0.05) -> dict:
    """What changed from table `a` to table `b` (as `read_table` gives them): winner flips
    (another implementation or parameter set wins; `_same_winner`), slowdowns (the winner's step
    latency per layer grew by more than `threshold`, a fraction), speedups (shrank by more),
    entries only in one of them."""
    # a table may hold one entry of a key per GPU, or per class of GPUs (export decides each
    # one's keys on its rows): entries compare within one GPU, a class's members as one
    ea = {(_gpu(e, a), e.key): e for e in _typed(a)}
    eb = {(_gpu(e, b), e.key): e for e in _typed(b)}
    several = len({g for g, _ in ea.keys() | eb.keys()}) > 1
    describe = lambda gk: describe_key(gk[1]) + (f" on {gk[0]}" if several else "")  # noqa: E731
    order = lambda gk: (str(gk[0]), tuple(-1 if v is None else v for v in gk[1]))  # noqa: E731
    flips, slowdowns, speedups = [], [], []
    for key in sorted(set(ea) & set(eb), key=order):
        x, y = ea[key], eb[key]
        change = y.per_layer_us / x.per_layer_us - 1.0
        item = {"key": describe(key), "a": _winner(x), "b": _winner(y), "a_us": x.per_layer_us,
                "b_us": y.per_layer_us, "change": change}
        if not _same_winner(x.winner, y.winner):
            flips.append(item)
        if change > threshold:
            slowdowns.append(item)
        elif change < -threshold:
            speedups.append(item)
    only = lambda s, t: [describe(k) for k in sorted(set(s) - set(t), key=order)]  # noqa: E731
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
