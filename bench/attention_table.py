"""One drafter layer's attention, paged (several page sizes) against arena against FlashInfer fa2,
over batches and context lengths, with the copy roofline measured in the same run.

    python -m drafter_attn.bench.attention_table --preset qwen3-8b-dflash-b16 --batch 1,8,32 --ctx 2k,8k,32k \
        --page 16,64,128 --impl cupy --baseline flashinfer --out results/sm90-attention

Every kernel is first checked against the torch reference on the same random inputs (output
poisoned with NaN), then timed: CUDA graph replays, CUDA events, L2 flushed before each replay.
Prints a table and writes attention.csv / attention.json / attention.md under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path

import pandas as pd
import torch

from drafter_attn.kernels import reference, registry
from drafter_attn.kernels.cache import random_arena_context, random_paged_context
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.tuner import roofline
from drafter_attn.tuner.timing import time_step


def parse_sizes(text: str) -> list[int]:
    """'2k,8k,32k' -> [2048, 8192, 32768]; plain integers pass through."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part[-1] in "km":
            mult = 1024 if part[-1] == "k" else 1024 * 1024
            part = part[:-1]
        out.append(int(float(part) * mult))
    return out


def parse_impl(spec: str):
    """'cupy' or 'cupy:tile_n=128,stages=2' -> (label, backend bound to those params)."""
    return spec, registry.from_spec(spec)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def measure_attention(impl_name: str, geometry, layout: str, page: int | None, batch: int,
                      ctx: int, seed: int, copy_bw: float, reps: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    g = geometry
    dtp = g.torch_dtype
    dev = "cuda"
    lens = [ctx] * batch
    q = torch.randn(batch, g.block_size, g.num_q_heads, g.head_dim, device=dev, dtype=dtp)
    kb = torch.randn(batch, g.block_size, g.num_kv_heads, g.head_dim, device=dev, dtype=dtp)
    vb = torch.randn_like(kb)
    impl_name, impl = parse_impl(impl_name)
    kw = dict(mask=g.mask, window=g.window)
    if layout == "paged":
        cache = random_paged_context(g, lens, page, dev, gen)
        fn = lambda: impl.paged_attention(q, kb, vb, *cache, **kw)  # noqa: E731
        ref = reference.paged_attention(q, kb, vb, *cache, **kw)
    else:
        cache = random_arena_context(g, lens, ctx, dev, gen, extra_slots=0)
        fn = lambda: impl.arena_attention(q, kb, vb, *cache, **kw)  # noqa: E731
        ref = reference.arena_attention(q, kb, vb, *cache, **kw)
    torch.full_like(q, float("nan"))  # poison the block the output will reuse
    err = _rel_err(fn(), ref)
    del ref
    t = time_step(fn, reps=reps)
    nbytes = roofline.attention_bytes(g, lens, q.element_size(), page)
    return dict(impl=impl_name, layout=layout, page=page or 0, batch=batch, ctx=ctx,
                rel_err=err, bytes=nbytes, **t.as_dict(),
                gbps=nbytes / t.median_us / 1e3, roofline_frac=nbytes / t.median_us * 1e6 / copy_bw,
                floor_us=nbytes / copy_bw * 1e6)


def measure_flashinfer(geometry, page: int, batch: int, ctx: int, seed: int, copy_bw: float,
                       reps: int) -> dict:
    from drafter_attn.kernels.baselines import FlashInferPaged

    base = FlashInferPaged(geometry, page, [ctx] * batch, "cuda",
                           torch.Generator().manual_seed(seed))
    t = time_step(base.run, reps=reps)
    nbytes = roofline.attention_bytes(geometry, [ctx] * batch, 2, page)
    return dict(impl="flashinfer-fa2", layout="paged", page=page, batch=batch, ctx=ctx,
                rel_err=float("nan"), bytes=nbytes, **t.as_dict(),
                gbps=nbytes / t.median_us / 1e3, roofline_frac=nbytes / t.median_us * 1e6 / copy_bw,
                floor_us=nbytes / copy_bw * 1e6)


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return dict(gpu=props.name, sm=props.major * 10 + props.minor, sms=props.multi_processor_count,
                torch=torch.__version__, cuda=torch.version.cuda, host=platform.node(),
                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), commit=commit)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=MAIN_PRESET)
    ap.add_argument("--batch", type=parse_sizes, default=[1, 8, 32])
    ap.add_argument("--ctx", type=parse_sizes, default=parse_sizes("2k,8k,32k"))
    ap.add_argument("--page", type=parse_sizes, default=[16, 64, 128])
    ap.add_argument("--impl", default="cupy",
                    help="';'-separated registry names, each optionally with params: "
                         "'cupy;cupy:tile_n=128,stages=2'")
    ap.add_argument("--baseline", default="flashinfer", help="'flashinfer' or 'none'")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=None, help="folder for CSV/JSON/markdown")
    args = ap.parse_args(argv)

    geometry = get_preset(args.preset)
    copy_bw = roofline.copy_bandwidth()
    env = environment() | dict(copy_bw_gbps=copy_bw / 1e9, preset=args.preset)
    print(f"{env['gpu']} sm{env['sm']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write)")
    rows = []
    seed = 0
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    def record(row: dict) -> None:
        # every row reaches the disk at once: a run cut short keeps what it measured
        rows.append(row)
        print(row, flush=True)
        if out:
            pd.DataFrame(rows).to_csv(out / "attention.csv", index=False)
        torch.cuda.empty_cache()

    for batch in args.batch:
        for ctx in args.ctx:
            for impl in args.impl.split(";"):
                for page in [*args.page, None]:
                    seed += 1
                    layout = "paged" if page else "arena"
                    try:
                        row = measure_attention(impl, geometry, layout, page, batch, ctx, seed,
                                                copy_bw, args.reps)
                    except Exception as exc:  # record and go on: one failure must not end the table
                        row = dict(impl=impl, layout=layout, page=page or 0, batch=batch, ctx=ctx,
                                   error=repr(exc)[:300])
                    record(row)
            if args.baseline == "flashinfer" and geometry.mask == "full":
                for page in args.page:
                    try:
                        row = measure_flashinfer(geometry, page, batch, ctx, seed, copy_bw,
                                                 args.reps)
                    except Exception as exc:
                        row = dict(impl="flashinfer-fa2", layout="paged", page=page, batch=batch,
                                   ctx=ctx, error=repr(exc)[:300])
                    record(row)
    df = pd.DataFrame(rows)
    if "median_us" in df:
        arena = df[df.layout == "arena"].set_index(["impl", "batch", "ctx"])["median_us"]
        df["over_arena"] = [
            r.median_us / arena.get((r.impl, r.batch, r.ctx), float("nan"))
            if r.layout == "paged" and r.impl != "flashinfer-fa2" else float("nan")
            for r in df.itertuples()]
    cols = [c for c in ("impl", "layout", "page", "batch", "ctx", "median_us", "p10_us", "p90_us",
                        "floor_us", "gbps", "roofline_frac", "over_arena", "rel_err", "error")
            if c in df]
    table = df[cols]
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if out:
        df.to_csv(out / "attention.csv", index=False)
        (out / "attention.json").write_text(json.dumps(dict(environment=env,
                                                            rows=df.to_dict("records")), indent=1,
                                                       default=str))
        (out / "attention.md").write_text(
            f"# {args.preset} attention, {env['gpu']} (sm{env['sm']}), {env['date']}\n\n"
            f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, commit {env['commit']}\n\n"
            f"`python -m drafter_attn.bench.attention_table {' '.join(argv or os.sys.argv[1:])}`\n\n"
            + table.to_markdown(index=False, floatfmt=".4g") + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
