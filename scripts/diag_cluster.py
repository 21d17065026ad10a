"""How many clusters of the main preset's attention CTA an H200 holds at once, by cluster size,
at the CTA's own shared memory and at one CTA an SM (`lone_cta_smem`): the question behind
`cupy:cluster=1` running slower than the same split count merged by the combine kernel.

    python scripts/diag_cluster.py
"""
import torch

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem

g = get_preset(MAIN_PRESET)
prob = Problem(g, "paged", 64, 1, 8192)
p = cb.default_params(prob, 90, cluster=True)
mod = cb.CUPY.module_for(0, g.torch_dtype, g.head_dim, 64, g.block_size, g.group, p)
print(f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}; CTA: {mod.threads} "
      f"threads, {mod.regs} registers, {mod.smem} B of shared memory")
for smem in (mod.smem, cb.lone_cta_smem(mod.smem)):
    counts = {size: cb.max_active_clusters(mod.attention, (size, 8, 1), mod.threads, smem, size)
              for size in (1, 2, 4, 8, 16)}
    print(f"smem {smem}: max active clusters by size {counts}; CTAs "
          f"{ {s: s * c for s, c in counts.items()} }")
