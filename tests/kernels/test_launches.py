"""GPU launches of one MiTA attention call on the Triton path (``mita_triton``, s = 1), counted
stage by stage under the CPU interpreter.

Each launch costs a few microseconds of host time (and a node of a captured CUDA graph)
whatever N is, so at serving sizes a call's launch count is part of its latency.

What counts as one launch:
- every ATen operation the call dispatches (seen by a ``TorchDispatchMode``), except pure view
  and metadata operations (view, expand, slice, select, transpose, t, permute, unsqueeze,
  squeeze, as_strided, detach, alias, _unsafe_view — a reshape that is a view dispatches
  these), allocations (empty, empty_like, empty_strided: no kernel runs) and size, stride or
  type queries. A fused library kernel (SDPA) is one launch, and so is a factory that fills
  (zeros); a copy or cast (_to_copy, clone) is one.
- every Triton kernel launch, ``kernel[grid](...)``, which under the interpreter enters
  ``InterpretedFunction.run``.
While a Triton kernel runs, the interpreter copies its tensor arguments to numpy and back with
ATen operations of its own; a GPU launch has no such copies, so counting pauses inside a
launch (``test_interpreter_copies_are_not_counted`` checks there were some).

The top-k stage (inside ``landmark_scores``: the path ``mita.kernels.choose`` picks) is counted
apart from the others: the budget is ≤ 15 launches per call, ≤ 10 of them outside the top-k
stage (the tile table is a counting sort split across N: zeroed counters, count, scan,
scatter — four launches where one serial program per (batch, head) was one). Both Triton
top-k paths are counted (``MITA_TOPK_PATH``).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mita import mita_attention

from ..helpers import rand_qkv, random_mask, triton_interpreter

# heavy(4): ~46 CPU s in a serial run
pytestmark = [pytest.mark.slow, pytest.mark.heavy(4)]  # the Triton interpreter: ~1.5 min on 2 cores

NOT_LAUNCHES = frozenset({
    # views and metadata
    "view", "_unsafe_view", "_reshape_alias", "view_as", "expand", "slice", "select",
    "transpose", "t", "permute", "unsqueeze", "squeeze", "as_strided", "detach", "alias",
    "unbind", "split", "narrow", "diagonal",
    # allocations: no kernel runs
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    # size, stride and type queries
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous",
    "promote_types", "result_type",
})
TOPK_STAGE = "landmark_scores"  # the top-k path runs inside it
TOTAL_BUDGET, OTHER_STAGES_BUDGET = 15, 10
SHAPE = dict(B=2, H=2, N=128, d=32, m=16, k=16)  # no launch depends on N, m, k (k ≤ 512)

# The launches of one call, per stage, worked out from mita/kernels (triton_mita.mita_triton
# and the functions it calls), in order:
EXPECTED = {
    "no mask": {
        # _pool_kernel: the landmarks (float32 and the input dtype), landmark_valid and the
        # int8 key vector (all ones) in one launch
        "pool": ["triton:_pool_kernel"],
        "landmark_scores": None,  # TOPK below
        # one SDPA call on the landmarks already in the input dtype (the CPU's fused kernel)
        "shared_compress": ["_scaled_dot_product_flash_attention_for_cpu"],
        # route_shared: argmax + shared half; landmark_valid is read as int8 in place
        "route": ["triton:_route_shared_kernel"],
        # fused_attention: the tile table (zeroed counters; count, scan, scatter), then the
        # attention kernel
        "attention": ["zeros", "triton:_tile_count_kernel", "triton:_tile_scan_kernel",
                      "triton:_tile_scatter_kernel", "triton:_mita_fused_kernel"],
    },
    "mask": {
        # the running padding count the pool kernel's binary search reads, then the kernel
        # (which also writes the int8 key vector and SDPA's additive bias)
        "pool": ["cumsum", "triton:_pool_kernel"],
        "landmark_scores": None,  # TOPK below; key_valid reused
        "shared_compress": ["_scaled_dot_product_flash_attention_for_cpu"],  # bias reused
        "route": ["triton:_route_shared_kernel"],
        # + zeroing the padded queries' rows, which get no tile
        "attention": ["zeros", "triton:_tile_count_kernel", "triton:_tile_scan_kernel",
                      "triton:_tile_scatter_kernel", "triton:_mita_fused_kernel",
                      "masked_fill_"],
    },
}


# The top-k stage per path (the same with and without a mask: the int8 key vector is the pool
# kernel's): the threshold select's group max (which also zeroes the candidate counters), θ,
# filter (group max and filter one scoring kernel), select and the fallback (launched always:
# it returns at once when no landmark needs it); the bitonic kernel and the same fallback for
# a landmark that did not take exactly k. Buffers are allocated empty.
TOPK = {
    "select": ["triton:_select_pass_kernel", "triton:_theta_kernel",
               "triton:_select_pass_kernel", "triton:_select_kernel",
               "triton:_bisect_topk_kernel"],
    "bitonic": ["triton:_landmark_topk_kernel", "triton:_bisect_topk_kernel"],
}


class LaunchCounter(TorchDispatchMode):
    """Launches by stage (``launches[stage]``: op or ``triton:<kernel>`` names, in order), as
    the module docstring defines them; ``interpreter_ops`` counts what ran inside launches."""

    def __init__(self):
        super().__init__()
        self.stage = None
        self.launches = defaultdict(list)
        self.inside_kernel = 0
        self.interpreter_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.inside_kernel:
            self.interpreter_ops += 1
        elif name not in NOT_LAUNCHES:
            self.launches[self.stage].append(name)
        return func(*args, **(kwargs or {}))


class StageRecorder:
    """A ``StageHook`` that tells the counter which stage runs."""

    def __init__(self, counter: LaunchCounter):
        self.counter = counter

    @contextmanager
    def stage(self, name):
        self.counter.stage = name
        try:
            yield
        finally:
            self.counter.stage = None

    def layer(self, index):
        return nullcontext()


@pytest.fixture(scope="module")
def interpreted():
    with triton_interpreter():
        yield


@pytest.fixture
def counter(interpreted, monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    counter = LaunchCounter()
    run = InterpretedFunction.run

    def counted_run(kernel, *args, **kwargs):
        counter.launches[counter.stage].append(f"triton:{kernel.fn.__name__}")
        counter.inside_kernel += 1
        try:
            return run(kernel, *args, **kwargs)
        finally:
            counter.inside_kernel -= 1

    monkeypatch.setattr(InterpretedFunction, "run", counted_run)
    return counter


def counted_call(counter, dtype, masked):
    """One ``mita_triton`` call at ``SHAPE``, called directly: ``mita_attention``'s argument
    checks before it (the mask's all-padding-row check reads the device) are not part of the
    Triton path. Returns the output and the inputs."""
    from mita.kernels.triton_mita import mita_triton

    B, H, N, d, m, k = SHAPE.values()
    q, kk, v = (t.to(dtype) for t in rand_qkv(B, H, N, d, seed=5, dtype=torch.float32))
    mask = random_mask(B, N, seed=2, suffix=False) if masked else None
    with counter:
        out = mita_triton(q, kk, v, m, k, 1, mask, None, "paper", StageRecorder(counter))
    return out, (q, kk, v, mask)


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "mask"])
@pytest.mark.parametrize("dtype,path", [(torch.float32, "select"), (torch.bfloat16, "select"),
                                        (torch.float32, "bitonic")])
def test_launches_per_call(counter, dtype, path, masked, monkeypatch):
    monkeypatch.setenv("MITA_TOPK_PATH", path)
    out, (q, k, v, mask) = counted_call(counter, dtype, masked)
    launches = dict(counter.launches)
    assert launches == EXPECTED["mask" if masked else "no mask"] | {TOPK_STAGE: TOPK[path]}
    assert None not in launches  # nothing launched outside a stage
    kernels = [name for names in launches.values() for name in names
               if name.startswith("triton:")]
    # pool, the top-k's kernels, route_shared, tile table (3), attention: all seen
    assert len(kernels) == 6 + len([n for n in TOPK[path] if n.startswith("triton:")])
    total = sum(map(len, launches.values()))
    assert total <= TOTAL_BUDGET
    assert total - len(launches[TOPK_STAGE]) <= OTHER_STAGES_BUDGET
    assert out.dtype == dtype and torch.isfinite(out).all()
    if dtype == torch.float32:  # the counted call computed MiTA: the PyTorch path, 1e-5
        # relative as in test_kernels.py (IEEE fp32 products, fp32 softmax over ≤ 32 keys)
        ref = mita_attention(q.double(), k.double(), v.double(), num_landmarks=SHAPE["m"],
                             topk=SHAPE["k"], key_padding_mask=mask, backend="torch")
        assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_interpreter_copies_are_not_counted(counter):
    """The interpreter does issue ATen copies of its own inside a launch; none reached the
    count (the expected lists above have none of its copy_ / clone operations)."""
    counted_call(counter, torch.float32, masked=True)
    assert counter.interpreter_ops > 10
    assert not {"copy_", "clone", "_to_copy"} & {n for names in counter.launches.values()
                                                  for n in names}
