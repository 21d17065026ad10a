"""Static compile profile: compile the default kernel variants for several SM targets with NVRTC
(no GPU needed) and report registers, shared memory, spills and, from the SASS (cuobjdump), the
tensor-core instructions and trap instructions per kernel.

    python -m drafter_attn.kernels.static_profile --sm 90,100,103   (or --sm all)

The tuner's `tuner compile` prints the same table and stores it in the profile database.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from drafter_attn.kernels.presets import PRESETS

DEFAULT_SMS = (90, 100, 103)
DEFAULT_PAGES = (16, 64, 128)
# (batch, context) calls either side of where the cupy defaults change: one request (lean copies,
# the split combine a CTA a row), a long context (TMA from kernels.cupy_backend.TMA_MIN_CTX) and
# a batch (TMA from TMA_MIN_BATCH, the combine a warp a row)
DEFAULT_CALLS = ((1, 0), (1, 131072), (8, 0))


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
    (sm_90 variants use wgmma where the shape allows, other targets mma.sync), at batches and
    contexts either side of where the defaults change (`DEFAULT_CALLS`): each distinct one once."""
    from drafter_attn.kernels import cupy_backend as cb
    from drafter_attn.kernels.spec import Problem

    out = {}
    for sm in sms:
        for geom in (presets or PRESETS).values():
            for page in (*page_sizes, None):
                for batch, ctx in DEFAULT_CALLS:
                    problem = Problem(geom, "paged" if page else "arena", page, batch, ctx)
                    params = cb.default_params(problem, sm)
                    defines = cb.variant_defines(geom.dtype, geom.head_dim, page, geom.block_size,
                                                 geom.group, params, sm)
                    key = tuple(sorted(defines.items()))
                    smem = params.smem_bytes(geom.head_dim, defines["NUM_WARPS"], defines["WGMMA"], page)
                    out[(sm, key)] = Variant("cupy", cb.SOURCE, key, smem, cb.NVRTC_OPTIONS, sm)
    return list(out.values())


def cutlass_default_variants(page_sizes=DEFAULT_PAGES, presets=None, wgmma: bool = True,
                             sms=DEFAULT_SMS) -> list[Variant]:
    """The cutlass backend's default-parameter variants for every preset geometry, layout and SM
    (mma.sync, at each SM's defaults), plus with `wgmma` the sm_90a warpgroup-MMA variant
    (params wgmma=True) where the shape allows it. Empty when the nvidia-cutlass wheel (the
    `cutlass` extra) is not installed."""
    try:
        from drafter_attn.kernels import cutlass_backend as kb
    except ImportError:
        return []
    from drafter_attn.kernels.spec import Problem

    out = {}
    for sm in sms:
        for geom in (presets or PRESETS).values():
            for page in (*page_sizes, None):
                problem = Problem(geom, "paged" if page else "arena", page, 1, 0)
                base = kb.default_params(problem, sm)
                for params in (base, dataclasses.replace(base, wgmma=True)):
                    defines = kb.variant_defines(geom.dtype, geom.head_dim, page, geom.block_size,
                                                 geom.group, params, sm)
                    if params.wgmma and not (wgmma and defines["WGMMA"]):
                        continue  # no warpgroup path here: the mma.sync variant serves
                    key = tuple(sorted(defines.items()))
                    out[(sm, key)] = Variant("cutlass", kb.SOURCE, key, kb.defines_smem(defines),
                                             kb.NVRTC_OPTIONS, sm, (kb.include_dir(),),
                                             kb.header_identity())
    return list(out.values())


def default_variants(page_sizes=DEFAULT_PAGES, sms=DEFAULT_SMS) -> list[Variant]:
    return (cupy_default_variants(page_sizes, sms=sms)
            + cutlass_default_variants(page_sizes, sms=sms))


@functools.cache
def cuobjdump_path() -> str | None:
    """cuobjdump on PATH, else the nvidia-cuda-cuobjdump wheel's (None when neither exists)."""
    found = shutil.which("cuobjdump")
    wheel = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin" / "cuobjdump"
    return found or (str(wheel) if wheel.exists() else None)


_SASS_FUNC = re.compile(r"Function : (\S+)")
_SASS_MMA = re.compile(r"\b(HGMMA|HMMA|UTCHMMA|UTCQMMA)\.")


def parse_sass(text: str) -> dict[str, dict]:
    """Per function of a `cuobjdump -sass` listing: its tensor-core MMA opcodes (sorted, joined
    by '+', '' when none) and its trap instructions."""
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if m := _SASS_FUNC.search(line):
            current = out.setdefault(m[1], {"mma": set(), "traps": 0})
        elif current is not None:
            current["mma"].update(_SASS_MMA.findall(line))
            current["traps"] += bool(re.search(r"\bBPT\.TRAP\b|\bTRAP\b", line))
    return {k: {"mma": "+".join(sorted(v["mma"])), "traps": v["traps"]} for k, v in out.items()}


def sass_text(cubin: str, function: str | None = None) -> str | None:
    """`cuobjdump -sass` of a cubin (one function with `function`); None without cuobjdump."""
    tool = cuobjdump_path()
    if tool is None:
        return None
    # cuobjdump -sass runs nvdisasm, which the wheels put beside it
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    args = [tool, "-sass", *(["-fun", function] if function else []), cubin]
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass {cubin} failed: {res.stderr.strip()}")
    return res.stdout


_SASS_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* (0x[0-9a-f]{16}) \*/")
_SASS_HI = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/")


def sass_instructions(text: str) -> dict[str, list[dict]]:
    """Per function of a `cuobjdump -sass` listing, its instructions with their scheduling control
    bits (sm_70 and later: bits 105-125 of the 128-bit word, as reverse-engineered by Jia et al.,
    "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking"): `stall` cycles, the
    scoreboard the instruction sets when its result lands (`wsb`, 0-5; None: none), the one it
    sets when its operands are read (`rsb`), and the scoreboards it waits for first (`wait`, a
    set of 0-5)."""
    out: dict[str, list[dict]] = {}
    current = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if m := _SASS_FUNC.search(line):
            current = out.setdefault(m[1], [])
            continue
        m = _SASS_INS.search(line)
        if current is None or m is None or i + 1 >= len(lines):
            continue
        hi = _SASS_HI.search(lines[i + 1])
        if hi is None:
            continue
        ctrl = int(hi[1], 16) >> 41
        wsb, rsb = (ctrl >> 5) & 7, (ctrl >> 8) & 7
        current.append(dict(addr=int(m[1], 16), text=m[2].strip(), stall=ctrl & 0xF,
                            wsb=None if wsb == 7 else wsb, rsb=None if rsb == 7 else rsb,
                            wait={b for b in range(6) if (ctrl >> 11) >> b & 1}))
    return out


def main_loop(instrs: list[dict]) -> list[dict]:
    """The instructions of the kernel's tile loop: the longest range a backward branch closes
    that holds a CTA barrier (BAR.SYNC); [] when there is none."""
    best: list[dict] = []
    for ins in instrs:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", ins["text"])
        if m and int(m[1], 16) < ins["addr"]:
            body = [x for x in instrs if int(m[1], 16) <= x["addr"] <= ins["addr"]]
            if len(body) > len(best) and any("BAR.SYNC" in x["text"] for x in body):
                best = body
    return best


def loop_global_loads(text: str, function: str = "drafter_attention") -> dict:
    """What the tile loop of `function` loads from global memory into registers, beside its
    cp.async tile loads: `ldg` (LDG instructions: the page-id lookups of the paged kernels),
    `ldgsts` (cp.async), and `arrive_waits_on_ldg`, the WARPGROUP.ARRIVEs (wgmma fences) that
    wait for a scoreboard one of those LDGs sets: a warpgroup MMA stalled behind a global load
    round trip on every tile (page 16 on the wgmma path before its fix,
    results/perf-notes.md)."""
    loop = main_loop(sass_instructions(text).get(function, []))
    ldg = [x for x in loop if re.search(r"\bLDG\.", x["text"])]
    sbs = {x["wsb"] for x in ldg} - {None}
    arrive = [x for x in loop if "WARPGROUP.ARRIVE" in x["text"]]
    return dict(loop_instructions=len(loop), ldg=len(ldg),
                ldgsts=sum("LDGSTS" in x["text"] for x in loop),
                arrive=len(arrive), arrive_waits_on_ldg=sum(bool(x["wait"] & sbs) for x in arrive))


def sass_digest(text: str, function: str = "drafter_attention") -> str:
    """sha256 of one function's instructions (addresses, mnemonics and encodings, control bits
    included): equal digests, byte-identical code."""
    import hashlib

    body = [f"{x['addr']:x} {x['text']} {x['stall']} {x['wsb']} {x['rsb']} {sorted(x['wait'])}"
            for x in sass_instructions(text).get(function, [])]
    if not body:
        raise ValueError(f"no SASS for {function}")
    return hashlib.sha256("\n".join(body).encode()).hexdigest()


def sass_summary(cubin: str) -> dict[str, dict] | None:
    """parse_sass of a cubin, kept beside it (cubin names are content hashes); None without
    cuobjdump."""
    side = Path(f"{cubin}.sass.json")
    if side.exists():
        return json.loads(side.read_text())
    text = sass_text(cubin)
    if text is None:
        return None
    summary = parse_sass(text)
    tmp = side.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(summary))
    os.replace(tmp, side)
    return summary


def _compile_one(args) -> list[dict]:
    from drafter_attn.kernels.nvrtc import arch_for_sm, compile_cubin

    variant, sm = args
    res = compile_cubin(variant.source, dict(variant.defines), arch_for_sm(sm),
                        include_dirs=variant.include_dirs, extra_options=variant.options,
                        header_identity=variant.header_identity)
    sass = sass_summary(str(res.cubin_path)) or {}
    return [
        dict(sm=sm, arch=res.arch, backend=variant.backend, variant=variant.label, kernel=name,
             registers=r.registers, spill_bytes=r.spill_store_bytes + r.spill_load_bytes,
             stack_bytes=r.stack_bytes, smem_static=r.smem_static_bytes,
             smem_dynamic=variant.dynamic_smem if name.endswith("attention") else 0,
             mma=sass.get(name, {}).get("mma"), traps=sass.get(name, {}).get("traps"),
             compile_s=round(res.seconds, 2), cached=res.cached, cubin=str(res.cubin_path))
        for name, r in sorted(res.resources.items())
    ]


def sass_problems(rows: list[dict]) -> list[str]:
    """Rows whose SASS is wrong: an attention kernel without tensor-core MMAs, any trap."""
    out = []
    for r in rows:
        where = f"sm {r['sm']} {r['variant']} {r['kernel']}"
        if r.get("traps"):
            out.append(f"{where}: {r['traps']} trap instruction(s)")
        if r["kernel"].endswith("attention") and r.get("mma") == "":
            out.append(f"{where}: no tensor-core MMA in the SASS")
    return out


def smem_problems(rows: list[dict]) -> list[str]:
    """Rows whose kernel asks for more shared memory than a CTA gets on its SM
    (kernels.cupy_backend.SM_BUDGETS): such a variant would not launch there."""
    from drafter_attn.kernels.cupy_backend import sm_budget

    out = []
    for r in rows:
        need, limit = r["smem_dynamic"] + r["smem_static"], sm_budget(r["sm"]).smem_block
        if need > limit:
            out.append(f"sm {r['sm']} {r['variant']} {r['kernel']}: {need} bytes of shared memory, "
                       f"more than the {limit // 1024} KB a CTA gets")
    return out


def compile_variants(sms=DEFAULT_SMS, variants: list[Variant] | None = None,
                     workers: int | None = None) -> list[dict]:
    """Compile every variant for every SM (in parallel processes); one row per kernel."""
    variants = variants if variants is not None else default_variants(sms=sms)
    jobs = [(v, sm) for sm in sms for v in variants if v.sm in (None, sm)]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        results = map(_compile_one, jobs)
        return [row for rows in results for row in rows]
    with ProcessPoolExecutor(workers) as pool:
        return [row for rows in pool.map(_compile_one, jobs) for row in rows]


def parse_sms(text: str) -> tuple[int, ...] | str:
    """`--sm`: "all", or SM numbers like 90,100,103 (checked against NVRTC by resolve_sms)."""
    if text.strip().lower() == "all":
        return "all"
    try:
        sms = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or SM numbers like 90,100,107, got {text!r}")
    if not sms:
        raise argparse.ArgumentTypeError("expected 'all' or at least one SM number")
    return sms


def resolve_sms(sms: tuple[int, ...] | str) -> tuple[int, ...]:
    """SM targets to compile: "all" is every NVRTC target the kernels run on (SM 80 up); each
    SM named must be one (raises nvrtc.UnsupportedArch before anything compiles)."""
    from drafter_attn.kernels import nvrtc

    if sms == "all":
        return nvrtc.compile_targets()
    for sm in sms:
        nvrtc.arch_for_sm(sm)
        if sm < nvrtc.MIN_SM:
            raise nvrtc.UnsupportedArch(f"SM {sm}: the kernels need SM {nvrtc.MIN_SM} or newer "
                                        f"(bf16 mma.sync, cp.async)")
    return tuple(sms)


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = ("sm", "variant", "kernel", "registers", "spill_bytes", "smem_dynamic", "mma",
               "traps", "compile_s")
    table = Table(title="static compile profile (NVRTC, ptxas -v, cuobjdump -sass)")
    for col in columns:
        table.add_column(col, justify="left" if col in ("variant", "kernel", "mma") else "right")
    bad = {id(r) for r in rows if r["spill_bytes"] or sass_problems([r]) or smem_problems([r])}
    for r in rows:
        table.add_row(*(str(r.get(c, "")) for c in columns), style="red" if id(r) in bad else None)
    Console().print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafter_attn.kernels.static_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sm", type=parse_sms, default=DEFAULT_SMS, help="e.g. 90,100,103, or all")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(argv)
    rows = compile_variants(resolve_sms(args.sm), workers=args.workers)
    print_table(rows)
    return 1 if any(r["spill_bytes"] for r in rows) or sass_problems(rows) or smem_problems(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
