"""Graph capture and replay of uniform steps per batch-size bucket: CUDA graphs, and AMD's equivalent
through the same ``torch.cuda`` API (``platform.graphs_label`` names which).

A step whose rows all compute the same number q of tokens -- pure decode (q = 1), uniform verification
(q = k + 1), a draft step -- is padded up to the next batch-size bucket B and replayed from the graph
captured for (B, q). Any other batch (prefill chunks longer than k + 1, mixed rows, more rows than the
largest bucket, block tables wider than the static buffer) runs eagerly. A bucket is captured on its first use: a warm-up run
(Triton compilation, cuBLAS workspaces) and then the capture, into one memory pool shared by all graphs.

Padding rows compute q tokens at positions 0 .. q - 1 of a scratch block no request owns (the worker
allocates ``num_blocks + 1`` KV blocks), so they never touch a real request's KV; every layer treats rows
independently, so they do not change the real rows' outputs either.

Static inputs: a graph reads fixed device buffers sized for the largest bucket. Each step copies its packed
host batch into them in place (``copy_``); a tensor a graph holds is never rebound.

The capture mechanism is a strategy: ``CudaGraphCapture`` on a GPU, ``RerunCapture`` in tests (its "graph"
re-runs the recorded callable on the same static buffers), so bucketing, padding and slicing are tested on
CPU against the eager path (``tests/test_graphs.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, count
from typing import Protocol

import torch

from specserve.model.attention import AttentionMetadata
from specserve.model.decoder import DecoderModel
from specserve.platform import Platform, staged
from specserve.worker.input_batch import HostBatch, RowTree, batch_views, pack_batch, upload

log = logging.getLogger("specserve")

Outputs = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # hidden, or (hidden, prenorm)

# Test/debug hook read once at start-up: "rerun" selects RerunCapture on any platform (CPU included).
CAPTURE_ENV = "SPECSERVE_GRAPH_CAPTURE"


class Graph(Protocol):
    def replay(self) -> Outputs: ...


class CaptureBackend(Protocol):
    num_captures: int

    def capture(self, fn: Callable[[], Outputs]) -> Graph: ...


class _CudaGraph:
    __slots__ = ("graph", "out")

    def __init__(self, graph: torch.cuda.CUDAGraph, out: Outputs) -> None:
        self.graph, self.out = graph, out

    def replay(self) -> Outputs:
        self.graph.replay()
        return self.out  # NOTE: the same tensors every replay; callers copy what they keep


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` (AMD's graphs on AMD builds of torch), every graph in one shared memory pool.

    NOTE on the shared pool: each graph keeps its output tensors referenced, so a later capture never
    reuses their memory; graphs may share intermediates, which is safe because they replay one at a time
    on one stream.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.num_captures = 0

    def capture(self, fn: Callable[[], Outputs]) -> Graph:
        # Warm-up on a side stream (PyTorch's recipe): Triton JIT compilation and launcher set-up, cuBLAS
        # handles / workspaces and allocator growth must happen outside the capture.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.num_captures += 1
        return _CudaGraph(graph, out)


class _Rerun:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Outputs]) -> None:
        self.fn = fn

    def replay(self) -> Outputs:
        return self.fn()


class RerunCapture:
    """Test/debug backend: the "graph" re-runs the recorded callable on the static buffers (any device)."""

    def __init__(self) -> None:
        self.num_captures = 0

    def capture(self, fn: Callable[[], Outputs]) -> Graph:
        fn()  # the warm-up run, as the real backend does (KV writes are idempotent: same inputs, same values)
        self.num_captures += 1
        return _Rerun(fn)


def select_capture(platform: Platform, enforce_eager: bool) -> tuple[CaptureBackend | None, str]:
    """The capture backend (None = eager) and why, chosen once at start-up."""
    if enforce_eager:
        return None, "eager (--enforce-eager)"
    if os.environ.get(CAPTURE_ENV, "") == "rerun":
        return RerunCapture(), f"rerun capture ({CAPTURE_ENV}=rerun: eager re-runs on static buffers)"
    if not platform.can_capture_graphs:
        return None, platform.graphs_label()
    return CudaGraphCapture(platform.device), platform.graphs_label()


def batch_buckets(max_num_seqs: int, largest: int = 256) -> list[int]:
    """Batch sizes captured: 1, 2, 4, then multiples of 8, up to the first >= min(max_num_seqs, largest)."""
    top = max(1, min(max_num_seqs, largest))
    out: list[int] = []
    for b in chain((1, 2, 4), count(8, 8)):
        out.append(b)
        if b >= top:
            return out
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class GraphPlan:
    """What a worker captures: shared by its target step and its draft step (each has its own buffers)."""

    capture: CaptureBackend
    batch_sizes: list[int]  # ascending
    max_query_len: int  # q = 1 (decode) .. k + 1 (verification)
    max_blocks_per_req: int  # width of the static block tables
    scratch_block: int  # KV block of the padding rows (not in the block pool)

    def describe(self) -> str:
        return (f"batch sizes {self.batch_sizes} x query lengths 1..{self.max_query_len}, "
                f"captured on first use")


@dataclass(slots=True)
class StepOutput:
    hidden: torch.Tensor  # [T, hidden] final-normed hidden states of the real tokens (the caller's own)
    prenorm: torch.Tensor | None  # [T, hidden] last layer's output before the final norm, when asked
    query_start_loc: torch.Tensor  # [B + 1] int32 of the real rows, on the device

    def last_hidden(self) -> torch.Tensor:
        """[B, hidden] at each request's last token."""
        return self.hidden[self.query_start_loc[1:].long() - 1]


@dataclass(slots=True)
class _Entry:
    meta: AttentionMetadata  # over the static buffers; its host fields are refreshed every replay
    fn: Callable[[], Outputs]
    graph: Graph | None = None


@dataclass
class _Static:
    """Device buffers the graphs read, sized for the largest bucket; per bucket, fixed views into them."""

    tokens: torch.Tensor  # [3 * B_max * q_max] int64, laid out per bucket like HostBatch.tokens
    reqs: torch.Tensor  # [2 * B_max + 1] int32, laid out per bucket like HostBatch.reqs
    tables: torch.Tensor  # [B_max, W_max] int32
    graphs: dict[tuple[int, int, bool], _Entry] = field(default_factory=dict)


class ModelStep:
    """One model's forward over a flat batch (the target step, or a draft step): a graph replay when the
    batch is uniform and fits a bucket, eager otherwise. Outputs are the caller's own tensors."""

    def __init__(self, model: DecoderModel, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, num_layers: int | None = None, plan: GraphPlan | None = None) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.num_layers = num_layers
        self.plan = plan
        self.static: _Static | None = None
        if plan is not None:
            b_max, q_max = plan.batch_sizes[-1], plan.max_query_len
            self.static = _Static(
                tokens=torch.zeros(3 * b_max * q_max, dtype=torch.int64, device=device),
                reqs=torch.zeros(2 * b_max + 1, dtype=torch.int32, device=device),
                tables=torch.full((b_max, plan.max_blocks_per_req), plan.scratch_block, dtype=torch.int32,
                                  device=device),
            )

    def __call__(self, token_ids: Sequence[Sequence[int]], starts: list[int],
                 block_ids: Sequence[Sequence[int]], prenorm: bool = False,
                 trees: Sequence[RowTree | None] | None = None) -> StepOutput:
        """``trees``: draft-tree rows (``input_batch.pack_batch``); a step with one runs eager."""
        bucket = None if trees is not None and any(t is not None for t in trees) else self.bucket(token_ids, block_ids)
        if bucket is None:
            return self._eager(token_ids, starts, block_ids, prenorm, trees)
        return self._replay(bucket, token_ids, starts, block_ids, prenorm)

    def bucket(self, token_ids: Sequence[Sequence[int]], block_ids: Sequence[Sequence[int]]) -> int | None:
        """The padded batch size of a graph for this batch, or None (eager)."""
        plan = self.plan
        if plan is None or not token_ids:
            return None
        q = len(token_ids[0])
        if not 1 <= q <= plan.max_query_len or any(len(t) != q for t in token_ids):
            return None
        if max(len(b) for b in block_ids) > plan.max_blocks_per_req:
            return None
        return next((b for b in plan.batch_sizes if b >= len(token_ids)), None)

    def _eager(self, token_ids: Sequence[Sequence[int]], starts: list[int],
               block_ids: Sequence[Sequence[int]], prenorm: bool,
               trees: Sequence[RowTree | None] | None = None) -> StepOutput:
        fb = upload(pack_batch(token_ids, starts, block_ids, self.block_size, trees=trees), self.device)
        out = self.model(fb.input_ids, fb.positions, self.kv_caches, fb.meta, num_layers=self.num_layers,
                         return_prenorm=prenorm)
        hidden, pre = out if isinstance(out, tuple) else (out, None)
        return StepOutput(hidden, pre, fb.meta.query_start_loc)

    def _replay(self, bucket: int, token_ids: Sequence[Sequence[int]], starts: list[int],
                block_ids: Sequence[Sequence[int]], prenorm: bool) -> StepOutput:
        assert self.plan is not None and self.static is not None
        st, q, n = self.static, len(token_ids[0]), len(token_ids)
        hb = pack_batch(token_ids, starts, block_ids, self.block_size, pad_to=bucket,
                        pad_block=self.plan.scratch_block)
        # In-place copies into the buffers the graph reads (pinned + non-blocking on a GPU). Table columns
        # past this step's width keep stale block ids: never read, since keys stop at each row's seq_len.
        st.tokens[:hb.tokens.shape[0]].copy_(staged(hb.tokens, self.device), non_blocking=True)
        st.reqs[:hb.reqs.shape[0]].copy_(staged(hb.reqs, self.device), non_blocking=True)
        st.tables[:bucket, :hb.tables.shape[1]].copy_(staged(hb.tables, self.device), non_blocking=True)
        key = (bucket, q, prenorm)
        entry = st.graphs.get(key)
        if entry is None:
            entry = st.graphs[key] = self._entry(hb, prenorm)
        # Host fields of the metadata: read by the torch reference attention (RerunCapture on CPU); a
        # captured Triton graph ignores them -- its launch grids use only num_reqs and max_query_len,
        # which are the bucket's constants.
        entry.meta.seq_lens_host[:] = hb.seq_lens
        entry.meta.max_seq_len = max(hb.seq_lens)
        entry.meta.plan = None
        if entry.graph is None:
            entry.graph = self.plan.capture.capture(entry.fn)
            log.debug("graphs: captured batch %d x q %d (prenorm=%s)", bucket, q, prenorm)
        out = entry.graph.replay()
        hidden, pre = out if isinstance(out, tuple) else (out, None)
        t = n * q
        return StepOutput(hidden[:t].clone(), pre[:t].clone() if pre is not None else None,
                          st.reqs[:n + 1].clone())

    def _entry(self, hb: HostBatch, prenorm: bool) -> _Entry:
        """The callable a bucket's graph records: the model over fixed views of the static buffers.

        NOTE: everything the captured kernels see is bucket-static: T = B * q tokens (the KV-write grid),
        num_reqs = B and max_query_len = q (the attention grid); seq_lens, block tables and slots are read
        from device memory inside the kernels, so one capture serves every step of the bucket.
        """
        assert self.static is not None
        st = self.static
        fb = batch_views(hb, st.tokens, st.reqs, st.tables[:hb.num_reqs])
        model, kv, layers = self.model, self.kv_caches, self.num_layers

        def fn() -> Outputs:
            return model(fb.input_ids, fb.positions, kv, fb.meta, num_layers=layers, return_prenorm=prenorm)

        return _Entry(fb.meta, fn)
