"""SASS of every touched variant in the GPU matrix's random cases: HEAD against 06875a4
(the kernels whose full GPU matrices ran in sessions 14/15)."""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/tests")
from drafter_attn.tuner import rekey
from drafter_attn.tuner.kernel_digests import row_jobs
import test_backends_gpu as m

SPECS = ["cupy:ws=2", "cupy:ws=3", "cupy:ws=4", "cupy:ws=3,tile_n=32", "cupy:ws=3,tile_n=32,stages=9",
         "cupy:ws=2,lean=0", "cupy:ws=3,tile_n=32,stages=9,lean=0", "cupy:ws=4,lean=0", "cupy:trim=1"]
rows, seen = [], {}
for spec in SPECS:
    params = {k: int(v) for k, v in (p.split("=") for p in spec.split(":")[1].split(","))}
    for geom, page, lens, seed in [c.values if hasattr(c, "values") else c for c in m._cases()]:
        for layout in ("paged", "arena"):
            for g in (geom, geom.with_(num_q_heads=8 * geom.num_kv_heads)):
                row = dict(id=len(rows), impl="cupy", params=json.dumps(params), sm=90,
                           num_q_heads=g.num_q_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                           block_size=g.block_size, mask=g.mask, window=g.window, num_layers=1,
                           dtype=g.dtype, layout=layout, page_size=page if layout == "paged" else None,
                           batch=len(lens), ctx_len=max(lens))
                jobs = row_jobs({**row, "params": params})
                if isinstance(jobs, str):
                    continue
                key = tuple(jobs)
                if key not in seen:
                    seen[key] = row
                    rows.append(row)
print(len(rows), "distinct variants", flush=True)
with tempfile.TemporaryDirectory() as d:
    old = rekey.export_package("06875a4", Path(d))
    a = rekey.kernel_digests(rows, None, 2)
    b = rekey.kernel_digests(rows, old, 2)
diff = [r for r in rows if a[r["id"]] != b[r["id"]] or str(a[r["id"]]).startswith("error")]
print("differ or error:", len(diff))
for r in diff[:10]:
    print(r, a[r["id"]][:60], b[r["id"]][:60])
