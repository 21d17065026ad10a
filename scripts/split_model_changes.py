"""Which candidates of a tuner spec the split model plans differently after a change to
`kernels.cupy_backend.choose_splits` (CPU only: compiles each variant with NVRTC for its
registers; no GPU).

    python scripts/split_model_changes.py sm90 --old-rows 0 [--db profiles/sm90.db --replan]

`--old-rows 0` is the model before partial rows were charged (rows=0 charges nothing). Prints
each changed candidate's problem, parameters and the two split counts. With `--db` and
`--replan`, moves those candidates' rows measured on today's kernel sources to a copy of their
environment whose sources hash ends in "+replanned": the rows are kept, but no longer count as
today's, so the runtime and `tuner export` stop using them and the next sweep into that database
measures them again under the new plan (`tuner rekey` proves machine code, not host-side split
counts).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.tuner.spec import load_spec, target_sm


def planned_kv(problem, block_size: int) -> int:
    """The context the tuner's step plans with: the fitted table's width (paged) or the arena
    slot (ctx + the stored rows), as `tuner.step.DecodeStep` builds them."""
    need = problem.ctx_len + block_size
    if problem.layout == "paged":
        need = math.ceil(need / problem.page_size) * problem.page_size
    g = problem.geometry
    return need if g.mask == "full" else min(need, g.window)


def module_resources(family, defines: dict, sm: int) -> cb.Module:
    """The loaded module's launch resources (shared memory, registers, threads), without a GPU."""
    seen = {}

    def fake_load(index, cubin_path, smem, threads):
        seen.update(smem=smem, threads=threads)
        return None

    real = cb.load_cubin, cb.device_info
    cb.load_cubin, cb.device_info = fake_load, lambda index: (132, sm)
    try:
        family.load_variant(0, tuple(sorted(defines.items())))
    finally:
        cb.load_cubin, cb.device_info = real
    result = family.compile_variant(defines, sm)
    kernel = next(k for k in result.resources if "attention" in k)
    return cb.Module(None, None, None, seen["smem"], result.resources[kernel].registers,
                     seen["threads"])


def changes(spec_name: str, old_rows: int, num_sms: int = 132):
    spec = load_spec(spec_name)
    out = []
    resources = {}
    for cand in spec.candidates():
        sm = target_sm(cand.target)
        backend = registry.get(cand.impl).with_params(**cand.params_dict)
        p = backend.params_for(cand.problem, sm)
        if p.num_splits:
            continue
        family = backend.family
        g = cand.problem.geometry
        defines = family.variant_defines(g.dtype, g.head_dim, cand.problem.page_size,
                                         g.block_size, g.group, p, sm)
        key = (family.module, tuple(sorted(defines.items())))
        if key not in resources:
            resources[key] = module_resources(family, defines, sm)
        resident = resources[key].resident_ctas(cb.sm_budget(sm).smem_sm)
        if getattr(p, "ctas_per_sm", 0):
            resident = min(resident, p.ctas_per_sm)
        rs = getattr(p, "row_split", 1)
        args = (cand.problem.batch * rs, g.num_kv_heads, planned_kv(cand.problem, g.block_size),
                p.tile_n, num_sms, resident)
        old = cb.choose_splits(*args, rows=old_rows)
        new = cb.choose_splits(*args, rows=cb.cta_rows(g.block_size, g.group, rs))
        if old != new:
            out.append((cand, old, new))
    return out


def replan(db_path, keys: set[str]) -> int:
    """Move the rows of `keys` measured on today's kernel sources to "+replanned" copies of their
    environments (kept, no longer current). Returns the rows moved."""
    from drafter_attn.kernels.nvrtc import sources_digest
    from drafter_attn.tuner.db import ProfileDB

    db = ProfileDB(db_path)
    today = sources_digest()
    moved = 0
    envs = db.query("SELECT * FROM environments WHERE sources_hash = ?", (today,))
    with db.transaction():
        for env in envs:
            new = {**env, "env_id": env["env_id"] + "-replanned",
                   "sources_hash": today + "+replanned", "fingerprint": env["fingerprint"] + "+replanned"}
            names = list(new)
            db.conn.execute(f"INSERT OR IGNORE INTO environments ({', '.join(names)}) "
                            f"VALUES ({', '.join('?' * len(names))})", [new[n] for n in names])
            for key in keys:
                moved += db.conn.execute("UPDATE results SET env_id = ? WHERE env_id = ? AND candidate_key = ?",
                                         (new["env_id"], env["env_id"], key)).rowcount
    return moved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--old-rows", type=int, default=0, help="rows the old model charged (0: none)")
    ap.add_argument("--db")
    ap.add_argument("--replan", action="store_true")
    args = ap.parse_args(argv)
    found = changes(args.spec, args.old_rows)
    for cand, old, new in found:
        pr = cand.problem
        print(f"{cand.preset:22s} {pr.layout:5s} {pr.page_size or '-':>4} B={pr.batch:<3d} "
              f"ctx={pr.ctx_len:<7d} {cand.impl}:{dict(cand.params)} splits {old} -> {new}")
    print(f"{len(found)} candidates planned differently")
    if args.db and args.replan and found:
        moved = replan(args.db, {c.key() for c, _, _ in found})
        print(f"moved {moved} rows of today's sources in {args.db} to '+replanned' environments")
    return 0


if __name__ == "__main__":
    sys.exit(main())
