"""Static compile profile: compile the default kernel variants for several SM targets with NVRTC
(no GPU needed) and report registers, shared memory and spills per kernel.

    python -m drafter_attn.kernels.static_profile --sm 90,100,103

The tuner's `tuner compile` prints the same table and stores it in the profile database.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from drafter_attn.kernels.presets import PRESETS

DEFAULT_SMS = (90, 100, 103)
DEFAULT_PAGES = (16, 64, 128)


@dataclass(frozen=True)
class Variant:
    """One compiled module: a backend, its source and the defines that specialise it."""

    backend: str
    source: str
    defines: tuple  # sorted (name, value) pairs
    dynamic_smem: int
    options: tuple = ()  # extra NVRTC options
    sm: int | None = None  # the one SM target this variant is for (None: every target)
    include_dirs: tuple = ()  # extra -I directories (the CuTe headers for cutlass)
    header_identity: str = ""  # version of those headers, part of the cubin cache key

    @property
    def label(self) -> str:
        d = dict(self.defines)
        layout = f"page{d['PAGE_SIZE']}" if d.get("PAGE_SIZE") else "arena"
        dtype = "bf16" if d.get("DTYPE_BF16", 1) else "fp16"
        rest = ",".join(f"{k.lower()}={v}" for k, v in self.defines
                        if k not in ("PAGE_SIZE", "DTYPE_BF16"))
        return f"{self.backend}:{layout}:{dtype}:{rest}"


def cupy_default_variants(page_sizes=DEFAULT_PAGES, presets=None,
                          sms=DEFAULT_SMS) -> list[Variant]:
    """The cupy backend's default-parameter variants for every preset geometry, layout and SM
    (sm_90 variants use wgmma where the shape allows, other targets mma.sync)."""
    from drafter_attn.kernels import cupy_backend as cb
    from drafter_attn.kernels.spec import Problem

    out = {}
    for sm in sms:
        for geom in (presets or PRESETS).values():
            for page in (*page_sizes, None):
                problem = Problem(geom, "paged" if page else "arena", page, 1, 0)
                params = cb.default_params(problem)
                defines = cb.variant_defines(geom.dtype, geom.head_dim, page, geom.block_size,
                                             geom.group, params, sm)
                key = tuple(sorted(defines.items()))
                smem = params.smem_bytes(geom.head_dim, defines["NUM_WARPS"], defines["WGMMA"])
                out[(sm, key)] = Variant("cupy", cb.SOURCE, key, smem, cb.NVRTC_OPTIONS, sm)
    return list(out.values())


def cutlass_default_variants(page_sizes=DEFAULT_PAGES, presets=None,
                             wgmma: bool = True) -> list[Variant]:
    """The cutlass backend's default-parameter variants for every preset geometry and layout
    (mma.sync, for every SM target), plus with `wgmma` the sm_90a warpgroup-MMA variant
    (params wgmma=True) where the shape allows it. Empty when the nvidia-cutlass wheel (the
    `cutlass` extra) is not installed."""
    try:
        from drafter_attn.kernels import cutlass_backend as kb
    except ImportError:
        return []
    from drafter_attn.kernels.spec import Problem

    out = {}
    for geom in (presets or PRESETS).values():
        for page in (*page_sizes, None):
            problem = Problem(geom, "paged" if page else "arena", page, 1, 0)
            base = kb.default_params(problem)
            for params, sm in ((base, None), (dataclasses.replace(base, wgmma=True), 90)):
                defines = kb.variant_defines(geom.dtype, geom.head_dim, page, geom.block_size,
                                             geom.group, params, sm)
                if sm is not None and not (wgmma and defines["WGMMA"]):
                    continue  # no warpgroup path for this shape: the mma.sync variant serves
                key = tuple(sorted(defines.items()))
                out[key] = Variant("cutlass", kb.SOURCE, key, kb.defines_smem(defines),
                                   kb.NVRTC_OPTIONS, sm, (kb.include_dir(),),
                                   kb.header_identity())
    return list(out.values())


def default_variants(page_sizes=DEFAULT_PAGES) -> list[Variant]:
    return cupy_default_variants(page_sizes) + cutlass_default_variants(page_sizes)


def _compile_one(args) -> list[dict]:
    from drafter_attn.kernels.nvrtc import arch_for_sm, compile_cubin

    variant, sm = args
    res = compile_cubin(variant.source, dict(variant.defines), arch_for_sm(sm),
                        include_dirs=variant.include_dirs, extra_options=variant.options,
                        header_identity=variant.header_identity)
    return [
        dict(sm=sm, arch=res.arch, backend=variant.backend, variant=variant.label, kernel=name,
             registers=r.registers, spill_bytes=r.spill_store_bytes + r.spill_load_bytes,
             stack_bytes=r.stack_bytes, smem_static=r.smem_static_bytes,
             smem_dynamic=variant.dynamic_smem if name.endswith("attention") else 0,
             compile_s=round(res.seconds, 2), cached=res.cached, cubin=str(res.cubin_path))
        for name, r in sorted(res.resources.items())
    ]


def compile_variants(sms=DEFAULT_SMS, variants: list[Variant] | None = None,
                     workers: int | None = None) -> list[dict]:
    """Compile every variant for every SM (in parallel processes); one row per kernel."""
    variants = variants if variants is not None else default_variants()
    jobs = [(v, sm) for sm in sms for v in variants if v.sm in (None, sm)]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        results = map(_compile_one, jobs)
        return [row for rows in results for row in rows]
    with ProcessPoolExecutor(workers) as pool:
        return [row for rows in pool.map(_compile_one, jobs) for row in rows]


def parse_sms(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sm expects numbers like 90,100,103, got {text!r}")


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="static compile profile (NVRTC, ptxas -v)")
    for col in ("sm", "variant", "kernel", "registers", "spill_bytes", "smem_dynamic",
                "compile_s"):
        table.add_column(col, justify="right" if col not in ("variant", "kernel") else "left")
    for r in rows:
        table.add_row(*(str(r[c]) for c in ("sm", "variant", "kernel", "registers",
                                             "spill_bytes", "smem_dynamic", "compile_s")),
                      style="red" if r["spill_bytes"] else None)
    Console().print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafter_attn.kernels.static_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sm", type=parse_sms, default=DEFAULT_SMS, help="e.g. 90,100,103")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(argv)
    rows = compile_variants(args.sm, workers=args.workers)
    print_table(rows)
    return 1 if any(r["spill_bytes"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
