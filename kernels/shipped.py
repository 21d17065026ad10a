"""Where the runtime and the read-only tuner commands find their measurements by default.

The profile databases and tuned tables measured on real GPUs ship with the package, one pair per
SM (`profiles/sm<SM>.json`, `profiles/sm<SM>.db`, installed as `drafter_attn.profiles`), and for an
SM measured under a sustained load also that regime's table (`profiles/sm<SM>-sustained.json`;
kernels.tuned_table.REGIMES). `$DRAFTER_TUNED_TABLE` and `$DRAFTER_DB` override them.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

ENV_VARS = {"table": "DRAFTER_TUNED_TABLE", "db": "DRAFTER_DB"}
SUFFIXES = {"table": ".json", "db": ".db"}


def shipped_dir() -> Path | None:
    """The folder of the shipped profiles (package data), or None when it is not installed."""
    try:
        return Path(str(resources.files("drafter_attn.profiles")))
    except (ModuleNotFoundError, TypeError):
        return None


def gpu_sm() -> int | None:
    """The SM of the current CUDA device, or None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor
    except Exception:
        return None


def find_default(sm: int | None = None, kinds=("table", "db"), regime: str = "burst") -> Path | None:
    """The measurements to read: the first of `kinds` set in its environment variable, else the
    first of `kinds` shipped for SM `sm` (None: the current GPU's); None when there is none. In
    the sustained `regime` a table shipped for it comes first (a database holds both regimes:
    its reader picks the regime's rows)."""
    for kind in kinds:
        value = os.environ.get(ENV_VARS[kind])
        if value:
            return Path(value).expanduser()
    folder = shipped_dir()
    sm = gpu_sm() if sm is None else sm
    if sm is None or folder is None:
        return None
    names = [f"sm{int(sm)}{SUFFIXES[kind]}" for kind in kinds]
    if regime != "burst" and "table" in kinds:
        names.insert(0, f"sm{int(sm)}-{regime}{SUFFIXES['table']}")
    for name in names:
        path = folder / name
        if path.is_file():
            return path
    return None


def only_shipped(kind: str = "db") -> Path | None:
    """The one `kind` file shipped, where exactly one SM has one (what a reading command without
    --sm on a machine without a GPU reads); None otherwise."""
    folder = shipped_dir()
    if folder is None:
        return None
    found = [p for p in folder.glob(f"sm*{SUFFIXES[kind]}") if p.stem[2:].isdigit()]
    return found[0] if len(found) == 1 else None
