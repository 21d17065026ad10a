"""Is page 16 slow in the kernel or in DRAM? Bandwidth of gathering one KV head's slices of
randomly placed pages (what each attention CTA reads), per page size, beside a plain copy.

    python scripts/diag_gather.py [--tokens 262144]

A page [Hkv, PAGE, D] holds one 2*PAGE*D-byte slice per KV head (4 KB at page 16, head_dim 128,
bf16); the CTA of head h reads only slice h of each of its request's pages, so DRAM sees reads of
that size at random places. Here torch gathers those slices, head by head, from a pool whose page
order is shuffled, and the achieved read+write bandwidth is printed per page size. If 4 KB
slices gather near the copy bandwidth, page 16's cost is the kernel's; if not, it is DRAM's.
"""
import argparse

import torch

from drafter_attn.tuner.roofline import copy_bandwidth
from drafter_attn.tuner.timing import time_replays


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32 * 8192, help="context tokens in the pool")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'page':>6} {'slice':>8} {'median_us':>10} {'GB/s':>8} {'of copy':>8}")
    for page in (8, 16, 32, 64, 128, 256):
        pages = args.tokens // page
        pool = torch.randn(pages, args.heads, page, args.head_dim, device="cuda", dtype=torch.bfloat16)
        order = torch.randperm(pages, device="cuda")
        out = torch.empty(args.heads, pages, page, args.head_dim, device="cuda", dtype=torch.bfloat16)

        def gather():
            for h in range(args.heads):  # one head's slices, as one CTA family reads them
                torch.index_select(pool[:, h], 0, order, out=out[h])

        t = time_replays(gather, reps=30)
        nbytes = 2 * pool.numel() * pool.element_size()
        gbps = nbytes / t.median_us / 1e3
        print(f"{page:>6} {2 * page * args.head_dim // 1024:>6} KB {t.median_us:>10.1f} "
              f"{gbps:>8.0f} {gbps * 1e9 / copy:>8.2f}")
        del pool, order, out
        torch.cuda.empty_cache()
    flat = torch.randn(args.tokens * args.heads * args.head_dim, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(flat)
    t = time_replays(lambda: dst.copy_(flat), reps=30)
    print(f"{'dense':>6} {'-':>8} {t.median_us:>10.1f} {2 * flat.numel() * 2 / t.median_us / 1e3:>8.0f}")


if __name__ == "__main__":
    main()
