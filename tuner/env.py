"""Environment fingerprint: what a measurement depends on besides the problem and the kernel.

Rows of the profile database are keyed by it, so a number measured on one GPU, driver or kernel
source is never taken for another. `fingerprint()` needs the GPU it describes; `env_id()` hashes
the fingerprint into the short id the database stores.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from importlib import metadata

# The fields that identify an environment, in database column order.
FIELDS = ("gpu_name", "sm", "sm_count", "driver", "cuda", "torch", "cupy", "cutlass", "nvrtc",
          "sources_hash")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _first_version(*dists: str) -> str | None:
    return next((v for v in map(_version, dists) if v), None)


def _driver_version() -> str | None:
    """The display driver (e.g. 580.95.05; one per host) from nvidia-smi, else the CUDA driver
    API version."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip()
        if out:
            return out.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import cupy

        v = cupy.cuda.runtime.driverGetVersion()
        return f"cuda-driver-api {v // 1000}.{v % 1000 // 10}"
    except Exception:
        return None


def software_versions() -> dict:
    """Library and compiler versions, and the kernel-source hash (no GPU needed)."""
    import torch

    from drafter_attn.kernels import nvrtc

    try:
        nvrtc_v = ".".join(map(str, nvrtc.nvrtc_version()))
    except Exception:  # cuda-bindings or the NVRTC wheel missing
        nvrtc_v = None
    return dict(
        cuda=torch.version.cuda,
        torch=torch.__version__,
        cupy=_first_version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        cutlass=_first_version("nvidia-cutlass"),
        nvrtc=nvrtc_v,
        sources_hash=nvrtc.sources_digest(),
    )


def fingerprint(device_index: int = 0) -> dict:
    """The environment of CUDA device `device_index` as a flat dict of FIELDS."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return dict(
        gpu_name=props.name,
        sm=props.major * 10 + props.minor,
        sm_count=props.multi_processor_count,
        driver=_driver_version(),
        **software_versions(),
    )


def env_id(fp: dict) -> str:
    """Stable short id of a fingerprint (same environment -> same id on every host)."""
    canonical = json.dumps({k: fp.get(k) for k in FIELDS}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
