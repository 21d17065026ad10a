"""Predicted rows for GPUs you do not own: a roofline projection from datasheet bandwidth.

For every measured `ok` row of a source SM (the nearest measured one by default: the same family
sm // 10 first, then the numerically nearest), with the step's bytes that must move `bytes_moved`:

    efficiency  = (bytes_moved / median) / datasheet bandwidth of the measured GPU
    predicted   = bytes_moved / (efficiency x datasheet bandwidth of the target GPU)
                = median x bandwidth(source) / bandwidth(target)

(the attention and store halves scale the same way). The model assumes the kernel reaches the
same fraction of peak bandwidth on the target, and scales fixed costs (launches, pipeline fill)
with bandwidth too, so it is optimistic for short steps. Predicted rows go into the database with
provenance `predicted`, in an environment of their own named after the target GPU; the runtime,
`tuner export` and AUTO leave them out unless asked. Nothing not modelled (host syncs, workspace,
noise) is filled in.

The datasheet table (`tuner/datasheets.toml`, or `--datasheets PATH`) is editable and names
the source of every number.
"""

from __future__ import annotations

import math
import sys
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from drafter_attn.kernels import tuned_table
from drafter_attn.tuner.db import ProfileDB, SchemaError, db_errors
from drafter_attn.tuner.env import env_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GPU_KEYS = ("name", "sm", "bandwidth_tbs", "source", "match", "default_for_sm")
# Columns copied from the measured row (the candidate's identity and what does not depend on the GPU).
COPIED = ("candidate_key", "problem_key", "preset", "num_q_heads", "num_kv_heads", "head_dim",
          "block_size", "mask", "window", "num_layers", "dtype", "layout", "page_size", "batch",
          "ctx_len", "accepted", "impl", "params", "bytes_moved", "kv_bytes")
SCALED = ("median_us", "attention_median_us", "store_median_us")


class DatasheetError(ValueError):
    """A datasheet table that cannot be used, or a GPU it does not list."""


@dataclass(frozen=True)
class GPU:
    name: str
    sm: int
    bandwidth_tbs: float
    source: str
    match: tuple = ()
    default_for_sm: bool = False

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_tbs * 1e12


def _datasheet_text(path) -> tuple[str, str]:
    if path is None:
        return resources.files(__package__).joinpath("datasheets.toml").read_text(), "tuner/datasheets.toml"
    try:
        return Path(path).read_text(), str(path)
    except OSError as exc:
        raise DatasheetError(f"{path}: cannot read the datasheet table: {exc.strerror or exc}") from None


def load_datasheets(path=None) -> list[GPU]:
    """The GPUs of a datasheet table (default: the one shipped with the tuner), validated."""
    text, where = _datasheet_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DatasheetError(f"{where}: not valid TOML: {exc}") from None
    gpus = data.get("gpu")
    if not isinstance(gpus, list) or not gpus:
        raise DatasheetError(f"{where}: expected [[gpu]] entries")
    out, defaults = [], {}
    for i, g in enumerate(gpus):
        key = f"{where}: gpu[{i}]"
        unknown = set(g) - set(GPU_KEYS)
        if unknown:
            raise DatasheetError(f"{key}: unknown key(s) {sorted(unknown)}; known: {', '.join(GPU_KEYS)}")
        for name, typ in (("name", str), ("sm", int), ("source", str)):
            if not isinstance(g.get(name), typ) or isinstance(g.get(name), bool) or not g[name]:
                raise DatasheetError(f"{key}.{name}: expected a non-empty {typ.__name__}, got {g.get(name)!r}")
        bw = g.get("bandwidth_tbs")
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
            raise DatasheetError(f"{key}.bandwidth_tbs: expected a positive number, got {bw!r}")
        match = g.get("match", [])
        if not isinstance(match, list) or not all(isinstance(m, str) and m for m in match):
            raise DatasheetError(f"{key}.match: expected a list of strings, got {match!r}")
        gpu = GPU(g["name"], g["sm"], float(bw), g["source"], tuple(match), bool(g.get("default_for_sm")))
        if gpu.default_for_sm:
            if gpu.sm in defaults:
                raise DatasheetError(f"{key}.default_for_sm: sm {gpu.sm} already has {defaults[gpu.sm]!r}")
            defaults[gpu.sm] = gpu.name
        out.append(gpu)
    return out


def gpu_for_device(gpus: list[GPU], device_name: str) -> GPU | None:
    """The datasheet entry of a measured GPU by its device name (longest matching part)."""
    name = (device_name or "").lower()
    best, best_len = None, 0
    for g in gpus:
        for m in g.match or (g.name,):
            if m.lower() in name and len(m) > best_len:
                best, best_len = g, len(m)
    return best


def target_gpu(gpus: list[GPU], sm: int, name: str | None = None) -> GPU:
    """The GPU to predict for: by (part of) its name, else the default of `sm`."""
    if name:
        found = [g for g in gpus if name.lower() in g.name.lower()]
        exact = [g for g in found if g.name.lower() == name.lower()]
        found = exact or found
        if len(found) != 1:
            raise DatasheetError(f"--gpu {name!r} matches {[g.name for g in found] or 'no GPU'} in the "
                                 f"datasheet table; known: {', '.join(g.name for g in gpus)}")
        if found[0].sm != sm:
            raise DatasheetError(f"{found[0].name} is sm{found[0].sm}, not sm{sm}")
        return found[0]
    of_sm = [g for g in gpus if g.sm == sm]
    chosen = [g for g in of_sm if g.default_for_sm] or (of_sm if len(of_sm) == 1 else [])
    if not chosen:
        raise DatasheetError(f"no default GPU for sm{sm} in the datasheet table "
                             f"({', '.join(g.name for g in of_sm) or 'none listed'}): give --gpu, or add "
                             f"one with default_for_sm = true")
    return chosen[0]


def nearest_sm(measured: list[int], target: int) -> int | None:
    """The measured SM nearest `target`: the same family (sm // 10) first, then numerically."""
    if not measured:
        return None
    return min(measured, key=lambda s: (s // 10 != target // 10, abs(s - target), s))


_SOURCE_SQL = """
SELECT r.*, e.gpu_name, e.sm, e.cuda, e.torch, e.cupy, e.cutlass, e.nvrtc, e.sources_hash
FROM results r JOIN environments e USING (env_id)
WHERE e.sm = ? AND r.status = 'ok' AND r.provenance = 'measured' AND r.median_us > 0
ORDER BY r.created_at DESC, r.id DESC
"""  # newest first: a candidate measured more than once is projected from its latest timing,
     # as export and report read it


def measured_sms(db: ProfileDB) -> list[int]:
    return [r["sm"] for r in db.query(
        "SELECT DISTINCT e.sm FROM results r JOIN environments e USING (env_id) "
        "WHERE r.status = 'ok' AND r.provenance = 'measured' ORDER BY e.sm")]


def _measured_sms_in(path) -> list[int]:
    """SMs with measured ok rows in the database at `path` (read-only); [] when it is missing
    or unreadable."""
    try:
        with ProfileDB(path, readonly=True) as db:
            return measured_sms(db)
    except SchemaError:
        return []


def default_source(db_path, target_sm: int, from_sm: int | None = None) -> Path | None:
    """Where `tuner predict` without --db reads measured rows: None (the database in use,
    `db_path`) when it holds measured rows to project from, else the profile database shipped
    for the measured SM (profiles/sm<SM>.db: `from_sm`, or the nearest shipped one), so that
    a fresh install predicts from the H200's measurements. None when nothing is shipped."""
    from drafter_attn.kernels.shipped import shipped_dir

    usable = [s for s in _measured_sms_in(db_path) if s != target_sm]
    if (from_sm in usable) if from_sm is not None else usable:
        return None
    folder = shipped_dir()
    shipped = {}
    for path in sorted(folder.glob("sm*.db")) if folder is not None else ():
        if path.stem[2:].isdigit() and int(path.stem[2:]) != target_sm:
            shipped[int(path.stem[2:])] = path
    sm = from_sm if from_sm is not None else nearest_sm(sorted(shipped), target_sm)
    return shipped.get(sm)


def predict(db_path, target_sm: int, from_sm: int | None = None, *, gpu: str | None = None,
            datasheets=None, source=None) -> dict:
    """Write predicted rows for `target_sm` into the database at `db_path` from the measured
    rows of `from_sm` (default: the nearest measured SM) in `source` (a database opened
    read-only; default: `db_path` itself, which must then exist). Rows predicted before (same
    target, same candidate) are skipped. Returns a summary: target, source, written, skipped
    and why."""
    gpus = load_datasheets(datasheets)
    target = target_gpu(gpus, target_sm, gpu)
    summary = {"target": target.name, "target_sm": target.sm, "target_tbs": target.bandwidth_tbs,
               "target_source": target.source, "written": 0, "skipped_done": 0, "superseded": 0,
               "skipped_no_bytes": 0, "skipped_bad": [], "no_datasheet": [], "sources": [],
               "source_db": str(source or db_path)}
    if source is None:
        with ProfileDB(db_path, create=False) as db:
            rows = _source_rows(db, target, from_sm, summary)
            return _write_predictions(db, rows, gpus, target, summary)
    with ProfileDB(source, readonly=True) as src:
        rows = _source_rows(src, target, from_sm, summary)
    with ProfileDB(db_path) as db:  # created when missing, as `tuner sweep` and `compile` do
        return _write_predictions(db, rows, gpus, target, summary)


def _source_rows(source: ProfileDB, target: GPU, from_sm: int | None, summary: dict) -> list:
    """The measured ok rows of `from_sm` (default: the nearest measured SM) in `source`."""
    sms = measured_sms(source)
    if from_sm is None:
        from_sm = nearest_sm([s for s in sms if s != target.sm], target.sm)
        if from_sm is None:
            raise DatasheetError(f"{source.path} holds no measured rows to project from")
    summary["from_sm"] = from_sm
    # burst timings only: a bandwidth projection of a power-capped timing would be a burst row
    # on the target with another regime's number
    rows = [r for r in source.query(_SOURCE_SQL, (from_sm,)) if tuned_table.row_regime(r) == "burst"]
    if not rows:
        raise DatasheetError(f"{source.path} holds no measured ok rows of sm{from_sm} (measured: "
                             f"{', '.join(f'sm{s}' for s in sms) or 'none'})")
    return rows


def _write_predictions(db: ProfileDB, rows: list, gpus: list, target: GPU, summary: dict) -> dict:
    """Project `rows` onto `target` and store them in `db` (all or nothing)."""
    from_sm = summary["from_sm"]
    sweep_id = "predict-" + uuid.uuid4().hex[:12]
    envs: dict[str, tuple[str, dict, GPU, set]] = {}
    pending: list[tuple[dict, dict]] = []
    projected: set[tuple[str, str]] = set()
    for row in rows:
        src = gpu_for_device(gpus, row["gpu_name"])
        if src is None:
            if row["gpu_name"] not in summary["no_datasheet"]:
                summary["no_datasheet"].append(row["gpu_name"])
            continue
        if row["env_id"] not in envs:
            fp = dict(gpu_name=f"{target.name} (predicted from {row['gpu_name']})", sm=target.sm,
                      sm_count=None, driver=None, cuda=row["cuda"], torch=row["torch"],
                      cupy=row["cupy"], cutlass=row["cutlass"], nvrtc=row["nvrtc"],
                      sources_hash=row["sources_hash"])
            eid = env_id(fp)
            envs[row["env_id"]] = (eid, fp, src, db.done_candidates(eid))
            source_gpu = {"gpu": row["gpu_name"], "datasheet": src.name,
                          "tbs": src.bandwidth_tbs, "source": src.source}
            if source_gpu not in summary["sources"]:  # one GPU recorded under several environments
                summary["sources"].append(source_gpu)
        eid, fp, src, done = envs[row["env_id"]]
        if (eid, row["candidate_key"]) in projected:  # an older timing of a candidate just projected
            summary["superseded"] += 1
            continue
        if row["candidate_key"] in done:
            summary["skipped_done"] += 1
            continue
        if not row.get("bytes_moved"):
            summary["skipped_no_bytes"] += 1
            continue
        if _bad_numbers(row):
            summary["skipped_bad"].append(row["id"])
            continue
        out = _projected(row, src, target, from_sm)
        out.update(env_id=eid, sweep_id=sweep_id)
        pending.append((fp, out))
        projected.add((eid, row["candidate_key"]))
    pending.reverse()  # stored in the measured rows' order (they were read newest first)
    # All or nothing: a failure part way leaves no half-written prediction behind.
    with db_errors(db.path, "storing predicted rows"), db.transaction():
        for fp, out in pending:
            db.add_environment(fp)
            db.add_result(out)
    summary["written"] = len(pending)
    return summary


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bad_numbers(row: dict) -> list[str]:
    """Columns of a measured row that a projection needs but that hold no usable number."""
    bad = [k for k in ("median_us", "bytes_moved") if not (_is_number(row.get(k)) and row[k] > 0)]
    return bad + [k for k in SCALED[1:] if row.get(k) is not None and not _is_number(row[k])]


def _projected(row: dict, src: GPU, target: GPU, from_sm: int) -> dict:
    """The predicted row of one measured row (environment and sweep id still to fill in)."""
    achieved = row["bytes_moved"] / (row["median_us"] * 1e-6)
    efficiency = achieved / src.bytes_per_s
    ratio = src.bytes_per_s / target.bytes_per_s
    out = {k: row[k] for k in COPIED}
    for k in SCALED:
        out[k] = None if row.get(k) is None else row[k] * ratio
    predicted_bw = row["bytes_moved"] / (out["median_us"] * 1e-6)
    out.update(status="ok", provenance="predicted", worker="tuner predict",
               bandwidth_gbs=predicted_bw / 1e9,
               reason=(f"predicted: roofline projection of {row['median_us']:.2f} us measured on "
                       f"{row['gpu_name']} (sm{from_sm}, row {row['id']}): efficiency "
                       f"{efficiency:.3f} of its datasheet {src.bandwidth_tbs} TB/s "
                       f"[{src.source}] applied to {target.name} {target.bandwidth_tbs} TB/s "
                       f"[{target.source}]"))
    return out
