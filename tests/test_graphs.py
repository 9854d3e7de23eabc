"""Graph runner (worker/graphs.py) on CPU: the capture backend is injected (RerunCapture re-runs the recorded
callable on the static buffers), so bucketing, padding and slicing are checked against the eager path.
Also the GPU flags: --enforce-eager and --gpu-memory-utilization (KV sizing with a faked GPU platform)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run under the interpreter on CPU (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specserve import SamplingParams
from specserve.config import EngineConfig
from specserve.platform import Platform
from specserve.worker import graphs
from specserve.worker.graphs import GraphPlan, ModelStep, RerunCapture, batch_buckets, select_capture
from tests.helpers import our_model, save_tiny_checkpoint, tiny_hf_model

BS = 4  # block size
NUM_BLOCKS = 32
CPU = Platform("cpu", torch.device("cpu"), torch.float32, "torch", False, "gloo")


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def _steps(max_q: int = 4, sizes: tuple[int, ...] = (1, 2, 4, 8)):
    """A graph step and an eager step over two identical caches (one scratch block more for the graph)."""
    model = our_model(tiny_hf_model("llama", seed=1), "llama")
    shape = model.kv_cache_shape(NUM_BLOCKS + 1, BS)
    kv_g = [torch.zeros(shape) for _ in range(model.arch.num_layers)]
    kv_e = [torch.zeros(shape) for _ in range(model.arch.num_layers)]
    plan = GraphPlan(RerunCapture(), list(sizes), max_q, max_blocks_per_req=8, scratch_block=NUM_BLOCKS)
    cpu = torch.device("cpu")
    return ModelStep(model, kv_g, BS, cpu, plan=plan), ModelStep(model, kv_e, BS, cpu), plan


def _same(step_g: ModelStep, step_e: ModelStep, toks, starts, blocks, prenorm: bool = False) -> None:
    """The graph step's outputs vs eager: bitwise against the eager run of the same padded batch (padding rows
    at positions 0.. of the scratch block), to rounding against the unpadded eager batch (GEMMs of another
    row count may round differently), and the real blocks of both KV caches bitwise equal."""
    bucket, n = step_g.bucket(toks, blocks), len(toks)
    g = step_g(toks, starts, blocks, prenorm=prenorm)
    e = step_e(toks, starts, blocks, prenorm=prenorm)
    t = sum(map(len, toks))
    assert g.hidden.shape == e.hidden.shape == (t, 64)
    assert torch.equal(g.query_start_loc, e.query_start_loc)
    assert torch.allclose(g.hidden, e.hidden, rtol=0, atol=1e-5)
    assert torch.allclose(g.last_hidden(), e.last_hidden(), rtol=0, atol=1e-5)
    if bucket is not None and bucket > n:
        q, pad = len(toks[0]), bucket - n
        e = step_e(list(toks) + [[0] * q] * pad, starts + [0] * pad, list(blocks) + [(NUM_BLOCKS,)] * pad,
                   prenorm=prenorm)
    assert torch.equal(g.hidden, e.hidden[:t])
    if prenorm:
        assert g.prenorm is not None and e.prenorm is not None and torch.equal(g.prenorm, e.prenorm[:t])
    for kg, ke in zip(step_g.kv_caches, step_e.kv_caches):  # padding wrote only the scratch block
        assert torch.equal(kg[:, :NUM_BLOCKS], ke[:, :NUM_BLOCKS])


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 4]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100)[-2:] == [96, 104]
    assert batch_buckets(10_000)[-1] == 256


def test_padded_decode_and_verify_match_eager():
    step_g, step_e, plan = _steps()
    blocks = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [19, 20, 21]]
    _same(step_g, step_e, prompts, [0, 0, 0], blocks)  # prefill: mixed lengths, eager
    assert plan.capture.num_captures == 0
    lens = [len(p) for p in prompts]
    # decode: 3 rows of q = 1 padded to the bucket of 4 (captured on first use)
    _same(step_g, step_e, [[30], [31], [32]], lens, blocks)
    assert plan.capture.num_captures == 1
    assert step_g.kv_caches[0][:, NUM_BLOCKS].abs().sum() > 0  # the padding row wrote its scratch block
    lens = [n + 1 for n in lens]
    # uniform verification: q = k + 1 = 3, with the pre-norm features (EAGLE / distill)
    _same(step_g, step_e, [[40, 41, 42], [43, 44, 45], [46, 47, 48]], lens, blocks, prenorm=True)
    assert plan.capture.num_captures == 2
    lens = [n + 3 for n in lens]
    _same(step_g, step_e, [[50], [51], [52]], lens, blocks)  # replay of the (4, 1) graph: no new capture
    assert plan.capture.num_captures == 2
    _same(step_g, step_e, [[53], [54]], [n + 1 for n in lens[:2]], blocks[:2])  # bucket 2: a new capture
    assert plan.capture.num_captures == 3


def test_triton_attention_through_graph_runner():
    """The GPU attention backend over the static buffers: padded rows, full-width static block tables, bucket
    constants for num_reqs / max_query_len (the kernels under the Triton interpreter on CPU)."""
    pytest.importorskip("triton")
    from specserve.model.kernels.triton_attention import TritonAttention

    step_g, step_e, plan = _steps()
    step_g.model.backend = TritonAttention()  # the model is shared by both steps
    blocks = [(0, 1), (4, 5), (8, 9)]
    _same(step_g, step_e, [[5, 6, 7, 8, 9], [10, 11], [19, 20, 21]], [0, 0, 0], blocks)
    _same(step_g, step_e, [[30], [31], [32]], [5, 2, 3], blocks)
    _same(step_g, step_e, [[40, 41], [42, 43], [44, 45]], [6, 3, 4], blocks)
    assert plan.capture.num_captures == 2


def test_shapes_outside_buckets_run_eager():
    step_g, step_e, plan = _steps(max_q=2, sizes=(1, 2))
    blocks = [(i,) for i in range(3)]
    assert step_g.bucket([[1], [2]], blocks[:2]) == 2
    assert step_g.bucket([[1], [2], [3]], blocks) is None  # more rows than the largest bucket
    assert step_g.bucket([[1, 2], [3]], blocks[:2]) is None  # mixed query lengths
    assert step_g.bucket([[1, 2, 3]], blocks[:1]) is None  # q > k + 1 (a prefill chunk)
    assert step_g.bucket([[1]], [tuple(range(9))]) is None  # block table wider than the static buffer
    _same(step_g, step_e, [[1], [2], [3]], [0, 0, 0], blocks)
    _same(step_g, step_e, [[4, 5, 6]], [1], blocks[:1])
    assert plan.capture.num_captures == 0
    assert ModelStep(step_e.model, step_e.kv_caches, BS, torch.device("cpu")).bucket([[1]], blocks[:1]) is None


def test_capture_selection(monkeypatch):
    monkeypatch.delenv(graphs.CAPTURE_ENV, raising=False)
    assert select_capture(CPU, enforce_eager=False)[0] is None
    gpu_torch_attn = Platform("cuda", torch.device("cpu"), torch.bfloat16, "torch", True, "nccl")
    capture, why = select_capture(gpu_torch_attn, enforce_eager=False)
    assert capture is None and "not capturable" in why
    gpu = Platform("cuda", torch.device("cuda", 0), torch.bfloat16, "triton", True, "nccl")
    assert gpu.graphs_label() == "CUDA graphs"
    assert Platform("rocm", gpu.device, torch.bfloat16, "triton", True, "nccl").graphs_label() == "HIP graphs"
    assert select_capture(gpu, enforce_eager=True) == (None, "eager (--enforce-eager)")
    monkeypatch.setenv(graphs.CAPTURE_ENV, "rerun")
    assert isinstance(select_capture(CPU, enforce_eager=False)[0], RerunCapture)
    assert select_capture(CPU, enforce_eager=True)[0] is None


def _generate(ckpt: str, batches: list[list[str]], **kw):
    from specserve.llm import LLM

    llm = LLM(ckpt, num_blocks=64, max_num_seqs=4, max_model_len=256, **kw)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [[o.outputs[0].token_ids for o in llm.generate(b, sp)] for b in batches], llm


@pytest.mark.parametrize("spec", [{}, {"speculative_method": "ngram", "num_speculative_tokens": 3},
                                  {"speculative_method": "layer_skip", "num_speculative_tokens": 2,
                                   "draft_layers": 1}], ids=["plain", "ngram", "layer_skip"])
def test_llm_greedy_with_graphs_equals_eager(ckpt, monkeypatch, spec):
    # a padded batch of 3, then one request alone (uniform verification rows at any k)
    batches = [["abcabcabcabc", "hello hello", "xyz"], ["abcabcabcabc"]]
    monkeypatch.delenv(graphs.CAPTURE_ENV, raising=False)
    ref, llm = _generate(ckpt, batches)  # plain eager generation, no speculation
    assert llm.engine.runner.graph_plan is None
    monkeypatch.setenv(graphs.CAPTURE_ENV, "rerun")
    out, llm = _generate(ckpt, batches, speculative_adaptive=False, **spec)
    assert out == ref
    runner = llm.engine.runner
    assert runner.graph_plan is not None and runner.kv_caches[0].shape[1] == runner.num_blocks + 1
    assert runner.target_step.static is not None
    buckets = set(runner.target_step.static.graphs)  # (batch size, q, prenorm)
    assert any(b == 4 for b, _, _ in buckets)  # steps of the 3-request batch, padded to 4
    if spec:
        assert llm.get_metrics()["speculative"]["draft_tokens"] > 0
        assert any(q > 1 for _, q, _ in buckets)  # verification rows replayed from graphs


def test_enforce_eager_disables_graphs(ckpt, monkeypatch):
    from specserve.cli import build_parser
    from specserve.engine_args import engine_kwargs

    monkeypatch.setenv(graphs.CAPTURE_ENV, "rerun")
    for argv in (["generate", "--enforce-eager"], ["serve", "--enforce-eager"],
                 ["bench", "offline", "--enforce-eager"]):
        assert EngineConfig.from_kwargs(None, **engine_kwargs(build_parser().parse_args(argv))).model.enforce_eager
    assert not EngineConfig.from_kwargs(None, **engine_kwargs(build_parser().parse_args(["generate"]))) \
        .model.enforce_eager
    _, llm = _generate(ckpt, [["abc"]], enforce_eager=True)
    assert llm.engine.runner.graph_plan is None


def test_gpu_memory_utilization_flag(capsys):
    from specserve.cli import build_parser, main
    from specserve.engine_args import engine_kwargs

    args = build_parser().parse_args(["generate", "--gpu-memory-utilization", "0.5"])
    assert EngineConfig.from_kwargs(None, **engine_kwargs(args)).cache.gpu_memory_utilization == 0.5
    assert EngineConfig.from_kwargs(None).cache.gpu_memory_utilization == 0.9
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
            EngineConfig.from_kwargs(None, gpu_memory_utilization=bad)
    assert main(["generate", "--gpu-memory-utilization", "1.5"]) == 2
    assert "--gpu-memory-utilization must be in (0, 1]" in capsys.readouterr().err


def test_gpu_memory_utilization_sizes_kv_on_gpu(ckpt, monkeypatch):
    from specserve.model.checkpoint.loader import load_checkpoint
    from specserve.worker.model_runner import ModelRunner

    free = 8 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 4 * free))
    # A "GPU" platform whose tensors still live on the CPU (is_gpu: kind != "cpu"); torch attention: eager.
    gpu = Platform("cuda", torch.device("cpu"), torch.float32, "torch", True, "nccl")
    target = load_checkpoint(ckpt)

    def blocks(**kw) -> tuple[int, int]:
        runner = ModelRunner(EngineConfig.from_kwargs(ckpt, max_model_len=128, **kw), gpu, target)
        return runner.num_blocks, runner.kv_bytes_per_block()

    n, per_block = blocks()
    assert n == int(0.9 * free // per_block)
    assert blocks(gpu_memory_utilization=0.5)[0] == int(0.5 * free // per_block)
    # --kv-cache-memory (bytes, or a fraction of free memory) and --num-kv-blocks take precedence
    assert blocks(gpu_memory_utilization=0.5, kv_cache_memory=float(100 * per_block))[0] == 100
    assert blocks(gpu_memory_utilization=0.5, kv_cache_memory=0.25)[0] == int(0.25 * free // per_block)
    assert blocks(gpu_memory_utilization=0.5, num_blocks=7)[0] == 7
