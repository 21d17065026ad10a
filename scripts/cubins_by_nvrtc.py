"""The shipped picks' kernels compiled by this machine's NVRTC, kept as cubins, and two such
sets compared instruction by instruction with one cuobjdump (tuner/kernel_digests.py's
normalisation: SASS and per-function resources, without the symbol table), so two NVRTC versions
are compared without two tools' formats in the way.

    python scripts/cubins_by_nvrtc.py dump OUT [--limit N]   # OUT/<NVRTC>/<i>.cubin + manifest.json
    python scripts/cubins_by_nvrtc.py compare A B            # per variant: same or differing lines

`dump` takes the distinct (module, defines) of profiles/sm90.json's and sm90-sustained.json's
winners (attention modules; the store is the same kernel in each), the most used first. No GPU
needed.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tuner"))  # kernel_digests, run as a module of scripts


def _variants(limit: int | None) -> list[tuple]:
    import kernel_digests

    uses = collections.Counter()
    for name in ("sm90.json", "sm90-sustained.json"):
        for e in json.loads((REPO / "profiles" / name).read_text())["entries"]:
            jobs = kernel_digests.row_jobs(dict(e, num_layers=1))
            if isinstance(jobs, list):
                uses[jobs[0]] += 1
    return [job for job, _ in uses.most_common(limit)]


def _compile(job: tuple) -> str:
    module, defines, sm = job
    return str(importlib.import_module(module).compile_variant(dict(defines), sm).cubin_path)


def dump(out: Path, limit: int | None) -> None:
    import os
    from concurrent.futures import ProcessPoolExecutor

    from drafter_attn.kernels import nvrtc

    version = "%d.%d" % nvrtc.nvrtc_version()
    folder = out / version
    folder.mkdir(parents=True, exist_ok=True)
    jobs = _variants(limit)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        cubins = list(pool.map(_compile, jobs))
    manifest = []
    for i, ((module, defines, sm), cubin) in enumerate(zip(jobs, cubins)):
        shutil.copy(cubin, folder / f"{i}.cubin")
        manifest.append(dict(index=i, module=module, defines=dict(defines), sm=sm))
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"NVRTC {version}: {len(manifest)} cubins in {folder}")


def compare(a: Path, b: Path) -> int:
    import difflib

    import kernel_digests

    ma = {json.dumps([m["module"], m["defines"], m["sm"]], sort_keys=True): m["index"]
          for m in json.loads((a / "manifest.json").read_text())}
    mb = {json.dumps([m["module"], m["defines"], m["sm"]], sort_keys=True): m["index"]
          for m in json.loads((b / "manifest.json").read_text())}
    same = differ = 0
    for key in ma.keys() & mb.keys():
        ta = kernel_digests.machine_code(str(a / f"{ma[key]}.cubin")).splitlines()
        tb = kernel_digests.machine_code(str(b / f"{mb[key]}.cubin")).splitlines()
        if ta == tb:
            same += 1
            continue
        differ += 1
        changed = [ln for ln in difflib.unified_diff(ta, tb, lineterm="", n=0)
                   if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
        print(f"variant {ma[key]} ({a.name}) / {mb[key]} ({b.name}): {len(changed)} lines differ "
              f"of {len(ta)}; first: {changed[:2]}")
    print(f"{same} variants the same, {differ} differ ({a.name} against {b.name})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--limit", type=int)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.what == "dump":
        dump(args.out, args.limit)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
