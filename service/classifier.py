"""Classifier deployment: one class, two deployments (``mita`` and ``dense``), one checkpoint.

Requests arrive one sequence each and are batched by ``@serve.batch``. With
``deterministic: true`` (the default) every sequence of a batch then runs as its own forward,
unpadded: the same request gives bit-identical probabilities whatever else arrived with it (a
padded or larger batch changes BLAS blocking and the float32 rounding, ~1e-7). With
``deterministic: false`` a batch is split into groups of similar length (power-of-two length
buckets), each group padded with the model's key padding mask and run as one forward — up to
2× the throughput for short sequences on CPU, ~5 % at N = 2000. Forwards run in a worker
thread (the event loop stays free for health checks and queueing). Every request's stage
times are recorded as metrics; the timings go back in the response when asked for.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import torch
from ray import serve

from mita.model import checkpoint_metadata, load_checkpoint, set_mita_backend
from profiler.cost import profile_forward

from . import PROJECT_ROOT
from .metrics import ServiceMetrics, n_bucket


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint folder; relative paths are taken from the project root."""
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices grouped by power-of-two length bucket (⌈log2 n⌉), so padding at most doubles
    a sequence's length. Deterministic: groups in bucket order, indices ascending."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(math.ceil(math.log2(max(n, 1))), []).append(i)
    return [groups[b] for b in sorted(groups)]


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@serve.deployment
class Classifier:
    """Args: ``checkpoint`` folder, ``attention`` (``mita`` | ``dense``), ``device``
    (``auto`` | ``cpu`` | ``cuda``), ``mita_backend`` (``mita_attention``'s ``backend``:
    ``torch`` times every MiTA stage apart; ``auto`` runs the compiled CPU kernels or the Triton
    kernel, which report fewer, fused stages). ``user_config``: ``max_batch_size``,
    ``batch_wait_timeout_s``, ``deterministic``."""

    def __init__(self, checkpoint: str, attention: str, device: str = "auto",
                 mita_backend: str = "auto"):
        folder = resolve_checkpoint(checkpoint)
        self.device = pick_device(device)
        self.model = load_checkpoint(folder, device=self.device, attention=attention)
        set_mita_backend(self.model, mita_backend)
        self.variant = attention
        meta = checkpoint_metadata(folder)
        self.model_id = f"{folder.name}@{meta['weights_sha256'][:12]}"
        self.info_dict = {
            "variant": attention, "model_id": self.model_id, "device": str(self.device),
            "mita_backend": mita_backend if attention == "mita" else None,
            # Changes when Serve replaces the replica (crash, OOM kill): tests and operators
            # can see a restart.
            "replica": serve.get_replica_context().replica_id.unique_id,
            "torch_threads": torch.get_num_threads(),
            "config": meta["config"] | {"attention": attention},
            "training": meta.get("training", {}),
        }
        self.metrics = ServiceMetrics()
        self.deterministic = True

    def reconfigure(self, config: dict) -> None:
        self.deterministic = bool(config.get("deterministic", True))
        self.classify_batch.set_max_batch_size(int(config.get("max_batch_size", 8)))
        self.classify_batch.set_batch_wait_timeout_s(
            float(config.get("batch_wait_timeout_s", 0.005)))

    def info(self) -> dict:
        return self.info_dict

    async def classify(self, ids: list[int]) -> dict:
        """Classify one validated id sequence; returns label, probabilities, n, model_id,
        variant and the profile of the forward it was part of."""
        return await self.classify_batch(ids)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def classify_batch(self, batch: list[list[int]]) -> list[dict]:
        return await asyncio.to_thread(self._run, batch)

    def _run(self, batch: list[list[int]]) -> list[dict]:
        results: list[dict | None] = [None] * len(batch)
        pad = self.model.config.pad_id
        groups = ([[i] for i in range(len(batch))] if self.deterministic
                  else length_groups([len(x) for x in batch]))
        for group in groups:
            n_max = max(len(batch[i]) for i in group)
            ids = torch.full((len(group), n_max), pad, dtype=torch.long)
            mask = torch.ones(len(group), n_max, dtype=torch.bool)
            for row, i in enumerate(group):
                ids[row, : len(batch[i])] = torch.tensor(batch[i], dtype=torch.long)
                mask[row, : len(batch[i])] = False
            # No padding in the group: no mask (dense SDPA can then take its flash path).
            mask = mask.to(self.device) if bool(mask.any()) else None
            logits, prof = profile_forward(self.model, ids.to(self.device), mask)
            probs = torch.softmax(logits.double(), -1).cpu()
            profile = prof.as_dict() | {"batch_size": len(group), "padded_n": n_max,
                                        "flops_total": sum(prof.flops.values())}
            self._record(group, batch, profile)
            for row, i in enumerate(group):
                results[i] = {"label": int(probs[row].argmax()),
                              "probabilities": probs[row].tolist(), "n": len(batch[i]),
                              "variant": self.variant, "model_id": self.model_id,
                              "profile": profile}
        return results

    def _record(self, group: list[int], batch: list[list[int]], profile: dict) -> None:
        m = self.metrics
        for i in group:
            tags = {"variant": self.variant, "n_bucket": n_bucket(len(batch[i]))}
            for stage, ms in profile["stages_ms"].items():
                m.stage_duration.observe(ms / 1e3, tags | {"stage": stage})
            m.forward_duration.observe(profile["total_ms"] / 1e3, tags)
            m.tokens.inc(len(batch[i]), {"variant": self.variant})
        m.flops.inc(profile["flops_total"], {"variant": self.variant})
        if profile["peak_memory_bytes"] is not None:
            m.peak_memory.set(profile["peak_memory_bytes"],
                              {"variant": self.variant, "kind": profile["peak_memory_kind"]})
