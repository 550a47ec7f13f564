"""The classifier's serving logic as a plain class, without Ray.

``ClassifierEngine`` is what each Serve classifier replica runs (``service.classifier`` wraps
it): load the checkpoint on a device in a dtype, group a batch of requests, pad, run the
profiled forward, turn logits into probabilities; each answer carries the profile of the
forward it was part of (the gateway's ``service.recorder`` records it). Nothing here imports
Ray, so the exact serving code runs on a GPU machine without it
(``benchmarks/gpu_serving.py``) and in unit tests.

Batching: with ``deterministic=True`` every sequence of a batch runs as its own forward,
unpadded: the same request gives bit-identical probabilities whatever else arrived with it (a
padded or larger batch changes BLAS blocking and the float32 rounding, ~1e-7). With
``deterministic=False`` a batch is split into groups of similar length (power-of-two length
buckets), each group padded with the model's key padding mask and run as one forward.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from mita.hooks import Cancelled, cancellable
from mita.kernels import MAX_HEAD_DIM, choose, triton_supported
from mita.model import checkpoint_config, checkpoint_metadata, load_checkpoint, set_mita_backend
from mita.timer import profile_forward

from . import resolve_checkpoint
from .graphs import GraphCache
from .schemas import TopkReport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


def pick_device(device: str, tool: str = "the service", auto: bool = True) -> torch.device:
    """The one device check, for the service's replicas and its pre-start checks, the sweep and
    the advisor (``tool`` names which in the message; ``auto=False``: the tool records the
    device it ran on, so ``auto`` is refused). ``auto``: CUDA when available, else the CPU;
    otherwise ``device`` (``cpu``, ``cuda`` or ``cuda:N``) as a torch device. Raises
    ValueError naming the device: not a torch device, not cpu or cuda, or a CUDA device this
    torch does not see."""
    if device == "auto" and auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        choices = "auto, cpu, cuda, cuda:N" if auto else "cpu, cuda, cuda:N"
        raise ValueError(f"device {device!r} is not a torch device ({choices})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: {tool} runs on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.type == "cuda" and (dev.index or 0) >= count:
        raise ValueError(f"device {device!r}: this machine's torch ({torch.__version__}) sees "
                         f"{count} CUDA device(s)")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The weights' and activations' dtype: ``auto`` is bfloat16 on CUDA (flash SDPA for the
    dense baseline needs 16 bits; MiTA's kernel multiplies in 16 bits with fp32
    accumulation) and float32 on the CPU. Raises ValueError for a name not in
    ``DTYPE_CHOICES``."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


# Bounded memory under many distinct lengths. glibc's malloc keeps what a forward frees: every
# new sequence length allocates tensors of new sizes, above its mmap threshold at first, which
# glibc then raises to the size freed (up to 32 MiB), so from there on they are carved out of
# its arenas and their freed chunks stay mapped, fragmented, for sizes that may never come
# again. Measured in process (no Ray, engine.run over N = 1 ... 4,000 once each, 2 cores): MiTA
# RSS 515 -> 1,031 MiB, dense 455 -> 1,098 MiB (and flat from there), with malloc's bytes in use
# flat at 115-119 MiB and the Python heap (tracemalloc) at 1.9 MiB: all the growth was free
# memory held in the arenas (mallinfo2's fordblks 163 -> 660 MiB). ``malloc_trim(0)`` hands
# the free pages back, but each forward after a trim faults its pages in again (a sweep that
# trimmed after every forward took 1.9x as long), so it runs only once the RSS has grown by the
# budget since the last trim. MiTA over 3,000 new lengths (CPU seconds of the process, RSS at
# the end): no trim 44.0 s, 740 MiB; budget 64 MiB 48.3 s (200 trims), 397 MiB; 128 MiB 45.0 s
# (59 trims), 493 MiB; a fixed 128 KiB mmap threshold instead (MALLOC_MMAP_THRESHOLD_, every
# large tensor a fresh mapping) 51.7 s, 382 MiB. 128 MiB: ~2 % CPU when every request is a new
# length, nothing when lengths repeat. benchmarks/soak_memory.py measures it in the real
# service; docs/operating.md, "Memory under many distinct lengths".
HEAP_TRIM_ENV = "MITA_SERVE_HEAP_TRIM_MIB"
HEAP_TRIM_MIB = 128.0


MAX_HEAP_TRIM_MIB = 1024.0 * 1024  # 1 TiB: above any RSS, the same as off


def _trim_budget_ok(mib: float) -> bool:
    """0 (off) or 1 … ``MAX_HEAP_TRIM_MIB``: below 1 MiB it would round to off; NaN fails."""
    return mib == 0 or 1 <= mib <= MAX_HEAP_TRIM_MIB


def heap_trim_mib(raw: str | None) -> float:
    """The trim budget in MiB from ``$MITA_SERVE_HEAP_TRIM_MIB``'s value ``raw``: unset or blank
    → ``HEAP_TRIM_MIB``; ``0`` → off; else a number from 1 to ``MAX_HEAP_TRIM_MIB``. Raises
    ValueError naming the variable for anything else (negative, NaN, infinite, below 1 MiB:
    it would round to off, or not a number). ``python -m service`` checks it before it starts
    anything; a bad value would fail every classifier replica at start."""
    text = (raw or "").strip()
    if not text:
        return HEAP_TRIM_MIB
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not _trim_budget_ok(value):
        raise ValueError(f"{HEAP_TRIM_ENV}={raw!r}: the classifiers' heap trim budget in MiB, "
                         f"0 (off) or a number from 1 to {MAX_HEAP_TRIM_MIB:.0f}")
    return value


class HeapTrim:
    """Keeps the process's resident memory within ``budget_mib`` of where the last trim left it,
    by ``malloc_trim(0)`` after a forward that ended above that.

    Args: ``budget_mib`` (MiB; None: ``$MITA_SERVE_HEAP_TRIM_MIB``, else ``HEAP_TRIM_MIB``);
    0 turns trimming off (what ``benchmarks/soak_memory.py --no-trim`` measures against).
    Without glibc's ``malloc_trim`` or ``/proc/self/statm`` (macOS, musl) it does nothing.
    Raises ValueError when the budget (argument or variable) is not 0 or 1 … 2^20 MiB
    (``heap_trim_mib``).
    """

    def __init__(self, budget_mib: float | None = None):
        if budget_mib is None:
            budget_mib = heap_trim_mib(os.environ.get(HEAP_TRIM_ENV))
        if not _trim_budget_ok(budget_mib):
            raise ValueError(f"heap trim budget must be 0 (off) or 1 … {MAX_HEAP_TRIM_MIB:.0f} "
                             f"MiB, got {budget_mib!r}")
        self.budget_bytes = int(budget_mib * 2**20)
        self.trims = 0  # malloc_trim calls made
        self._lock = threading.Lock()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._malloc_trim = None
        self._statm: int | None = None
        if self.budget_bytes:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                self._malloc_trim = libc.malloc_trim
                self._malloc_trim.argtypes, self._malloc_trim.restype = [ctypes.c_size_t], \
                    ctypes.c_int
                # kept open: a pread of it is ~2 us, an open() more
                self._statm = os.open("/proc/self/statm", os.O_RDONLY)
            except (OSError, AttributeError):  # not glibc, or no procfs: nothing to do
                self._malloc_trim = None
        self.floor = self.rss_bytes()  # RSS after the last trim (or at start), bytes

    def __del__(self):
        if getattr(self, "_statm", None) is not None:
            os.close(self._statm)
            self._statm = None

    @property
    def active(self) -> bool:
        """True when this process trims (a budget, glibc and procfs)."""
        return self._malloc_trim is not None and self._statm is not None

    def rss_bytes(self) -> int:
        """This process's resident set size in bytes (0 when it cannot be read here)."""
        if self._statm is None:
            return 0
        return int(os.pread(self._statm, 64, 0).split()[1]) * self._page

    def after_forward(self) -> bool:
        """Trim when the RSS is more than the budget above ``floor``; the RSS after the trim
        is the new floor. Returns whether it trimmed. Safe from any thread (a call while
        another trims returns False)."""
        if not self.active or not self._lock.acquire(blocking=False):
            return False
        try:
            if self.rss_bytes() <= self.floor + self.budget_bytes:
                return False
            self._malloc_trim(0)
            self.trims += 1
            self.floor = self.rss_bytes()
            return True
        finally:
            self._lock.release()


def load_served(folder, device: torch.device | str, attention: str,
                setting: dict | None = None):
    """A checkpoint folder's model as the service serves it, ``attention`` with ``setting``
    (``ModelConfig`` overrides: m, k, s, shared scale): the product's own
    (``mita.model.load_checkpoint``) or a fine-tuned transformers model folder
    (``mita.pretrained.served.PretrainedClassifier``, the same forward interface). Raises as
    ``load_checkpoint``, or ValueError naming a transformers folder it cannot load."""
    meta = checkpoint_metadata(folder)
    if "pretrained" not in meta:
        return load_checkpoint(folder, device=device, attention=attention, **(setting or {}))
    from mita.pretrained.served import load_served as load_pretrained  # transformers: here

    return load_pretrained(folder, meta, checkpoint_config(folder, meta, attention=attention,
                                                           **(setting or {})), device)


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices grouped by power-of-two length bucket (⌈log2 n⌉), so padding at most doubles
    a sequence's length. Deterministic: groups in bucket order, indices ascending."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(math.ceil(math.log2(max(n, 1))), []).append(i)
    return [groups[b] for b in sorted(groups)]


class ClassifierEngine:
    """One classifier variant on one device.

    Args:
        checkpoint: checkpoint folder (relative to the project root unless absolute).
        attention: ``"mita"`` or ``"dense"``.
        device: ``"auto"`` | ``"cpu"`` | ``"cuda"`` | ``"cuda:N"``.
        mita_backend: ``mita_attention``'s ``backend`` (``torch`` times every MiTA stage
            apart; ``auto`` runs the compiled CPU kernels or the Triton kernel).
        dtype: ``"auto"`` | ``"float32"`` | ``"bfloat16"`` | ``"float16"`` for weights and
            activations (``resolve_dtype``); logits are returned in float32 and
            probabilities computed in float64.
        cuda_graphs: on CUDA, replay unstaged forwards from CUDA graphs per input shape
            (``service.graphs.GraphCache``: captured the 2nd time a shape is seen, N ≤ 16384).
        setting: ``ModelConfig`` overrides applied on loading, e.g. MiTA's
            ``{"num_landmarks": 32, "topk": 32, "route_topk": 2}`` (same weights).
    Raises: ValueError (bad checkpoint, unknown attention/backend/dtype, a setting
        ``ModelConfig`` refuses), FileNotFoundError, RuntimeError (MiTA with
        ``mita_backend="cpu"`` on the CPU where the compiled kernels cannot be loaded; with
        ``"auto"`` it serves the PyTorch stages instead, and ``backend`` says ``torch``).
    """

    def __init__(self, checkpoint: str, attention: str, device: str = "auto",
                 mita_backend: str = "auto", dtype: str = "auto", cuda_graphs: bool = True,
                 setting: dict | None = None):
        folder = resolve_checkpoint(checkpoint)
        self.device = pick_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = load_served(folder, self.device, attention, setting)
        self.model.to(self.dtype)
        if attention == "mita" and self.device.type == "cpu" and mita_backend in ("auto", "cpu"):
            # Load (or build) the compiled kernels here, not in the first request: the wait for
            # another process's build is bounded (mita.kernels.cpu), and a replica without them
            # fails its constructor ("cpu") or serves the PyTorch stages from the start ("auto";
            # load() logged why, once).
            from mita.kernels import cpu

            if cpu.load() is None:
                if mita_backend == "cpu":
                    raise RuntimeError("mita_backend 'cpu': the MiTA CPU kernels could not be "
                                       "loaded here (the log says why); use 'auto' or 'torch'")
                mita_backend = "torch"
        set_mita_backend(self.model, mita_backend)
        self.backend = mita_backend
        # Unstaged forwards replay CUDA graphs per input shape (service.graphs; CUDA only).
        # The PyTorch MiTA stages read the device from the host (not capturable): no graphs.
        capturable = (attention == "dense" or mita_backend != "torch") and getattr(
            self.model, "cuda_graph_safe", True)
        self.graphs = (GraphCache(self.model)
                       if cuda_graphs and capturable and self.device.type == "cuda" else None)
        # mita.attention's choice for inference: the Triton launcher, whose top-k path is
        # chosen per shape (mita.kernels.choose), or else the PyTorch / CPU stages
        cfg = self.model.config
        self.triton = attention == "mita" and (mita_backend == "triton" or (
            mita_backend == "auto" and self.device.type == "cuda"
            and cfg.dim // cfg.num_heads <= MAX_HEAD_DIM
            and triton_supported() is None))
        self._graph_topk: dict[tuple, str] = {}  # top-k path captured in each shape's graph
        # Every staged_every-th forward (0: none) runs the PyTorch stages, each timed apart, so
        # dashboards see all seven MiTA stages while the rest run fused.
        self.staged_every = 0
        self._forwards = 0
        self._lock = threading.Lock()
        # Resident memory bounded under many distinct lengths (HeapTrim); floor taken here,
        # with the model loaded.
        self.heap = HeapTrim()
        self.variant = attention
        meta = checkpoint_metadata(folder)
        self.model_id = f"{folder.name}@{meta['weights_sha256'][:12]}"
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.info = {
            "variant": attention, "model_id": self.model_id, "device": str(self.device),
            "dtype": self.dtype_name,
            "mita_backend": mita_backend if attention == "mita" else None,
            "torch_threads": torch.get_num_threads(),
            "config": dataclasses.asdict(self.model.config),  # what is served, setting included
            "training": meta.get("training", {}),
            # a transformers model folder: architecture, text or image, MiTA setting
            "pretrained": meta.get("pretrained"),
        }

    def fused(self) -> bool:
        """True when this variant's forwards report fused stages (MiTA on the compiled CPU
        kernels or the Triton kernel); a staged forward then times every stage apart."""
        return self.variant == "mita" and self.backend != "torch"

    def topk_report(self) -> dict | None:
        """MiTA's top-k paths, for ``/v1/models`` (``schemas.TopkReport``): ``triton``
        (whether the Triton launcher serves the unstaged forwards; otherwise the PyTorch or
        compiled CPU stages, with no choice to make), ``forced`` and ``decisions`` (this
        process's ``mita.kernels.choose.CHOOSER``: per shape, the path, timed or in the fixed
        order, with the timings in ms). None for dense."""
        if self.variant != "mita":
            return None
        return TopkReport.model_validate({"triton": self.triton} | choose.CHOOSER.report()
                                         ).model_dump()

    def _topk_path(self, shape: tuple, graph: bool) -> str | None:
        """The top-k path of the forward just run (of input ``shape`` = (batch, N, masked)):
        what the chooser served it, or for a CUDA-graph replay, where no Python runs, the path
        captured in that shape's graph. None: no Triton top-k ran."""
        path = choose.CHOOSER.take_served()
        if self.graphs is None:
            return path
        if path is not None and shape in self.graphs.graphs:
            self._graph_topk[shape] = path
        elif graph:
            path = self._graph_topk.get(shape)
        self._graph_topk = {s: p for s, p in self._graph_topk.items() if s in self.graphs.graphs}
        return path

    def _stages(self, staged: bool):
        """Run the forward inside with the PyTorch MiTA stages when ``staged`` (one forward at
        a time: the backend is a model attribute); else just one forward at a time (the lock
        itself: no generator to step on every forward)."""
        return self._staged() if staged and self.fused() else self._lock

    @contextmanager
    def _staged(self):
        with self._lock:
            set_mita_backend(self.model, "torch")
            try:
                yield
            finally:
                set_mita_backend(self.model, self.backend)

    def run(self, batch: Sequence[Sequence[int] | np.ndarray], deterministic: bool = True,
            staged: Sequence[bool] | None = None,
            abandoned: Sequence[Callable[[], bool]] | None = None) -> list[dict]:
        """Classify a batch of validated id sequences (lists or 1-D integer numpy arrays).

        Returns one dict per sequence, in order: ``label``, ``probabilities`` (float64
        softmax of the logits, as a list), ``n``, ``variant``, ``model_id`` and ``profile``
        (``mita.records.ForwardProfile``: the forward it was part of, with ``batch_size``,
        ``padded_n``, ``dtype``, ``started_at`` — the forward's start in Unix seconds —
        ``cuda_graph``: whether it was a CUDA-graph replay, timed as a whole, no stages —
        and ``topk_path``: the Triton top-k path that served it, ``"select"`` |
        ``"bitonic"`` | ``"torch"`` (``mita.kernels.choose``), None when the PyTorch or CPU
        stages did, and for dense), and ``staged``: whether every stage was timed apart (for
        dense and for MiTA on ``backend="torch"`` unless replayed; for a fused MiTA backend
        when the forward was sampled — every ``staged_every``-th — or asked for:
        ``staged[i]`` True for a sequence in it). A sequence whose logits are not all finite
        gets no ``label`` or ``probabilities`` but ``error`` (the Serve gateway answers it with
        a JSON 500).
        The sequences of one forward share one profile, the same object (``batch_size`` of
        them).

        ``abandoned[i]()`` is True once sequence i's caller has gone (client disconnect,
        gateway timeout). It is asked just before each forward — before each sequence with
        ``deterministic``, before each length group otherwise — and a sequence whose caller is
        gone gets no forward: its result is ``n``, ``variant``, ``model_id``, ``abandoned: True``
        and ``error`` (nobody reads it). A forward already running stops when every caller
        of its sequences has gone (``mita.hooks.cancellable``: before each block, and between
        dense attention's query chunks of a long sequence on the CPU), with the same result.
        """
        results: list[dict | None] = [None] * len(batch)
        pad = self.model.config.pad_id
        lengths = [len(x) for x in batch]

        def left(i: int, when: str) -> dict:
            return {"n": lengths[i], "variant": self.variant, "model_id": self.model_id,
                    "abandoned": True, "error": f"the caller left {when} this sequence ran"}
        groups = ([[i] for i in range(len(batch))] if deterministic
                  else length_groups(lengths))
        for group in groups:
            if abandoned is not None:
                for i in group:
                    if abandoned[i]():
                        results[i] = left(i, "before")
                group = [i for i in group if results[i] is None]
                if not group:
                    continue
            n_max = max(lengths[i] for i in group)
            if all(lengths[i] == n_max for i in group):
                # No padding (always so with deterministic): no mask, so dense SDPA can take
                # its flash path. Both copy: ids arriving over Ray are read-only arrays, which
                # torch warns about (one sequence needs no np.stack).
                ids = torch.from_numpy(
                    np.array(batch[group[0]], dtype=np.int64)[None] if len(group) == 1
                    else np.stack([np.asarray(batch[i], dtype=np.int64) for i in group]))
                mask = None
            else:
                ids = torch.full((len(group), n_max), pad, dtype=torch.long)
                mask = torch.ones(len(group), n_max, dtype=torch.bool)
                for row, i in enumerate(group):
                    ids.numpy()[row, : lengths[i]] = batch[i]
                    mask[row, : lengths[i]] = False
                mask = mask.to(self.device)
            self._forwards += 1
            want = (any(staged[i] for i in group) if staged is not None else False) or bool(
                self.staged_every and self._forwards % self.staged_every == 0)
            started_at = time.time()
            choose.CHOOSER.take_served()  # forget a call made outside this forward
            everyone_gone = (lambda g=group: all(abandoned[i]() for i in g)) \
                if abandoned is not None else (lambda: False)
            try:
                with self._stages(want), cancellable(everyone_gone):
                    logits, prof = profile_forward(
                        self.model, ids.to(self.device), mask,
                        replay=None if want or self.graphs is None else self.graphs.run)
            except Cancelled:
                for i in group:
                    results[i] = left(i, "while")
                continue
            graph = prof.cuda_graph  # profile_forward's: the replay answered
            topk_path = self._topk_path((len(group), n_max, mask is not None), graph)
            # numpy from here: per-row work on a few logits costs microseconds, not tens
            probs = torch.softmax(logits.double(), -1).cpu().numpy()
            # dtype, batch_size (len(group)) and padded_n (n_max): profile_forward's
            profile = prof.shipped(started_at=started_at,
                                   staged=(want or not self.fused()) and not graph,
                                   cuda_graph=graph, topk_path=topk_path)
            labels, rows = probs.argmax(-1).tolist(), probs.tolist()
            for row, i in enumerate(group):
                results[i] = {"n": lengths[i], "variant": self.variant,
                              "model_id": self.model_id, "profile": profile}
                if all(map(math.isfinite, rows[row])):
                    results[i] |= {"label": labels[row], "probabilities": rows[row]}
                else:  # never a label from NaN/inf: the caller answers 5xx
                    results[i]["error"] = "non-finite logits (NaN or infinity) from the model"
        self.heap.after_forward()  # after the batch's tensors are freed: see HeapTrim
        return results
