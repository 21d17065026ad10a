"""Compile CUDA C++ (plain or CuTe) to cubins with NVRTC, cached on disk, with ptxas resource usage.

NVRTC needs no GPU, so every kernel compiles for every SM target on any machine. The cache key
hashes the sources, the compiler version, the options, the arch and any extra header identity
(e.g. the CUTLASS version), so a stale cubin is never loaded. The cache directory is
``$DRAFTER_CACHE_DIR`` or ``~/.cache/drafter-attn``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CUDA_SRC_DIR = Path(__file__).parent / "cuda"

# SM targets the suite compiles for; "a" variants unlock arch-specific instructions (wgmma etc).
SM_ARCH = {90: "sm_90a", 100: "sm_100a", 103: "sm_103a", 120: "sm_120a"}


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries the compiler log."""


@dataclass
class KernelResources:
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    smem_static_bytes: int


@dataclass
class CompileResult:
    cubin_path: Path
    arch: str
    options: list[str]
    resources: dict[str, KernelResources] = field(default_factory=dict)
    seconds: float = 0.0
    cached: bool = False

    @property
    def spills(self) -> int:
        return sum(r.spill_store_bytes + r.spill_load_bytes for r in self.resources.values())


def arch_for_sm(sm: int) -> str:
    if sm not in SM_ARCH:
        raise ValueError(f"sm={sm} is not a compile target; known: {sorted(SM_ARCH)}")
    return SM_ARCH[sm]


def cache_dir() -> Path:
    root = os.environ.get("DRAFTER_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "drafter-attn"
    )
    path = Path(root) / "cubins"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def cuda_include_dir() -> str:
    """The CUDA toolkit's include dir (its CCCL lives in include/cccl)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, candidates):
        inc = os.path.join(root, "include")
        if os.path.exists(os.path.join(inc, "cuda_bf16.h")):
            return inc
    raise CompileError(
        "CUDA headers not found (cuda_bf16.h): set CUDA_HOME to a CUDA toolkit (>= 12.6)"
    )


@functools.cache
def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CompileError(
            "cuda-bindings is not installed: pip install 'drafter-attn-suite[cu13]' (or [cu12])"
        ) from exc
    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    err, major, minor = _nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


def _check(err, what: str, log: str = "") -> None:
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}\n{log}")


def _read_sources() -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(CUDA_SRC_DIR.glob("*.cu*"))}


def _digest(sources: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name, data in sources.items():
        h.update(name.encode())
        h.update(data)
    return h.hexdigest()


def sources_digest() -> str:
    """Hash of every shipped kernel source (part of the environment fingerprint). Read anew on
    each call, so an edit made while a process runs is never keyed under the old hash."""
    return _digest(_read_sources())


_FUNC_RE = re.compile(r"Function properties for (\S+)")
_STACK_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Per-kernel registers, stack, spills and static smem from ``ptxas -v`` output."""
    out: dict[str, KernelResources] = {}
    current = None
    pending: dict = {}
    for line in log.splitlines():
        if m := _FUNC_RE.search(line):
            current = m.group(1)
            pending = {}
        elif current and (m := _STACK_RE.search(line)):
            pending.update(stack=int(m[1]), sst=int(m[2]), sld=int(m[3]))
        elif current and (m := _USED_RE.search(line)):
            out[current] = KernelResources(
                registers=int(m[1]),
                stack_bytes=pending.get("stack", 0),
                spill_store_bytes=pending.get("sst", 0),
                spill_load_bytes=pending.get("sld", 0),
                smem_static_bytes=int(m[2] or 0),
            )
            current = None
    return out


def compile_cubin(
    source: str,
    defines: dict[str, int | str],
    arch: str,
    include_dirs: tuple[str, ...] = (),
    extra_options: tuple[str, ...] = (),
    header_identity: str = "",
) -> CompileResult:
    """Compile ``kernels/cuda/<source>`` for ``arch`` (e.g. "sm_90a"); cached by content hash."""
    src_path = CUDA_SRC_DIR / source
    inc = cuda_include_dir()
    options = [
        f"-arch={arch}",
        "-std=c++17",
        "-default-device",
        "--ptxas-options=-v",
        f"-I{CUDA_SRC_DIR}",
        *(f"-I{d}" for d in include_dirs),
        f"-I{os.path.join(inc, 'cccl')}",
        f"-I{inc}",
        *(f"-D{k}={v}" for k, v in sorted(defines.items())),
        *extra_options,
    ]
    # The key hashes the very bytes compiled below (the source and its sibling headers).
    sources = _read_sources()
    key_src = json.dumps(
        [_digest(sources), nvrtc_version(), source, options[:1] + options[4:], header_identity]
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    stem = f"{src_path.stem}-{arch}-{key}"
    cubin_path = cache_dir() / f"{stem}.cubin"
    meta_path = cache_dir() / f"{stem}.json"
    if cubin_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        res = {k: KernelResources(**v) for k, v in meta["resources"].items()}
        return CompileResult(cubin_path, arch, options, res, meta["seconds"], cached=True)

    nvrtc = _nvrtc()
    t0 = time.perf_counter()
    err, prog = nvrtc.nvrtcCreateProgram(sources[source], str(src_path).encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        log = _program_log(prog)
        _check(err, f"NVRTC compile of {source} for {arch} with {defines}", log)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        buf = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        _check(err, "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    seconds = time.perf_counter() - t0
    resources = parse_ptxas_log(log)
    # Write atomically: concurrent compiles (test workers, sweep workers) may race on one key.
    tmp = cubin_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(buf)
    os.replace(tmp, cubin_path)
    meta = {"resources": {k: asdict(v) for k, v in resources.items()}, "seconds": seconds,
            "options": options, "log": log}
    tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    return CompileResult(cubin_path, arch, options, resources, seconds, cached=False)


def _program_log(prog) -> str:
    nvrtc = _nvrtc()
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00")
