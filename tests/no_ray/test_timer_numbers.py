"""Every number the profiler's stage timer shows a user, pinned on hand-made inputs: both
branches (CUDA on fake events), stage by stage and layer by layer, and the peak memory.

Expected values are worked out by hand (in the comments) or by an independent formula. Inputs
are binary fractions wherever a value is printed or compared exactly, so float equality is
exact.
"""

from __future__ import annotations

import types

import pytest
import torch

from mita import timer
from mita.timer import StageRecord, StageTimer

# --- stage timer: CUDA branch on fake events -------------------------------------------------


class FakeCuda:
    """``torch.cuda``'s timing API on a clock the test sets (``ms``), as the real one behaves:
    ``Event(enable_timing=True)``; ``record()`` takes the time now; an event is complete once
    it, or an event recorded after it on the stream, was synchronized; ``a.elapsed_time(b)``
    is the ms from a's record to b's, raising when either is not recorded, not timing, or not
    complete. Peak memory per device, reset calls recorded."""

    def __init__(self, peaks: dict[int, int]):
        self.ms, self.seq, self.done = 0.0, 0, 0
        self.made, self.syncs, self.resets = 0, 0, []
        self.peaks = peaks
        self.current = 0

    def patch(self, monkeypatch):
        monkeypatch.setattr(timer, "_FREE_EVENTS", {})
        monkeypatch.setattr(torch.cuda, "Event", self.event)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.resets.append)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                            lambda device: self.peaks[self.index(device)])
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        return self

    def index(self, device) -> int:
        """A device's index; "cuda" alone is the current device, as torch.cuda reads it."""
        index = torch.device(device).index
        return self.current if index is None else index

    def event(self, enable_timing: bool = False):
        self.made += 1
        return FakeEvent(self, enable_timing)


class FakeEvent:
    def __init__(self, cuda: FakeCuda, enable_timing: bool):
        self.cuda, self.timing, self.at, self.seq = cuda, enable_timing, None, None

    def record(self, stream=None):
        self.cuda.seq += 1
        self.at, self.seq = self.cuda.ms, self.cuda.seq

    def synchronize(self):
        self.cuda.syncs += 1
        self.cuda.done = max(self.cuda.done, self.seq)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        if max(self.seq, end.seq) > self.cuda.done:
            raise RuntimeError("device not ready")
        return end.at - self.at


def timed(t: StageTimer, clock, name: str, start: float, end: float):
    """One stage of ``t`` from ``start`` to ``end`` on ``clock`` (FakeCuda: ms; else ns)."""
    clock.ms = start
    with t.stage(name):
        clock.ms = end


def forward_at_known_times(t: StageTimer, clock):
    """A forward from 10.0 to 20.0: embed, block 1 then block 0 (out of order: the layer list
    is by index), attention twice in block 1 (summed), head."""
    clock.ms = 10.0
    with t.forward():
        timed(t, clock, "embed", 10.5, 11.0)  # 0.5
        with t.layer(1):
            timed(t, clock, "qkv_proj", 11.25, 12.0)  # 0.75
            timed(t, clock, "attention", 12.0, 14.0)  # 2.0
            timed(t, clock, "attention", 14.0, 14.25)  # 0.25
        with t.layer(0):
            timed(t, clock, "qkv_proj", 14.5, 15.0)  # 0.5
            timed(t, clock, "attention", 15.0, 18.0)  # 3.0
            timed(t, clock, "gather", 18.0, 18.0)  # 0.0
        timed(t, clock, "head", 18.5, 19.0)  # 0.5
        clock.ms = 20.0


EXPECTED_RECORDS = [StageRecord("embed", None, 0.5), StageRecord("qkv_proj", 1, 0.75),
                    StageRecord("attention", 1, 2.0), StageRecord("attention", 1, 0.25),
                    StageRecord("qkv_proj", 0, 0.5), StageRecord("attention", 0, 3.0),
                    StageRecord("gather", 0, 0.0), StageRecord("head", None, 0.5)]


def test_cuda_branch_times_every_stage_layer_and_peak_memory(monkeypatch):
    cuda = FakeCuda({0: 123_456_789}).patch(monkeypatch)
    t = StageTimer("cuda:0")
    forward_at_known_times(t, cuda)
    assert cuda.resets == [torch.device("cuda:0")]  # the peak window is this forward
    # attention: 2.0 + 0.25 + 3.0 = 5.25 ms → 21e6 FLOPs / 5.25e-3 s = 4 GFLOP/s; embed has
    # no FLOPs, gather no time, pool was not run: no rate for them.
    prof = t.result(flops={"attention": 21_000_000, "embed": 0, "gather": 7, "pool": 5},
                    activation_bytes=5)
    assert cuda.syncs == 1  # one synchronisation, on the last event
    assert prof.records == EXPECTED_RECORDS
    assert prof.total_ms == 10.0
    assert list(prof.stages_ms.items()) == [("embed", 0.5), ("qkv_proj", 1.25),
                                            ("attention", 5.25), ("gather", 0.0),
                                            ("head", 0.5)]
    assert prof.layers_ms == [{"qkv_proj": 0.5, "attention": 3.0, "gather": 0.0},
                              {"qkv_proj": 0.75, "attention": 2.25}]
    assert prof.gflops_per_s == {"attention": 4.0}
    # Measured on CUDA: the analytic estimate passed in is not what is reported.
    assert (prof.peak_memory_bytes, prof.peak_memory_kind) == (123_456_789, "cuda_max_allocated")
    # 8 stages + the forward, two events each: all made once, then free for reuse.
    assert cuda.made == 18 and len(timer._FREE_EVENTS[0]) == 18
    # Resolved once: asking again neither synchronises nor frees the events twice.
    assert t.result().records == EXPECTED_RECORDS
    assert cuda.syncs == 1 and len(timer._FREE_EVENTS[0]) == 18


def test_cuda_events_are_recycled_per_device_without_mixing_timers(monkeypatch):
    cuda = FakeCuda({0: 1000, 3: 3000}).patch(monkeypatch)
    first = StageTimer("cuda:0")
    forward_at_known_times(first, cuda)
    first.result()
    # Two timers open at once on device 0, interleaved: both take recycled events, none new.
    a, b = StageTimer(torch.device("cuda:0")), StageTimer("cuda:0")
    cuda.ms = 100.0
    with a.forward():
        cuda.ms = 101.0
        with b.forward():
            timed(a, cuda, "ffn", 102.0, 104.0)
            timed(b, cuda, "ffn", 104.0, 104.5)
            cuda.ms = 105.0
        cuda.ms = 108.0
    assert cuda.made == 18 and len(timer._FREE_EVENTS[0]) == 18 - 8
    pa, pb = a.result(), b.result()
    assert (pa.records, pa.total_ms) == ([StageRecord("ffn", None, 2.0)], 8.0)
    assert (pb.records, pb.total_ms) == ([StageRecord("ffn", None, 0.5)], 4.0)
    assert len(timer._FREE_EVENTS[0]) == 18
    # The first timer's numbers stay its own after its events were recorded again.
    assert first.result().records == EXPECTED_RECORDS and first.result().total_ms == 10.0
    # "cuda" alone is the current device (3 here): its own free list, its own events, its peak.
    cuda.current = 3
    other = StageTimer("cuda")
    cuda.ms = 0.0
    with other.forward():
        cuda.ms = 1.5
    assert cuda.made == 20 and sorted(timer._FREE_EVENTS) == [0, 3]
    prof = other.result()
    assert (prof.total_ms, prof.peak_memory_bytes, prof.device) == (1.5, 3000, "cuda")
    assert len(timer._FREE_EVENTS[3]) == 2 and len(timer._FREE_EVENTS[0]) == 18
    # An explicit index is that device, whichever is current.
    with StageTimer("cuda:1").forward():
        pass
    assert sorted(timer._FREE_EVENTS) == [0, 1, 3]


def test_cuda_free_list_stops_growing_at_its_cap(monkeypatch):
    cuda = FakeCuda({0: 0}).patch(monkeypatch)
    monkeypatch.setattr(timer, "_MAX_FREE_EVENTS", 4)
    a, b = StageTimer("cuda:0"), StageTimer("cuda:0")
    for t in (a, b):  # both record before either resolves: 8 new events
        with t.forward():
            timed(t, cuda, "ffn", 1.0, 2.0)
    a.result()
    assert len(timer._FREE_EVENTS[0]) == 4  # 0 < 4: a's four are kept
    b.result()
    assert len(timer._FREE_EVENTS[0]) == 4  # full (4 is not < 4): b's are dropped


def test_cpu_branch_reads_the_host_clock_in_ns(monkeypatch):
    monkeypatch.setattr(timer, "_FREE_EVENTS", {})
    clock = types.SimpleNamespace(ms=0)  # here the "clock" holds ns
    monkeypatch.setattr(timer, "time", types.SimpleNamespace(perf_counter_ns=lambda: clock.ms))
    t = StageTimer()  # the default: the CPU
    with pytest.raises(RuntimeError, match=r"^no forward recorded: wrap the model call in "
                                           r"timer\.forward\(\)$"):
        t.result()
    clock.ms = 1_000_000_000
    with t.forward():
        with t.layer(2):
            with t.layer(5):
                timed(t, clock, "ffn", 1_001_000_000, 1_003_500_000)  # 2.5 ms
            timed(t, clock, "ffn", 1_004_000_000, 1_004_250_000)  # block 2 again: 0.25 ms
        timed(t, clock, "head", 1_005_000_000, 1_005_125_000)  # 0.125 ms
        clock.ms = 1_006_000_000
    prof = t.result(activation_bytes=4096)
    assert prof.records == [StageRecord("ffn", 5, 2.5), StageRecord("ffn", 2, 0.25),
                            StageRecord("head", None, 0.125)]
    assert prof.total_ms == 6.0 and prof.device == "cpu"
    assert prof.layers_ms == [{"ffn": 0.25}, {"ffn": 2.5}]
    assert (prof.peak_memory_bytes, prof.peak_memory_kind) == (4096,
                                                               "analytic_activation_estimate")
    assert (t.result().peak_memory_bytes, t.result().peak_memory_kind) == (None, None)
    assert timer._FREE_EVENTS == {-1: []}  # CPU: a key no CUDA index takes, never filled


def test_a_stage_or_layer_left_by_an_exception_is_still_recorded_and_restored(monkeypatch):
    clock = types.SimpleNamespace(ms=0)
    monkeypatch.setattr(timer, "time", types.SimpleNamespace(perf_counter_ns=lambda: clock.ms))
    t = StageTimer()
    with t.forward():
        with pytest.raises(ValueError, match="^inside$"), t.layer(3):
            clock.ms = 2_000_000
            with t.stage("attention"):
                clock.ms = 2_750_000
                raise ValueError("inside")
        timed(t, clock, "head", 3_000_000, 3_500_000)  # outside any block again
    assert t.result().records == [StageRecord("attention", 3, 0.75),
                                  StageRecord("head", None, 0.5)]


def test_profile_forward_estimates_memory_in_the_models_dtype():
    """CPU: ``profile_forward``'s peak memory is the analytic estimate in the weights' dtype —
    a bfloat16 model's is half the float32 one's (2 bytes an element against 4). A mutant
    that let the estimate default to float32 passed every other test, which profile float32
    models only."""
    from mita.cost import activation_bytes_estimate
    from mita.model import EncoderClassifier, ModelConfig

    cfg = ModelConfig(dim=32, depth=2, num_heads=2, ffn_dim=64, num_landmarks=8, topk=16)
    torch.manual_seed(3)
    model = EncoderClassifier(cfg).eval()
    ids = torch.randint(1, cfg.vocab_size, (2, 96))
    _, p32 = timer.profile_forward(model, ids)
    _, p16 = timer.profile_forward(model.to(torch.bfloat16), ids)
    assert p32.peak_memory_bytes == 2 * p16.peak_memory_bytes
    assert p16.peak_memory_bytes == activation_bytes_estimate(cfg, 2, 96, torch.bfloat16) > 0
    assert p16.peak_memory_kind == "analytic_activation_estimate"
