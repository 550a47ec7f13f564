"""Classifier deployment: one class, two deployments (``mita`` and ``dense``), one checkpoint.

A thin Serve wrapper around ``service.engine.ClassifierEngine``, which holds all the serving
logic (device, dtype, grouping, padding, profiled forward, probabilities) and runs without Ray.
Requests arrive one sequence each (a numpy array of ids). Forwards run one at a time, in
arrival order, in one worker thread (the event loop stays free for health checks and
queueing) — except, with ``deterministic``, a short one (``INLINE_MAX_N``) of a request alone
in the replica, which runs on the event loop and saves the two thread hops. No request waits
for a batch that cannot help it: with ``deterministic`` every sequence runs its own forward
anyway, so it goes straight to the forward thread; with padded batching a request that finds
the replica empty does too, and only requests that arrive while others are inside go through
``@serve.batch`` (whose wait overlaps the forward running then, when that is longer).
The forward's profile (stage times, FLOPs, peak memory) goes back in each answer; the
gateway's ``service.recorder`` turns it into metrics (a classifier replica exports none).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
from ray import serve

from .live_config import LiveConfig, store_key
from .settings import ClassifierConfig

# With deterministic forwards, a lone request of at most this many tokens, of a length this
# replica has run before, runs its forward on the replica's event loop instead of the forward
# thread: the two thread hops (0.2-0.3 ms on a loaded 2-core machine) are then a sizeable part
# of the request, and the loop is blocked only for a short forward (CPU, shipped model: MiTA
# ~3 ms, dense ~9 ms at N = 1,024), never for a first one (kernel compiles, the top-k choice,
# a CUDA-graph capture).
INLINE_MAX_N = 1024


@serve.deployment
class Classifier:
    """Args: ``checkpoint`` folder, ``attention`` (``mita`` | ``dense``), ``device``
    (``auto`` | ``cpu`` | ``cuda``), ``mita_backend`` (``mita_attention``'s ``backend``),
    ``dtype`` (``auto`` | ``float32`` | ``bfloat16`` | ``float16``; auto: bfloat16 on CUDA,
    float32 on CPU). ``user_config``: ``max_batch_size``, ``batch_wait_timeout_s``,
    ``deterministic``, ``staged_profile_every`` (a fused MiTA backend runs every n-th forward
    with each stage timed apart; 0: only on request). Stage metrics come from staged forwards
    only, so a stage name always means the same work. ``setting``: ModelConfig overrides
    (MiTA's m, k, s, shared scale) applied on loading."""

    def __init__(self, checkpoint: str, attention: str, device: str = "auto",
                 mita_backend: str = "auto", dtype: str = "auto", cuda_graphs: bool = True,
                 setting: dict | None = None):
        # Here, not at the top: Serve's controller imports this module to build the app, and
        # torch (~1-2 s of a start-up) is for the replica alone.
        from .engine import ClassifierEngine

        self.engine = ClassifierEngine(checkpoint, attention, device, mita_backend, dtype,
                                       cuda_graphs, setting)
        # The replica id changes when Serve replaces the replica (crash, OOM kill): tests and
        # operators can see a restart.
        self.info_dict = self.engine.info | {
            "replica": serve.get_replica_context().replica_id.unique_id,
            # The GPUs Ray assigned this replica (CUDA_VISIBLE_DEVICES); [] without num_gpus.
            "gpu_ids": ray.get_runtime_context().get_accelerator_ids().get("GPU", []),
            # On a cluster: which node this replica was placed on (hex id, as `ray list nodes`).
            "node_id": ray.get_runtime_context().get_node_id()}
        self.deterministic = True
        # One forward at a time, in arrival order, whichever path a request takes.
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self._inside = 0  # classify calls in this replica that have not answered yet
        self._pending = 0  # forward-thread jobs submitted and not finished (loop-side count)
        self._ran: set[int] = set()  # lengths up to INLINE_MAX_N this replica has classified
        context = serve.get_replica_context()
        self.live = LiveConfig(ClassifierConfig, f"deployment {context.deployment!r} user_config",
                               store_key(context.app_name, context.deployment),
                               counted=False)  # classifier replicas export no metrics

    def reconfigure(self, config: dict) -> None:
        """Apply a ``user_config``, parsed strictly (``settings.ClassifierConfig``). A refused
        live update leaves the replica on its last applied config (``LiveConfig``: logged, and
        in ``info()["config_update"]``, which ``/v1/models`` shows); a new replica starts on
        the deployment's last applied config, or raises when there is none."""
        if not self.live.update(config):  # refused: the old config keeps serving
            return
        cfg = self.live.value
        self.deterministic = cfg.deterministic
        self.engine.staged_every = cfg.staged_profile_every
        self.forward_batch.set_max_batch_size(cfg.max_batch_size)
        self.forward_batch.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)

    def info(self) -> dict:
        cfg = self.live.value  # None until the first reconfigure
        return self.info_dict | {"deterministic": self.deterministic,
                                 "max_batch_size": cfg and cfg.max_batch_size,
                                 "batch_wait_timeout_s": cfg and cfg.batch_wait_timeout_s,
                                 "staged_profile_every": self.engine.staged_every,
                                 "config_update": self.live.status(),
                                 "topk": self.engine.topk_report()}  # decided as shapes come

    async def classify(self, ids: np.ndarray, staged: bool = False) -> dict:
        """Classify one validated id sequence; returns label, probabilities, n, model_id,
        variant, this replica's id and the profile of the forward it was part of
        (``staged``: time every stage of that forward apart). A caller that leaves (Serve
        cancels this call: client disconnect, gateway timeout) gets no forward if its sequence
        has not started."""
        gone = threading.Event()  # read by the engine's thread before each forward
        self._inside += 1
        try:
            if (self.deterministic and self._inside == 1 and self._pending == 0
                    and len(ids) in self._ran):
                # Alone in the replica and nothing left in the forward thread: nothing else
                # waits for the loop or for this forward (INLINE_MAX_N). Not with padded
                # batching: requests could not gather behind a forward that holds the loop.
                result = self.engine.run([ids], self.deterministic, [staged])[0]
            elif self.deterministic or self._inside == 1:
                result = (await self._forward([ids], [staged], [gone]))[0]
            else:
                result = await self.forward_batch(ids, staged, gone)
        except asyncio.CancelledError:
            gone.set()
            raise
        finally:
            self._inside -= 1
        if len(ids) <= INLINE_MAX_N:
            self._ran.add(len(ids))
        result["replica"] = self.info_dict["replica"]  # peak memory is per replica
        return result

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def forward_batch(self, batch: list[np.ndarray], staged: list[bool],
                            gone: list[threading.Event]) -> list[dict]:
        """The requests ``@serve.batch`` gathered, run by the engine off the event loop.
        Serve drops a request cancelled before the batch starts; ``gone`` lets the engine skip
        one cancelled while earlier sequences of the batch run."""
        return await self._forward(batch, staged, gone)

    async def _forward(self, batch: list[np.ndarray], staged: list[bool],
                       gone: list[threading.Event]) -> list[dict]:
        """``engine.run`` on the forward thread (one forward at a time, in arrival order)."""
        loop = asyncio.get_running_loop()
        job = self._forward_thread.submit(self.engine.run, batch, self.deterministic, staged,
                                          [g.is_set for g in gone])
        self._pending += 1
        # counted down once the job has finished (or was cancelled before it started), not
        # when a cancelled caller stops waiting: the thread may still be running it
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._job_done))
        return await asyncio.wrap_future(job)

    def _job_done(self) -> None:
        self._pending -= 1
