"""The GPU at hand: which CUDA devices torch sees, and the checks `bench decode` makes before it
measures anything (a CUDA GPU exists; `--sm` names the SM of one of them)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from drafter_attn.bench.options import BenchError

# Only for messages: what a user might have meant by an SM number.
SM_NAMES = {
    80: "A100 / A30 (Ampere)",
    86: "RTX 30xx / A10 (Ampere)",
    87: "Jetson AGX Orin (Ampere)",
    89: "L4 / L40 / RTX 40xx (Ada)",
    90: "H100 / H200 / GH200 (Hopper)",
    100: "B200 / GB200 (Blackwell)",
    103: "B300 / GB300 (Blackwell Ultra)",
    107: "Vera Rubin (Rubin)",
    110: "Jetson Thor",
    120: "RTX 50xx / RTX PRO Blackwell",
    121: "DGX Spark (GB10)",
}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    sm: int
    sm_count: int
    memory_bytes: int

    def describe(self) -> str:
        return f"cuda:{self.index} {self.name} (SM {self.sm}, {self.sm_count} SMs, " \
               f"{self.memory_bytes / 2**30:.0f} GiB)"


def probe() -> list[GpuInfo]:
    """Every CUDA device torch sees (empty without one)."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(GpuInfo(i, p.name, p.major * 10 + p.minor, p.multi_processor_count, p.total_memory))
    return out


def _sm_text(sm: int) -> str:
    name = SM_NAMES.get(sm)
    return f"SM {sm} ({name})" if name else f"SM {sm}"


def no_gpu_message(command: str, requested: int | None = None,
                   predicted: dict[str, int] | None = None, db_path=None) -> str:
    """No CUDA GPU here: what torch says, what runs without one, and for `--sm N` what is
    recorded for SM N (`predicted`: predicted_rows)."""
    import torch

    cuda = torch.version.cuda
    build = f"a CUDA {cuda} build" if cuda else "a CPU-only build: torch.version.cuda is None"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    lines = [
        f"{command}: no CUDA GPU found: torch {torch.__version__} ({build}) reports "
        f"torch.cuda.is_available() = False"
        + (f", with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "") + ".",
        f"{command} measures kernels on a GPU; run it on a machine with an NVIDIA GPU "
        f"(check nvidia-smi and that torch is a CUDA build).",
        "Without a GPU you can still run:",
        "  bench memory --preset NAME --max-ctx 1M --concurrency 16   (arena against paged KV footprint)",
        "  bench report [--sm N]                                      (plots and summary of recorded results)",
    ]
    lines.append("  tuner show --sm N                                          (recorded profiles)")
    if requested is not None:
        lines += _recorded_lines(requested, predicted, "  ", db_path)
    return "\n".join(lines)


def _recorded_lines(requested: int, predicted: dict[str, int] | None, bullet: str,
                    db_path=None) -> list[str]:
    """Where the rows recorded for SM `requested` are: the predicted ones when there are some,
    else how to look and how to project them."""
    if predicted:
        rows = "; ".join(f"{n} for {name}" for name, n in sorted(predicted.items()))
        return [f"{bullet}read the predicted rows recorded for SM {requested} (tuner predict: measured "
                f"efficiency x datasheet bandwidth; {rows}):",
                f"    bench report --sm {requested}   or   tuner show --sm {requested}"]
    if _measured(requested, db_path):
        return [f"{bullet}see what was measured on SM {requested}: bench report --sm {requested}",
                f"    or tuner show --sm {requested}"]
    if _has_datasheet(requested):
        return [f"{bullet}project SM {requested} from another SM's measurements: tuner predict --sm {requested}"]
    return [f"{bullet}nothing is recorded for SM {requested}, and tuner's datasheet table has no GPU "
            f"of it to project measurements onto (tuner predict --list shows the GPUs it knows)"]


def _measured(sm: int, db_path=None) -> bool:
    """Whether `db_path` (else the database a reading command would read for `sm`) holds
    measured ok rows of SM `sm`."""
    import sqlite3

    from drafter_attn.tuner.db import ProfileDB, SchemaError, reading_path

    sql = ("SELECT 1 FROM results r JOIN environments e USING (env_id) WHERE e.sm = ? "
           "AND r.status = 'ok' AND r.provenance = 'measured' LIMIT 1")
    try:
        with ProfileDB(db_path or reading_path(sm), readonly=True) as db:
            return bool(db.query(sql, (sm,)))
    except (SchemaError, sqlite3.Error, OSError):
        return False


def _has_datasheet(sm: int) -> bool:
    from drafter_attn.tuner.predict import DatasheetError, load_datasheets, target_gpu

    try:
        target_gpu(load_datasheets(), sm)
        return True
    except DatasheetError:
        return False


def predicted_rows(db_path, sm: int) -> dict[str, int]:
    """`tuner predict` rows (provenance predicted) recorded for `sm`, counted per projected GPU
    name; empty when there are none or the database cannot be read (a message aid only)."""
    import sqlite3

    from drafter_attn.tuner.db import ProfileDB, SchemaError, default_path

    sql = ("SELECT e.gpu_name AS gpu, COUNT(*) AS n FROM results r JOIN environments e USING (env_id) "
           "WHERE e.sm = ? AND r.provenance = 'predicted' AND r.status = 'ok' GROUP BY e.gpu_name")
    try:
        with ProfileDB(db_path or default_path(), create=False) as db:
            return {r["gpu"]: r["n"] for r in db.query(sql, (sm,))}
    except (SchemaError, sqlite3.Error, OSError):
        return {}


def mismatch_message(command: str, requested: int, gpus: list[GpuInfo],
                     predicted: dict[str, int] | None = None, db_path=None) -> str:
    """What was found and what to do instead; `predicted` (predicted_rows) points at the
    projections recorded for the SM asked."""
    found = "; ".join(g.describe() for g in gpus)
    here = sorted({g.sm for g in gpus})
    lines = [
        f"{command}: --sm {requested} does not match the GPU here: {found}.",
        f"{command} measures the GPU at hand, so it cannot measure {_sm_text(requested)} on this machine.",
        "What you can do instead:",
        f"  - measure this GPU: run without --sm, or with --sm {here[0]}"
        + (f" (or {', '.join(map(str, here[1:]))})" if len(here) > 1 else ""),
        f"  - run the same command on a machine with an {_sm_text(requested)} GPU",
    ]
    return "\n".join(lines + _recorded_lines(requested, predicted, "  - ", db_path))


def require_gpu(sm: int | None, command: str = "bench decode", gpus: list[GpuInfo] | None = None,
                db_path=None) -> GpuInfo:
    """The device to measure on: the first GPU (or the first whose SM is `sm`). Raises BenchError
    (exit code 2) with what was found and what to do instead, pointing at predicted rows for
    `sm` in the profile database (`db_path`, else the default one) where there are some."""
    gpus = probe() if gpus is None else gpus
    if not gpus:
        raise BenchError(no_gpu_message(command, sm, None if sm is None else predicted_rows(db_path, sm),
                                        db_path))
    if sm is None:
        return gpus[0]
    for g in gpus:
        if g.sm == sm:
            return g
    raise BenchError(mismatch_message(command, sm, gpus, predicted_rows(db_path, sm), db_path))
