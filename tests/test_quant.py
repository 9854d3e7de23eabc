"""Weight-only quantization (model/quant.py) and the C++ CPU kernels (model/kernels/cpu_kernels.cpp).

- GGUF Q4_0 / Q4_1 / Q8_0 blocks decode to exactly the numbers the gguf package dequantizes them to;
- the matmuls, in both weight layouts (rows: AVX2; tiled: AVX-512 VNNI, where the CPU has it), equal a
  reference that rounds the activations to the same 16-bit grid per group of 32 and multiplies the codes,
  up to summation order; and a row's result does not depend on the other rows (the
  property that makes greedy speculation bit-exact on quantized targets);
- the paged-attention kernel and the fused small ops against their torch references;
- ``--quantization``'s policy and its errors.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specserve.config import CheckpointError, ModelConfig
from specserve.model.attention import CpuKernelAttention, TorchAttention, build_metadata
from specserve.model.checkpoint.gguf_file import _quantized
from specserve.model.kernels.cpu import load_cpu_kernels
from specserve.model.layers import RMSNorm, RotaryEmbedding
from specserve.model.ops import CpuFusedOps, TorchOps
from specserve.model.quant import (
    CpuQuantWeight,
    DenseWeight,
    QuantizedParts,
    QuantizedTensor,
    cat_rows,
    make_packer,
    quantize,
)
from specserve.platform import cpu_has_vnni, detect

needs_kernels = pytest.mark.skipif(detect("cpu").quant_kernels != "cpu" or not load_cpu_kernels(),
                                   reason="the C++ CPU kernels need an x86 CPU with AVX2 and a C++ compiler")
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_decode_to_the_files_numbers(qtype):
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)  # [6, blocks * block bytes]
    want = gguf.quants.dequantize(raw, qtype)
    qt = _quantized(raw.reshape(-1), qtype, (6, 96))
    assert qt.bits == (8 if qtype == Q.Q8_0 else 4)
    got = qt.dequantize().numpy()
    # Q4_1 (d * q + m) may round the sum once where numpy rounds twice: within an ulp of the weight.
    np.testing.assert_allclose(got, want, rtol=0, atol=float(np.abs(want).max()) * 2 ** -22)
    if qtype != Q.Q4_1:
        assert np.array_equal(got, want)


def test_quantize_error_bounds_and_shapes():
    w = torch.randn(40, 96)
    g = w.view(40, 3, 32)
    for bits, step in ((4, (g.amax(-1) - g.amin(-1)) / 15), (8, g.abs().amax(-1) / 127)):
        qt = quantize(w, bits)
        err = (qt.dequantize() - w).abs().view(40, 3, 32).amax(-1)
        assert bool((err <= step * 0.51 + 1e-7).all()), bits
    a, b = quantize(w[:8], 4), quantize(w[8:], 8)
    fused = cat_rows([a, b])  # mixed widths stay parts: neither is requantized
    assert isinstance(fused, QuantizedParts) and fused.shape == (40, 96)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(CheckpointError, match="not a multiple of the group size 32"):
        quantize(torch.randn(4, 48), 4, "model.layers.0.mlp.down_proj.weight")


def test_quantization_choices_are_validated():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4"):
        ModelConfig(quantization="fp4")


def _activation_grid(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x rounded per group of 32 as the kernels round activations: round(x / d) * d, d = max|x| / levels."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / levels)).view_as(x)


def _grid_reference(x: torch.Tensor, qt: QuantizedTensor, levels: int) -> torch.Tensor:
    """The kernels' arithmetic in float64: activations on their grid times the codes, scaled per group; the
    4-bit min term multiplies the exact sums of x."""
    m, k = x.shape
    xg = _activation_grid(x, levels).view(m, -1, 32).double()
    codes = qt.codes.double().view(qt.shape[0], -1, 32)
    y = torch.einsum("mgk,ngk,ng->mn", xg, codes, qt.scales.double())
    if qt.mins is not None:
        y = y + x.view(m, -1, 32).double().sum(-1) @ qt.mins.double().t()
    return y.float()


LAYOUTS = ["rows"] + (["tiled"] if cpu_has_vnni() else [])


@needs_kernels
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [160, 576])  # an odd group count (a lone last group) and the demo's width
def test_cpu_matmul_matches_reference_and_is_row_invariant(layout, bits, k, act_bits):
    torch.manual_seed(0)
    w = torch.randn(80, k)
    qt = quantize(w, bits)
    packed = CpuQuantWeight(qt, torch.device("cpu"), tiled=layout == "tiled")
    packed.act_bits = act_bits
    assert packed.tiled == (layout == "tiled")
    x = torch.randn(23, k)
    y = packed(x)
    levels = 127 if act_bits == 8 else 32512 if packed.tiled else 32767
    ref = _grid_reference(x, qt, levels)
    assert (y - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    # against unrounded activations: the grid's own error (1/(2 levels) of a group's largest value per element)
    exact = x @ qt.dequantize().t()
    err = (y - exact).abs().max().item() / exact.abs().max().item()
    assert err < (1e-4 if act_bits == 16 else 2e-2)
    if act_bits == 8:  # the coarser grid is visible: it is not the 16-bit kernel under another name
        assert err > 1e-4
    for m in (1, 2, 5, 8, 9, 17):  # any row tile split: row 0 always gets the same bits
        assert torch.equal(packed(x[:m]), y[:m]), m
    assert torch.equal(packed(x[5:6]), y[5:6])
    # the packed form round-trips to the same codes
    back = packed.unpacked()
    assert torch.equal(back.codes, qt.codes) and torch.equal(back.scales, qt.scales)
    assert back.mins is None if bits == 8 else torch.equal(back.mins, qt.mins)
    # a wrong nibble order is caught by the reference check above: swap and compare
    if bits == 4:
        swapped = CpuQuantWeight(QuantizedTensor(4, 15 - qt.codes, qt.scales, qt.mins), torch.device("cpu"),
                                 tiled=packed.tiled)
        assert (swapped(x) - ref).abs().max().item() > 0.1


def test_tiled_layout_is_the_platforms_choice(monkeypatch):
    monkeypatch.setenv("SPECSERVE_CPU_TILED", "0")  # the row layout, for comparisons
    assert not cpu_has_vnni()
    assert not CpuQuantWeight(quantize(torch.randn(32, 64), 4), torch.device("cpu")).tiled
    monkeypatch.delenv("SPECSERVE_CPU_TILED")
    assert cpu_has_vnni() == (bool(torch.cpu._is_vnni_supported()) and bool(torch.cpu._is_avx512_supported()))


@needs_kernels
def test_tiled_layout_needs_a_multiple_of_16_columns():
    qt = quantize(torch.randn(72, 64), 4)
    assert not CpuQuantWeight(qt, torch.device("cpu"), tiled=True).tiled  # 72 columns: the row layout
    if cpu_has_vnni():
        assert CpuQuantWeight(quantize(torch.randn(80, 64), 8), torch.device("cpu")).tiled


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_weights_keep_fp16_scales_when_exact(bits):
    torch.manual_seed(1)
    qt = quantize(torch.randn(40, 576), bits)
    for t in (qt.scales, qt.mins):  # requantized scales and mins are fp16 values, as GGUF's
        assert t is None or torch.equal(t.half().float(), t)
    packed = CpuQuantWeight(qt, torch.device("cpu"))
    assert packed.scales.dtype == torch.float16
    x = torch.randn(7, 576)
    as_fp32 = CpuQuantWeight(qt, torch.device("cpu"))
    as_fp32.scales = as_fp32.scales.float()
    if as_fp32.mins is not None:
        as_fp32.mins = as_fp32.mins.float()
    assert torch.equal(packed(x), as_fp32(x))  # the kernel reads either storage to the same numbers
    assert torch.equal(packed.unpacked().scales, qt.scales)
    inexact = QuantizedTensor(bits, qt.codes, qt.scales + 1e-6, qt.mins)  # not fp16 values: stay fp32
    assert CpuQuantWeight(inexact, torch.device("cpu")).scales.dtype == torch.float32


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 32), (8, 2, 64), (4, 4, 48), (4, 2, 40)])
def test_cpu_paged_attention_matches_torch_reference(kv_dtype, heads, kv_heads, d):
    """Head sizes that are multiples of 16 take the 512-bit code on CPUs with AVX-512 (40: the 256-bit code
    everywhere); 3 heads per KV head are one set, 4 are a set of 3 and a set of 1, 1 is a set of its own."""
    torch.manual_seed(0)
    bs = 16
    kv = torch.randn(2, 60, bs, kv_heads, d).to(kv_dtype)
    # rows of one chunk (<= 64 keys), of 64-key chunks (120, 300) and of 128-key chunks (700)
    q_lens, seq_lens = [1, 5, 37, 1, 3, 2], [300, 120, 37, 17, 3, 700]
    tables = [(torch.randperm(59)[: -(-s // bs)] + 1).tolist() for s in seq_lens]
    meta = build_metadata(q_lens, seq_lens, tables, bs)
    q = torch.randn(sum(q_lens), heads, d).to(torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32)
    ref = TorchAttention().attend(q, kv, meta, d ** -0.5).float()
    out = CpuKernelAttention().attend(q, kv, meta, d ** -0.5).float()
    tol = 2e-2 if kv_dtype == torch.bfloat16 else 1e-5
    assert (ref - out).abs().max().item() < tol
    # row invariance: each request alone gives the same rows as the mixed batch
    start = 0
    for q_len, s_len, table in zip(q_lens, seq_lens, tables):
        alone = CpuKernelAttention().attend(q[start:start + q_len], kv, build_metadata([q_len], [s_len], [table], bs),
                                            d ** -0.5).float()
        assert torch.equal(alone, out[start:start + q_len])
        start += q_len


@needs_kernels
def test_fused_ops_match_torch_ops():
    torch.manual_seed(0)
    hidden, heads, kv_heads, d, t = 64, 4, 2, 16, 7
    norm = RMSNorm(hidden, 1e-6, torch.float32, torch.device("cpu"))
    norm.weight.data.normal_()
    h, delta = torch.randn(t, hidden), torch.randn(t, hidden)
    for a, b in zip(TorchOps().add_norm(h, delta, norm), CpuFusedOps().add_norm(h, delta, norm)):
        assert (a - b).abs().max().item() < 1e-5
    assert (TorchOps().add_norm(h, None, norm)[1] - CpuFusedOps().add_norm(h, None, norm)[1]).abs().max() < 1e-5
    assert torch.equal(CpuFusedOps().add_norm(h, delta, norm)[0], h + delta)  # the residual add is exact
    gu = torch.randn(t, 2 * 13) * 4  # 13: a tail past the 8-lane blocks
    gu[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -88.5])
    g, u = gu.split(13, dim=-1)
    act = torch.ops.specserve_cpu.silu_mul(gu)  # what decoder_layer and CpuFusedOps.mlp use for SiLU * up
    assert torch.allclose(act, torch.nn.functional.silu(g) * u, rtol=1e-6, atol=1e-30)
    assert torch.equal(torch.ops.specserve_cpu.silu_mul(gu[3:4]), act[3:4])  # a row alone: the same bits
    chunked = RMSNorm(hidden // 4, 1e-6, torch.float32, torch.device("cpu"), chunks=4)  # an EAGLE-3 feature norm
    chunked.weight.data.normal_()
    h[:, :hidden // 4] = 0.0  # an all-zero chunk (a drafting step's missing feature layers) stays zero
    got = CpuFusedOps().add_norm(h, None, chunked)[1]
    assert (TorchOps().add_norm(h, None, chunked)[1] - got).abs().max().item() < 1e-5
    assert torch.equal(got[:, :hidden // 4], torch.zeros(t, hidden // 4))
    rope = RotaryEmbedding(d, 64, 10000.0, None, torch.float32, torch.device("cpu"))
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    positions = torch.tensor([3, 9, 10, 11, 40, 41, 0])
    meta = build_metadata([t], [t], [[1, 2, 3, 4]], 16)
    meta.slot_mapping = torch.tensor([5, 17, 18, 19, 33, 34, 60])
    caches = [torch.zeros(2, 5, 16, kv_heads, d) for _ in range(2)]
    qs = [ops.qkv_rope_write(qkv, positions, rope, heads, kv_heads, cache, meta, TorchAttention())
          for ops, cache in zip((TorchOps(), CpuFusedOps()), caches)]
    assert (qs[0] - qs[1]).abs().max().item() < 1e-5
    assert (caches[0] - caches[1]).abs().max().item() < 1e-5
    # a 16-bit cache (--kv-cache-dtype) holds the fp32 cache's values rounded once, to nearest even
    for half in (torch.float16, torch.bfloat16):
        cache = torch.zeros(2, 5, 16, kv_heads, d, dtype=half)
        q = CpuFusedOps().qkv_rope_write(qkv, positions, rope, heads, kv_heads, cache, meta, TorchAttention())
        assert torch.equal(q, qs[1])
        assert torch.equal(cache, caches[1].to(half))


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_decoder_layer_equals_per_op_path(tmp_path, family):
    """A layer whose matmuls are all quantized runs as one ``decoder_layer`` call, and a model whose layers
    all do as one ``decoder_stack`` call; their results (prefill, decode, a 4-token verification, the feature
    layers an EAGLE head reads, and a layer a float weight keeps on the per-op path) equal the per-op path's
    bit for bit. qwen2 adds the q/k/v bias."""
    from specserve.model.checkpoint.loader import load_checkpoint
    from specserve.model.ops import _fused_args, _stack_args
    from specserve.worker.model_runner import build_model
    from tests.helpers import tiny_hf_model

    tiny_hf_model(family, layers=3).save_pretrained(tmp_path)
    model = build_model(load_checkpoint(str(tmp_path)), detect("cpu"), torch.float32, 128, "int4")
    assert isinstance(model.ops, CpuFusedOps)
    layers = model.decoder_layers
    kv0 = torch.zeros(model.kv_cache_shape(8, 16))

    class Layered(CpuFusedOps):  # one decoder_layer call per layer
        stack = TorchOps.stack

    class PerOp(Layered):
        layer = TorchOps.layer

    def run(ops: TorchOps) -> list[torch.Tensor]:
        model.ops = ops
        kv = [torch.zeros(model.kv_cache_shape(8, 16)) for _ in layers]
        ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
        outs = []
        for start, n in ((0, 30), (30, 1), (31, 5)):  # prefill, decode, verification
            meta = build_metadata([n], [start + n], [[0, 1, 2, 3]], 16)
            normed, features = model(ids[start:start + n], torch.arange(start, start + n), kv, meta,
                                     return_prenorm=True)
            outs += [model.compute_logits(normed), features]
            meta = build_metadata([n], [start + n], [[4, 5, 6, 7]], 16)  # the first two layers only
            outs.append(model(ids[start:start + n], torch.arange(start, start + n), kv[:2], meta, num_layers=2))
        return outs + kv

    model.feature_layers = (1, 3)
    assert _stack_args(layers, model.layer_ropes, [kv0] * 3) is not None
    stacked, layered, per_op = run(CpuFusedOps()), run(Layered()), run(PerOp())
    assert all(torch.equal(a, b) for a, b in zip(stacked, per_op))
    assert all(torch.equal(a, b) for a, b in zip(layered, per_op))

    layers[2].mlp.down = DenseWeight(layers[2].mlp.down.dequantize())  # this layer cannot be fused
    assert _fused_args(layers[0], kv0) is not None and _fused_args(layers[2], kv0) is None
    assert _stack_args(layers, model.layer_ropes, [kv0] * 3) is None  # noticed: the weight was replaced
    assert _stack_args(layers[:2], model.layer_ropes[:2], [kv0] * 2) is not None
    fused, per_op = run(CpuFusedOps()), run(PerOp())
    assert all(torch.equal(a, b) for a, b in zip(fused, per_op))


def test_packer_policy():
    sd = {"model.layers.0.mlp.down_proj.weight": torch.randn(8, 64), "lm_head.weight": torch.randn(16, 64)}
    cpu = torch.device("cpu")
    assert make_packer("none", "cpu", sd, cpu, torch.float32) is None
    assert make_packer("auto", "cpu", sd, cpu, torch.float32) is None  # float checkpoint: left alone
    assert make_packer("int4", None, sd, cpu, torch.float32) is None  # no kernel here: dequantized
    if detect("cpu").quant_kernels == "cpu" and load_cpu_kernels():
        packer = make_packer("int4", "cpu", sd, cpu, torch.float32)
        assert packer is not None
        layer = packer(sd["model.layers.0.mlp.down_proj.weight"], "model.layers.0.mlp.down_proj.weight")
        head = packer(sd["lm_head.weight"], "lm_head.weight")
        assert (layer.bits, head.bits) == (4, 8)  # the LM head stays 8-bit, as in llama.cpp's Q4 files
        auto = make_packer("auto", "cpu", {**sd, "x": quantize(torch.randn(8, 64), 4)}, cpu, torch.float32)
        assert isinstance(auto(sd["lm_head.weight"], "lm_head.weight"), DenseWeight)  # float stays float


@pytest.mark.slow
@needs_kernels
def test_demo_gguf_kept_quantized_agrees_with_dequantized_reference():
    """The demo GGUF (Q4_1 layers, Q8_0 embedding/LM head) under --quantization auto multiplies with the file's
    own numbers; against the file dequantized to float32 only the kernels' 16-bit activation grid and the
    summation order differ: greedy outputs of 64 tokens must agree on at least 7 of 8 prompts, and the logits
    stay within a small |delta| (measured 1.7e-2 here, 2.1e-2 over 16 prompts)."""
    from specserve import SamplingParams
    from specserve.datasets import load_dataset
    from specserve.llm import LLM

    ref = LLM(None, quantization="none", dtype="float32", device="cpu", num_blocks=256, max_num_seqs=8)
    assert "int" not in ref.engine.runner.weights_note
    tok = ref.tokenizer
    prompts = [tok.apply_chat_template(item.messages) for item in load_dataset("chat")[:8]]
    params = SamplingParams(temperature=0, max_tokens=64)
    want = [o.outputs[0].token_ids for o in ref.generate(None, params, prompt_token_ids=prompts)]
    ref_logits = _last_logits(ref, prompts[0] + want[0])
    del ref
    llm = LLM(None, quantization="auto", dtype="float32", device="cpu", num_blocks=256, max_num_seqs=8)
    note = llm.engine.runner.weights_note
    assert "int4" in note and "int8" in note, note  # Q4_1 layers and the Q8_0 LM head stayed quantized
    got = [o.outputs[0].token_ids for o in llm.generate(None, params, prompt_token_ids=prompts)]
    delta = float((_last_logits(llm, prompts[0] + want[0]) - ref_logits).abs().max())
    equal = sum(a == b for a, b in zip(want, got))
    print(f"auto vs dequantized reference: greedy equal on {equal} of 8 prompts, max |logit delta| {delta:.2e}")
    assert equal >= 7
    assert delta < 5e-2


def _last_logits(llm, tokens: list[int]) -> torch.Tensor:
    model = llm.engine.runner.model
    n, bs = len(tokens), 16
    blocks = -(-n // bs)
    kv = [torch.zeros(model.kv_cache_shape(blocks, bs)) for _ in range(model.arch.num_layers)]
    hidden = model(torch.tensor(tokens), torch.arange(n), kv, build_metadata([n], [n], [list(range(blocks))], bs))
    return model.compute_logits(hidden).float()


def test_cli_errors_are_one_line(tmp_path, capsys):
    """A bad --quantization value, and int4 over a weight whose input size is not a multiple of 32: exit 2 with
    one error line, no traceback."""
    from specserve.cli import main
    from tests.helpers import tiny_hf_model, write_char_tokenizer

    with pytest.raises(SystemExit) as e:
        main(["generate", "--quantization", "fp4", "--prompt", "x"])
    assert e.value.code == 2 and "invalid choice: 'fp4'" in capsys.readouterr().err
    model = tiny_hf_model("llama", hidden_size=48, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2)
    model.save_pretrained(tmp_path)
    write_char_tokenizer(str(tmp_path), model.config.vocab_size)
    capsys.readouterr()  # drop save_pretrained's progress bar
    args = ["generate", "--model", str(tmp_path), "--device", "cpu", "--prompt", "x", "--max-tokens", "2"]
    if detect("cpu").quant_kernels == "cpu" and load_cpu_kernels():
        assert main(args + ["--quantization", "int4"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a multiple of the group size 32" in err[0], err
        assert err[0].startswith("specserve: error:") and "--quantization none" in err[0]
    assert main(args + ["--quantization", "auto"]) == 0  # a float checkpoint: auto leaves it float


def test_abandoned_kernel_build_lock_is_removed(tmp_path):
    """torch's extension builder waits for its lock file without a limit: a lock older than a build could
    take (a process killed while building) is removed, before the build and while it waits; a fresh one
    (another process building now) is left alone."""
    import os
    import time

    from specserve.model.kernels import cpu as kernels

    lock = tmp_path / "lock"
    assert not kernels.remove_stale_lock(str(tmp_path))  # no lock
    lock.touch()
    assert not kernels.remove_stale_lock(str(tmp_path)) and lock.exists()  # fresh: someone is building
    old = time.time() - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert kernels.remove_stale_lock(str(tmp_path)) and not lock.exists()
    with kernels._stale_lock_watch(str(tmp_path), every_s=0.02):  # what _build wraps torch's load() in
        lock.touch()
        os.utime(lock, (old, old))
        deadline = time.time() + 10
        while lock.exists() and time.time() < deadline:
            time.sleep(0.02)
        assert not lock.exists()
