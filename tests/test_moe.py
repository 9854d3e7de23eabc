"""SparseMoE (model/sparse_moe.py) vs HF transformers' sparse MoE blocks, its batch invariance and sparsity, and the
Triton experts (model/kernels/triton_moe.py) vs the torch path.

On CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before triton is imported);
shapes are kept tiny because the interpreter executes every program instance in Python.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors import safe_open  # noqa: E402

from specserve.model.sparse_moe import SparseMoE  # noqa: E402

try:
    from specserve.model.kernels import triton_moe
except ImportError:  # pragma: no cover - depends on the environment
    triton_moe = None  # type: ignore[assignment]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(triton_moe is None, reason="needs triton")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
HIDDEN, INTER = 64, 32


def _hf_block(family: str, num_experts: int, norm_topk_prob: bool, seed: int = 0):
    """An HF sparse MoE block with random weights (hidden 64, top-2) and its config."""
    import transformers as tf

    common = dict(hidden_size=HIDDEN, num_experts_per_tok=2)
    if family == "mixtral":  # renormalises always
        cfg = tf.MixtralConfig(intermediate_size=INTER, num_local_experts=num_experts, **common)
        block_cls = tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(moe_intermediate_size=INTER, num_experts=num_experts,
                                norm_topk_prob=norm_topk_prob, **common)
        block_cls = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    else:
        cfg = tf.OlmoeConfig(intermediate_size=INTER, num_experts=num_experts, norm_topk_prob=norm_topk_prob,
                             **common)
        block_cls = tf.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock
    cfg._experts_implementation = "eager"
    block = block_cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block


def _moe(num_experts, top_k, norm, *, seed=0, dtype=torch.float32, device="cpu", **kw) -> SparseMoE:
    """SparseMoE with random weights scaled so activations stay O(1)."""
    moe = SparseMoE(HIDDEN, INTER, num_experts, top_k, norm, dtype, torch.device(device), **kw)
    g = torch.Generator().manual_seed(seed)
    for p in moe.parameters():
        p.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).to(dtype))
    return moe


def _x(T: int, seed: int = 1, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


# -- parity with HF ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False),
                                         ("olmoe", True), ("olmoe", False)])
@pytest.mark.parametrize("num_experts", [4, 8])
def test_matches_hf_block(family, norm, num_experts):
    block = _hf_block(family, num_experts, norm)
    moe = SparseMoE(HIDDEN, INTER, num_experts, 2, norm, torch.float32, torch.device("cpu"))
    moe.gate.copy_(block.gate.weight)
    moe.gate_up.copy_(block.experts.gate_up_proj)
    moe.down.copy_(block.experts.down_proj)
    for T in (1, 5, 33):
        x = _x(T, seed=T)
        with torch.no_grad():
            ref = block(x[None])[0]
        assert (moe(x) - ref).abs().max().item() < 1e-5, (family, norm, T)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_loads_per_expert_checkpoint_tensors(family, tmp_path):
    """save_pretrained writes one tensor per expert and projection (the MoeNames convention); gate_up[e] is
    cat([gate_proj, up_proj]) (Mixtral: cat([w1, w3])), down[e] is down_proj (w2)."""
    import transformers as tf

    common = dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, num_experts_per_tok=2)
    if family == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=INTER, num_local_experts=4, **common))
        pre, names = "model.layers.0.block_sparse_moe.", ("w1", "w3", "w2")
    else:
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(moe_intermediate_size=INTER, num_experts=4,
                                                         norm_topk_prob=True, **common))
        pre, names = "model.layers.0.mlp.", ("gate_proj", "up_proj", "down_proj")
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys() if k.startswith(pre)}
    moe = SparseMoE(HIDDEN, INTER, 4, 2, True, torch.float32, torch.device("cpu"))
    moe.gate.copy_(t[pre + "gate.weight"])
    for e in range(4):
        gate, up, down = (t[f"{pre}experts.{e}.{n}.weight"] for n in names)
        moe.gate_up[e].copy_(torch.cat([gate, up]))
        moe.down[e].copy_(down)
    x = _x(9)
    with torch.no_grad():
        ref = model.model.layers[0].mlp(x[None])[0]
    assert (moe(x) - ref).abs().max().item() < 1e-5


# -- batch invariance and sparsity -------------------------------------------------------------------------
def _rowwise_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear one row at a time: row-invariant by construction."""
    return torch.cat([F.linear(r[None], w) for r in x]) if len(x) else F.linear(x, w)


def _alone_vs_batched(moe: SparseMoE, device="cpu", dtype=torch.float32) -> float | None:
    """max |alone - inside a batch of 7 others| over 8 tokens at every batch position; None if bitwise equal."""
    worst = 0.0
    for pos in range(8):
        x = _x(8, seed=10 + pos, dtype=dtype, device=device)
        alone = moe(x[pos:pos + 1])[0]
        batched = moe(x)[pos]
        if not torch.equal(alone, batched):
            worst = max(worst, (alone - batched).abs().max().item())
    return worst or None


@pytest.mark.parametrize("top_k", [2, 4])
def test_batch_invariant_bitwise_with_row_invariant_matmuls(top_k):
    """With a row-invariant matmul (what Platform.linear provides where it can) a token's output bits do not
    depend on the batch: routing, grouping and the fixed-order combine add nothing batch-dependent."""
    moe = _moe(8, top_k, True, linear=_rowwise_linear)
    assert _alone_vs_batched(moe) is None


def test_batch_invariance_with_mkl_fp32():
    """MKL's fp32 sgemm rounds 1, 2-3 and >= 4 rows differently, so with plain F.linear a token alone and
    in a batch agree to float rounding only."""
    worst = _alone_vs_batched(_moe(8, 2, True))
    assert worst is None or worst < 1e-6


def test_only_selected_experts_run():
    calls = []

    def counting(x, w):
        calls.append(w.data_ptr())
        return F.linear(x, w)

    moe = _moe(8, 2, False, linear=counting)
    for T in (1, 3, 40):
        _, ids = moe.route(_x(T, seed=T))
        calls.clear()
        moe(_x(T, seed=T))
        active = ids.unique().numel()
        assert len(calls) == 1 + 2 * active, (T, active)  # router + gate_up and down per active expert
        assert len(set(calls)) == 1 + 2 * active
    assert active == 8 and moe.route(_x(1, seed=1))[1].unique().numel() == 2


def test_empty_input():
    moe = _moe(8, 2, True)
    assert moe(_x(0)).shape == (0, HIDDEN)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kernel"):
        SparseMoE(HIDDEN, INTER, 4, 2, True, torch.float32, torch.device("cpu"), kernel="cuda")
    with pytest.raises(ValueError, match="top_k"):
        SparseMoE(HIDDEN, INTER, 4, 5, True, torch.float32, torch.device("cpu"))


# -- Triton -------------------------------------------------------------------------------------------------
@needs_triton
def test_align_groups_every_assignment_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [1, 2], [3, 0]], device=DEVICE)
    sorted_ids, block_expert = triton_moe.align(ids, 6, block_m=4)
    A = ids.numel()
    blocks = sorted_ids.view(-1, 4).cpu()
    assert sorted(blocks[blocks < A].tolist()) == list(range(A))
    flat = ids.flatten().cpu()
    for b, e in enumerate(block_expert.cpu().tolist()):
        rows = blocks[b][blocks[b] < A]
        if e == 6:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows] == e).all()


@needs_triton
@pytest.mark.parametrize("norm", [True, False])
def test_triton_matches_torch(norm):
    torch_moe = _moe(4, 2, norm, device=DEVICE)
    triton_moe_ = _moe(4, 2, norm, device=DEVICE, kernel="triton")
    for T in (0, 1, 5, 21):
        x = _x(T, seed=T, device=DEVICE)
        got, ref = triton_moe_(x), torch_moe(x)
        assert got.shape == (T, HIDDEN)
        if T:
            assert (got - ref).abs().max().item() < 1e-5, T


@needs_triton
def test_triton_batch_invariant():
    moe = _moe(4, 2, True, device=DEVICE, kernel="triton", linear=_rowwise_linear)  # the router's matmul
    assert _alone_vs_batched(moe, device=DEVICE) is None


# -- device -------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@needs_triton
def test_triton_bf16_realistic_shapes():
    """Qwen3-30B-A3B's expert shapes (hidden 2048, inter 768, 128 experts, top-8) in bf16, decode to prefill."""
    H, inter, E, k = 2048, 768, 128, 8
    g = torch.Generator().manual_seed(0)
    mods = []
    for kernel in ("torch", "triton"):
        moe = SparseMoE(H, inter, E, k, True, torch.bfloat16, torch.device("cuda"), kernel=kernel)
        g.manual_seed(0)
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5).to(torch.bfloat16))
        mods.append(moe)
    for T in (1, 8, 300):
        x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
        ref = _fp32_reference(mods[0], x)
        got = mods[1](x).float()
        assert (got - ref).abs().max().item() < 2e-2 * ref.abs().max().item(), T
    mods[1].linear = _rowwise_linear  # the router's cuBLAS matmul is not row-invariant; the experts must be
    x = torch.randn(8, H, generator=g).to("cuda", torch.bfloat16)
    for pos in range(8):
        assert torch.equal(mods[1](x[pos:pos + 1])[0], mods[1](x)[pos])


def _fp32_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The torch path in fp32 on the module's weights and routing."""
    weights, ids = moe.route(x)
    ref = SparseMoE(moe.hidden, moe.inter, moe.num_experts, moe.top_k, moe.norm_topk_prob, torch.float32, x.device)
    ref.gate_up.copy_(moe.gate_up.float())
    ref.down.copy_(moe.down.float())
    return ref._experts_torch(x.float(), weights.float(), ids)


@pytest.mark.gpu
@gpu
@needs_triton
def test_triton_graph_capture():
    moe = _moe(8, 2, True, device="cuda", kernel="triton")
    x = _x(4, device="cuda")
    eager = moe(x)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    moe(static_x)  # warm-up compiles the kernels outside the capture
    with torch.cuda.graph(graph):
        static_y = moe(static_x)
    static_x.copy_(_x(4, seed=7, device="cuda"))
    graph.replay()
    assert torch.equal(static_y, moe(static_x))
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(static_y, eager)
