"""The host-side launch model of the cupy kernels, CPU only: the split-KV count from the wave
model (kernels.cupy_backend.choose_splits) and CTAs per SM from a module's resources."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("cupy")

from drafter_attn.kernels.cupy_backend import _Module, choose_splits  # noqa: E402
from tests.test_ops import planning  # noqa: E402,F401 (fixture)

H200_SMS = 132


def _waves(batch, hkv, splits, resident):
    return math.ceil(batch * hkv * splits / (H200_SMS * resident))


def test_batch_one_fills_one_wave():
    # 8 KV heads: 16 splits make 128 CTAs, one wave of 132 slots; 17 would spill into a second
    for ctx in (2048, 8192, 32768):
        s = choose_splits(1, 8, ctx + 16, 64, H200_SMS, resident=1)
        assert s == 16 and _waves(1, 8, s, 1) == 1
    # two CTAs per SM: twice the slots, twice the splits
    assert choose_splits(1, 8, 8192 + 16, 64, H200_SMS, resident=2) == 33


def test_a_full_gpu_is_not_split():
    # 32 x 8 = 256 CTAs already fill two waves: splitting adds waves and per-CTA cost
    assert choose_splits(32, 8, 8192 + 16, 64, H200_SMS, resident=1) == 1
    assert choose_splits(64, 8, 32768, 64, H200_SMS, resident=2) == 1


def test_every_split_keeps_two_tiles_and_the_cap():
    # 3 tiles of context: at most one split (each split must stream at least two tiles)
    assert choose_splits(1, 1, 150, 64, H200_SMS, resident=1) == 1
    assert choose_splits(1, 1, 64 * 40, 64, H200_SMS, resident=1) == 20
    assert choose_splits(1, 1, 1 << 20, 64, H200_SMS, resident=4, max_splits=48) == 48
    for batch in (1, 2, 3, 8, 17, 32):
        for kv in (100, 2048, 8192, 65536):
            s = choose_splits(batch, 8, kv, 64, H200_SMS, resident=2)
            assert 1 <= s <= max(1, -(-kv // 64) // 2) and s <= 64


def test_more_splits_only_when_they_shorten_the_step():
    # the chosen count is never beaten by another count under the model's own cost: waves of
    # tiles plus two a CTA, and, once the grid needs a second wave, the partial rows written
    # and read back
    def cost(batch, s, tiles, resident, rows=64, tile_n=64):
        slots = H200_SMS * resident
        part = 2 * rows / tile_n * batch * 8 * s / slots if s > 1 and batch * 8 * s > slots else 0
        return _waves(batch, 8, s, resident) * (tiles / s + 2) + part

    for batch in (1, 2, 4, 8, 12, 16):
        for resident in (1, 2, 3):
            for ctx, rows in ((8192, 64), (131072, 64), (8192, 16)):
                s = choose_splits(batch, 8, ctx, 64, H200_SMS, resident, rows=rows)
                tiles = ctx // 64
                assert all(cost(batch, s, tiles, resident, rows) <= cost(batch, t, tiles, resident, rows) + 1e-9
                           for t in range(1, 65))


def test_long_contexts_take_one_wave_once_partials_count():
    """At ctx 128k the wave model alone found 33 splits in several waves as good as one wave;
    the partial rows every split writes and the combine reads back tip it to one wave. On the
    H200 (page 64, one layer, two rounds): B=2 16 splits 254.6 us against 33's 265.0, B=4 8
    splits 491 against 522, B=8 4 splits 961.5 against 1024 (results/perf-notes.md, "The split
    count at long contexts"). B=1 keeps 33 (one wave either way): 137.5 us against 148.4 for 16."""
    kv = 131072 + 16
    assert [choose_splits(b, 8, kv, 64, H200_SMS, 2) for b in (1, 2, 4, 8)] == [33, 16, 8, 4]
    assert [choose_splits(b, 8, kv, 64, H200_SMS, 2, rows=0) for b in (1, 2, 4, 8)] == [33, 33, 33, 33]
    assert choose_splits(1, 8, 4 * 131072 + 16, 64, H200_SMS, 2) == 33  # 512k: one wave already


def test_partials_never_empty_a_wave_that_fills_the_gpu():
    """laguna's 144-row CTAs (the padded and 9-warp paths, one CTA a (request, KV head)) at its
    512-token window: B=8 is 64 CTAs, and 2 splits fill one wave of 132 one-CTA slots. Charging
    the partials inside that wave took it to 1 split (half the SMs idle), 28-34% slower over 64
    candidates of the sm90 profile; B=1 likewise to 5 splits from 8-16, 9-19% slower. Beyond
    one wave they still count: its 48-row CTAs at B=8 (192 already, 1.45 waves) stay unsplit,
    15-18% faster than 2 splits."""
    laguna_kv = 512
    assert [choose_splits(8, 8, laguna_kv, t, H200_SMS, 1, rows=144) for t in (16, 32)] == [2, 2]
    assert [choose_splits(1, 8, laguna_kv, t, H200_SMS, 1, rows=144) for t in (16, 32)] == [16, 8]
    assert [choose_splits(24, 8, laguna_kv, t, H200_SMS, 1, rows=48) for t in (32, 64)] == [1, 1]
    assert [choose_splits(24, 8, laguna_kv, t, H200_SMS, 1, rows=0) for t in (32, 64)] == [2, 2]


@pytest.mark.parametrize("smem, regs, threads, resident", [
    (104 * 1024, 128, 128, 2),   # smem: 2 x (104 + 1) KB fit in 228 KB, 3 do not
    (48 * 1024, 255, 128, 2),    # registers: 256 per thread x 128 threads = 32k regs per CTA
    (16 * 1024, 64, 128, 8),     # 64 regs: 8 CTAs by registers, 13 by smem
    (143 * 1024, 168, 288, 1),   # laguna's 9 warps with Q in smem: one CTA per SM
    (1024, 16, 32, 32),          # tiny CTAs: capped at 32 per SM
])
def test_resident_ctas(smem, regs, threads, resident):
    mod = _Module(attention=None, combine=None, store=None, smem=smem, regs=regs, threads=threads)
    assert mod.resident_ctas() == resident


def test_ctas_per_sm_caps_the_waves_slots(planning, monkeypatch):
    """`ctas_per_sm=1` plans one CTA an SM (each CTA more tiles): at B=1 ctx 8k on the H200 with
    cupy:lean=1, 16 splits ran 4.8% faster than the 33 of two an SM
    (results/sm90-2026-12-02/lean/)."""
    from tests.test_ops import HKV, _plan, trtllm_pool_case

    assert choose_splits(1, 8, 8192, 64, H200_SMS, 1) == 16  # that shape: one CTA an SM
    assert choose_splits(1, 8, 8192, 64, H200_SMS, 2) == 33
    cb_, backend = planning
    monkeypatch.setattr(cb_, "device_info", lambda index: (16, 90))  # a small GPU: caps bind
    case, _ = trtllm_pool_case("cpu", batch=1, max_pages=512, num_pages=520)
    resident = cb_.Module(0, 0, 0, 60_000, 128, 128).resident_ctas()
    assert resident == 3  # the stand-in modules' shared memory
    splits = {}
    for cap, slots in ((0, resident), (1, 1), (2, 2)):
        _, plan = _plan(cb_, backend.with_params(ctas_per_sm=cap), case)
        splits[cap] = plan.splits
        assert plan.splits == choose_splits(1, HKV, 512 * 16, 64, 16, slots), cap
    assert splits[1] < splits[2] < splits[0]


def test_ctas_per_sm_takes_the_tunables_values():
    from drafter_attn.kernels import registry

    assert registry.from_spec("cupy:ctas_per_sm=1").with_params(ctas_per_sm=2) is not None
    with pytest.raises(ValueError, match="ctas_per_sm=-1 must be one of"):
        registry.from_spec("cupy:ctas_per_sm=-1")


def test_pairs_take_even_counts_and_two_at_batch_eight():
    """`pairs` (the ws kernel's `pair`): only even split counts, at least two even where the
    context holds fewer tiles; B=8 over 8 KV heads fills one ws wave with two (64 pairs), as the
    unpaired model does, and B=1 with 16 (8 partials for the combine)."""
    assert choose_splits(8, 8, 8192 + 16, 32, H200_SMS, resident=1) == 2
    assert choose_splits(8, 8, 8192 + 16, 32, H200_SMS, resident=1, pairs=True) == 2
    assert choose_splits(1, 8, 8192 + 16, 32, H200_SMS, resident=1, pairs=True) == 16
    assert choose_splits(1, 1, 40, 32, H200_SMS, resident=1, pairs=True) == 2  # one tile
    for batch, ctx in ((1, 2048), (2, 8192), (3, 32768), (5, 131072), (32, 8192)):
        s = choose_splits(batch, 8, ctx, 32, H200_SMS, resident=1, pairs=True)
        assert s >= 2 and s % 2 == 0, (batch, ctx, s)
