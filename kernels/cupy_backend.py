"""The `cupy` backend: hand-written CUDA C++ (kernels/cuda/drafter_attention.cu) compiled with
NVRTC, loaded through CuPy and launched through the driver (kernels/launch.py) on torch's current
stream, on the torch tensors themselves.

Plan, then run (as FlashInfer splits them): the first call of a shape validates its arguments,
picks parameters and the split count, loads the variant and packs the kernel arguments (a
`DrafterParams` struct, kernels/cuda/params.cuh, passed field by field). Every later call of that
shape is a lookup (one C++ check of the tensors against the last call of the same form,
kernels/guards.py; else the plan key), the pointers and one driver launch of the call's kernels
as a graph (kernels/launch.py, its tail in C where kernels/native.py can build it; inside a
stream capture, one launch per kernel). Nothing reads a device
value, so a step runs under ``torch.cuda.set_sync_debug_mode("error")`` and captures into a CUDA
graph; data-dependent work (which tiles a request reads, where a split starts) is decided on the
device from ``ctx_lens``.
`DRAFTER_CHECKS=0` shortens the plan key to what the plan depends on, so calls whose tensors
differ in other ways are no longer rejected (serving, once inputs are known to be right).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import os
import struct
import threading
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from drafter_attn.kernels import contract
from drafter_attn.kernels.footprint import partial_elems
from drafter_attn.kernels.guards import RecentPlans
from drafter_attn.kernels.launch import Launch, LaunchGraph, capturing
from drafter_attn.kernels.nvrtc import compile_for_device
from drafter_attn.kernels.spec import Problem
from drafter_attn.kernels.tma import TmaMap

SOURCE = "drafter_attention.cu"
HEAD_DIMS = (64, 128)
PAGE_SIZES = tuple(2**k for k in range(3, 9))  # 8 .. 256
MAX_ROWS = 256  # Qb * G rows packed per CTA: 16 warps of 16 rows
MASK_CODE = {"full": 0, "sliding": 1, "sliding_causal": 2}
SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per block on SM90/SM100
SMEM_PER_SM = 228 * 1024
REGS_PER_SM = 65536
MAX_BATCH = 65535  # requests a call: the attention grid's z and the store grid's y dimension


@dataclass(frozen=True)
class Params:
    """Tunable knobs. `num_splits=0` means: pick from the batch, heads and the planned context
    (the capacity, or the caller's `max_ctx` hint; device-side balancing spreads the actual
    context over the splits). `q_smem` keeps Q in shared memory
    instead of registers (for CTAs of many warps, whose per-thread register budget is small).
    `wgmma` (sm_90a only) computes both products with warpgroup MMAs; None = wherever it runs
    as is (whole warpgroups, whole-warp tile loads: `wgmma_fits`); True also pads other CTAs of
    up to 12 warps to whole warpgroups (`wgmma_reason`; laguna's 9 warps run as 12).
    `overlap` (sm_90a wgmma path only) software-pipelines the tiles: S = QK^T of the next tile
    runs on the tensor cores while this tile's softmax runs, with one V stage more; 1 issues the
    next loads under that S, 2 under P.V (kernels/cuda/drafter_attention.cu, OVERLAP). The
    defaults take 2 wherever the wgmma path runs (`DEFAULT_OVERLAP`), 0 elsewhere."""

    tile_n: int = 64
    stages: int = 3
    num_splits: int = 0
    q_smem: bool = False
    wgmma: bool | None = None
    min_ctas: int = 1  # occupancy the compiler must fit (caps registers per thread)
    skip_compute: bool = False  # diagnostic: loads only, output is garbage (never a default)
    skip_loads: bool = False  # diagnostic: math only, on whatever the stages hold (never a default)
    overlap: int = 0  # 0 off; 1, 2: next tile's S = QK^T under this tile's softmax (sm_90a wgmma;
    # default_params turns it on wherever that path runs)
    tma: bool = False  # pipelined wgmma path only: context tiles by TMA bulk tensor copies, issued
    # by lane 0 of up to every warp, landing on shared-memory barriers (kernels/tma.py; `tma_reason`)
    combine: int = 1  # the split combine: 1 one warp a row, 2 a CTA of 4 warps a row with the
    # splits dealt over its warps (kernels/cuda/combine_store.cuh, COMBINE_CTA); default_params
    # picks 2 up to COMBINE_CTA_MAX_ROWS packed rows a call
    row_split: int = 1  # CTAs a (request, KV head, split) deals its Qb*G packed rows over, each
    # reading the same K/V (the others from L2): laguna's 144 rows as 3 one-warpgroup CTAs of 48
    # (`num_warps`, drafter_attention.cu ROW_SPLIT; `row_split_reason`)
    lean: bool = False  # fewer instructions a tile: a cp.async context tile's copies from one base
    # address (pages of a tile or more, the arena), and the softmax scale folded into exp2's FMA
    # (drafter_attention.cu LEAN); with `ws`, the consumers' tile loop: descriptors made once,
    # masking behind one branch, O rescaled only when a row's max moves (warp_specialized.cuh)
    ctas_per_sm: int = 0  # CTAs an SM the split model plans a wave with: 0 as many as fit, else at
    # most this many (host only: one CTA an SM gives each CTA more tiles; `plan_splits`)
    ws: int = 0  # warp-specialised (sm_90a) with this many consumer warpgroups (2-4; 0 off):
    # one CTA an SM, a producer warpgroup that issues every context tile's TMA copies, and the
    # consumers, which take the tiles in turn and merge at the end
    # (kernels/cuda/warp_specialized.cuh; `ws_reason`)
    trim: bool = False  # the software-pipelined wgmma path's tile loop trimmed as ws's lean one:
    # descriptors advanced by offsets, the mask behind one branch a tile, O rescaled only when a
    # row's max moves by more than 2^8 (drafter_attention.cu TRIM; `trim_reason`)
    early_ids: bool = False  # ws only: the producer copies a split's first page ids before the
    # context length lands, planned for a context that fills the table, and keeps them where the
    # real share starts among them: one round trip fewer before the first tiles (warp_specialized.cuh
    # EARLY_IDS; `ws_knobs_reason`)
    ws_rows: bool = False  # ws only: the consumers deal the CTA's rows (each at most 64) instead of
    # the tiles, all reading every tile once, each storing its own rows (laguna's 144 as 3 x 48 in
    # one CTA, where row_split reads each tile once a CTA; warp_specialized.cuh WS_ROWS; `ws_reason`)
    ws_overlap: bool = False  # ws only: a consumer's P V of one tile issued with the S = Q K^T of
    # its next and run under that tile's softmax, holding two stages (warp_specialized.cuh
    # WS_OVERLAP; `ws_knobs_reason`)
    q_step: bool = False  # ws only: each thread's Q copies addressed by a constant step a row
    # instead of a division by the group a row: about 200 straight-line instructions a thread
    # instead of a loop of about 480 (warp_specialized.cuh Q_STEP; `ws_knobs_reason`)
    one_trip: bool = False  # the split combine (either `combine`) reads its rows' lse values and
    # each warp's first 4 partial rows in one round trip (16 splits a CTA a row, 4 a warp a row;
    # then 4 a trip), the weights made once both have landed, and addresses its output in 32-bit
    # divisions (combine_store.cuh COMBINE_ONE_TRIP)
    pair: bool = False  # ws only: splits 2j and 2j + 1 run as one cluster of two CTAs that merge
    # their rows at the end through shared memory, each sending the other the half of the rows
    # it keeps (st.async) and storing its own half, so only the pairs' partials (none at two
    # splits: no combine kernel) go through L2; an even split count (warp_specialized.cuh
    # WS_PAIR; `ws_knobs_reason`)

    @property
    def tensor_maps(self) -> bool:
        """Whether the variant reads its context tiles through TMA tensor maps (`tma`, `ws`)."""
        return self.tma or bool(self.ws)

    def smem_bytes(self, head_dim: int, warps: int, wgmma: bool = False,
                   page_size: int | None = None) -> int:
        """`warps`: the CTA's 16-row warps; Q in shared memory holds 16 rows a warp, of whole
        warpgroups on the wgmma path (`padded_warps`). `page_size` (None: the arena) adds the
        pipelined path's page-id ring where it has one."""
        if self.ws:
            return ws_bytes(self.tile_n, self.stages, head_dim, self.ws, self.early_ids,
                            self.ws_rows, self.pair)
        return pipelined_bytes(self.tile_n, self.stages, head_dim,
                               padded_warps(warps) if wgmma else warps, wgmma, self.overlap,
                               self.q_smem, page_size, self.lean, self.tma)


def smem_bytes(tile_n: int, stages: int, head_dim: int, q_warps: int = 0,
               wgmma: bool = False, overlap: int = 0) -> int:
    """K and V stages (rows padded by 16 bytes for ldmatrix, unpadded core matrices for wgmma;
    `overlap` keeps one V stage more than K stages), plus Q rows (padded) when Q lives in shared
    memory."""
    kv_row = head_dim if wgmma else head_dim + 8
    kv_tiles = 2 * stages + (1 if overlap else 0)
    return kv_tiles * tile_n * kv_row * 2 + 16 * q_warps * (head_dim + 8) * 2


def id_ring_bytes(tile_n: int, stages: int, head_dim: int, warps: int, page_size: int | None,
                  overlap: bool, lean: bool = False) -> int:
    """Shared memory of the page-id ring of the pipelined wgmma path at pages smaller than a
    tile (drafter_attention.cu, ID_RING): STAGES + 1 slots of `warps` x PG ids, PG the page ids
    a warp's rows of a tile span (its `PG`: rows a warp loads per 64-column half over the page
    size where the warps divide the tile's 4-row quads, else one per load iteration). `lean`
    (LEAN) takes the ring at pages of a tile or more too, one id a warp."""
    if not (overlap and page_size and (page_size < tile_n or lean)):
        return 0
    if page_size >= tile_n:
        pg = 1
    elif (tile_n // 4) % warps == 0:
        pg = max(1, tile_n // warps // page_size)
    else:
        pg = -(-tile_n * head_dim // 8 // (warps * 32))
    return (stages + 1) * warps * pg * 4


def pipelined_bytes(tile_n: int, stages: int, head_dim: int, warps: int, wgmma: bool,
                    overlap: int, q_smem: bool, page_size: int | None, lean: bool,
                    tma: bool) -> int:
    """Shared memory of the kernels other than ws (drafter_attention.cu's layout) for a CTA of
    `warps` warps as compiled: the stages (`smem_bytes`), the page-id ring (`id_ring_bytes`) and
    the TMA barriers and page ids (`tma_bytes`). The planner (`Params.smem_bytes`) and the
    loader (`module_smem`) both count it here."""
    return (smem_bytes(tile_n, stages, head_dim, warps if q_smem else 0, wgmma, overlap)
            + id_ring_bytes(tile_n, stages, head_dim, warps, page_size,
                            wgmma and bool(overlap) and not tma, lean)
            + (tma_bytes(stages, warps) if tma else 0))


def tma_bytes(stages: int, warps: int) -> int:
    """Shared memory of the TMA path beside the stages: one 8-byte barrier per stage and, for
    each warp that issues copies (at most `warps`), two chunks of 16 page ids
    (drafter_attention.cu, TMA_LOADS: ISSUERS, IDS)."""
    return stages * 8 + warps * 2 * 16 * 4


def ws_bytes(tile_n: int, stages: int, head_dim: int, consumers: int,
             early_ids: bool = False, ws_rows: bool = False, pair: bool = False) -> int:
    """Shared memory of the warp-specialised kernel (`ws`, warp_specialized.cuh): the K and V
    stages, the Q stage (64 rows; with `ws_rows` one a consumer), a full and an empty barrier a
    stage and Q's, 2 KB for the row maxima and sums each consumer but the first hands it (their O
    goes through their last stages), with `early_ids` the 64 page ids the producer copies
    first, and with `pair` the pair's barrier and the buffer the peer CTA writes the 32 rows this
    one keeps into (fp32 O, maxima and sums: head_dim / 8 + 1 float4 for each of 64 threads)."""
    q_stages = consumers if ws_rows else 1
    return (2 * stages * tile_n * head_dim * 2 + q_stages * 64 * head_dim * 2 + stages * 16 + 8
            + (consumers - 1) * 4 * 128 * 4 + (64 * 4 if early_ids else 0)
            + (8 + (head_dim // 8 + 1) * 64 * 16 if pair else 0))


def ws_threads(consumers: int) -> int:
    """Threads of the warp-specialised CTA: a producer warpgroup and the consumers."""
    return 128 * (1 + consumers)


# its default stages: 6 x 32 KB of 64-key head_dim-128 K/V tiles in flight an SM (a multiple of
# 2 and of 3 consumers)
WS_STAGES = 6
# Four consumers (`ws=4`) hold their O at 112 registers a thread only beside 32-key tiles' scores;
# 12 stages of 32 keys keep the same 192 KB in flight as 6 of 64.
WS4_TILE = dict(tile_n=32, stages=12)
# The deepest cp.async / TMA pipeline of the other paths (and of the CuTe backend): built and
# GPU-tested up to 8 stages; the registry's range goes to 12 for the warp-specialised kernel.
PIPELINE_MAX_STAGES = 8


def num_warps(block_size: int, group: int, wgmma: bool = False, row_split: int = 1) -> int:
    """16 packed query rows per warp, and at least 4 warps so loads keep enough bytes in flight.
    On the wgmma path whole warpgroups (64-row M tiles): `padded_warps` of that count. With
    `row_split` a CTA holds ceil(Qb*G / row_split) of the rows."""
    warps = max(4, -(-cta_rows(block_size, group, row_split) // 16))
    return padded_warps(warps) if wgmma else warps


def cta_rows(block_size: int, group: int, row_split: int = 1) -> int:
    """Packed query rows one CTA holds: all Qb*G of its (request, KV head), or its share of them
    when `row_split` CTAs deal them (the last one may hold fewer)."""
    return -(-block_size * group // row_split)


def row_split_reason(block_size: int, group: int, row_split: int) -> str | None:
    """Why the rows of a (request, KV head) cannot be dealt over `row_split` CTAs (None when
    they can): every CTA must get at least one row."""
    rows = block_size * group
    if row_split < 1:
        return f"row_split={row_split}: at least 1"
    if row_split > 1 and (row_split - 1) * cta_rows(block_size, group, row_split) >= rows:
        return (f"row_split={row_split} leaves a CTA without rows (Qb*G = {rows} rows, "
                f"{cta_rows(block_size, group, row_split)} a CTA)")
    return None


def padded_warps(warps: int) -> int:
    """The warps of a wgmma CTA for `warps` 16-row warps: whole warpgroups (9 -> 12: laguna's
    144 rows run as 3 x 64 row slots, the last 48 zero rows that are never stored). The same
    count wherever `warps` is a multiple of 4, so those variants do not change."""
    return -(-warps // 4) * 4


def wgmma_fits(head_dim: int, warps: int, tile_n: int) -> bool:
    """Shapes the wgmma path takes by default (`wgmma=None`): whole warpgroups, whole warps per
    tile load (every thread loads the same number of chunks)."""
    return (warps % 4 == 0 and tile_n in (32, 64, 128) and head_dim in (64, 128)
            and (tile_n * head_dim // 8) % (warps * 32) == 0)


# Warps the wgmma path takes when forced (`wgmma=True`) with padding or a predicated last
# tile-load iteration: at most 3 warpgroups (384 threads, 168 registers a thread). A 16-warp CTA
# gets 128 registers a thread; it keeps the wgmma path only where `wgmma_fits` (as before).
MAX_PADDED_WARPS = 12


def wgmma_reason(head_dim: int, warps: int, tile_n: int) -> str | None:
    """Why `wgmma=True` cannot compile for a CTA of `warps` 16-row warps (None when it can).
    Beyond `wgmma_fits`' shapes the kernel takes rows padded to whole warpgroups (laguna's 9
    warps run as 12) and chunk counts the thread count does not divide (a predicated last load
    iteration), up to MAX_PADDED_WARPS."""
    if wgmma_fits(head_dim, warps, tile_n):
        return None
    if tile_n not in (32, 64, 128) or head_dim not in (64, 128):
        return (f"the wgmma path needs tile_n 32/64/128 and head_dim 64/128 (tile_n={tile_n}, "
                f"head_dim={head_dim})")
    if padded_warps(warps) > MAX_PADDED_WARPS:
        return (f"{warps} warps ({padded_warps(warps)} on the wgmma path) with {tile_n}-key "
                f"tiles of head_dim {head_dim} leave some threads a load more than others, "
                f"which the wgmma path takes for at most {MAX_PADDED_WARPS} warps (beyond them "
                f"a thread gets 128 registers; not built)")
    return None


def use_wgmma(params: Params, head_dim: int, warps: int, sm: int) -> bool:
    """Whether a variant takes the sm_90a wgmma path; `warps` are the CTA's 16-row warps
    (`num_warps` without wgmma). `wgmma=None` takes it where `wgmma_fits`; `wgmma=True` also
    where `wgmma_reason` allows it (rows padded to whole warpgroups), else ValueError."""
    if params.wgmma is None:
        wgmma = sm == 90 and wgmma_fits(head_dim, warps, params.tile_n)
    elif params.wgmma and (sm != 90 or wgmma_reason(head_dim, warps, params.tile_n)):
        raise ValueError(f"wgmma=True needs sm_90 and a fitting shape (sm={sm}, "
                         f"head_dim={head_dim}, warps={warps}, tile_n={params.tile_n}"
                         f"{'' if sm != 90 else ': ' + wgmma_reason(head_dim, warps, params.tile_n)})")
    else:
        wgmma = params.wgmma
    if params.overlap and not wgmma:
        raise ValueError(f"overlap={params.overlap} pipelines the sm_90a wgmma path, which this "
                         f"variant does not take (sm={sm}, wgmma={params.wgmma}, "
                         f"head_dim={head_dim}, warps={warps}, tile_n={params.tile_n})")
    return wgmma


def overlap_reason(params: Params, head_dim: int, warps: int,
                   sm: int | None = None) -> str | None:
    """Why `params.overlap` cannot apply to this shape on a GPU of SM `sm` (None when it can, or
    is off). Without an SM only the shape is checked: off sm_90, variant_defines then refuses
    overlap (ValueError)."""
    if not params.overlap:
        return None
    if sm is not None and sm != 90:
        return (f"overlap={params.overlap} needs the sm_90a wgmma path, which SM {sm} does not "
                f"have")
    if params.wgmma is not None and not params.wgmma:  # False, or 0 from a spec
        return (f"overlap={params.overlap} pipelines the wgmma path; wgmma=0 (mma.sync) has no "
                f"overlap variant")
    if params.wgmma and wgmma_reason(head_dim, warps, params.tile_n) is None:
        return None  # forced onto the (padded) wgmma path, which has an overlap variant
    if not wgmma_fits(head_dim, warps, params.tile_n):
        return (f"overlap={params.overlap} needs the sm_90a wgmma path, which this shape does not "
                f"take ({warps} warps, head_dim {head_dim}, tile_n {params.tile_n}: it needs whole "
                f"warpgroups, tile_n 32/64/128 and whole-warp tile loads)")
    return None


def tma_reason(params: Params, head_dim: int, warps: int, sm: int | None = None) -> str | None:
    """Why `params.tma` cannot apply (None when it can, or is off): TMA feeds the pipelined
    sm_90a wgmma path (`overlap` 1 or 2) with Q in registers."""
    if not params.tma:
        return None
    if sm is not None and sm != 90:
        return f"tma=1 needs sm_90a bulk tensor copies, which SM {sm} does not have"
    if not params.overlap:
        return "tma=1 feeds the pipelined wgmma path: it needs overlap=1 or 2"
    if params.q_smem:
        return "tma=1 keeps Q in registers: q_smem=1 has no TMA variant"
    return overlap_reason(params, head_dim, warps, sm)


def trim_reason(params: Params, head_dim: int, warps: int, sm: int | None = None) -> str | None:
    """Why `params.trim` cannot apply (None when it can, or is off): it trims the software-
    pipelined wgmma path's loop (`overlap` 1 or 2); ws has its own (`lean`)."""
    if not params.trim:
        return None
    if params.ws:
        return "trim=1 trims the pipelined wgmma path; ws trims its consumers' loop with lean"
    if not params.overlap:
        return "trim=1 trims the software-pipelined wgmma path: it needs overlap=1 or 2"
    return overlap_reason(params, head_dim, warps, sm)


def ws_knobs_reason(params: Params) -> str | None:
    """Why `params.early_ids`, `params.ws_rows`, `params.ws_overlap`, `params.q_step` or
    `params.pair` cannot apply (None when they can, or are off): all are the warp-specialised
    kernel's (ws_overlap on its lean loop; pair on its one-CTA rows, an even split count)."""
    if params.early_ids and not params.ws:
        return "early_ids=1 is the warp-specialised producer's (ws=2..4)"
    if params.ws_rows and not params.ws:
        return "ws_rows=1 deals rows over the warp-specialised kernel's consumers (ws=2..4)"
    if params.q_step and not params.ws:
        return "q_step=1 addresses the warp-specialised kernel's Q copies (ws=2..4)"
    if params.ws_overlap and not params.ws:
        return "ws_overlap=1 pipelines the warp-specialised kernel's consumers (ws=2..4)"
    if params.ws_overlap and not params.lean:
        return "ws_overlap=1 pipelines the lean consumer loop: it needs lean=1 (ws's default)"
    if params.pair and not params.ws:
        return "pair=1 merges split pairs of the warp-specialised kernel (ws=2..4)"
    if params.pair and (params.ws_rows or params.row_split != 1):
        return "pair=1 hands a split's rows over in one CTA: not with ws_rows or row_split"
    if params.pair and params.num_splits % 2:
        return f"pair=1 runs the splits in pairs: num_splits={params.num_splits} is odd"
    if params.ws_overlap and params.ws == 4:
        # ptxas: 80-116 bytes spilled and every wgmma serialised for want of registers
        return "ws_overlap=1 holds a second tile's P, for which four consumers' 112 registers are too few"
    return None


def ws_reason(params: Params, head_dim: int, warps: int, sm: int | None = None) -> str | None:
    """Why `params.ws` cannot apply (None when it can, or is off): 2-4 consumers, sm_90a,
    consumers of one warpgroup (at most 64 packed rows a CTA, `row_split` dealing more; with
    `ws_rows` 64 a consumer, all in one CTA), wgmma tiles, stages a multiple of the consumers
    (with 32-key tiles two a consumer, which its hand-over of O needs; `ws_rows` has neither);
    its loads and its Q stage are its own, so none of the pipelined path's knobs (q_smem,
    overlap, tma); `lean` has a ws meaning of its own."""
    if not params.ws:
        return None
    if params.ws not in (2, 3, 4):
        return f"ws={params.ws}: 2, 3 or 4 consumer warpgroups (0: off)"
    if sm is not None and sm != 90:
        return f"ws needs sm_90a (TMA, wgmma, setmaxnreg), which SM {sm} does not have"
    if params.ws_rows and params.row_split != 1:
        return f"ws_rows=1 holds all of a split's rows in one CTA: row_split={params.row_split}"
    if params.ws_rows and warps > 4 * params.ws:
        return (f"ws_rows=1 gives each of the {params.ws} consumers at most 64 packed query rows "
                f"(this CTA has {warps} 16-row warps)")
    if not params.ws_rows and warps != 4:
        return (f"ws takes at most 64 packed query rows a CTA (this one has {warps} 16-row "
                f"warps); row_split deals more over CTAs, ws_rows over the consumers")
    if params.wgmma is not None and not params.wgmma:
        return "ws runs on wgmma: wgmma=0 has no warp-specialised variant"
    if params.tile_n not in (32, 64, 128) or head_dim not in (64, 128):
        return f"ws needs tile_n 32-128 and head_dim 64/128 (tile_n={params.tile_n})"
    if not params.ws_rows and (params.stages < params.ws or params.stages % params.ws):
        return (f"ws={params.ws} needs stages a multiple of its {params.ws} consumers "
                f"(stages={params.stages})")
    if not params.ws_rows and params.tile_n == 32 and params.stages < 2 * params.ws:
        # a consumer hands its 64 x head_dim fp32 O to the first through its K/V stages
        return (f"ws with 32-key tiles needs two stages a consumer for the hand-over "
                f"(stages={params.stages}, ws={params.ws})")
    if params.q_smem or params.overlap or params.tma:
        return "ws loads its own tiles: q_smem, overlap and tma do not combine with it"
    return None


# --------------------------------------------------------------------------------------------
# per-SM defaults


@dataclass(frozen=True)
class SmBudget:
    """What one SM target gives a CTA, and the K/V pipeline its default variants of 4-8 warps
    use. Shared memory as the CUDA C++ Programming Guide's "Technical Specifications per
    Compute Capability" states it: the opt-in maximum per block and the total per SM."""

    smem_block: int  # bytes of dynamic shared memory one CTA may opt in to
    smem_sm: int  # bytes of shared memory per SM (resident CTAs, split planning)
    tile_n: int = 64  # keys per K/V stage
    stages: int = 3


_KB = 1024
_BIG, _MID, _SMALL = (227 * _KB, 228 * _KB), (163 * _KB, 164 * _KB), (99 * _KB, 100 * _KB)

# The per-SM defaults: the one place where default parameters differ by SM target (every SM
# NVRTC 13.5 targets from 80 up). Chosen from the static profile (`tuner compile --sm all`:
# registers, spills, shared memory of each default variant; docs/design.md, "Kernel design"):
# - 90, 100, 103: 64-key tiles in 3 stages, tuned on the H200 (sm_90a runs them on wgmma).
#   sm_100/103 compile the 4-warp head_dim-128 variant at 255 registers, no spills.
# - 107, 110: their ptxas spills that variant (32-100 bytes at 255 registers); 32-key tiles in
#   6 stages keep the same 192 K/V rows in flight at 224-238 registers.
# - 86, 88, 89, 120, 121: 99 KB a CTA, where 64 x 3 stages of head_dim 128 need 102 KB; 32 x 5
#   (85 KB) fits, at 224-238 registers on sm_120/121 (whose ptxas also spills 64-key tiles).
# - 80, 87: 163 KB a CTA; the SM 8x ptxas keeps 64-key tiles within 234 registers.
# SM 107's shared memory is taken as SM 100's (the Programming Guide's table predates it).
# CTAs of more than 8 warps use 16-key tiles in 6 stages with Q in shared memory (89 KB) on
# every target but SM 90, which pads up to 12 warps to 3 warpgroups (`default_params`).
SM_BUDGETS = {
    80: SmBudget(*_MID), 86: SmBudget(*_SMALL, 32, 5), 87: SmBudget(*_MID),
    88: SmBudget(*_SMALL, 32, 5), 89: SmBudget(*_SMALL, 32, 5),
    90: SmBudget(*_BIG), 100: SmBudget(*_BIG), 103: SmBudget(*_BIG),
    107: SmBudget(*_BIG, 32, 6), 110: SmBudget(*_BIG, 32, 6),
    120: SmBudget(*_SMALL, 32, 5), 121: SmBudget(*_SMALL, 32, 5),
}
# OVERLAP of the default variants where the sm_90a wgmma path runs (0 elsewhere)
DEFAULT_OVERLAP = 2
# From this batch up, SM 90's pipelined defaults load context tiles by TMA (`tma`): H200, main
# preset, same-run medians, cp.async / TMA: B=32 ctx 8k page 64 281.8 / 261.2 us, page 128
# 280.8 / 258.9, B=8 ctx 32k 285.8 / 262.8, B=8 ctx 8k 81.7 / 81.7; below it TMA's longer start
# costs more than it saves (B=1 ctx 2k 18.4 / 19.2, 8k 26.9 / 28.3; results/perf-notes.md,
# "Context tiles by TMA").
TMA_MIN_BATCH = 8
# ... and below it from this planned context up, where a split streams many tiles: B=1 ctx 128k
# took 139.8-140.5 us a layer by TMA against 149.2-150.5 by cp.async (main preset, pages 16-128
# and the arena; gpt-oss 83.0-84.7 against 90.0-95.1; the sm90 profile, profiles/README.md).
TMA_MIN_CTX = 131072
# ... except at pages below TMA_MIN_PAGE, where a tile is 32 boxes of 1 KB (main preset, page 8:
# 1.05-1.38x the arena by TMA, 1.02-1.05x by cp.async), and below TMA_MIN_PAGE_D64 with head_dim
# 64 (gpt-oss-20b-dflash at page 16: 1.01-1.04x the cp.async time by TMA from batch 8 up, once a
# tile's copies were dealt over the warps; 1.16-1.28x before; profiles/README.md).
TMA_MIN_PAGE = 16
TMA_MIN_PAGE_D64 = 32
# CTAs of more than 8 warps: Q in shared memory, 16-key tiles in 6 stages (mma.sync; every SM but
# SM 90, which pads them to warpgroups: PADDED_WGMMA).
MANY_WARPS = dict(tile_n=16, stages=6, q_smem=True)
# The same CTAs on the sm_90a wgmma path (SM 90's default, and `wgmma=True`: 9-12 warps padded
# to 3 warpgroups, 384 threads, at most 168 registers a thread for one CTA per SM). ptxas -v, NVRTC
# 13.5, laguna (head_dim 128, page 64): 32-key tiles with Q in registers 157 registers, no spill,
# at 3-8 stages (and 152 at head_dim 64); 64-key tiles spill 24 bytes (Q in registers) or 104
# (Q in shared memory), the pipelined variants (overlap 1/2) 28-336. One CTA per SM either way
# (registers), so shared memory is free to spend on depth: 8 stages keep 7 x 32 keys (112 KB of
# K and V) in flight. SM 90's default for these CTAs (`_padded_wgmma`; results/perf-notes.md,
# "GQA 9 on the wgmma path").
PADDED_WGMMA = dict(tile_n=32, stages=8, q_smem=False)
# An SM the table does not name (a target of a newer NVRTC): the smallest budget of any.
UNKNOWN_SM_BUDGET = SmBudget(*_SMALL, 32, 5)
# No SM given (a problem described without a GPU): SM 90's, the measured defaults.
NO_SM = 90


def sm_budget(sm: int | None) -> SmBudget:
    """The budget of the code a GPU of SM `sm` runs: its own SM's where NVRTC builds for it,
    else that of the PTX's compute capability (nvrtc.code_sm: SM 999 runs compute_121 PTX with
    NVRTC 13.5, so it gets SM 121's budget). Never raises."""
    from drafter_attn.kernels.nvrtc import code_sm

    return SM_BUDGETS.get(code_sm(NO_SM if sm is None else sm), UNKNOWN_SM_BUDGET)


def sm_defaults(params_cls, many_warps: dict, problem: Problem | None, sm: int | None,
                overrides: dict):
    """A kernel family's default `params_cls` on a GPU of SM `sm`: CTAs of 4-8 warps take the
    K/V pipeline of `sm_budget(sm)` (64-key tiles, as SM 90 runs, where the block's own keys
    would not fit one tile), CTAs of more warps `many_warps` on every SM; then stages come off
    (down to 2) until the padded stages fit the shared memory a CTA gets on that SM (at least
    what a wgmma variant needs); `overrides` last."""
    budget = sm_budget(sm)
    base = params_cls(tile_n=budget.tile_n, stages=budget.stages)
    if problem is not None:
        g = problem.geometry
        warps = num_warps(g.block_size, g.group, row_split=overrides.get("row_split", 1))
        if warps > 8:
            base = params_cls(**many_warps)
        elif g.block_size > base.tile_n:
            base = params_cls()
        while base.stages > 2 and base.smem_bytes(g.head_dim, warps) > budget.smem_block:
            base = dataclasses.replace(base, stages=base.stages - 1)
    return dataclasses.replace(base, **overrides)


def _padded_wgmma(problem: Problem, sm: int | None, overrides: dict) -> bool:
    """Whether a CTA of 9-12 warps takes the padded wgmma path: when asked (`wgmma=True`), and by
    default on SM 90 wherever the path takes the shape (H200, laguna B=8-32: 10-19% faster than
    the 9-warp mma.sync variant; results/perf-notes.md, "GQA 9 on the wgmma path")."""
    g = problem.geometry
    warps = num_warps(g.block_size, g.group, row_split=overrides.get("row_split", 1))
    if not 8 < warps <= MAX_PADDED_WARPS:
        return False
    if "wgmma" in overrides:
        return bool(overrides["wgmma"])
    tile_n = overrides.get("tile_n", PADDED_WGMMA["tile_n"])
    # the device itself must be SM 90: wgmma is sm_90a code, which PTX JIT-compiled for
    # another chip (code_sm 90 on a GPU NVRTC does not know) cannot hold
    return ((NO_SM if sm is None else sm) == 90
            and wgmma_reason(g.head_dim, warps, tile_n) is None)


def _row_split_default(problem: Problem, sm: int | None, overrides: dict) -> int:
    """SM 90's `row_split` for CTAs of 9-12 warps (laguna's 144 rows, GQA 12's 192): the rows
    dealt over ceil(rows / 64) CTAs of one warpgroup, which take the pipelined path the main
    preset runs (two CTAs an SM) instead of the padded one (3 warpgroups, one CTA an SM). H200,
    laguna, page 64 / arena, same run: B=8 ctx 8k 29.0 / 30.1 -> 24.4 / 24.1 us, B=32 ctx 8k-32k
    71.2-71.5 -> 63.2-63.9, B=1 ctx 8k 18.7 / 18.2 -> 17.9 / 18.3 (results/perf-notes.md, "GQA 9
    as three one-warpgroup CTAs"). 1 (no split) wherever a parameter names the path (`wgmma`,
    `row_split`), off SM 90, and where the one-warpgroup CTA would not take the wgmma path."""
    g = problem.geometry
    if "row_split" in overrides or "wgmma" in overrides or (NO_SM if sm is None else sm) != 90:
        return 1
    warps = num_warps(g.block_size, g.group)
    if not 8 < warps <= MAX_PADDED_WARPS:
        return 1
    rs = padded_warps(warps) // 4  # a CTA for each warpgroup the padded path would run
    tile_n = overrides.get("tile_n", sm_budget(sm).tile_n)
    return rs if wgmma_fits(g.head_dim, num_warps(g.block_size, g.group, row_split=rs), tile_n) else 1


# The split combine a CTA a row (`combine=2`) up to this many packed query rows a call (batch x
# Qb x query heads), a warp a row above. H200: at 512 rows (B=1 of the main preset, 16-33 splits)
# a CTA a row took 1.5-2.1 us off a layer at ctx 2k-32k, where a warp a row runs 128 CTAs of 4
# warps, latency-bound; at 1024 (B=2 ctx 8k) 0.7 us; at 2048 (B=4) it was level to 0.4 us
# slower and at 4096 (B=8, 4 splits) 1.4 us slower, a warp a row already filling the GPU
# (results/perf-notes.md, "The split combine as a CTA a row").
COMBINE_CTA_MAX_ROWS = 1024


def default_params(problem: Problem | None = None, sm: int | None = None,
                   **overrides) -> Params:
    """Fast-without-tuning defaults for a GPU of SM `sm` (None: SM 90's), chosen so no default
    variant spills on any SM target (checked by tests/test_static_profile). CTAs of 4-8 warps
    take the K/V pipeline of `sm_budget(sm)`. Above 8 warps (registers are allocated per 4
    warps, so 9 warps get the budget of 12) Q moves to shared memory and key tiles shrink to 16
    keys in 6 stages on every SM but SM 90 (see below): at 9 warps, 64-key tiles spill on sm_90a and sm_103 (116-132
    bytes) and 32-key tiles 32 bytes on sm_90a since the kernels take a page stride; 16-key
    tiles compile at 138-146 registers everywhere. A block of more keys than the budget's tile
    keeps SM 90's 64-key tiles; stages come off where the SM's shared memory would be exceeded
    (neither happens for the presets' shapes). Given a problem, SM 90's defaults software-pipeline
    the tiles (`overlap=DEFAULT_OVERLAP`) wherever the wgmma path runs and the extra V stage fits,
    unless the overrides name `overlap` or exclude that path (`wgmma=False`). CTAs of 9-12 warps
    on SM 90 deal their rows over one-warpgroup CTAs (`_row_split_default`: laguna as 3 CTAs
    of 48 rows, each as the main preset's); `wgmma=True` takes `PADDED_WGMMA` instead (3
    warpgroups: 32-key tiles in 8 stages, Q in registers, not pipelined). Pipelined tiles that
    cp.async loads (below TMA's batch and context) take `lean`. The split combine runs
    a CTA a row up to `COMBINE_CTA_MAX_ROWS` packed rows a call, a warp a row above. With `ws`
    (opt-in) the warp-specialised kernel takes `WS_STAGES` stages and its lean consumer loop,
    deals more than 64 rows over CTAs (`row_split`), and nothing of the pipelined path."""
    if problem is not None and "combine" not in overrides:
        g = problem.geometry
        rows = problem.batch * g.block_size * g.num_q_heads
        overrides = {"combine": 2 if rows <= COMBINE_CTA_MAX_ROWS else 1, **overrides}
    if overrides.get("ws"):  # its own pipeline: none of the pipelined path's knobs
        # and the lean consumer loop (H200: 3-12% faster at B=1-8 on dflash2, gpt-oss and page 16;
        # the tuned pick at 66 of the sm90 profile's 224 keys; results/perf-notes.md, "The ws
        # consumers' tile loop, trimmed")
        four = overrides["ws"] == 4 and not overrides.get("ws_rows")
        overrides = {**(WS4_TILE if four else {"stages": WS_STAGES}), "lean": True, **overrides}
        if overrides.get("ws_rows"):  # every row in one CTA (a Q stage a consumer): 32-key
            # tiles (four consumers' O fits only beside their scores), not the many-warp q_smem
            overrides = {"tile_n": 32, "q_smem": False, "row_split": 1, **overrides}
        if problem is not None and "row_split" not in overrides:
            g = problem.geometry  # consumers of one warpgroup: at most 64 rows a CTA
            overrides["row_split"] = -(-g.block_size * g.group // 64)
        return sm_defaults(Params, MANY_WARPS, problem, sm, overrides)
    many = MANY_WARPS
    row_split = 1 if problem is None else _row_split_default(problem, sm, overrides)
    if row_split > 1:
        overrides = {"row_split": row_split, **overrides}
    if problem is not None and _padded_wgmma(problem, sm, overrides):
        many = PADDED_WGMMA  # 3 warpgroups
        overrides = {"wgmma": True, **overrides}
    params = sm_defaults(Params, many, problem, sm, overrides)
    if problem is None or "overlap" in overrides:
        return params
    # The sm_90a wgmma path runs software-pipelined wherever it can (measured on the H200:
    # OVERLAP=2 is 8-14% faster at B >= 8 and up to 8% at B=1 32k, level at B=1 2k-8k); not
    # where forced rows need a predicated load iteration (3 warpgroups: the pipelined variants
    # spill at 168 registers).
    g = problem.geometry
    warps = num_warps(g.block_size, g.group, row_split=params.row_split)
    pipelined = dataclasses.replace(params, overlap=DEFAULT_OVERLAP)
    target = NO_SM if sm is None else sm  # the device's own SM (see _padded_wgmma)
    budget = sm_budget(sm).smem_block
    if (overlap_reason(pipelined, g.head_dim, warps, target) is None
            and wgmma_fits(g.head_dim, padded_warps(warps), params.tile_n)
            and pipelined.smem_bytes(g.head_dim, warps, True, problem.page_size) <= budget):
        # and, from TMA_MIN_BATCH requests or a TMA_MIN_CTX context up, its context tiles by
        # TMA (where nothing asked for or excludes it: `tma` named, Q in shared memory; not
        # at the smallest pages)
        loaded = dataclasses.replace(pipelined, tma=True)
        min_page = TMA_MIN_PAGE if g.head_dim >= 128 else TMA_MIN_PAGE_D64
        if ("tma" not in overrides
                and (problem.batch >= TMA_MIN_BATCH or problem.ctx_len >= TMA_MIN_CTX)
                and (problem.page_size is None or problem.page_size >= min_page)
                and tma_reason(loaded, g.head_dim, warps, target) is None
                and loaded.smem_bytes(g.head_dim, warps, True, problem.page_size) <= budget):
            return loaded
        # cp.async tiles: lean (fewer instructions a tile, no spills; H200, page 64: B=1 32k
        # 3% and B=4 8k 2.6% faster than without, B=1 8k within the run-to-run spread; the
        # profile's B=1 rows at pages 16-128 0.98x at the median; results/perf-notes.md, "Lean
        # without spills")
        lean = dataclasses.replace(pipelined, lean=True)
        if ("lean" not in overrides
                and lean.smem_bytes(g.head_dim, warps, True, problem.page_size) <= budget):
            return lean
        return pipelined
    return params


def combine_ctas(rows: int, params) -> int:
    """CTAs (of 128 threads) of the split combine over `rows` packed rows: one a row with
    `combine=2`, else one a 4 rows (a warp a row). Families without the knob take the latter."""
    return rows if getattr(params, "combine", 1) == 2 else -(-rows // 4)


def problem_reason(problem: Problem, tile_n: int, head_dims=HEAD_DIMS,
                   page_sizes=PAGE_SIZES, max_rows: int = MAX_ROWS) -> str | None:
    """Checks every kernel family here shares: dtype, head_dim, rows per CTA, tile, page size."""
    g = problem.geometry
    if g.dtype not in ("bfloat16", "float16"):
        return f"dtype {g.dtype} not supported (bfloat16, float16)"
    if g.head_dim not in head_dims:
        return f"head_dim {g.head_dim} not compiled (supported: {head_dims})"
    if g.block_size * g.group > max_rows:
        return (f"Qb*G = {g.block_size}*{g.group} = {g.block_size * g.group} query rows exceed "
                f"{max_rows} per CTA")
    if g.block_size > tile_n:
        return f"block_size {g.block_size} exceeds tile_n {tile_n}"
    if problem.layout == "paged" and problem.page_size not in page_sizes:
        return f"page_size {problem.page_size} not supported ({page_sizes[0]}..{page_sizes[-1]})"
    if problem.batch > MAX_BATCH:
        return f"batch {problem.batch} exceeds {MAX_BATCH} requests a call (a grid dimension's limit)"
    if g.num_kv_heads > MAX_BATCH:
        return f"{g.num_kv_heads} KV heads exceed {MAX_BATCH} (the attention grid's y dimension)"
    if problem.batch * g.num_q_heads * g.block_size >= 2**31:
        return (f"B*Hq*Qb = {problem.batch * g.num_q_heads * g.block_size} query rows a call: the "
                f"combine counts them in a C int (below 2**31)")
    return None


def smem_limit_reason(need: int, sm: int | None) -> str | None:
    """Why `need` bytes of shared memory do not fit one CTA on a GPU of SM `sm` (None: any
    SM 90/100-class GPU, 227 KB), or None."""
    limit = SMEM_LIMIT if sm is None else sm_budget(sm).smem_block
    if need <= limit:
        return None
    where = "" if sm is None else f" on SM {sm}"
    return f"needs {need} bytes of shared memory, more than the {limit // 1024} KB a CTA gets{where}"


def supports(problem: Problem, params: Params | None = None, sm: int | None = None) -> str | None:
    """None when the cupy kernels run this problem (on a GPU of SM `sm`, when given), else
    the reason they do not."""
    g = problem.geometry
    params = params or default_params(problem, sm)
    reason = (problem_reason(problem, params.tile_n)
              or row_split_reason(g.block_size, g.group, params.row_split))
    if reason:
        return reason
    warps = num_warps(g.block_size, g.group, row_split=params.row_split)
    if params.wgmma:  # forced: refused here, not at compile time
        if sm is not None and sm != 90:  # sm_90a code: the device itself must be SM 90
            return f"wgmma=1 needs the sm_90a wgmma path, which SM {sm} does not have"
        reason = wgmma_reason(g.head_dim, warps, params.tile_n)
        if reason:
            return f"wgmma=1: {reason}"
    reason = ws_reason(params, g.head_dim, warps, sm)
    if reason:
        return reason
    if not params.ws and params.stages > PIPELINE_MAX_STAGES:
        return (f"stages={params.stages}: the pipelined paths take 2-{PIPELINE_MAX_STAGES} stages "
                f"(more only with ws, the warp-specialised kernel)")
    reason = smem_limit_reason(params.smem_bytes(g.head_dim, warps, bool(params.wgmma),
                                                 problem.page_size), sm)
    if reason:
        return f"tile_n={params.tile_n} stages={params.stages} {reason}"
    return (overlap_reason(params, g.head_dim, warps, sm) or tma_reason(params, g.head_dim, warps, sm)
            or trim_reason(params, g.head_dim, warps, sm) or ws_knobs_reason(params)
            or min_ctas_reason(params, g.head_dim, warps, sm))


# Registers a thread of the wgmma path needs at the least: below them ptxas refuses the kernel
# (C7602, "Insufficient registers"; min_ctas=6 on the 4-warp variant, 2 on laguna's 9 warps)
WGMMA_MIN_REGISTERS = 96


def min_ctas_reason(params: Params, head_dim: int, warps: int, sm: int | None) -> str | None:
    """Why `min_ctas` leaves a wgmma variant's threads too few registers to compile, or None
    (`__launch_bounds__(threads, min_ctas)` caps them at 64K / (threads x min_ctas), in 8s)."""
    if params.min_ctas <= 1 or params.ws or sm is None:
        return None
    try:
        wgmma = use_wgmma(params, head_dim, warps, sm)
    except ValueError:  # refused above for its own reason
        return None
    if not wgmma:
        return None
    threads = 32 * padded_warps(warps)
    registers = 65536 // (threads * params.min_ctas) // 8 * 8
    if registers < WGMMA_MIN_REGISTERS:
        return (f"min_ctas={params.min_ctas} leaves each of a {threads}-thread CTA's threads "
                f"{registers} registers; the wgmma path needs {WGMMA_MIN_REGISTERS}")
    return None


def tunables(problem: Problem | None = None) -> dict[str, list]:
    return {
        "tile_n": [32, 64, 128],
        "stages": [2, 3, 4],
        "num_splits": [0, 1, 2, 4, 8, 16, 32],
        "q_smem": [False, True],
        "wgmma": [None, False],
        "overlap": [0, 1, 2],
        "tma": [False, True],
        "combine": [1, 2],
        "row_split": [1, 2, 3],
        "lean": [False, True],
        "ctas_per_sm": [0, 1, 2],
        "ws": [0, 2, 3, 4],
        "trim": [False, True],
        "early_ids": [False, True],
        "ws_rows": [False, True],
        "ws_overlap": [False, True],
        "q_step": [False, True],
        "one_trip": [False, True],
        "pair": [False, True],
    }


# --------------------------------------------------------------------------------------------
# compile + load


def common_defines(dtype: torch.dtype | str, head_dim: int, page_size: int | None,
                   block_size: int, group: int, params, wgmma: bool,
                   warps: int | None = None) -> dict[str, int]:
    """The compile-time knobs every kernel family takes (kernels/cuda/variant.cuh). `warps`:
    the CTA's warps (default `num_warps(block_size, group)`)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return dict(
        DTYPE_BF16=int(name == "bfloat16"),
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size or 0,
        TILE_N=params.tile_n,
        NUM_WARPS=warps or num_warps(block_size, group),
        STAGES=params.stages,
        Q_SMEM=int(params.q_smem),
        WGMMA=int(wgmma),
        MIN_CTAS=params.min_ctas,
    )


def variant_defines(dtype: torch.dtype | str, head_dim: int, page_size: int | None,
                    block_size: int, group: int, params: Params, sm: int) -> dict[str, int]:
    reason = row_split_reason(block_size, group, params.row_split)
    if reason:
        raise ValueError(reason)
    warps = num_warps(block_size, group, row_split=params.row_split)
    # ws_rows: each consumer is a one-warpgroup CTA's math (ws_reason bounds its rows)
    cta_warps = 4 if params.ws and params.ws_rows else warps
    wgmma = use_wgmma(params, head_dim, cta_warps, sm)
    defines = dict(common_defines(dtype, head_dim, page_size, block_size, group, params, wgmma,
                                  padded_warps(cta_warps) if wgmma else cta_warps),
                   SKIP_COMPUTE=int(params.skip_compute), SKIP_LOADS=int(params.skip_loads))
    if params.overlap:  # named only when on: the default variants keep their defines (and labels)
        defines["OVERLAP"] = int(params.overlap)
    if params.tma:
        reason = tma_reason(params, head_dim, warps, sm)
        if reason:
            raise ValueError(reason)
        defines["TMA_LOADS"] = 1
    if params.combine == 2:
        defines["COMBINE_CTA"] = 1
    if params.one_trip:  # named only when on: the other variants keep their defines
        defines["COMBINE_ONE_TRIP"] = 1
    if params.row_split > 1:  # named only when on: the other variants keep their defines
        defines["ROW_SPLIT"] = params.row_split
    if params.lean:
        defines["LEAN"] = 1
    if params.ws:
        reason = ws_reason(params, head_dim, warps, sm)
        if reason:
            raise ValueError(reason)
        defines.update(WARP_SPEC=1, TMA_LOADS=1, WS_CONSUMERS=params.ws)
        if params.ws_rows:  # named only when on: the other ws variants keep their defines
            defines["WS_ROWS"] = 1
        if params.ws_overlap:
            defines["WS_OVERLAP"] = 1
    if params.trim:  # named only when on: the other variants keep their defines
        reason = trim_reason(params, head_dim, warps, sm)
        if reason:
            raise ValueError(reason)
        defines["TRIM"] = 1
    if (params.early_ids or params.ws_rows or params.ws_overlap or params.q_step
            or params.pair):  # ws's own knobs
        reason = ws_knobs_reason(params)
        if reason:
            raise ValueError(reason)
    if params.early_ids:  # named only when on: the other ws variants keep their defines
        defines["EARLY_IDS"] = 1
    if params.q_step:
        defines["Q_STEP"] = 1
    if params.pair:  # named only when on: the other ws variants keep their defines
        defines["WS_PAIR"] = 1
    return defines


# ptxas otherwise caps some variants at 128 registers and spills; occupancy is planned by hand.
NVRTC_OPTIONS = ("-maxrregcount=255",)


def compile_variant(defines: dict[str, int], sm: int):
    """For a GPU of SM `sm`: its exact arch, or PTX the driver JITs where NVRTC lacks it."""
    return compile_for_device(SOURCE, defines, sm, extra_options=NVRTC_OPTIONS)


@functools.cache
def device_info(index: int) -> tuple[int, int]:
    """(SM count, SM version) of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major * 10 + props.minor


@dataclass
class Module:
    """A loaded variant: its three kernels (driver handles) and the attention's resources."""

    attention: object
    combine: object
    store: object
    smem: int
    regs: int
    threads: int
    owner: object = None  # keeps the loaded module alive as long as its handles

    def resident_ctas(self, smem_per_sm: int = SMEM_PER_SM) -> int:
        """CTAs of this variant one SM holds (at most 32), by shared memory (`smem_per_sm`:
        the GPU's, SmBudget.smem_sm; 1 KB reserved per CTA) and by registers."""
        by_smem = smem_per_sm // (self.smem + 1024)
        regs_per_warp = -(-self.regs * 32 // 256) * 256
        by_regs = REGS_PER_SM // (regs_per_warp * (self.threads // 32))
        return max(1, min(by_smem, by_regs, 32))


_Module = Module  # the name tests/test_split_model.py builds resource-only modules with


@contextlib.contextmanager
def _relaxed_capture():
    """Let this thread load modules while a CUDA graph is being captured (torch's allocator
    does the same around cudaMalloc): a module load is no stream work, but in the default
    'global' capture mode the driver may refuse it as potentially unsafe."""
    from cuda.bindings import driver

    err, previous = driver.cuThreadExchangeStreamCaptureMode(
        driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed: {err!r}")
    try:
        yield
    finally:
        driver.cuThreadExchangeStreamCaptureMode(previous)


def load_cubin(index: int, cubin_path, smem: int, threads: int) -> Module:
    """Load a compiled variant on device `index` (CuPy loads it; launches go through the driver),
    also while a CUDA graph is being captured."""
    import cupy
    from cuda.bindings import driver

    with cupy.cuda.Device(index), _relaxed_capture():
        mod = cupy.RawModule(path=str(cubin_path))
        attn = mod.get_function("drafter_attention")
        attn.max_dynamic_shared_size_bytes = smem
        regs = attn.num_regs  # from the loaded cubin itself
        # RawKernel.kernel is CuPy's loaded Function; its ptr is the driver's CUfunction
        handles = [driver.CUfunction(f.kernel.ptr) for f in
                   (attn, mod.get_function("drafter_combine"), mod.get_function("drafter_store"))]
    return Module(*handles, smem, regs, threads, owner=mod)


def module_smem(defines: dict[str, int]) -> int:
    """Dynamic shared memory a variant's attention kernel launches with, from its compile-time
    defines: what its kernel source lays out (the stages, Q, the page-id ring, the TMA barriers
    and page ids, or the warp-specialised kernel's own layout). `Params.smem_bytes` plans with
    the same sums before anything compiles (tests/test_smem.py holds the two together)."""
    if defines.get("WARP_SPEC", 0):
        return ws_bytes(defines["TILE_N"], defines["STAGES"], defines["HEAD_DIM"],
                        defines["WS_CONSUMERS"], bool(defines.get("EARLY_IDS", 0)),
                        bool(defines.get("WS_ROWS", 0)), bool(defines.get("WS_PAIR", 0)))
    return pipelined_bytes(defines["TILE_N"], defines["STAGES"], defines["HEAD_DIM"],
                           defines["NUM_WARPS"], bool(defines["WGMMA"]), defines.get("OVERLAP", 0),
                           bool(defines["Q_SMEM"]), defines["PAGE_SIZE"] or None,
                           bool(defines.get("LEAN", 0)), bool(defines.get("TMA_LOADS", 0)))


def _load(index: int, defines_items: tuple) -> Module:
    defines = dict(defines_items)
    result = compile_variant(defines, device_info(index)[1])
    threads = (ws_threads(defines["WS_CONSUMERS"]) if defines.get("WARP_SPEC", 0)
               else defines["NUM_WARPS"] * 32)
    return load_cubin(index, result.cubin_path, module_smem(defines), threads)


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family (a .cu source and its knobs) behind the shared host code: what
    `CupyBackend` asks of it. kernels.cutlass_backend builds the CuTe one."""

    module: str  # the Python module that defines it (scripts compile variants through it)
    Params: type
    default_params: Callable
    supports: Callable
    tunables: Callable
    variant_defines: Callable  # (dtype, head_dim, page, block, group, params, sm) -> defines
    compile_variant: Callable  # (defines, sm) -> nvrtc.CompileResult
    load_variant: Callable  # (device index, sorted defines items) -> Module
    HEAD_DIMS: tuple
    PAGE_SIZES: tuple

    def module_for(self, index: int, dtype, head_dim, page_size, block_size, group,
                   params) -> Module:
        """The loaded variant for a shape (compiled and loaded once per process)."""
        defines = self.variant_defines(dtype, head_dim, page_size, block_size, group, params,
                                       device_info(index)[1])
        key = (self.module, index, tuple(sorted(defines.items())))
        mod = _loaded.get(key)
        if mod is None:
            with _load_lock:
                mod = _loaded.get(key) or self.load_variant(index, key[2])
                _loaded[key] = mod
        return mod


_load_lock = threading.Lock()
_loaded: dict[tuple, Module] = {}


CUPY = KernelFamily(__name__, Params, default_params, supports, tunables, variant_defines,
                    compile_variant, _load, HEAD_DIMS, PAGE_SIZES)


# --------------------------------------------------------------------------------------------
# launch: argument structs packed once per plan, one driver launch per kernel per call


class DrafterParams(ctypes.Structure):
    """Host mirror of `DrafterParams` in kernels/cuda/params.cuh (same fields, same order)."""

    _fields_ = ([(n, ctypes.c_void_p) for n in ("q", "k_blk", "v_blk", "k_cache", "v_cache",
                                                "table", "ctx_lens", "out", "o_part",
                                                "lse_part")]
                + [(n, ctypes.c_int) for n in ("qb", "hq", "hkv", "group", "table_stride",
                                               "capacity", "mask_mode", "window",
                                               "loc_stride")]
                + [("scale_log2", ctypes.c_float)])


class TmaDrafterParams(ctypes.Structure):
    """The TMA variant's arguments: DrafterParams' fields, then the K and V tensor maps."""

    _fields_ = DrafterParams._fields_ + [("tma_k", TmaMap), ("tma_v", TmaMap)]


class CombineArgs(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_void_p) for n in ("o_part", "lse_part", "out")]
                + [(n, ctypes.c_int) for n in ("batch", "qb", "hq", "hkv", "group", "splits")])


class StoreArgs(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_void_p) for n in ("k_new", "v_new", "num_new", "k_cache",
                                                "v_cache", "table", "ctx_lens", "counters")]
                + [(n, ctypes.c_int) for n in ("rows", "hkv", "table_stride", "capacity",
                                               "loc_stride")])


# _stream(index): torch's current stream on device `index`, as a raw handle (graph capture
# follows it); torch's own function, bound without a wrapper (absent from CPU-only builds).
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _plan_counters(index: int, batch: int) -> torch.Tensor:
    """A store plan's own zeroed arrival counters, for its captures (`StorePlan`). Made outside a
    capture they are kept for the process's life (`_kept_counters`): a graph captured from the
    plan holds their address after the plan is gone (`clear_plans`, a dropped backend). Made
    inside a capture, they are the graph's own memory and their zero fill is captured too, so
    every replay starts from zero."""
    if batch > MAX_BATCH:
        raise ValueError(f"batch={batch} exceeds {MAX_BATCH} requests a store call (the grid's y "
                         f"dimension)")
    counters = _zeros(batch, index)
    if not torch.cuda.is_current_stream_capturing():
        _kept_counters.append(counters)  # B int32s a plan shape
    return counters


_kept_counters: list[torch.Tensor] = []


def _zeros(n: int, index: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=f"cuda:{index}")


def _stream_counters(index: int, stream: int) -> int:
    """The address of the zeroed per-request arrival counters of the store kernel (which leaves
    them zeroed) for eager stores on `stream` (a raw handle, torch's current stream) of device
    `index`. One buffer a stream: stores on one stream run in order, so they can share one;
    stores on two streams may be in flight together, and shared counters would mix their
    arrivals (a length never advanced, a counter left non-zero). A buffer holds MAX_BATCH
    requests (256 KB) and is never freed: plans keep its address. torch draws its streams from a
    fixed pool, so a process has a few of them."""
    buf = _counter_bufs.get((index, stream))
    if buf is None:  # two threads' first stores on one stream: one buffer kept, for both
        buf = _counter_bufs.setdefault((index, stream), _zeros(MAX_BATCH, index))
    return buf.data_ptr()


_counter_bufs: dict[tuple[int, int], torch.Tensor] = {}


# --------------------------------------------------------------------------------------------
# plans: everything a call needs that its shapes determine


def choose_splits(batch: int, hkv: int, kv_tokens: int, tile_n: int, num_sms: int,
                  resident: int, max_splits: int = 64, rows: int = 64, pairs: bool = False) -> int:
    """Split-KV count from a wave model, in units of one tile step of a full wave:
    - `batch * hkv * S` CTAs run in ceil(CTAs / slots) waves of `slots = SMs * resident` CTAs;
    - a wave lasts one split's share of the KV tiles, plus a fixed per-CTA cost of about two
      tiles (pipeline fill, epilogue);
    - with S > 1 every CTA also writes its `rows` fp32 partial rows, which the combine reads
      back. That is 2 * rows / tile_n tiles' worth of traffic a CTA (a tile of K and V in
      bf16/fp16 is 4 * tile_n bytes a column; a partial row 4 bytes a column, written and read).
      Spread over the slots, it costs `2 * rows / tile_n * CTAs / slots` tile steps, charged
      only when the grid needs more than one wave: a grid inside one wave leaves SMs idle, and
      its partials ride on bandwidth nobody else uses.

    Without the partials' traffic, the model took 33 splits (4 waves) at B=4 ctx 128k. On the
    H200 that ran 6% slower than 8 splits in one wave, and 6% slower than 4 splits at B=8
    (results/perf-notes.md, "The split count at long contexts"). Charged inside one wave too,
    they cut laguna's 144-row CTAs to half a wave (B=8: 2 splits -> 1), 28-34% slower in the
    sm90 profile (results/perf-notes.md, "Partial rows in the split model").

    `pairs` (the ws kernel's `pair`): even counts only, at least 2, a pair writing one CTA's
    partial rows (none at 2)."""
    ctas = batch * hkv
    slots = num_sms * resident
    tiles = max(1, -(-kv_tokens // tile_n))
    limit = max(1, min(max_splits, tiles // 2))
    step = 2 if pairs else 1
    best, best_cost = step, float("inf")
    for s in range(step, max(step, limit) + 1, step):
        written = s // step  # CTAs that write partials
        partials = (2 * rows / tile_n * ctas * written / slots
                    if written > 1 and ctas * s > slots else 0.0)
        cost = math.ceil(ctas * s / slots) * (tiles / s + 2) + partials
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


# Split-KV workspaces a plan keeps, one per stream, the oldest dropped beyond this.
_WORKSPACE_STREAMS = 4
# The pointer fields lead the packed structs (DrafterParams: q .. out, o_part, lse_part;
# CombineArgs: o_part, lse_part, out; StoreArgs: k_new .. ctx_lens, counters): one pack_into a call writes
# them (ctypes structs are writable buffers), and only when they changed since the last call.
_ATTENTION_PTRS, _COMBINE_PTRS = struct.Struct("10P"), struct.Struct("3P")
_STORE_PTRS = struct.Struct("8P")
# The same fields for the C runner (kernels.native): (byte offset, source) with the sources a
# call's tensors, then an attention's o_part and lse_part, or a store's counters.
_ATTENTION_WRITES = tuple((8 * i, i) for i in range(10))
_COMBINE_WRITES = ((0, 8), (8, 9), (16, 7))
_STORE_WRITES = tuple((8 * i, i) for i in range(8))
# The byte alignment each tensor of a call needs (0: any), checked whenever its pointer is new,
# on every path (a misaligned copy faults the CUDA context rather than raising): q, the block's
# K/V, the caches and the store's new rows go by 16-byte copies (cp.async, uint4), `out` takes
# 4-byte stores, and torch keeps int32 tensors 4-byte aligned.
ATTENTION_ALIGN = (("q", 16), ("k_blk", 16), ("v_blk", 16), ("k_cache", 16), ("v_cache", 16),
                   ("table", 0), ("ctx_lens", 0), ("out", 4))
STORE_ALIGN = (("k_new", 16), ("v_new", 16), ("num_new", 0), ("k_cache", 16), ("v_cache", 16),
               ("table", 0), ("ctx_lens", 0))


def check_aligned(aligns, ptrs) -> None:
    """ValueError naming the first pointer of `ptrs` (data_ptr values, in `aligns`' order) that
    is not aligned as the kernels need; the C runner makes the same check."""
    for (name, align), ptr in zip(aligns, ptrs):
        if align and ptr % align:
            raise ValueError(f"{name}: data_ptr {ptr:#x} is not {align}-byte aligned")


@dataclass
class AttentionPlan:
    """A planned attention shape: the split count, the workspace size and the launches."""

    index: int
    splits: int
    part_elems: int  # float32 elements of o_part (lse_part follows it in one workspace)
    lse_elems: int
    attention: Launch
    combine: Launch | None
    tma: TmaMaps | None = None  # the tensor maps of a tma=1 variant
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # split-KV workspaces by raw stream handle (`_workspace`)
    workspaces: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # the call's launches: one graph launch per eager call (kernels.launch)
    launches: LaunchGraph = dataclasses.field(init=False, repr=False, compare=False)
    packed: tuple = dataclasses.field(default=(), repr=False, compare=False)  # the last pointers

    def __post_init__(self):
        # the C runner's layout: the call's 8 tensors, then the workspace's two pointers; a TMA
        # plan re-encodes its tensor maps when the caches move, which only the Python path does
        layout = None if self.tma is not None else (
            8, 10, (_ATTENTION_WRITES, _COMBINE_WRITES)[:2 if self.combine else 1],
            ATTENTION_ALIGN)
        self.launches = LaunchGraph([self.attention] + ([self.combine] if self.combine else []),
                                    self.index, layout)

    def run(self, q, k_blk, v_blk, k_cache, v_cache, table, ctx_lens, out):
        if out is None:
            out = torch.empty_like(q)
        with self.lock:  # the packed arguments are shared by every call of this shape
            stream = _stream(self.index)
            captured = capturing()
            part = lse = 0  # no split: the attention writes `out` itself
            if self.combine is not None:
                part = self._workspace(stream, q.device, captured).data_ptr()
                lse = part + 4 * self.part_elems
            runner = None if captured else self.launches.runners.get(stream)
            if runner is not None:  # the stream's graph takes the call in C (kernels.native)
                runner(stream, q, k_blk, v_blk, k_cache, v_cache, table, ctx_lens, out, part,
                       lse)
                self.packed = ()  # the structs hold the runner's pointers now
                return out
            o, kp, vp = out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
            ptrs = (q.data_ptr(), k_blk.data_ptr(), v_blk.data_ptr(), kp, vp, table.data_ptr(),
                    ctx_lens.data_ptr(), o, part, lse)
            if ptrs != self.packed:  # a decode loop over static buffers packs nothing
                if (ptrs[0] | ptrs[1] | ptrs[2] | kp | vp) & 15 or o & 3:  # ATTENTION_ALIGN
                    check_aligned(ATTENTION_ALIGN, ptrs)
                _ATTENTION_PTRS.pack_into(self.attention.args, 0, *ptrs)
                if self.combine is not None:
                    _COMBINE_PTRS.pack_into(self.combine.args, 0, part, lse, o)
                if self.tma is not None and (kp, vp) != self.tma.ptrs:
                    self.tma.encode_into(self.attention.args, kp, vp)
                self.packed = ptrs
                self.launches.touch()
            self.launches(stream, captured)
        return out

    def _workspace(self, stream: int, device, captured: bool) -> torch.Tensor:
        """The split-KV workspace (o_part, then lse_part; float32) of a call on `stream`, with
        the plan's lock held.

        Outside a CUDA-graph capture each stream keeps its own from call to call: a stream runs
        its work in order and the lock keeps a call's two launches together, so the next call's
        attention overwrites the partials only after this call's combine has read them; two
        streams never share one (their calls may overlap). The tensor was allocated on that
        stream (torch's current one), so once dropped torch's allocator reuses its memory only
        behind that stream's work. Inside a capture each call allocates, as before: the buffer
        is the graph's own (as a store's counters, `StorePlan`), never one that eager calls also write."""
        if captured:
            return torch.empty(self.part_elems + self.lse_elems, dtype=torch.float32,
                               device=device)
        work = self.workspaces.get(stream)
        if work is None:
            if len(self.workspaces) >= _WORKSPACE_STREAMS:
                del self.workspaces[next(iter(self.workspaces))]  # the oldest stream's
            work = self.workspaces[stream] = torch.empty(self.part_elems + self.lse_elems,
                                                         dtype=torch.float32, device=device)
        return work


@dataclass
class TmaMaps:
    """The K and V tensor maps of a tma=1 plan (kernels/tma.py), encoded into its packed
    arguments again only when a call's cache addresses differ from the last ones."""

    dtype: str
    k_geo: object  # tma.MapGeometry
    v_geo: object
    ptrs: tuple = (None, None)

    def encode_into(self, args, k_ptr: int, v_ptr: int) -> None:
        from drafter_attn.kernels import tma

        args.tma_k = tma.encode(k_ptr, self.dtype, self.k_geo)
        args.tma_v = tma.encode(v_ptr, self.dtype, self.v_geo)
        self.ptrs = (k_ptr, v_ptr)


@dataclass
class StorePlan:
    """A planned store shape: its launch, and the counters it takes inside a capture.

    The kernel's per-request arrival counters come with each call: eager calls take their
    stream's (`_stream_counters`), a capture takes the plan's own `captured` buffer (zeroed when
    the plan was made; inside a capture, by a captured fill), so a graph never shares counters
    with eager stores, whatever streams either runs on. (Two graphs holding one plan, replayed
    at once on two streams, would still share it.)"""
    index: int
    launch: Launch | None  # None: no rows or no requests, nothing to write
    captured: torch.Tensor | None = None  # the counters of a store inside a capture
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # the eager counters' addresses by raw stream handle (`_stream_counters`)
    counters: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    launches: LaunchGraph | None = dataclasses.field(init=False, repr=False, compare=False)
    packed: tuple = dataclasses.field(default=(), repr=False, compare=False)  # the last pointers

    def __post_init__(self):
        self.launches = (LaunchGraph([self.launch], self.index,
                                      (7, 8, (_STORE_WRITES,), STORE_ALIGN))
                         if self.launch is not None else None)

    def run(self, k_new, v_new, num_new, k_cache, v_cache, table, ctx_lens):
        if self.launch is None:
            return
        with self.lock:
            stream = _stream(self.index)
            captured = capturing()
            runner = None if captured else self.launches.runners.get(stream)
            counters = (self.captured.data_ptr() if captured else self.counters.get(stream)
                        or self.counters.setdefault(stream, _stream_counters(self.index, stream)))
            if runner is not None:
                runner(stream, k_new, v_new, num_new, k_cache, v_cache, table, ctx_lens, counters)
                self.packed = ()
                return
            ptrs = (k_new.data_ptr(), v_new.data_ptr(), num_new.data_ptr(), k_cache.data_ptr(),
                    v_cache.data_ptr(), table.data_ptr(), ctx_lens.data_ptr(), counters)
            if ptrs != self.packed:
                if (ptrs[0] | ptrs[1] | ptrs[3] | ptrs[4]) & 15:  # STORE_ALIGN
                    check_aligned(STORE_ALIGN, ptrs)
                _STORE_PTRS.pack_into(self.launch.args, 0, *ptrs)
                self.packed = ptrs
                self.launches.touch()
            self.launches(stream, captured)


CHECKS = os.environ.get("DRAFTER_CHECKS", "1") != "0"
# DRAFTER_CHECKS=full (debug): every call runs the contract check, value checks included
# (kernels.contract), not only a call that plans.
FULL_CHECKS = os.environ.get("DRAFTER_CHECKS") == "full"


def call_key(kind: str, tensors, extra) -> tuple | None:
    """The plan key of a call. With checks on it holds every property the no-device-read contract
    checks depend on (shapes, strides, dtypes, devices) of every tensor, so a hit is a call
    already validated; with DRAFTER_CHECKS=0 only what the plan itself depends on. `tensors`:
    the seven tensors of an attention or store call, then an attention's `out` (or None). None
    when an argument is no tensor: no plan has that key, so the contract check names it."""
    try:
        if CHECKS:
            return (kind, extra, *[None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                                   for t in tensors])
        q, k_blk, _, k_cache, v_cache, table = tensors[:6]
        return (kind, extra, q.shape, q.dtype, q.device, k_blk.shape, k_cache.shape,
                k_cache.stride(0), v_cache.stride(0), table.shape)
    except AttributeError:  # no tensor (the contract refuses it before any plan is stored)
        return None


# --------------------------------------------------------------------------------------------
# the backend


@dataclass(frozen=True)
class CupyBackend:
    """The four contract functions; `overrides` pin tunables (the rest follow default_params).
    A call looks its plan up by `call_key`; the first call of a shape validates, compiles,
    loads and packs (`_plan_*`), every later one only sets pointers and launches."""

    overrides: tuple = ()
    name: str = "cupy"
    family: ClassVar[KernelFamily] = CUPY
    _plans: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                     compare=False)
    # each call form's last plan, behind a C++ check of the call's tensors (kernels.guards)
    _recent: RecentPlans = dataclasses.field(default_factory=RecentPlans, init=False,
                                             repr=False, compare=False)

    # registry protocol -------------------------------------------------------------------
    # `sm` (optional in the protocol, see registry.default_params): the GPU's SM; the
    # defaults and the shared-memory limit are that SM's (kernels.cupy_backend.SM_BUDGETS).
    def params_for(self, problem: Problem, sm: int | None = None):
        return self.family.default_params(problem, sm, **dict(self.overrides))

    def supports(self, problem: Problem, sm: int | None = None) -> str | None:
        return self.family.supports(problem, self.params_for(problem, sm), sm)

    def tunables(self, problem: Problem | None = None) -> dict[str, list]:
        return self.family.tunables(problem)

    def default_params(self, problem: Problem | None = None, sm: int | None = None) -> dict:
        return dataclasses.asdict(self.family.default_params(problem, sm))

    def with_params(self, **params) -> CupyBackend:
        from drafter_attn.kernels import registry

        params = registry.check_params(self, params)  # values become NVRTC options: typed, ranged
        merged = {**dict(self.overrides), **params}
        return dataclasses.replace(self, overrides=tuple(sorted(merged.items())))

    # contract ------------------------------------------------------------------------------
    # The two attention entry points spell out the same few lines rather than share a helper:
    # they are the per-call hot path, where a Python frame is about 0.1 us of an 8.5 us call.
    def paged_attention(self, q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, *,
                        mask="full", window=None, scale=None, out=None, max_ctx=None):
        args = (q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, out)
        form = ("paged", mask, window, scale, max_ctx, out is None)
        plan = self._attention_plan(form, args)
        if plan is None:
            plan = self._attend("paged", contract.check_paged, (mask, window, scale), args,
                                max_ctx, form)
        return plan.run(*args)

    def arena_attention(self, q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, *,
                        mask="full", window=None, scale=None, out=None, max_ctx=None):
        args = (q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, out)
        form = ("arena", mask, window, scale, max_ctx, out is None)
        plan = self._attention_plan(form, args)
        if plan is None:
            plan = self._attend("arena", contract.check_arena, (mask, window, scale), args,
                                max_ctx, form)
        return plan.run(*args)

    def store_paged(self, k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens):
        self._store("store_paged", contract.check_store_paged,
                    (k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens))

    def store_arena(self, k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens):
        self._store("store_arena", contract.check_store_arena,
                    (k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens))

    def _attention_plan(self, form, args):
        """The fast path: the plan of the last call of this form, if this call's tensors match
        its tensors' metadata (kernels.guards); else None."""
        if FULL_CHECKS:
            return None
        try:
            return self._recent.get(form, args if args[7] is not None else args[:7])
        except TypeError:  # an unhashable argument: the contract check names it
            return None

    def _attend(self, layout, check, extra, args, max_ctx=None, form=None):
        """The plan of an attention call by its key: one lookup on a hit; a miss validates
        (ValueError naming the argument) and plans. A `max_ctx` hint is checked on every call
        (a Python int against the capacity) and keys the plan by the context it plans for
        (contract.plan_ctx). The plan becomes its form's recent one (`_attention_plan`)."""
        key = attention_key(layout, args, extra, max_ctx)
        plan = self._plans.get(key)
        if plan is None or FULL_CHECKS:
            dims = check(*args[:7], *extra, max_ctx=max_ctx)
            if plan is None:
                plan = self._plan_attention(key, dims, layout, args)
        if form is not None:
            self._recent.put(form, args if args[7] is not None else args[:7], plan)
        return plan

    def planned(self, key):
        """The attention plan of a call key (`attention_key`), once a call of that key has run
        here, else None: what `Runtime` reaches in one lookup on later calls (`plan.run(*args)`
        with the key's eight arguments, `out` last)."""
        return self._plans.get(key)

    def clear_plans(self) -> None:
        """Forget every plan (each holds the module it loaded): the next call of any shape
        plans again."""
        self._plans.clear()
        self._recent.clear()

    def _store(self, kind, check, args):
        plan = None if FULL_CHECKS else self._recent.get(kind, args)
        if plan is None:
            key = call_key(kind, args, None)
            plan = self._plans.get(key)
            if plan is None or FULL_CHECKS:
                dims = check(*args)
                if plan is None:
                    plan = self._plan_store(key, dims, args)
            if self._plans.get(key) is plan:  # not a capture's own plan (`_plan_store`)
                self._recent.put(kind, args, plan)
        plan.run(*args)

    # planning ------------------------------------------------------------------------------
    def _params(self, dims, device: torch.device):
        """The parameters of a call on `device`: the overrides over that GPU's SM defaults, for
        the context it plans for (the capacity, or the caller's max_ctx hint)."""
        problem = Problem.from_dims(dims, dims.plan_ctx)
        sm = device_info(_index(device))[1]
        params = self.params_for(problem, sm)
        reason = self.family.supports(problem, params, sm)
        if reason:
            raise ValueError(f"the {self.name} backend cannot run this problem: {reason}")
        return params

    def plan_splits(self, dims, params, device: torch.device) -> int:
        """Split count for a call (host shape arithmetic only, identical on every replay)."""
        if params.num_splits:
            return params.num_splits
        index = _index(device)
        mod = self.family.module_for(index, dims.dtype, dims.head_dim, dims.page_size,
                                     dims.block_size, dims.group, params)
        # The planned context: the capacity, or the caller's max_ctx hint (an engine's block
        # table is sized for the model's longest context, far wider than the live one). Only the
        # split count follows it: each split still covers its share of the real ctx_lens.
        planned = dims.plan_ctx
        kv_tokens = planned if dims.mask == "full" else min(planned, dims.window)
        num_sms, sm = device_info(index)
        resident = mod.resident_ctas(sm_budget(sm).smem_sm)
        if getattr(params, "ctas_per_sm", 0):
            resident = min(resident, params.ctas_per_sm)
        # row_split CTAs per (request, KV head) split: the wave model counts them all, and each
        # writes its share of the rows' partials
        row_split = getattr(params, "row_split", 1)
        return choose_splits(dims.batch * row_split, dims.num_kv_heads, kv_tokens, params.tile_n,
                             num_sms, resident,
                             rows=cta_rows(dims.block_size, dims.group, row_split),
                             pairs=getattr(params, "pair", False))

    def _plan_attention(self, key, dims, layout, args) -> AttentionPlan:
        q, _, _, k_cache, v_cache, table, _, out = args
        _check_kernel_inputs(q, ATTENTION_ALIGN, args)
        if out is not None:
            contract.check_out(out, q)
        p = self._params(dims, q.device)
        index = _index(q.device)
        mod = self.family.module_for(index, q.dtype, dims.head_dim, dims.page_size,
                                     dims.block_size, dims.group, p)
        splits = self.plan_splits(dims, p, q.device)
        # the partials the combine merges: with `pair` one a split pair (none at two splits)
        parts = splits // 2 if getattr(p, "pair", False) else splits
        rows = dims.block_size * dims.group
        part_elems, lse_elems = partial_elems(dims.batch, dims.num_kv_heads, rows, dims.head_dim,
                                              parts)
        maps = None
        if getattr(p, "tensor_maps", False):  # cutlass's Params have no TMA variant
            maps = _tma_maps(k_cache, v_cache, dims.page_size, p.tile_n)
        packed = (TmaDrafterParams if maps else DrafterParams)(
            loc_stride=loc_stride(k_cache, dims.page_size), qb=dims.block_size, hq=dims.num_q_heads,
            hkv=dims.num_kv_heads, group=dims.group,
            table_stride=table.shape[1] if layout == "paged" else 1, capacity=dims.capacity,
            mask_mode=MASK_CODE[dims.mask], window=dims.window or 0,
            scale_log2=dims.scale * math.log2(math.e))
        grid_x = splits * getattr(p, "row_split", 1)  # a split's row_split CTAs adjacent in x
        attention = Launch(mod.attention, (grid_x, dims.num_kv_heads, dims.batch),
                           (mod.threads, 1, 1), mod.smem, packed)
        combine = None
        if parts > 1:
            total_rows = dims.batch * dims.num_kv_heads * rows
            combine = Launch(mod.combine, (combine_ctas(total_rows, p), 1, 1), (128, 1, 1), 0,
                             CombineArgs(batch=dims.batch, qb=dims.block_size,
                                         hq=dims.num_q_heads, hkv=dims.num_kv_heads,
                                         group=dims.group, splits=parts))
        plan = AttentionPlan(index, splits, part_elems, lse_elems, attention, combine, maps)
        self._plans[key] = plan
        return plan

    def _plan_store(self, key, dims, args) -> StorePlan:
        k_new, _, _, k_cache, v_cache, table, _ = args
        table_stride = table.shape[1] if table.dim() == 2 else 1
        _check_kernel_inputs(k_new, STORE_ALIGN, args)
        head_dims, page_sizes = self.family.HEAD_DIMS, self.family.PAGE_SIZES
        if dims.head_dim not in head_dims:
            raise ValueError(f"k_new: head_dim {dims.head_dim} not compiled (supported: {head_dims})")
        if dims.page_size is not None and dims.page_size not in page_sizes:
            raise ValueError(f"k_pages: page_size {dims.page_size} not supported "
                             f"({page_sizes[0]}..{page_sizes[-1]})")
        index = _index(k_new.device)
        launch = captured = None
        if dims.rows and dims.batch:
            captured = _plan_counters(index, dims.batch)  # refuses a batch past the grid first
            # The store depends on head_dim and the page size only: the attention module of a
            # minimal geometry at the GPU's defaults serves, so a step loads one module per
            # layout (one whose shared memory the GPU can give).
            sm = device_info(index)[1]
            mod = self.family.module_for(index, k_new.dtype, dims.head_dim, dims.page_size, 1,
                                         1, self.family.default_params(None, sm))
            packed = StoreArgs(rows=dims.rows, hkv=dims.num_kv_heads, table_stride=table_stride,
                               capacity=dims.capacity,
                               loc_stride=loc_stride(k_cache, dims.page_size))
            launch = Launch(mod.store, (dims.rows, dims.batch, 1), (128, 1, 1), 0, packed)
        plan = StorePlan(index, launch, captured)
        if not torch.cuda.is_current_stream_capturing():  # a capture's plan is its own
            self._plans[key] = plan
        return plan


def attention_key(layout: str, args, extra, max_ctx=None) -> tuple | None:
    """The plan key of an attention call of any backend of this family: `args` its eight
    arguments (`out` last, or None), `extra` (mask, window, scale). A `max_ctx` hint is checked
    against the capacity (ValueError) and keys the context it plans for."""
    key_extra = extra if max_ctx is None else (*extra, _hint_key(layout, args, max_ctx))
    return call_key(layout, args, key_extra)


def _hint_key(layout: str, args, max_ctx):
    """The plan-key part of a `max_ctx` hint: the context planned for (validated against the
    capacity on every call, from shapes and the Python int); None when the shapes do not give a
    capacity (the contract check then names the bad argument)."""
    try:
        cache, table = args[3], args[5]
        cap = table.shape[1] * cache.shape[2] if layout == "paged" else cache.shape[1]
    except (AttributeError, IndexError, TypeError):
        return None
    return contract.plan_ctx(max_ctx, cap, "block_table" if layout == "paged" else "k_arena")


def _tma_maps(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int | None,
              tile_n: int) -> TmaMaps:
    """The tensor-map geometry of both caches (kernels/tma.py), checked against the driver's
    limits before any kernel runs (ValueError)."""
    from drafter_attn.kernels import tma

    geos = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        geo = tma.geometry(tuple(cache.shape), _outer_stride(cache), page_size, tile_n,
                           cache.element_size())
        reason = tma.check(geo, cache.data_ptr())
        if reason:
            raise ValueError(f"{name}: tma=1 cannot map it: {reason}")
        geos.append(geo)
    return TmaMaps(str(k_cache.dtype).removeprefix("torch."), *geos)


def _check_kernel_inputs(ref: torch.Tensor, aligns, tensors) -> None:
    """What the kernels need beyond the contract: CUDA tensors, each aligned as `aligns` says."""
    if ref.device.type != "cuda":
        raise ValueError(f"the CUDA kernels need CUDA tensors, got {ref.device}")
    check_aligned(aligns, [0 if t is None else t.data_ptr() for t in tensors])


def _outer_stride(cache: torch.Tensor) -> int:
    """Elements from one page (slot) of `cache` to the next; a cache of one page has no stride
    of its own (torch reports any), so one packed page."""
    return cache.stride(0) if cache.shape[0] > 1 else math.prod(cache.shape[1:])  # 0 pages: one page's


def loc_stride(cache: torch.Tensor, page_size: int | None) -> int:
    """The cache's page (slot) stride in the kernels' unit (params.cuh, `loc_stride`): whole
    packed pages of Hkv * page * D elements for pages [., Hkv, page, D] (1 when packed, 2 for
    TensorRT-LLM's K/V pool views), token rows of Hkv * D for an arena [., max_ctx, Hkv, D].
    The contract already checked that each page or slot is packed."""
    unit = math.prod(cache.shape[1:]) if page_size else cache.shape[2] * cache.shape[3]
    stride = _outer_stride(cache)
    if stride % unit or stride // unit * cache.shape[0] >= 2**31:
        what = "one packed page" if page_size else "num_kv_heads * head_dim"
        raise ValueError(f"k/v cache stride {stride} must be a multiple of {what} = {unit} "
                         f"elements, fewer than 2**31 of them in all (the kernels' unit)")
    return stride // unit


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


BACKEND = CupyBackend()
