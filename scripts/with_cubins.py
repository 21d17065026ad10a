"""Run a module with the cupy kernels loaded from a folder of cubins (scripts/cubins_by_nvrtc.py
dump) wherever one was built for the variant: another NVRTC's code, timed here beside this
machine's own. Variants the folder lacks compile as usual; the variants taken are listed on
stderr at exit.

    python scripts/with_cubins.py DIR -m drafter_attn.bench.attention_table ARGS...
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import runpy
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1])
    if sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    module, args = sys.argv[3], sys.argv[4:]
    from drafter_attn.kernels import cupy_backend as cb

    built = {json.dumps([m["module"], m["defines"], m["sm"]], sort_keys=True): folder / f"{m['index']}.cubin"
             for m in json.loads((folder / "manifest.json").read_text())}
    own, taken = cb.compile_variant, []

    def compile_variant(defines, sm):
        result = own(defines, sm)  # this NVRTC's build: the result's other fields, and the fallback
        path = built.get(json.dumps([cb.__name__, dict(defines), sm], sort_keys=True))
        if path is None:
            return result
        taken.append(path.name)
        return dataclasses.replace(result, cubin_path=path)

    cb.compile_variant = compile_variant
    atexit.register(lambda: print(f"with_cubins: {len(taken)} variants from {folder}: "
                                  f"{', '.join(sorted(set(taken)))}", file=sys.stderr))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
