"""Stand-ins for the gateway's collaborators, without Ray: a clock, a classifier handle that
answers from a script, a recorder whose Ray metrics are spies, a ``/v1/stats`` body and a stats
window with hand-counted records. Plain helpers of the service's own objects are in
``helpers.py``."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from mita.hooks import STAGE_COLORS, VARIANT_COLORS
from mita.records import ForwardProfile, StageRecord

if TYPE_CHECKING:  # imported where used: the service's modules only when a test needs them
    from service.stats import StatsWindow


class FakeClock:
    """A module's ``time``: ``time()``/``monotonic()`` read ``now``; ``sleep`` is real (the
    recorder's refresh thread sleeps through it)."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def sleep(s: float) -> None:
        time.sleep(s)


def stats_body(summary: dict, weights: dict | None = None, shadow: bool = True) -> dict:
    """A summary completed as the gateway's ``/v1/stats`` completes it (the A/B split, the
    models, the colours), checked against ``StatsResponse``."""
    from service.schemas import StatsResponse
    from service.stats import ab_split

    body = dict(summary)
    body["ab"] = ab_split(body.pop("answered"), weights or {"mita": 0.8, "dense": 0.2}, shadow,
                          "x-client-key")
    body["models"] = {"mita": {"model_id": "listops-default@test", "attention": "mita",
                               "device": "cpu", "dtype": "float32", "m": 16, "k": 16, "s": 1},
                      "dense": {"model_id": "listops-default@test", "attention": "dense",
                                "device": "cpu", "dtype": "float32"}}
    body["stage_colors"], body["variant_colors"] = STAGE_COLORS, VARIANT_COLORS
    StatsResponse.model_validate(body)
    return body


def counted_window() -> StatsWindow:
    """Fixed records: 8 requests routed by the policy (6 mita, 2 dense), 5 that named dense
    (a load test's), one policy-routed 503; MiTA's stages from 2 staged forwards in N ≤ 1,024
    (too few) and 6 in N ≤ 4,096, dense's from 6 in each; three shadow comparisons."""
    from service.stats import StatsWindow

    w = StatsWindow(retention_s=60)
    for variant, override, times in (("mita", False, 6), ("dense", False, 2), ("dense", True, 5)):
        for i in range(times):
            w.add_request(variant, 200, 512, 0.01 * (i + 1), override=override)
    w.add_request("dense", 503)
    for bucket, mita_runs in (("le_1024", 2), ("le_4096", 6)):
        for i in range(mita_runs):
            w.add_forward("mita", bucket, {"qkv_proj": 13.7 - i, "attention": 3.0 + i})
        for i in range(6):
            w.add_forward("dense", bucket, {"qkv_proj": 2.0 + 0.1 * i, "attention": 9.0 + i})
    for primary, agree, kl in (("mita", True, 0.01), ("mita", True, 0.02), ("dense", False, 0.5)):
        w.add_shadow(primary, agree, kl)
    for variant in ("dense", "dense", "mita", "dense"):  # shadow calls that gave no comparison
        w.add_shadow_drop(variant)
    return w


class Spy:
    """Stands in for one Ray metric: keeps every call as (method, value, tags)."""

    def __init__(self):
        self.calls = []

    def inc(self, value, tags):
        self.calls.append(("inc", value, tags))

    def observe(self, value, tags):
        self.calls.append(("observe", value, tags))

    def set(self, value, tags):
        self.calls.append(("set", value, tags))


def spied_recorder():
    """A real ``Recorder`` whose Ray metrics are ``Spy``s."""
    from service.recorder import Recorder

    rec = Recorder()
    for name in list(vars(rec.metrics)):
        setattr(rec.metrics, name, Spy())
    return rec


class Call:
    """What ``handle.classify.remote(...)`` returns: awaitable, cancellable."""

    def __init__(self, outcome):
        self.outcome, self.cancelled = outcome, False

    def cancel(self):
        self.cancelled = True

    def __await__(self):
        async def answer():
            if isinstance(self.outcome, float):  # never answers in time
                await asyncio.sleep(self.outcome)
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return answer().__await__()


class Scripted:
    """A classifier handle answering from a script, one entry per call."""

    def __init__(self, *script):
        self.script, self.calls = list(script), []

    def remote(self, ids, staged):
        self.calls.append(Call(self.script.pop(0)))
        return self.calls[-1]


def answer() -> dict:
    profile = ForwardProfile(records=[StageRecord("attention", None, 1.0)], total_ms=1.0,
                             device="cpu", flops={"attention": 10}, dtype="float32",
                             batch_size=1, padded_n=3, started_at=0.0)
    return {"label": 1, "probabilities": [0.5, 0.5], "variant": "mita", "n": 3,
            "model_id": "m", "profile": profile, "replica": "r2"}
