"""Every kernel a shipped tuned table can hand the runtime, against the torch reference.

The backend matrix (tests/test_backends_gpu.py) checks variant families; a table's picks are
specific parameter sets (stages, tile width, the ws options, combine ways) chosen per key. Each
distinct pick of `profiles/sm<SM>*.json` runs here on its own entry's geometry, layout and page
size, at the entry's batch (at most 8) with ragged lengths up to its context (at most 16k:
the reference materialises every score), poisoned outputs. The entry's own split count is
forced too, so the combine path the key takes at full size (up to 33 splits) is the one checked.
"""

from __future__ import annotations

import json
import random
import zlib

import pytest
import torch

from drafter_attn.kernels import registry
from drafter_attn.kernels.contract import Dims
from drafter_attn.kernels.shipped import shipped_dir
from drafter_attn.kernels.spec import Geometry, Problem

from tests.test_backends_gpu import _block_inputs, check_layout

MAX_BATCH, MAX_CTX = 8, 16384
GEOMETRY_FIELDS = ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "mask", "window", "dtype")


def shipped_tables() -> list:
    folder = shipped_dir()
    return sorted(folder.glob("sm*.json")) if folder else []


def distinct_picks() -> list[dict]:
    """One case per distinct (SM, geometry, layout, page, impl, params) over every shipped table,
    keeping the largest key (batch, then context) each pick is shipped for."""
    picks: dict[str, dict] = {}
    for path in shipped_tables():
        for e in json.loads(path.read_text())["entries"]:
            ident = json.dumps([e["sm"], [e[f] for f in GEOMETRY_FIELDS], e["layout"], e["page_size"],
                                e["impl"], e["params"]], sort_keys=True)
            seen = picks.get(ident)
            tables = (seen["tables"] if seen else set()) | {path.name}
            if seen is None or (e["batch"], e["ctx_len"]) > (seen["batch"], seen["ctx_len"]):
                seen = picks[ident] = dict(e)
            seen["tables"] = tables
    return sorted(picks.values(), key=lambda e: json.dumps([e["sm"], e["layout"], e["page_size"],
                                                            e["batch"], e["ctx_len"], e["params"]]))


def _geometry(e: dict) -> Geometry:
    return Geometry(e["num_q_heads"], e["num_kv_heads"], e["head_dim"], e["block_size"],
                    mask=e["mask"], window=e["window"], dtype=e["dtype"])


def _spec(e: dict) -> str:
    return registry.format_spec(e["impl"], e["params"])


def _id(e: dict) -> str:
    page = f"p{e['page_size']}" if e["layout"] == "paged" else "arena"
    return (f"sm{e['sm']}-h{e['num_q_heads']}/{e['num_kv_heads']}-{e['mask']}{e['window'] or ''}-{page}"
            f"-B{e['batch']}x{e['ctx_len']}-{_spec(e)}")


PICKS = distinct_picks()


def test_every_shipped_table_has_picks():
    """The enumeration reads every shipped table (a renamed field would silently empty it)."""
    assert shipped_tables(), "no shipped tables found"
    names = set().union(*(e["tables"] for e in PICKS))
    assert names == {p.name for p in shipped_tables()}


@pytest.mark.parametrize("entry", PICKS, ids=_id)
def test_shipped_pick_is_accepted_at_its_key(entry):
    """Each pick is a variant its backend takes at the key it is shipped for, on its SM."""
    problem = Problem(_geometry(entry), entry["layout"], entry["page_size"], entry["batch"], entry["ctx_len"])
    assert registry.from_spec(_spec(entry)).supports(problem, entry["sm"]) is None


def _lens(entry: dict, rng: random.Random) -> list[int]:
    """Ragged lengths up to the key's context: the longest, a page edge short of it, a random
    one and 0, as many as the key's batch (at most MAX_BATCH)."""
    ctx = min(entry["ctx_len"], MAX_CTX)
    page = entry["page_size"] or 64
    pool = [ctx, max(ctx - page + 1, 1), rng.randrange(1, ctx + 1), 0, page, ctx - 1]
    return [pool[i % len(pool)] for i in range(min(entry["batch"], MAX_BATCH))]


def _key_splits(impl, entry: dict, geom: Geometry) -> int | None:
    """The split count the pick plans at its own key (None where the backend plans none)."""
    if not hasattr(impl, "plan_splits"):
        return None
    page, ctx = entry["page_size"], entry["ctx_len"]
    problem = Problem(geom, entry["layout"], page, entry["batch"], ctx)
    dims = Dims(batch=entry["batch"], block_size=geom.block_size, num_q_heads=geom.num_q_heads,
                num_kv_heads=geom.num_kv_heads, head_dim=geom.head_dim,
                group=geom.num_q_heads // geom.num_kv_heads, page_size=page,
                capacity=-(-ctx // page) * page if page else ctx, mask=geom.mask, window=geom.window,
                scale=geom.head_dim ** -0.5, dtype=geom.torch_dtype)
    device = torch.device("cuda")
    return impl.plan_splits(dims, impl.params_for(problem, entry["sm"]), device)


@pytest.mark.gpu
@pytest.mark.parametrize("forced", [False, True], ids=["own-splits", "key-splits"])
@pytest.mark.parametrize("entry", PICKS, ids=_id)
def test_shipped_pick_matches_reference(entry, forced):
    major, minor = torch.cuda.get_device_capability()
    if major * 10 + minor != entry["sm"]:
        pytest.skip(f"shipped for sm_{entry['sm']}")
    geom = _geometry(entry)
    impl = registry.from_spec(_spec(entry))
    if forced:
        splits = _key_splits(impl, entry, geom)
        if not splits or splits == 1:
            pytest.skip("the key plans no split")
        impl = impl.with_params(num_splits=splits)
    seed = zlib.crc32(_id(entry).encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    lens = _lens(entry, rng)
    check_layout(impl, geom, entry["layout"], entry["page_size"], lens, _block_inputs(geom, len(lens), gen), gen)
