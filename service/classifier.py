"""Classifier deployment: one class, two deployments (``mita`` and ``dense``), one checkpoint.

A thin Serve wrapper around ``service.engine.ClassifierEngine``, which holds all the serving
logic (device, dtype, grouping, padding, profiled forward, probabilities) and runs without Ray.
Requests arrive one sequence each (a numpy array of ids) and are batched by ``@serve.batch``;
forwards run in a worker thread (the event loop stays free for health checks and queueing).
Every request's stage times are recorded as metrics; the timings go back in the response.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import ray
from ray import serve

from .engine import ClassifierEngine
from .metrics import ServiceMetrics, n_bucket
from .schemas import ClassifierConfig, validated

GAUGE_REFRESH_S = 5.0


@serve.deployment
class Classifier:
    """Args: ``checkpoint`` folder, ``attention`` (``mita`` | ``dense``), ``device``
    (``auto`` | ``cpu`` | ``cuda``), ``mita_backend`` (``mita_attention``'s ``backend``),
    ``dtype`` (``auto`` | ``float32`` | ``bfloat16`` | ``float16``; auto: bfloat16 on CUDA,
    float32 on CPU). ``user_config``: ``max_batch_size``, ``batch_wait_timeout_s``,
    ``deterministic``, ``staged_profile_every`` (a fused MiTA backend runs every n-th forward
    with each stage timed apart; 0: only on request). Stage metrics come from staged forwards
    only, so a stage name always means the same work."""

    def __init__(self, checkpoint: str, attention: str, device: str = "auto",
                 mita_backend: str = "auto", dtype: str = "auto", cuda_graphs: bool = True):
        self.engine = ClassifierEngine(checkpoint, attention, device, mita_backend, dtype,
                                       cuda_graphs)
        # The replica id changes when Serve replaces the replica (crash, OOM kill): tests and
        # operators can see a restart.
        self.info_dict = self.engine.info | {
            "replica": serve.get_replica_context().replica_id.unique_id,
            # The GPUs Ray assigned this replica (CUDA_VISIBLE_DEVICES); [] without num_gpus.
            "gpu_ids": ray.get_runtime_context().get_accelerator_ids().get("GPU", [])}
        self.metrics = ServiceMetrics()
        self.deterministic = True
        # Ray drops a gauge series that is not set for a while (~20 s), so the last peak
        # memory is set again every few seconds while the replica lives.
        self._peak: dict[tuple[str, str], int] = {}
        threading.Thread(target=self._keep_gauges, daemon=True,
                         name="peak-memory-gauge").start()

    def reconfigure(self, config: dict) -> None:
        """Apply a ``user_config``, parsed strictly (``schemas.ClassifierConfig``); a refusal
        names the deployment and the fields, and Serve keeps the deployment unhealthy."""
        name = serve.get_replica_context().deployment
        cfg = validated(ClassifierConfig, config, f"deployment {name!r} user_config")
        self.deterministic = cfg.deterministic
        self.engine.staged_every = cfg.staged_profile_every
        self.classify_batch.set_max_batch_size(cfg.max_batch_size)
        self.classify_batch.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)

    def info(self) -> dict:
        return self.info_dict | {"deterministic": self.deterministic,
                                 "staged_profile_every": self.engine.staged_every}

    async def classify(self, ids: np.ndarray, staged: bool = False) -> dict:
        """Classify one validated id sequence; returns label, probabilities, n, model_id,
        variant and the profile of the forward it was part of (``staged``: time every stage
        of that forward apart)."""
        return await self.classify_batch(ids, staged)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def classify_batch(self, batch: list[np.ndarray], staged: list[bool]) -> list[dict]:
        return await asyncio.to_thread(self.engine.run, batch, self.deterministic,
                                       self._record, staged)

    def _record(self, lengths: list[int], profile: dict) -> None:
        m, variant = self.metrics, self.engine.variant
        for n in lengths:
            tags = {"variant": variant, "n_bucket": n_bucket(n)}
            for stage, ms in (profile["stages_ms"] if profile["staged"] else {}).items():
                m.stage_duration.observe(ms / 1e3, tags | {"stage": stage})
            m.forward_duration.observe(profile["total_ms"] / 1e3, tags)
            m.tokens.inc(n, {"variant": variant})
        m.flops.inc(profile["flops_total"], {"variant": variant})
        if profile["peak_memory_bytes"] is not None:
            self._peak[(variant, profile["peak_memory_kind"])] = profile["peak_memory_bytes"]
            self._set_gauges()

    def _set_gauges(self) -> None:
        for (variant, kind), value in list(self._peak.items()):
            self.metrics.peak_memory.set(value, {"variant": variant, "kind": kind})

    def _keep_gauges(self, period_s: float = GAUGE_REFRESH_S) -> None:
        while True:
            time.sleep(period_s)
            self._set_gauges()
