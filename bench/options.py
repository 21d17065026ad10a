"""Option values of the `bench` command: sizes, head counts, SM numbers and the geometry.

Every parser raises `argparse.ArgumentTypeError` with a message that names what it expected, so
argparse reports "argument --page: ..." and exits with status 2.
"""

from __future__ import annotations

import argparse
import re

from drafter_attn.tuner.cli_checks import (  # noqa: F401  (bench's option types)
    add_sustain_load, non_negative_float, non_negative_int, positive_float, positive_int)
from drafter_attn.tuner.sizes import parse_size


class BenchError(Exception):
    """Something the user must change (the GPU, an option, a missing file). The message is
    printed as is; the command exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def sizes(text: str, *, what: str = "sizes", minimum: int = 1, power_of_two: bool = False) -> list[int]:
    """'2k,8k,32k' -> [2048, 8192, 32768] (k = 1024, M = 1024 * 1024), each a whole number of at
    least `minimum` (and a power of two when asked), duplicates dropped, order kept."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what} like 2k,8k,32k; got {text!r}")
    out = []
    for part in parts:
        try:
            value = parse_size(part)
        except ValueError as exc:
            where = f"one of the {what}" if len(parts) > 1 else what
            raise argparse.ArgumentTypeError(f"{exc} ({where})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be at least {minimum}, got {part.strip()!r}")
        if power_of_two and value & (value - 1):
            raise argparse.ArgumentTypeError(f"{what} must be powers of two, got {part.strip()!r}")
        out.append(value)
    return list(dict.fromkeys(out))


def size(text: str, *, what: str = "size", minimum: int = 1) -> int:
    values = sizes(text, what=what, minimum=minimum)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one {what}, got {text!r}")
    return values[0]


def batches(text: str) -> list[int]:
    return sizes(text, what="batch sizes")


def contexts(text: str) -> list[int]:
    return sizes(text, what="context lengths", minimum=0)


def pages(text: str) -> list[int]:
    return sizes(text, what="page sizes", minimum=1, power_of_two=True)


def max_ctx(text: str) -> int:
    return size(text, what="max context (tokens)")


def table_capacities(text: str) -> list[int]:
    return sizes(text, what="block-table capacities (tokens)")


def concurrency(text: str) -> int:
    return size(text, what="concurrency (requests)")


def chunks(text: str) -> list[int]:
    return sizes(text, what="chunk sizes (tokens)")


def heads(text: str) -> tuple[int, int]:
    """'32/8' -> (32 query heads, 8 KV heads); '32' -> (32, 32)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:/\s*(\d+)\s*)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected query/KV heads like 32/8, got {text!r}")
    hq = int(m.group(1))
    hkv = int(m.group(2)) if m.group(2) else hq
    if hq <= 0 or hkv <= 0:
        raise argparse.ArgumentTypeError(f"head counts must be positive, got {text!r}")
    if hq % hkv:
        raise argparse.ArgumentTypeError(f"query heads {hq} are not a multiple of KV heads {hkv} ({text!r})")
    return hq, hkv


def sm(text: str) -> int:
    """'90', 'sm90', 'sm_90', 'sm_90a' or '9.0' -> 90."""
    t = text.strip().lower()
    m = re.fullmatch(r"(?:sm_?)?(\d+)([af]?)", t) or re.fullmatch(r"(\d+)\.(\d)", t)
    if not m:
        raise argparse.ArgumentTypeError(f"expected an SM number like 90, 100 or sm_90a, got {text!r}")
    value = int(m.group(1)) * 10 + int(m.group(2)) if "." in t else int(m.group(1))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive SM number, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------
# The geometry: a preset, with any field overridden by an explicit option.

GEOMETRY_OPTIONS = ("heads", "head_dim", "block", "mask", "window", "layers", "dtype")


def add_geometry_options(parser: argparse.ArgumentParser) -> None:
    from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS
    from drafter_attn.kernels.spec import DTYPES, MASKS

    g = parser.add_argument_group(
        "geometry", f"a preset (default {MAIN_PRESET}); each explicit option overrides that field")
    g.add_argument("--preset", default=None, choices=list(PRESETS), metavar="NAME",
                   help=f"drafter preset: {', '.join(PRESETS)}")
    g.add_argument("--heads", type=heads, metavar="HQ/HKV", help="query/KV heads, e.g. 32/8")
    g.add_argument("--head-dim", type=positive_int, metavar="D")
    g.add_argument("--block", type=positive_int, metavar="QB", help="block size (queries per request)")
    g.add_argument("--mask", choices=list(MASKS))
    g.add_argument("--window", type=positive_int, metavar="W", help="window of the sliding masks")
    g.add_argument("--layers", type=positive_int, metavar="L")
    g.add_argument("--dtype", choices=list(DTYPES))


def geometry_from_args(args) -> tuple[object, str]:
    """(Geometry, label): the preset's name when no field was overridden, else 'custom' plus the
    fields. Raises BenchError naming the bad field."""
    from drafter_attn.kernels.presets import MAIN_PRESET, get_preset

    base_name = args.preset or MAIN_PRESET
    base = get_preset(base_name)
    changes = {}
    if args.heads is not None:
        changes["num_q_heads"], changes["num_kv_heads"] = args.heads
    for opt, field in (("head_dim", "head_dim"), ("block", "block_size"), ("mask", "mask"),
                       ("window", "window"), ("layers", "num_layers"), ("dtype", "dtype")):
        value = getattr(args, opt)
        if value is not None:
            changes[field] = value
    if args.mask == "full" and args.window is not None:
        raise BenchError("--window applies to the sliding masks only (--mask full has no window)")
    if args.mask in ("sliding", "sliding_causal") and args.window is None and base.window is None:
        raise BenchError(f"--mask {args.mask} needs --window W (the sliding window in tokens)")
    if "mask" in changes and changes["mask"] == "full":
        changes["window"] = None
    try:
        geometry = base.with_(**changes)
    except ValueError as exc:
        raise BenchError(f"invalid geometry: {exc}") from None
    if not changes or geometry == base:
        return geometry, base_name
    return geometry, "custom:" + describe(geometry)


def describe(g) -> str:
    """'32/8 d128 b16 full L5 bf16'-style short description of a geometry."""
    mask = g.mask if g.window is None else f"{g.mask}{g.window}"
    dt = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(g.dtype, g.dtype)
    return f"{g.num_q_heads}/{g.num_kv_heads} d{g.head_dim} b{g.block_size} {mask} L{g.num_layers} {dt}"


def baseline_option(text: str) -> str:
    """--baseline: auto, none, flashinfer (both FlashInfer plans), or a comma list of baselines."""
    from drafter_attn.kernels.baselines import NAMES

    if text in ("auto", "none", "flashinfer"):
        return text
    unknown = [n for n in (p.strip() for p in text.split(",")) if n and n not in NAMES]
    if unknown or not text.strip(","):
        raise argparse.ArgumentTypeError(f"unknown baseline {', '.join(unknown) or repr(text)}; expected auto, "
                                         f"none, flashinfer or a comma list of {', '.join(NAMES)}")
    return text
