"""The node ids of tests/test_backends_gpu.py that run exactly the given backend specs: those with
one of them as a whole parameter (so "cupy:ws=3" does not select "cupy:ws=3,tile_n=32"), one a
line, for `pytest "${ids[@]}"` (scripts/gpu_variants.sh's MATRIX). `-k` cannot select them: its
expressions take no "=" or ",".

    python scripts/matrix_ids.py SPEC [SPEC ...]        (no GPU needed: pytest only collects)
"""
from __future__ import annotations

import re
import subprocess
import sys

TESTS = "tests/test_backends_gpu.py"


def select(ids: list[str], specs: list[str]) -> list[str]:
    """The ids among `ids` (pytest's `path::name[params]`) with a spec of `specs` as one of the
    dash-separated parameters in their brackets."""
    pattern = re.compile("|".join(rf"[-\[]{re.escape(s)}[\]-]" for s in specs))
    return [i for i in ids if "[" in i and pattern.search(i[i.index("["):])]


def collect(path: str = TESTS) -> list[str]:
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path],
                         capture_output=True, text=True, check=False)
    return [line for line in res.stdout.splitlines() if "::" in line]


def main() -> int:
    specs = sys.argv[1:]
    if not specs:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(select(collect(), specs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
