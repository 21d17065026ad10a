"""The per-call plan lookup's fast path: the last plan of each call form, behind one C++ check of
the call's tensors.

A plan key (kernels.cupy_backend.call_key) reads shape, strides, dtype and device of every tensor
of a call in Python, about 3.5 us for an attention call on the H200's host, a third of the
per-call budget. torch already has that comparison in C++: the tensor check torch.compile runs
on every call of a compiled function (`torch._C._dynamo.guards.TensorGuards`: dispatch keys,
dtype, device index, requires_grad, sizes and strides): 1.3 us for an attention call's seven
tensors against 3.3 us for the key (H200 host, results/sm90-2026-12-03/session17/run3/). A
`RecentPlans` keeps, for each call form (the call kind and its scalar arguments), the last plan
and a check built from the tensors of the call that planned it; a later call whose tensors pass
the check has everything the plan key holds equal to that call's, so it is the same validated
call. Any difference (including requires_grad or inference-mode tensors, which the key ignores)
is only a miss: the key path runs as before.

`TensorGuards` is private to torch. It is used only after a self-test shows it accepts equal
tensors and rejects each kind of difference the key holds; otherwise (another torch, another
signature) `RecentPlans` holds nothing and every call takes the key path.
"""

from __future__ import annotations

import functools

import torch


def _build(tensors):
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


@functools.cache
def available() -> bool:
    """Whether torch's tensor check can be built and tells tensors apart as a plan key does."""
    try:
        a = torch.zeros(2, 4, dtype=torch.int32)
        b = torch.zeros(3)
        check = _build((a, b))
        differ = (torch.zeros(2, 4, dtype=torch.int64),  # dtype
                  torch.zeros(2, 5, dtype=torch.int32),  # shape
                  torch.zeros(4, 2, dtype=torch.int32).t(),  # strides
                  torch.zeros(8, dtype=torch.int32))  # rank
        return (check.check(a, b) and check.check(a.clone(), torch.ones(3))
                and not any(check.check(x, b) for x in differ)
                and not check.check(a, None))
    except Exception:  # noqa: BLE001 - any failure means: do without it
        return False


class RecentPlans:
    """The last plan of each call form, with the check of the tensors it was planned for.

    `form`: a hashable of everything but the tensors that the plan depends on (the call kind and
    its Python arguments); `tensors`: the call's tensors, each a `torch.Tensor` (the caller drops
    an absent `out`, and the form says whether it was given). One entry per form: a loop over
    one shape hits every call, and a new shape replaces the form's entry."""

    __slots__ = ("_by_form", "enabled")

    def __init__(self):
        self._by_form: dict = {}
        self.enabled = available()

    def get(self, form, tensors):
        """The plan recorded for `form` if `tensors` match its tensors' metadata, else None."""
        hit = self._by_form.get(form)
        if hit is not None and hit[0].check(*tensors):
            return hit[1]
        return None

    def put(self, form, tensors, plan) -> None:
        if self.enabled:
            if len({id(t) for t in tensors}) != len(tensors):
                # one tensor passed twice (k_blk as v_blk): torch's check never passes such a
                # call, so an entry would only be rebuilt, at 7 us, on every call
                return
            try:
                self._by_form[form] = (_build(tensors), plan)
            except TypeError:  # not tensors (a plan is only put after validation, so rare)
                pass

    def clear(self) -> None:
        self._by_form.clear()
