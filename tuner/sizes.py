"""Token counts and sizes as people write them on command lines and in specs: `8k`, `1M`, `4096`.

The one parser of such sizes; the CLIs (`tuner`, `bench`) and the sweep specs wrap it with their
own messages.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_UNIT = {"": 1, "k": 1024, "m": 1 << 20}


def parse_size(text: str) -> int:
    """'8k' -> 8192, '1M' -> 1048576, '1.5k' -> 1536; ValueError unless a whole number results."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {str(text).strip()!r} as a size: expected a whole number, "
                         f"optionally with k (x1024) or M (x1048576), e.g. 128k or 1M")
    value = float(m.group(1)) * _UNIT[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"{str(text).strip()!r} is not a whole number")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """'2k,8k,32k' -> [2048, 8192, 32768]; empty items are skipped."""
    return [parse_size(part) for part in str(text).split(",") if part.strip()]
