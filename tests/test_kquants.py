"""GGUF block formats kept as the file has them (``--quantization auto``): Q4_0, Q4_1, Q8_0, Q5_0 and the
K-quants Q4_K and Q6_K (two-level scales, Q6_K's 16-weight groups).

- the numbers the kernels use are the gguf package's dequantization of the file, value for value;
- the CPU kernels (row layout; tiled where the CPU has AVX-512 VNNI) match ``x @ w.T`` and are row-invariant,
  and the two-level scale blobs give the same bits as the fp32 products they stand for;
- resident bytes stay near the file's; a format still requantized says so; a tiny K-quant model decodes
  greedily with speculation on exactly as off.
Files are written here with the gguf package's writer; K-quant blocks are random but well-formed (the gguf
package has no K-quant quantizer).
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from specserve.model.checkpoint.gguf_file import parse_gguf, read_gguf_tensor
from specserve.model.kernels.cpu import load_cpu_kernels
from specserve.model.ops import _fused_args
from specserve.model.quant import (
    ConcatWeight,
    CpuQuantWeight,
    QuantEmbedding,
    QuantizedParts,
    QuantizedTensor,
    cat_rows,
    pack,
)
from specserve.platform import cpu_has_vnni, detect

Q = gguf.GGMLQuantizationType
needs_kernels = pytest.mark.skipif(detect("cpu").quant_kernels != "cpu" or not load_cpu_kernels(),
                                   reason="the C++ CPU kernels need an x86 CPU with AVX2 and a C++ compiler")
KEPT = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K]
LAYOUTS = [False] + ([True] if cpu_has_vnni() else [])  # tiled: the AVX-512 VNNI layout
# where the fp16 d (and dmin) of each block sit, and a magnitude for them that gives weights of ~0.05
_HALVES = {Q.Q4_0: [(0, 0.01)], Q.Q4_1: [(0, 0.01), (2, 0.05)], Q.Q8_0: [(0, 0.0005)], Q.Q5_0: [(0, 0.005)],
           Q.Q4_K: [(0, 0.0005), (2, 0.0005)], Q.Q6_K: [(208, 0.0001)]}


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Well-formed random blocks of an [n, k] weight in ``qtype``: random codes and sub-scales, fp16 block
    scales of a sensible size. Returned in the shape the gguf writer takes ([n, bytes per row])."""
    rng = np.random.default_rng(seed)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for off, scale in _HALVES[qtype]:
        d = (np.abs(rng.standard_normal((n, k // block))) * scale + scale / 10).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype: Q, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32))


def write(path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def kept(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[QuantizedTensor, torch.Tensor]:
    raw = random_blocks(qtype, n, k, seed)
    from specserve.model.checkpoint.gguf_file import _decode

    t = _decode(raw.reshape(-1), qtype, (n, k), "w", "mem", keep_quantized=True)
    assert isinstance(t, QuantizedTensor)
    return t, reference(raw, qtype, n, k)


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_every_kept_format_is_the_files_values(tmp_path, qtype):
    """Through a real file: kept quantized, the tensor dequantizes to the gguf package's values exactly (and
    read as float, to the same values); K-quants carry their two-level scales."""
    shapes = {"a.weight": (48, 512), "b.weight": (5, 768)}  # odd row count, three super-blocks
    data = {name: (random_blocks(qtype, *shape, seed=i), qtype) for i, (name, shape) in enumerate(shapes.items())}
    write(tmp_path / "q.gguf", data)
    with open(tmp_path / "q.gguf", "rb") as f:
        g = parse_gguf(f, "q.gguf")
        for name, (raw, _) in data.items():
            want = reference(raw, qtype, *shapes[name])
            t = read_gguf_tensor(f, g.tensors[name], "q.gguf", keep_quantized=True)
            assert isinstance(t, QuantizedTensor)
            assert torch.equal(t.dequantize(), want), name
            assert torch.equal(read_gguf_tensor(f, g.tensors[name], "q.gguf"), want)  # type: ignore[arg-type]
            assert (t.levels is not None) == (qtype in (Q.Q4_K, Q.Q6_K))
            assert t.group == (16 if qtype == Q.Q6_K else 32)


@needs_kernels
@pytest.mark.parametrize("tiled", LAYOUTS, ids=lambda t: "tiled" if t else "rows")
@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
@pytest.mark.parametrize("act_bits", [16, 8])
def test_kernels_match_and_are_row_invariant(qtype, tiled, act_bits):
    for n, k in ((48, 512), (40, 768)):  # 40 columns: not whole tiles, the row layout
        t, w = kept(qtype, n, k, seed=n)
        packed = CpuQuantWeight(t, torch.device("cpu"), tiled=tiled)
        packed.act_bits = act_bits
        assert packed.tiled == (tiled and n % 16 == 0)
        x = torch.randn(7, k, generator=torch.Generator().manual_seed(k))
        y = packed(x)
        want = x @ w.T
        # the activation grid's error: 16 bits ~1e-5, 8 bits ~1/254 per element of a group's largest value
        assert (y - want).abs().max().item() < (1e-4 if act_bits == 16 else 2e-2) * want.abs().max().item()
        assert torch.equal(torch.cat([packed(x[i:i + 1]) for i in range(7)]), y)  # each row alone: same bits
        assert torch.equal(packed.dequantize(), w)
        if t.levels is not None:  # the blobs stand for exact fp32 products: the same bits as those
            plain = CpuQuantWeight(QuantizedTensor(t.bits, t.codes, t.scales, t.mins), torch.device("cpu"), tiled=tiled)
            plain.act_bits = act_bits
            assert plain.scales.dtype == torch.float32 and packed.scales.dtype == torch.uint8
            assert torch.equal(plain(x), y)


@needs_kernels
@pytest.mark.parametrize("tiled", LAYOUTS, ids=lambda t: "tiled" if t else "rows")
@pytest.mark.parametrize("act_bits", [16, 8])
def test_narrow_codes_give_the_eight_bit_kernels_bits(tiled, act_bits):
    """8-bit codes that fit 5 or 6 bits (Q5_0's, Q6_K's) are stored in those bits and give exactly the
    products of the same codes stored in 8: odd group counts (a lone group in the row layout), scales per
    group and per half group, 1 .. 17 rows, whole and partial tiles; the rows read back are the codes."""
    gen = torch.Generator().manual_seed(3)
    for bits in (5, 6):
        half = 1 << (bits - 1)
        for n, k, group in ((48, 96, 16), (40, 160, 32), (32, 512, 16)):
            codes = torch.randint(-half, half, (n, k), generator=gen, dtype=torch.int8)
            codes[0, :3] = torch.tensor([-half, half - 1, 0], dtype=torch.int8)  # the extremes
            scales = torch.rand(n, k // group, generator=gen) * 0.01
            qt = QuantizedTensor(8, codes, scales, None)
            narrow = CpuQuantWeight(qt, torch.device("cpu"), tiled=tiled)
            eight = CpuQuantWeight(qt, torch.device("cpu"), tiled=tiled, narrow=False)
            assert narrow.code_bits == bits and eight.code_bits == 8
            assert narrow.tiled == eight.tiled == (tiled and n % 16 == 0)
            assert narrow.packed.numel() * 8 == eight.packed.numel() * bits
            narrow.act_bits = eight.act_bits = act_bits
            for m in (1, 5, 17):
                x = torch.randn(m, k, generator=gen)
                assert torch.equal(narrow(x), eight(x)), (bits, n, k, group, m)
            ids = torch.tensor([0, n - 1, 7, 0])
            assert torch.equal(narrow.take_rows(ids).codes, codes[ids])
            assert torch.equal(narrow.dequantize(), eight.dequantize())
    wide = QuantizedTensor(8, torch.full((16, 64), 32, dtype=torch.int8), torch.ones(16, 2), None)
    assert CpuQuantWeight(wide, torch.device("cpu"), tiled=tiled).code_bits == 8  # 32 needs 7 bits


@needs_kernels
def test_resident_bytes_stay_near_the_files():
    """Q4_K costs 4.5 bits a weight in the file and 4.625 here; Q6_K 6.5625 in both (6-bit codes, the file's
    two-level scales); Q5_0 5.5 in both (5-bit codes, an fp16 scale); Q4_0 20 bytes a group (fp16 scale and
    min) for 18. Bytes of the packed buffers over the file's block bytes."""
    limits = {Q.Q4_0: 1.12, Q.Q4_K: 1.03, Q.Q6_K: 1.0, Q.Q5_0: 1.0}  # Q4_0 keeps a min (-8 d) per group
    for qtype, limit in limits.items():
        n, k = 64, 1024
        t, _ = kept(qtype, n, k)
        for tiled in LAYOUTS:
            packed = CpuQuantWeight(t, torch.device("cpu"), tiled=tiled)
            resident = sum(b.numel() * b.element_size() for b in packed.buffers())
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            assert resident / (n * k // block * nbytes) <= limit, (qtype.name, tiled)


def test_formats_still_requantized_say_so(tmp_path, caplog):
    a = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).numpy()
    write(tmp_path / "q.gguf", {"blk.3.ffn_down.weight": (gguf.quants.quantize(a, Q.Q5_1), Q.Q5_1)})
    with open(tmp_path / "q.gguf", "rb") as f, caplog.at_level(logging.WARNING, logger="specserve"):
        g = parse_gguf(f, "q.gguf")
        t = read_gguf_tensor(f, g.tensors["blk.3.ffn_down.weight"], "q.gguf", keep_quantized=True)
    assert isinstance(t, QuantizedTensor) and t.bits == 8
    assert "blk.3.ffn_down.weight is Q5_1" in caplog.text and "requantized to int8" in caplog.text


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_embedding_rows_are_the_files_values(qtype):
    t, w = kept(qtype, 40, 512)
    table = QuantEmbedding(t, torch.float32, torch.device("cpu"))
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(table.lookup(ids), w[ids])
    assert torch.equal(table.dequantize(), w)
    assert sum(b.numel() * b.element_size() for b in table.buffers()) <= 0.27 * w.numel() * 4  # Q8_0: 17 / 64 of fp32


@needs_kernels
@pytest.mark.parametrize("tiled", LAYOUTS, ids=lambda t: "tiled" if t else "rows")
@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_a_tied_embedding_reads_the_packed_heads_rows(qtype, tiled):
    """A tied table is looked up in the LM head's packed bytes (``TiedEmbedding``): the file's values."""
    from specserve.model.quant import TiedEmbedding

    t, w = kept(qtype, 48, 512)
    head = CpuQuantWeight(t, torch.device("cpu"), tiled=tiled)
    ids = torch.tensor([17, 0, 47, 17, 31])
    assert torch.equal(head.take_rows(ids).dequantize(), w[ids])
    assert torch.equal(TiedEmbedding(head, torch.float32).lookup(ids), w[ids])


@needs_kernels
def test_mixed_formats_fuse_as_parts():
    """Q4_K q and k with a Q6_K v (Q4_K_M files): the fused weight keeps each part as it is."""
    (q, wq), (kk, wk), (v, wv) = kept(Q.Q4_K, 32, 512, 1), kept(Q.Q4_K, 16, 512, 2), kept(Q.Q6_K, 16, 512, 3)
    fused = cat_rows([q, kk, v])
    assert isinstance(fused, QuantizedParts) and fused.shape == (64, 512)
    same = cat_rows([q, kk])
    assert isinstance(same, QuantizedTensor) and torch.equal(same.dequantize(), torch.cat([wq, wk]))
    packed = pack(fused, "cpu", torch.device("cpu"), torch.float32)
    assert isinstance(packed, ConcatWeight)
    x = torch.randn(3, 512)
    parts = [CpuQuantWeight(p, torch.device("cpu")) for p in (q, kk, v)]
    assert torch.equal(packed(x), torch.cat([p(x) for p in parts], dim=-1))
    assert torch.equal(packed.dequantize(), torch.cat([wq, wk, wv]))


# -- a tiny Q4_K_M-like model end to end ------------------------------------------------------------------------
def _tiny_kquant_gguf(path) -> None:
    """A 2-layer Llama, hidden 256, llama.cpp's Q4_K_M mix: Q4_K attention q/k/o, gate/up and embedding; Q6_K
    v, down and output; F32 norms."""
    hidden, inter, vocab, layers = 256, 512, 512, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-kquant")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 256), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, inter), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_rope_dimension_count, 64), (w.add_vocab_size, vocab), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2)):
        add(value)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_scores([float(i) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    seed = iter(range(1000))

    def mat(name: str, n: int, k: int, qtype: Q) -> None:
        w.add_tensor(name, random_blocks(qtype, n, k, next(seed)), raw_dtype=qtype)

    mat("token_embd.weight", vocab, hidden, Q.Q4_K)
    mat("output.weight", vocab, hidden, Q.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        for name, n, k, qtype in (("attn_q", 256, hidden, Q.Q4_K), ("attn_k", 128, hidden, Q.Q4_K),
                                  ("attn_v", 128, hidden, Q.Q6_K), ("attn_output", hidden, 256, Q.Q4_K),
                                  ("ffn_gate", inter, hidden, Q.Q4_K), ("ffn_up", inter, hidden, Q.Q4_K),
                                  ("ffn_down", hidden, inter, Q.Q6_K)):
            mat(p + name + ".weight", n, k, qtype)
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@needs_kernels
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_tiny_kquant_model_speculation_is_bit_exact(tmp_path, activation_bits):
    from specserve import SamplingParams
    from specserve.llm import LLM
    from specserve.model.quant import weight_bytes

    path = str(tmp_path / "tiny-kquant.gguf")
    _tiny_kquant_gguf(path)
    prompts = [[5, 9, 13, 2 + i, 7, 5, 9, 13] for i in range(1, 6)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(num_blocks=64, block_size=16, device="cpu", activation_bits=activation_bits)
    with LLM(path, speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False,
             prompt_lookup_min=1, **kw) as llm:
        m = llm.engine.runner.model
        assert isinstance(m.embed, QuantEmbedding)
        assert isinstance(m.layers[0].attn.qkv, ConcatWeight)  # Q4_K q, k + Q6_K v
        kv = llm.engine.runner.kv_caches[0]
        fused = _fused_args(m.layers[0], kv)  # the one-call C++ layer takes the two parts
        assert fused is not None and fused[2][0] is not None and fused[2][3] == activation_bits
        calls: list[int] = []
        stack = torch.ops.specserve_cpu.decoder_stack
        resident = weight_bytes(m)
        torch.ops.specserve_cpu.decoder_stack = lambda *a: calls.append(1) or stack(*a)
        try:
            off = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts, speculative=False)]
        finally:
            torch.ops.specserve_cpu.decoder_stack = stack
        assert calls  # every layer in one call
        import specserve.model.ops as ops

        real = ops._fused_args
        ops._fused_args = lambda layer, kv: None  # op by op (ConcatWeight's parts in turn): the same bits
        try:
            per_op = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts,
                                                                    speculative=False)]
        finally:
            ops._fused_args = real
        assert per_op == off
        on = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts)]
        alone = [llm.generate(None, sp, prompt_token_ids=[p])[0].outputs[0].token_ids for p in prompts[:2]]
        assert llm.get_metrics()["speculative"]["draft_tokens"] > 0
    assert on == off and alone == off[:2]
    with open(path, "rb") as f:
        tensor_bytes = sum(i.nbytes for i in parse_gguf(f, path).tensors.values())
    assert resident <= 1.15 * tensor_bytes


@needs_kernels
@pytest.mark.slow
def test_tiny_kquant_model_tensor_parallel(tmp_path):
    """TP=2 slices K-quant weights: a slice of whole super-blocks keeps the two-level scales (ffn_down's 256
    columns a rank), another falls back to fp32 products (attn_output's 128): greedy equals TP=1 under the
    near-tie rule (the ranks add partial sums in another order)."""
    from specserve import SamplingParams
    from specserve.llm import LLM
    from tests.test_engine import assert_same_or_near_tie

    path = str(tmp_path / "tiny-kquant.gguf")
    _tiny_kquant_gguf(path)
    prompts = [[5, 9, 13, 2 + i, 7, 5, 9, 13] for i in range(1, 5)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(num_blocks=64, block_size=16, device="cpu")
    ref_llm = LLM(path, **kw)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(None, sp, prompt_token_ids=prompts)]
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        down = llm.engine.runner.model.layers[0].mlp.down
        assert isinstance(down, CpuQuantWeight) and down.scales.dtype == torch.uint8  # levels kept
        got = [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts)]
    ties: list[tuple] = []
    for p, g, r in zip(prompts, got, ref):
        assert_same_or_near_tie(ref_llm, p, g, r, ties)
    assert len(ties) <= 1, ties
