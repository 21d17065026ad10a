"""One attention call of the main preset, eagerly, for Nsight Compute:
ncu_case.py B CTX [PAGE [IMPL]] (IMPL a registry spec such as cupy:skip_loads=1)."""
import sys
import torch
from drafter_attn.kernels import registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.presets import get_preset

B, ctx = int(sys.argv[1]), int(sys.argv[2])
page = int(sys.argv[3]) if len(sys.argv) > 3 else 64
g = get_preset("qwen3-8b-dflash-b16")
cache = random_paged_context(g, [ctx] * B, page, "cuda", torch.Generator().manual_seed(0))
q = torch.randn(B, 16, 32, 128, device="cuda", dtype=torch.bfloat16)
kb = torch.randn(B, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
vb = torch.randn_like(kb)
impl = registry.from_spec(sys.argv[4]) if len(sys.argv) > 4 else registry.get("cupy")
for _ in range(3):
    impl.paged_attention(q, kb, vb, *cache)
torch.cuda.synchronize()
