"""The machine code behind profile rows: for each row (impl, its resolved params, its problem), a
digest of the SASS (and per-kernel resources) of the modules its measurement loaded (attention
and store). No GPU needed.

Run as a script by `tuner rekey`, once against this installation and once against another
revision's kernels package (`--root DIR`, a folder holding `drafter_attn/kernels`), so the two
can be compared. It therefore uses only what every revision's kernels package has had since the
sweeps began: registry.get, with_params, params_for, a backend's `family` with variant_defines,
Params and `module`, that module's compile_variant, and static_profile.cuobjdump_path.

    python tuner/kernel_digests.py [--root DIR] [--jobs N] < rows.json > digests.json

rows.json: [{"id", "impl", "params", "sm", and the problem columns of a result row}]; the answer
maps each id to a hex digest, or to "error: ..." where a kernel would not compile or the
backend refuses the problem (such a row is never taken as unchanged).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

NO_KERNELS = "no kernels of this package"  # a backend that compiles nothing (torch reference)


def use_root(root: str | None) -> None:
    """Import drafter_attn.kernels from `root` instead of the installed package."""
    if not root:
        return
    # an editable install's finder answers for drafter_attn.* before sys.path would
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not type(f).__module__.startswith("__editable__")]
    sys.path.insert(0, str(Path(root).resolve()))
    kernels = importlib.import_module("drafter_attn.kernels")
    where = Path(kernels.__file__).resolve()
    if Path(root).resolve() not in where.parents:
        raise SystemExit(f"drafter_attn.kernels came from {where}, not from {root}")


def row_jobs(row: dict) -> list[tuple] | str:
    """The (module, defines, sm) of each kernel `row`'s measurement loaded, or why there are none."""
    from drafter_attn.kernels import registry
    from drafter_attn.kernels.spec import Geometry, Problem

    g = Geometry(row["num_q_heads"], row["num_kv_heads"], row["head_dim"], row["block_size"],
                 row["mask"], row["window"], row.get("num_layers") or 1, row["dtype"])
    problem = Problem(g, row["layout"], row["page_size"], row["batch"], row["ctx_len"])
    backend = registry.get(row["impl"])
    kern = getattr(backend, "family", None)
    if kern is None:
        return NO_KERNELS
    sm = row["sm"]
    backend = backend.with_params(**row["params"])
    reason = backend.supports(problem, sm)
    if reason:
        return f"error: refused: {reason}"
    attn = kern.variant_defines(g.dtype, g.head_dim, problem.page_size, g.block_size, g.group,
                                backend.params_for(problem, sm), sm)
    store = kern.variant_defines(g.dtype, g.head_dim, problem.page_size, 1, 1, kern.Params(), sm)
    return [(kern.module, tuple(sorted(d.items())), sm) for d in (attn, store)]


def machine_code(cubin: str) -> str:
    """A cubin's SASS and each function's resources (registers, stack, shared, local, constant
    bank 0), without what differs between builds of the same code: the module's symbol table
    (internal names carry a hash of the source text) and its module-wide globals."""
    from drafter_attn.kernels.static_profile import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        raise RuntimeError("cuobjdump not found (the nvidia-cuda-cuobjdump wheel or PATH)")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True,
                         check=True).stdout
    per_function = [line for line in res.splitlines() if line.strip().startswith(("Function", "REG:"))]
    return sass + "\n".join(per_function)


def cubin_digest(job: tuple) -> str:
    module, defines, sm = job
    try:
        res = importlib.import_module(module).compile_variant(dict(defines), sm)
        code = machine_code(str(res.cubin_path))
    except Exception as exc:  # noqa: BLE001 - a compile error is an answer, not a crash
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return hashlib.sha256(code.encode()).hexdigest()


def digests(rows: list[dict], jobs: int | None = None) -> dict[str, str]:
    per_row, todo = {}, set()
    for row in rows:
        try:
            per_row[row["id"]] = row_jobs(row)
        except Exception as exc:  # noqa: BLE001
            per_row[row["id"]] = f"error: {type(exc).__name__}: {exc}"
        if isinstance(per_row[row["id"]], list):
            todo.update(per_row[row["id"]])
    todo = sorted(todo)
    with ProcessPoolExecutor(jobs or os.cpu_count()) as pool:
        cubins = dict(zip(todo, pool.map(cubin_digest, todo)))
    out = {}
    for rid, row_jobs_ in per_row.items():
        if not isinstance(row_jobs_, list):
            out[rid] = row_jobs_
            continue
        parts = [cubins[j] for j in row_jobs_]
        bad = [p for p in parts if p.startswith("error")]
        out[rid] = bad[0] if bad else hashlib.sha256("".join(parts).encode()).hexdigest()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", help="a folder holding drafter_attn/kernels to use instead")
    ap.add_argument("--jobs", type=int, help="compile processes (default: every core)")
    args = ap.parse_args(argv)
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # run as a script: tuner/'s modules are no top-level packages
    use_root(args.root)
    json.dump(digests(json.load(sys.stdin), args.jobs), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
