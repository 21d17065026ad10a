"""One attention call of a preset, eagerly, for Nsight Compute:
ncu_case.py B CTX [PAGE [IMPL [PRESET]]] (IMPL a registry spec such as cupy:skip_loads=1;
PRESET default the main one). Three calls: profile the last with --launch-skip."""
import sys

import torch

from drafter_attn.kernels import registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset

B, ctx = int(sys.argv[1]), int(sys.argv[2])
page = int(sys.argv[3]) if len(sys.argv) > 3 else 64
impl = registry.from_spec(sys.argv[4]) if len(sys.argv) > 4 else registry.get("cupy")
g = get_preset(sys.argv[5] if len(sys.argv) > 5 else MAIN_PRESET)
cache = random_paged_context(g, [ctx] * B, page, "cuda", torch.Generator().manual_seed(0))
q = torch.randn(B, g.block_size, g.num_q_heads, g.head_dim, device="cuda", dtype=torch.bfloat16)
kb = torch.randn(B, g.block_size, g.num_kv_heads, g.head_dim, device="cuda", dtype=torch.bfloat16)
vb = torch.randn_like(kb)
for _ in range(3):
    impl.paged_attention(q, kb, vb, *cache, mask=g.mask, window=g.window)
torch.cuda.synchronize()
