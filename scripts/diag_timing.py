"""Where does a small step's time go? Empty-graph overhead, warm vs cold L2, attention vs combine."""
import torch
from drafter_attn.kernels import registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.presets import get_preset
from drafter_attn.tuner.timing import time_replays

g = get_preset("qwen3-8b-dflash-b16")
x = torch.ones(1, device="cuda")
print("empty graph (one tiny kernel), cold:", time_replays(lambda: x.add_(1)).median_us)
print("empty graph (one tiny kernel), warm:", time_replays(lambda: x.add_(1), cold_l2=False).median_us)
for B, ctx, splits in [(1, 8192, 0), (1, 8192, 1), (1, 8192, 8), (8, 8192, 0), (32, 8192, 0)]:
    gen = torch.Generator().manual_seed(0)
    cache = random_paged_context(g, [ctx] * B, 64, "cuda", gen)
    q = torch.randn(B, 16, 32, 128, device="cuda", dtype=torch.bfloat16)
    kb = torch.randn(B, 16, 8, 128, device="cuda", dtype=torch.bfloat16); vb = torch.randn_like(kb)
    impl = registry.get("cupy").with_params(num_splits=splits) if splits else registry.get("cupy")
    fn = lambda: impl.paged_attention(q, kb, vb, *cache)
    print(B, ctx, "splits", splits or "auto", "cold", round(time_replays(fn).median_us, 2),
          "warm", round(time_replays(fn, cold_l2=False).median_us, 2))
