"""What both CLIs (`tuner` and `bench`) check before any work, and how they write files.

Number types for argparse options parse the text, check its range and raise
argparse.ArgumentTypeError naming what they expected, so argparse prints "argument --x: ..." and
exits 2. Output paths are checked before measuring or reading anything (a folder that cannot be
written must not cost a whole run), and files are written whole or not at all.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path


SUSTAIN_LOAD_HELP = ("with a sustained timing (--sustain): what holds that state: self (the step's own "
                     "load, the default; only heavy calls bring the clock down themselves), or gemm (a "
                     "co-runner's bf16 matmuls for those seconds and again before every timed replay: "
                     "the target model's load a drafter runs between, at the power limit whatever the "
                     "step's own draw)")


def add_sustain_load(parser) -> None:
    """The --sustain-load option, as every command that takes --sustain has it."""
    from drafter_attn.kernels.tuned_table import SUSTAIN_LOADS

    parser.add_argument("--sustain-load", choices=SUSTAIN_LOADS, default="self", help=SUSTAIN_LOAD_HELP)


def load_without_sustain(load: str, sustain_s) -> str | None:
    """What is wrong with a co-runner's `load` asked without a sustained timing (a burst has
    no load), or None."""
    if load != "self" and not sustain_s:
        return f"--sustain-load {load} needs --sustain SECONDS"
    return None


class OutputError(ValueError):
    """An output path that cannot be written; the message names it and why."""


def number(cast, ok, kind: str):
    """An argparse type: `cast` the text, then require `ok(value)`; errors name the `kind`."""
    noun = "number" if cast is float else "integer"
    unparsable = "expected a number" if cast is float else f"expected a {kind} integer"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{unparsable}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected a {kind} {noun}, got {text!r}")
        return value

    parse.__name__ = f"{kind.replace('-', '_')}_{cast.__name__}"
    return parse


# NaN fails every comparison, so each float range below also refuses it.
positive_float = number(float, lambda v: 0 < v < math.inf, "positive")
non_negative_float = number(float, lambda v: 0 <= v < math.inf, "non-negative")
positive_int = number(int, lambda v: v > 0, "positive")
non_negative_int = number(int, lambda v: v >= 0, "non-negative")


def positive_size(text: str) -> int:
    """An argparse type: a token count as people write it (128k, 1M, 4096), at least 1."""
    from drafter_attn.tuner.sizes import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def writable_dir(path, option: str = "--out") -> Path:
    """Create `path` (a folder) when missing and prove a file can be written in it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {path}: is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot write there: {exc.strerror or exc}") from None
    return path


def writable_file(path, option: str = "--out") -> Path:
    """Check that the file `path` can be written (its folder created when missing)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{option} {path}: is a folder, not a file")
    writable_dir(path.parent, option)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_whole(path, write) -> Path:
    """Call write(tmp) on a temporary file beside `path`, then move it over `path`: a failure (a
    full disk) leaves the old file or none, never a truncated one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        # mkstemp makes the file its owner's alone: give it the mode the file had, or the one a
        # plain open would (a table exported for a service must stay readable to it)
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated whole numbers, e.g. 90,100 or 16,64,128."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
