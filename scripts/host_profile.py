"""Where the host time of one eager attention call goes (B=1, ctx 2k, main preset): per-call time
of the backend (checks on and off) and of Runtime, then a cProfile of the backend's calls, top
entries by own time. Needs a CUDA GPU: python scripts/host_profile.py [CALLS]"""
import cProfile
import dataclasses
import pstats
import sys
import time

import torch

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.dispatch import Runtime
from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
g = PRESETS[MAIN_PRESET]
gen = torch.Generator().manual_seed(0)
q = torch.randn(1, g.block_size, g.num_q_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
kb = torch.randn(1, g.block_size, g.num_kv_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
args = (q, kb, torch.randn_like(kb), *random_paged_context(g, [2048], 64, "cuda", gen))


def per_call_us(fn) -> float:
    fn(*args)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


for checks in (True, False):
    cb.CHECKS = checks
    backend = dataclasses.replace(registry.get("cupy"))
    print(f"backend, checks {'on' if checks else 'off'}: {per_call_us(backend.paged_attention):.1f} us per call")
cb.CHECKS = True
print(f"Runtime: {per_call_us(Runtime().paged_attention):.1f} us per call")
backend = dataclasses.replace(registry.get("cupy"))
backend.paged_attention(*args)
prof = cProfile.Profile()
prof.enable()
for _ in range(calls):
    backend.paged_attention(*args)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
