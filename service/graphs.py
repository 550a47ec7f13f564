"""Replay the classifier's forward from CUDA graphs, one per input shape (no Ray).

At short N a MiTA forward is launch-bound: dozens of small kernels whose launch costs more
than their work (the shipped model took 4.2–4.7 ms per forward at every N ≤ 16K on an H200).
A CUDA graph (``torch.cuda.CUDAGraph``) records the forward's launches once and replays them
with one call. Shapes must be static, so ``GraphCache`` keeps one graph per ``(batch, N,
masked)`` — the engine's forwards have a handful of shapes under a load (one per request
length, or per power-of-two bucket when batching pads) — captured the ``capture_after``-th
time a shape is seen, for N ≤ ``max_n`` (above it launches are a small share of the forward,
and each graph holds its activations in a private memory pool), at most ``max_graphs`` kept
(least recently used dropped).

A replay copies the ids (and mask) into the graph's static inputs, replays, and clones the
static output. Staged (profiled) forwards are never replayed: CUDA timing events cannot be
recorded inside a graph, so a replay is timed as a whole.

``capture`` is the one CUDA-only step: ``torch.cuda.graph`` around the forward after warm-up
runs on a side stream (the PyTorch recipe). The bookkeeping around it (shape keys, when to
capture, eviction, static-buffer copies, output cloning) runs the same on the CPU with
``EagerCapture``, which the tests use to compare replays with plain forwards; on a GPU
``benchmarks/gpu_serving.py`` compares real replays with eager forwards.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


@dataclass
class Captured:
    """One captured forward: its static inputs and output, and ``replay()``."""

    ids: Tensor
    mask: Tensor | None
    out: Tensor
    replay: object  # callable: re-runs the captured forward on ids/mask into out
    graph: object = field(default=None, repr=False)  # keeps the CUDA graph alive


def cuda_capture(model: nn.Module, ids: Tensor, mask: Tensor | None,
                 warmup: int = 2) -> Captured:
    """Capture ``model(ids, mask)`` (no grad) in a ``torch.cuda.CUDAGraph`` on static copies
    of the inputs. Warm-up forwards run first on a side stream (Triton compiles, cuBLAS
    workspaces, the position table), as PyTorch's CUDA-graph recipe requires.
    Raises RuntimeError from PyTorch if the forward synchronises with the host."""
    static_ids = ids.clone()
    static_mask = None if mask is None else mask.clone()
    stream = torch.cuda.Stream(ids.device)
    stream.wait_stream(torch.cuda.current_stream(ids.device))
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmup):
            model(static_ids, static_mask)
    torch.cuda.current_stream(ids.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(static_ids, static_mask)
    return Captured(static_ids, static_mask, out, graph.replay, graph)


def eager_capture(model: nn.Module, ids: Tensor, mask: Tensor | None) -> Captured:
    """The CPU stand-in for ``cuda_capture``: the same static buffers, and a replay that
    runs the forward on them into the static output."""
    static_ids = ids.clone()
    static_mask = None if mask is None else mask.clone()
    with torch.no_grad():
        out = model(static_ids, static_mask)

    def replay():
        with torch.no_grad():
            out.copy_(model(static_ids, static_mask))

    return Captured(static_ids, static_mask, out, replay)


class GraphCache:
    """Forward replays keyed by input shape.

    Args:
        model: the classifier (``forward(ids, key_padding_mask)``).
        capture: ``cuda_capture`` (default) or ``eager_capture`` (CPU tests).
        capture_after: capture a shape the n-th time it is seen (1: at once).
        max_graphs: graphs kept; the least recently used is dropped beyond it.
        max_n: longest sequence captured.
    ``run(ids, mask)`` returns the logits from a replay, or None when the shape is not (yet)
    captured — the caller then runs the plain forward. A shape whose capture fails (a forward
    that synchronises with the host cannot be captured) is logged once and never tried
    again.
    """

    def __init__(self, model: nn.Module, capture=cuda_capture, capture_after: int = 2,
                 max_graphs: int = 16, max_n: int = 16384):
        if capture_after < 1 or max_graphs < 1 or max_n < 1:
            raise ValueError("capture_after, max_graphs and max_n must be ≥ 1")
        self.model, self.capture = model, capture
        self.capture_after, self.max_graphs, self.max_n = capture_after, max_graphs, max_n
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.seen: dict[tuple, int] = {}
        self.uncapturable: set[tuple] = set()  # capture failed once: plain forwards from now
        self.replays = 0

    def run(self, ids: Tensor, mask: Tensor | None) -> Tensor | None:
        B, N = ids.shape
        if N > self.max_n:
            return None
        key = (B, N, mask is not None)
        if key in self.uncapturable:
            return None
        entry = self.graphs.get(key)
        if entry is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < self.capture_after:
                return None
            try:
                entry = self.capture(self.model, ids, mask)
            except Exception as e:  # e.g. a forward that reads the device from the host
                # (the PyTorch MiTA stages): serve it plain, and do not try this shape again
                log.warning("CUDA graph capture of shape %s failed (%s: %s); running it "
                            "without a graph", key, type(e).__name__, str(e)[:200])
                self.uncapturable.add(key)
                self.seen.pop(key, None)
                return None
            self.graphs[key] = entry
            if len(self.graphs) > self.max_graphs:
                dropped, _ = self.graphs.popitem(last=False)
                self.seen.pop(dropped, None)
        self.graphs.move_to_end(key)
        entry.ids.copy_(ids)
        if mask is not None:
            entry.mask.copy_(mask)
        entry.replay()
        self.replays += 1
        return entry.out.clone()
