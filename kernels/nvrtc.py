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
import logging
import os
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

CUDA_SRC_DIR = Path(__file__).parent / "cuda"

# The kernels need SM 80 (bf16 mma.sync, cp.async, ldmatrix); `--sm all` starts here.
MIN_SM = 80
# SMs whose arch-specific variant ("sm_XXXa") the kernels need. Only sm_90: the wgmma path
# (wgmma.mma_async, fence.proxy.async) exists in sm_90a alone, and plain sm_90 turns it into
# traps. Everywhere else the kernels use the SM 80 instruction set only (mma.sync m16n8k16,
# cp.async, ldmatrix; no tcgen05/TMEM on 100/103/107/110, nothing 120/121-specific), so they get
# plain sm_XXX: the same code, and a plain cubin also runs on later minor revisions of its major
# (an sm_100 cubin on SM 103 and 107), which an "a" cubin never does.
ARCH_SPECIFIC_SMS = frozenset({90})

log = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries the compiler log."""


class UnsupportedArch(CompileError):
    """The installed NVRTC cannot compile for the SM asked (too old, or not an NVIDIA target)."""


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
    log: str = ""  # NVRTC's log: warnings and ptxas -v (e.g. "wgmma ... serialized" notes)

    @property
    def spills(self) -> int:
        return sum(r.spill_store_bytes + r.spill_load_bytes for r in self.resources.values())


@functools.cache
def supported_sms() -> tuple[int, ...]:
    """The SM targets the installed NVRTC compiles for (nvrtcGetSupportedArchs), ascending."""
    nvrtc = _nvrtc()
    if not hasattr(nvrtc, "nvrtcGetSupportedArchs"):  # pragma: no cover - cuda-bindings < 11.2
        raise UnsupportedArch("this cuda-bindings has no nvrtcGetSupportedArchs: "
                              "pip install -U 'drafter-attn-suite[cu13]'")
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs")
    return tuple(sorted(int(a) for a in archs))


def compile_targets(min_sm: int = MIN_SM) -> tuple[int, ...]:
    """Every supported SM the kernels can run on (`tuner compile --sm all`)."""
    return tuple(sm for sm in supported_sms() if sm >= min_sm)


def _nvrtc_name() -> str:
    return "NVRTC {}.{}".format(*nvrtc_version())


def arch_for_sm(sm: int, supported: tuple[int, ...] | None = None) -> str:
    """The -arch of an exact target: sm_XXXa where the kernels need it, sm_XXX elsewhere.
    Raises UnsupportedArch, naming what the installed NVRTC knows, when it cannot build `sm`."""
    supported = supported_sms() if supported is None else supported
    if sm not in supported:
        newer = " (a newer nvidia-cuda-nvrtc wheel may know it: pip install -U nvidia-cuda-nvrtc)" \
            if sm > max(supported, default=0) else ""
        raise UnsupportedArch(f"{_nvrtc_name()} cannot compile for SM {sm}; it knows "
                              f"{', '.join(map(str, supported))}{newer}")
    return f"sm_{sm}a" if sm in ARCH_SPECIFIC_SMS else f"sm_{sm}"


@dataclass(frozen=True)
class DeviceTarget:
    """How a GPU of SM `device_sm` gets its code: a cubin for its exact arch, or PTX of a lower
    compute capability that the driver JIT-compiles at load time."""

    device_sm: int
    arch: str  # NVRTC -arch: "sm_90a", "sm_107" (cubin) or "compute_121" (PTX)

    @property
    def ptx(self) -> bool:
        return self.arch.startswith("compute_")

    @property
    def code_sm(self) -> int:
        """The SM the code is built for: the device's own, or the PTX's compute capability."""
        return int(self.arch.split("_")[1].rstrip("a"))

    def describe(self) -> str:
        if self.ptx:
            return (f"SM {self.device_sm} is not a target of this NVRTC: running PTX for "
                    f"{self.arch}, JIT-compiled by the driver")
        return f"SM {self.device_sm}: cubins compiled for {self.arch}"


def device_target(device_sm: int, supported: tuple[int, ...]) -> DeviceTarget:
    """Pure: the exact arch when NVRTC supports `device_sm`, else PTX of the highest supported
    compute capability not above it (plain compute_XX: arch-specific PTX runs on its own SM
    only). Raises UnsupportedArch for a GPU below every usable target."""
    below = [sm for sm in supported if MIN_SM <= sm <= device_sm]
    if not below:
        raise UnsupportedArch(f"SM {device_sm} GPU: the kernels need SM {MIN_SM} or newer, and "
                              f"this NVRTC targets {', '.join(map(str, supported))}")
    if device_sm in supported:
        return DeviceTarget(device_sm, arch_for_sm(device_sm, supported))
    return DeviceTarget(device_sm, f"compute_{max(below)}")


def code_sm(device_sm: int) -> int:
    """The SM whose code a GPU of SM `device_sm` runs (see device_target): its own where this
    NVRTC builds for it, else the compute capability of the PTX the driver JITs. `device_sm`
    itself where that cannot be decided (no NVRTC here, or a GPU below every target). Never
    raises: the runtime picks per-SM defaults with it (kernels.cupy_backend.sm_budget)."""
    try:
        return device_target(device_sm, supported_sms()).code_sm
    except Exception:  # CompileError, or a libnvrtc that cannot be loaded
        return device_sm


@functools.cache
def _announce(target: DeviceTarget) -> None:
    """Say once per process how a device SM is served; PTX (slower first load) as a warning."""
    if target.ptx:
        warnings.warn(target.describe(), RuntimeWarning, stacklevel=3)
    else:
        log.info(target.describe())


def compile_for_device(source: str, defines: dict[str, int | str], device_sm: int,
                       **kwargs) -> CompileResult:
    """Compile `source` for a GPU of SM `device_sm` (see device_target); the route is said once."""
    target = device_target(device_sm, supported_sms())
    _announce(target)
    return compile_cubin(source, defines, target.arch, **kwargs)


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
def toolchain_identity(include_dir: str) -> list:
    """What else the compiled bytes depend on: the toolkit the include path resolves to (a
    /usr/local/cuda link moved to another toolkit keeps its path) and the NVRTC wheel's full
    version (nvrtcVersion() gives major.minor only)."""
    from importlib import metadata

    wheels = []
    for name in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
        try:
            wheels.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return [os.path.realpath(include_dir), wheels]


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
    """Compile ``kernels/cuda/<source>`` for ``arch`` (e.g. "sm_90a"); cached by content hash.
    A virtual arch ("compute_121") gives PTX (no ptxas, so no resources); `cubin_path` is then
    the .ptx file, which the driver loads the same way."""
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
        [_digest(sources), nvrtc_version(), source, options[:1] + options[4:], header_identity,
         toolchain_identity(inc)]
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    stem = f"{src_path.stem}-{arch}-{key}"
    ptx = arch.startswith("compute_")
    cubin_path = cache_dir() / f"{stem}.{'ptx' if ptx else 'cubin'}"
    meta_path = cache_dir() / f"{stem}.json"
    if cubin_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        res = {k: KernelResources(**v) for k, v in meta["resources"].items()}
        return CompileResult(cubin_path, arch, options, res, meta["seconds"], cached=True,
                             log=meta.get("log", ""))

    nvrtc = _nvrtc()
    t0 = time.perf_counter()
    err, prog = nvrtc.nvrtcCreateProgram(sources[source], str(src_path).encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        log = _program_log(prog)
        _check(err, f"NVRTC compile of {source} for {arch} with {defines}", log)
        get_size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx
                         else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
        err, size = get_size(prog)
        _check(err, get_size.__name__)
        buf = b" " * size
        (err,) = get(prog, buf)
        _check(err, get.__name__)
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
    return CompileResult(cubin_path, arch, options, resources, seconds, cached=False, log=log)


def _program_log(prog) -> str:
    nvrtc = _nvrtc()
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00")
