"""Where the warps of a kernel wait, from scripts/gpu_ncu_source.sh's output: per case, its
duration, warp instructions executed and the share of stall samples by reason, then the
instructions holding the most samples (with their top reasons), and, with --loop, the opcode mix
of the instructions executed at least LOOP times (the tile loop's, given its trip count).

    python scripts/ncu_source_summary.py DIR_OR_TGZ [--top 15] [--loop 3000]
"""
from __future__ import annotations

import argparse
import io
import re
import tarfile
from pathlib import Path

import pandas as pd


def _read(src: Path) -> dict[str, str]:
    if src.is_dir():
        return {p.name: p.read_text() for p in src.glob("case_*")}
    with tarfile.open(src) as tar:
        return {m.name.split("/")[-1]: tar.extractfile(m).read().decode()
                for m in tar.getmembers() if m.isfile()}


def _sass(text: str) -> pd.DataFrame:
    # line 0 names the kernel; line 1 is the header
    df = pd.read_csv(io.StringIO(text.split("\n", 1)[1]), thousands=",")
    df["samples"] = df["Warp Stall Sampling (All Samples)"].fillna(0)
    df["executed"] = df["Instructions Executed"].fillna(0)
    df["opcode"] = df["Source"].str.strip().str.replace(r"^@!?U?P\w+\s+", "", regex=True).str.split(r"[\s.]").str[0]
    return df


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--loop", type=int, default=0, help="opcode mix of instructions executed at least this often")
    args = ap.parse_args(argv)
    files = _read(args.src)
    cases = sorted({int(m[1]) for n in files if (m := re.match(r"case_(\d+)\.txt$", n))})
    for n in cases:
        head = files[f"case_{n}.txt"]
        dur = re.search(r"Duration\s+(\S+)\s+([\d.,]+)", head)
        df = _sass(files[f"case_{n}_sass.csv"])
        stalls = [c for c in df.columns if c.startswith("stall_") and "Not Issued" not in c]
        total = df["samples"].sum()
        print(f"== {head.splitlines()[0]}: {dur[2] + ' ' + dur[1] if dur else '?'}, "
              f"{int(df['executed'].sum())} warp instructions, {int(total)} samples")
        share = (df[stalls].sum() / total * 100).sort_values(ascending=False).head(8)
        print("   " + ", ".join(f"{k[6:]} {v:.0f}%" for k, v in share.items()))
        for _, r in df.nlargest(args.top, "samples").iterrows():
            why = r[stalls].astype(float).nlargest(2)
            print(f"   {100 * r['samples'] / total:5.1f}%  ex {int(r['executed']):6d}  {r['Source'][:58]:58s} "
                  + ", ".join(f"{k[6:]} {int(v)}" for k, v in why.items() if v))
        if args.loop:
            hot = df[df["executed"] >= args.loop]
            mix = hot.groupby("opcode")["executed"].sum().sort_values(ascending=False).head(12)
            print(f"   executed >= {args.loop}: {int(hot['executed'].sum())} warp instructions; "
                  + ", ".join(f"{k} {int(v)}" for k, v in mix.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
