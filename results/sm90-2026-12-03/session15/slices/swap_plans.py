"""One-off: bring profiles/sm90.db to the split model that charges partials only beyond one wave.
Rows planned under the all-CTA charge (measured this session) and under no charge (moved to
'+replanned' environments before) are swapped so that today's environment holds each
candidate's row of today's plan; rows of a plan nobody measured leave today's environment."""
import sys, math, json, collections
sys.path.insert(0, 'scripts')
import split_model_changes as smc
from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.kernels.nvrtc import sources_digest
from drafter_attn.tuner.spec import load_spec, target_sm
from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner import db as dbm

def full_charge(batch, hkv, kv, tile_n, num_sms, resident, rows):
    ctas = batch * hkv; slots = num_sms * resident
    tiles = max(1, -(-kv // tile_n)); limit = max(1, min(64, tiles // 2)); best, bc = 1, float('inf')
    for s in range(1, limit + 1):
        part = 0 if s == 1 else 2 * rows / tile_n * ctas * s / slots
        cst = math.ceil(ctas * s / slots) * (tiles / s + 2) + part
        if cst < bc - 1e-9: best, bc = s, cst
    return best

spec = load_spec('sm90'); res = {}; plan = {}
for cand in spec.candidates():
    sm = target_sm(cand.target)
    backend = registry.get(cand.impl).with_params(**cand.params_dict)
    p = backend.params_for(cand.problem, sm)
    if p.num_splits: continue
    fam = backend.family; g = cand.problem.geometry
    d = fam.variant_defines(g.dtype, g.head_dim, cand.problem.page_size, g.block_size, g.group, p, sm)
    key = (fam.module, tuple(sorted(d.items())))
    if key not in res: res[key] = smc.module_resources(fam, d, sm)
    r = res[key].resident_ctas(cb.sm_budget(sm).smem_sm)
    if getattr(p, 'ctas_per_sm', 0): r = min(r, p.ctas_per_sm)
    rs = getattr(p, 'row_split', 1)
    args = (cand.problem.batch * rs, g.num_kv_heads, smc.planned_kv(cand.problem, g.block_size), p.tile_n, 132, r)
    rows = cb.cta_rows(g.block_size, g.group, rs)
    none_, full, today = cb.choose_splits(*args, rows=0), full_charge(*args, rows=rows), cb.choose_splits(*args, rows=rows)
    if len({none_, full, today}) > 1:
        plan[cand.key()] = (none_, full, today)
print(len(plan), 'candidates whose plans differ among the three models')
h = sources_digest()
out = collections.Counter()
db = ProfileDB('profiles/sm90.db')
envs = db.query("SELECT env_id FROM environments WHERE sources_hash = ?", (h,))
assert len(envs) == 1
cur = envs[0]['env_id']; rep = cur + '-replanned'
assert db.query("SELECT 1 FROM environments WHERE env_id = ?", (rep,))
def row(env, k):
    got = db.query("SELECT id FROM results WHERE env_id = ? AND candidate_key = ?", (env, k))
    return got[0]['id'] if got else None
with db.transaction():
    for k, (none_, full, today) in plan.items():
        c, o = row(cur, k), row(rep, k)
        # the current row was measured under `full` where none_ != full (re-planned and measured
        # this session, or a new trim candidate); else under none_ == full
        cur_plan = full
        rep_plan = none_ if o is not None else None
        if cur_plan == today:
            out['kept'] += 1; continue
        if rep_plan == today:   # swap: the row of today's plan comes back
            db.conn.execute("UPDATE results SET env_id = ? WHERE id = ?", (cur, o))
            db.conn.execute("UPDATE results SET env_id = ? WHERE id = ?", (rep, c))
            out['swapped back'] += 1
        elif c is not None:
            if o is not None:
                raise SystemExit(f'{k}: both rows of other plans; decide by hand')
            db.conn.execute("UPDATE results SET env_id = ? WHERE id = ?", (rep, c))
            out['moved out (plan not measured)'] += 1
        else:
            out['not measured'] += 1
    db.conn.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (f"split model {dbm.now()}",
        dbm.canonical_json({"note": "partials charged only beyond one wave: rows swapped with '+replanned' to today's plans", **out})))
print(dict(out))
