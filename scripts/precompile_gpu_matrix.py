"""Compile, in parallel processes, every kernel variant the GPU test matrix will load, so the
tests themselves do not compile one module after another (CuTe modules take 15-30 s each).

    python scripts/precompile_gpu_matrix.py [backend-spec ...]   # default: tests' BACKENDS
"""
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from kernels.spec import Problem  # noqa: E402
from tests import test_backends_gpu as matrix  # noqa: E402


def _compile(job):
    module_name, defines, sm = job
    module = sys.modules.get(module_name) or __import__(module_name, fromlist=["x"])
    res = module.compile_variant(dict(defines), sm)
    return res.seconds, res.cached


def jobs(specs, sm):
    out = set()
    for spec in specs:
        backend = matrix._backend(spec)
        kern = backend._kernels
        for case in matrix._cases():
            geom, page, lens, _ = case.values
            for layout, ps in (("paged", page), ("arena", None)):
                problem = Problem(geom, layout, ps, len(lens), 0)
                if backend.supports(problem):
                    continue
                params = backend.params_for(problem)
                d = kern.variant_defines(geom.dtype, geom.head_dim, ps, geom.block_size,
                                         geom.group, params, sm)
                out.add((kern.__name__, tuple(sorted(d.items())), sm))
        for dtype in ("bfloat16", "float16"):  # store modules (block 1, group 1, defaults)
            for ps in (*kern.PAGE_SIZES, None):
                for hd in kern.HEAD_DIMS:
                    d = kern.variant_defines(dtype, hd, ps, 1, 1, kern.Params(), sm)
                    out.add((kern.__name__, tuple(sorted(d.items())), sm))
    return sorted(out)


if __name__ == "__main__":
    props = torch.cuda.get_device_properties(0)
    sm = props.major * 10 + props.minor
    todo = jobs(sys.argv[1:] or matrix.BACKENDS, sm)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        results = list(pool.map(_compile, todo))
    print(f"{len(todo)} variants for sm_{sm}: {sum(not c for _, c in results)} compiled, "
          f"{sum(s for s, c in results if not c):.0f} s of compile time")
