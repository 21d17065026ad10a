"""A short summary of attention_table CSVs, for the end of a device run's output: per point the
median attention time over rounds, the kernel that ran (`pick`), the lowest read floor, x floor.

    python scripts/table_summary.py OUT/small.csv [OUT/long.csv ...]
"""
import sys

import pandas as pd

for path in sys.argv[1:]:
    df = pd.read_csv(path)
    if "pick" not in df:
        df["pick"] = df["impl"]
    ok = df.dropna(subset=["attn_us"])
    g = ok.groupby(["impl", "layout", "page", "batch", "ctx"], sort=False).agg(
        pick=("pick", "first"), us=("attn_us", "median"), floor=("read_floor_us", "min"))
    g["x_floor"] = g.us / g.floor
    g["pick"] = [p if p != i else "" for (i, *_), p in zip(g.index, g.pick)]
    print(f"== {path}")
    print(g.reset_index().to_string(index=False, max_colwidth=64, float_format=lambda x: f"{x:.4g}"))
