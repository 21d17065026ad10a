"""Stand-ins for the GPU-side worker functions, so sweeps run in CPU tests (see test_tuner_sweep).

The fake measure's behaviour is chosen by the candidate's context length:
  13 -> the worker dies by SIGSEGV (a kernel fault that kills the process)
  17 -> hangs (a timeout)
  19 -> reports failed_runtime (the worker then exits and is restarted)
  else -> ok after `sleep` seconds, with median_us = ctx_len
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import zlib


def fingerprint() -> dict:
    return dict(gpu_name="fake GPU", sm=0, sm_count=1, driver="0", cuda=None, torch=None, cupy=None,
                cutlass=None, nvrtc=None, sources_hash="fake")


def measure(wire: dict, sleep: float = 0.0, **_options) -> dict:
    ctx = wire["problem"]["ctx_len"]
    if ctx == 13:
        os.kill(os.getpid(), signal.SIGSEGV)
    if ctx == 17:
        time.sleep(3600)
    if ctx == 19:
        return dict(status="failed_runtime", reason="CUDARuntimeError: an illegal memory access")
    time.sleep(sleep)
    return dict(status="ok", reason=None, median_us=float(ctx), p10_us=float(ctx), p90_us=float(ctx),
                count=30, elapsed_s=sleep)


def measure_noisy(wire: dict, seed: int = 0, noise: float = 0.01, **_options) -> dict:
    """ok, at a step time fixed by the candidate (100-150 us from a hash of its problem and
    parameters) times 1 + N(0, `noise`) drawn from `seed`: sweeps of two seeds stand in for one
    sweep run twice. p10/p90 lie `noise` below and above the median."""
    what = json.dumps(wire, sort_keys=True)
    true = 100.0 * (1 + (zlib.crc32(what.encode()) % 1000) / 2000)
    median = true * (1 + random.Random(f"{seed}:{what}").gauss(0, noise))
    return dict(status="ok", reason=None, median_us=median, p10_us=median * (1 - noise),
                p90_us=median * (1 + noise), count=30, elapsed_s=0.0)


def broken_fingerprint() -> dict:
    raise RuntimeError("no CUDA GPU")


def measure_gpu(wire: dict, **_options) -> dict:
    """On a GPU: ctx_len 13 trips a device-side assert (a sticky CUDA error, like an illegal
    address: the process's context is unusable afterwards); anything else runs a small kernel."""
    import torch

    x = torch.arange(4, device="cuda")
    if wire["problem"]["ctx_len"] == 13:
        x[torch.tensor([1 << 20], device="cuda")] += 1  # out of range: device-side assert
        torch.cuda.synchronize()
    return dict(status="ok", median_us=float(x.sum().item()))


def gpu_fingerprint() -> dict:
    import torch

    return {**fingerprint(), "gpu_name": torch.cuda.get_device_name(0)}


def node_fingerprint() -> dict:
    """The fake GPU of a Ray node: its SM from $FAKE_SM, which the test sets when it starts the
    node (the node's processes, and so its actors' workers, inherit it)."""
    return {**fingerprint(), "sm": int(os.environ.get("FAKE_SM", "0"))}
