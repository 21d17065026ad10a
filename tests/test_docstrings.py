"""The examples in the docstrings of the contract, the reference, the presets, the Runtime, the ops,
the registry and the syncing reference store run on the CPU and print what they say."""

from __future__ import annotations

import doctest

import pytest
import torch

from drafter_attn.kernels import contract, ops, presets, reference, registry, runtime, syncing_store
from drafter_attn.kernels.cache import random_arena_context, random_paged_context
from drafter_attn.kernels.presets import get_preset


def _contract_inputs() -> dict:
    """The names the contract's examples use: the main preset, contexts [100, 300], page 64,
    an arena of max_ctx 512, a 16-row store."""
    g = get_preset("qwen3-8b-dflash-b16")
    gen = torch.Generator().manual_seed(0)
    k_pages, v_pages, block_table, ctx_lens = random_paged_context(g, [100, 300], 64, "cpu", gen)
    k_arena, v_arena, slots, _ = random_arena_context(g, [100, 300], 512, "cpu", gen)
    q = torch.randn(2, 16, 32, 128, generator=gen).bfloat16()
    k_blk = torch.randn(2, 16, 8, 128, generator=gen).bfloat16()
    return dict(q=q, k_blk=k_blk, v_blk=k_blk.clone(), k_new=k_blk, v_new=k_blk.clone(),
                num_new=torch.tensor([3, 16], dtype=torch.int32), k_pages=k_pages, v_pages=v_pages,
                block_table=block_table, ctx_lens=ctx_lens, k_arena=k_arena, v_arena=v_arena,
                slots=slots)


@pytest.mark.parametrize("module, examples", [(reference, 4), (contract, 6), (presets, 1), (runtime, 6),
                                               (ops, 4), (registry, 10), (syncing_store, 1)],
                         ids=["reference", "contract", "presets", "runtime", "ops", "registry", "syncing_store"])
def test_docstring_examples(module, examples):
    globs = dict(vars(module), torch=torch, get_preset=get_preset,
                 random_paged_context=random_paged_context, random_arena_context=random_arena_context,
                 **_contract_inputs())
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, globs=globs) if t.examples]
    assert len(tests) == examples
    for t in tests:
        runner.run(t)
    assert runner.failures == 0
