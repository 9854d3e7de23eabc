"""The GPU side of the Qwen2.5-Coder 1.5B target / 0.5B draft pair, projected (issue 43, point 6).

Only 64 MiB travels to a lent GPU and it has no network, so the real weights cannot go there. This script
builds random-weight models with the exact shapes, in the repo's own classes and through the engine's own
step path, and measures what a step costs:

- target: Qwen2.5-Coder-1.5B-Instruct (hidden 1536, 28 layers, 12 heads / 2 KV heads, head_dim 128,
  intermediate 8960, vocab 151936, tied embeddings, qkv bias, rope_theta 1e6);
- draft model: Qwen2.5-Coder-0.5B-Instruct (hidden 896, 24 layers, 14 heads / 2 KV heads, head_dim 64,
  intermediate 4864, vocab 151936, tied);
- EAGLE head (``model/eagle_head.py``): one decoder layer at hidden 1536 (intermediate ``--head-intermediate``,
  default 3072), 12 / 2 heads, head_dim 128, feature layers (2, 14, 28), a draft vocabulary of 8192 tokens;

in bf16 (``--quantization none``) and in the quantized formats of the GPU path (``int8``, ``int4``: the Triton
weight-only matmuls of ``model/kernels/triton_quant.py``). Every row has ``--context`` tokens of KV before the
measured step (the KV holds zeros: the kernels' work does not depend on the values).

Measured, per format, at each batch size B (default 1, 8, 32), median over ``--iters`` steps:
- ``target``: the target step (``worker.graphs.ModelStep``: a graph replay where the platform captures graphs,
  as serving runs it) + the LM head over every new row + the greedy argmax, at q = 1 (decode) .. k + 1
  (verification) new tokens per row;
- ``target_prenorm``: the same with the EAGLE head's features returned (what a head configuration pays);
- ``draft``: one draft-model step (q = 1 per row, the full-vocabulary LM head, argmax), as ``Drafter``
  runs it;
- ``head`` / ``head_first``: one EAGLE head step (``worker.draft_steps.eagle_steps``' ``vocab_logits`` and the
  argmax of the greedy chain) reading its own predicted feature (drafts 2..k) / the target's three layers
  (the first draft).
Each figure has ``wall_ms`` (host time of the step, the device synchronized before and after: what the serving
loop waits for, host overhead included) and on a GPU ``device_ms`` (CUDA/HIP events around the step).

Projection (``project``): with ``a_i`` = the fraction of verification passes whose first i drafts were all
accepted (greedy, measured on the CPU with the real weights: greedy acceptance does not depend on the
hardware), one pass of a configuration with k drafts emits ``E(k) = 1 + a_1 + ... + a_k`` tokens per sequence
and costs ``T_verify(B, k + 1) + k * T_draft(B)``; plain decoding emits 1 token per ``T_target(B, 1)``, so

    speedup(k, B) = E(k) * T_target(B, 1) / (T_verify(B, k + 1) + k * T_draft(B)).

It is a projection from random-weight step costs, not a measurement of the real weights serving real text.

    python benchmarks/gpu_projection.py --out $OUT --acceptance benchmarks/data/qwen_coder_pair_acceptance.json
    python benchmarks/gpu_projection.py --device cpu --small            # CPU smoke of the same code
    python benchmarks/gpu_projection.py --costs gpu_projection.json --acceptance FILE   # re-project, no device

The acceptance file (``--acceptance``; format in ``load_acceptance``) may still hold null placeholders: the
costs are measured and written, and the projection is refused with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGURATIONS = {  # acceptance-file key -> (step cost of one draft, the verification's step kind)
    "draft_model": ("draft", "target"),
    "eagle_head": ("head", "target_prenorm"),
}
DEFAULT_ACCEPTANCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                                  "qwen_coder_pair_acceptance.json")


# -- the projection arithmetic -----------------------------------------------------------------------------------
def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens one verification pass emits per sequence with k drafts: 1 + a_1 + ... + a_k, where a_i is the
    fraction of passes whose first i drafts were all accepted."""
    if k > len(acceptance):
        raise ValueError(f"k = {k} needs acceptance at {k} positions, the file gives {len(acceptance)}")
    return 1.0 + sum(acceptance[:k])


def projected_speedup(acceptance: list[float], k: int, t_decode: float, t_verify: float, t_draft: float) -> float:
    """E(k) tokens per (verification of k + 1 rows + k draft steps) against 1 token per plain decode step."""
    return expected_tokens(acceptance, k) * t_decode / (t_verify + k * t_draft)


class AcceptanceMissing(Exception):
    """The acceptance file still holds placeholders (null): nothing is projected from invented numbers."""


def load_acceptance(path: str) -> dict[str, list[float]]:
    """The acceptance file: a JSON object with ``"configurations": {NAME: {"acceptance_per_position":
    [a_1, ..., a_k], ...}}``, NAME in ``CONFIGURATIONS`` (``draft_model``, ``eagle_head``). ``a_i`` is the fraction
    of verification passes whose first i drafts were all accepted -- ``specserve bench``'s
    ``acceptance_per_position`` field, measured greedy with a fixed k (``speculative_adaptive`` off). Raises
    ``AcceptanceMissing`` naming every configuration that still holds null, ``ValueError`` on a malformed file."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    confs = doc.get("configurations") if isinstance(doc, dict) else None
    if not isinstance(confs, dict) or not confs:
        raise ValueError(f"{path}: needs an object \"configurations\": {{name: {{\"acceptance_per_position\": "
                         f"[...]}}}}")
    out: dict[str, list[float]] = {}
    missing: list[str] = []
    for name, entry in confs.items():
        if name not in CONFIGURATIONS:
            raise ValueError(f"{path}: unknown configuration {name!r} (known: {', '.join(CONFIGURATIONS)})")
        values = entry.get("acceptance_per_position") if isinstance(entry, dict) else None
        if values is None or not isinstance(values, list) or not values or any(v is None for v in values):
            missing.append(name)
            continue
        if any(not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0 for v in values):
            raise ValueError(f"{path}: {name}: acceptance values must be fractions in [0, 1], got {values}")
        if any(b > a + 1e-9 for a, b in zip(values, values[1:])):
            raise ValueError(f"{path}: {name}: a_i (first i drafts all accepted) cannot grow with i: {values}")
        out[name] = [float(v) for v in values]
    if missing:
        raise AcceptanceMissing(f"{path}: acceptance of {', '.join(missing)} is null (a placeholder): fill "
                                f"it from a CPU measurement (benchmarks/data/README.md) before projecting; no "
                                f"speedup is projected from missing values")
    return out


def project(costs: dict[str, Any], acceptance: dict[str, list[float]], basis: str = "wall_ms"
            ) -> dict[str, Any]:
    """{format: {configuration: {k: {B: speedup}}}} from the measured step costs (``basis``: wall_ms or
    device_ms) and the per-position acceptance, for k = 1 .. min(k_max, positions given)."""
    out: dict[str, Any] = {}
    for fmt, m in costs["formats"].items():
        per: dict[str, Any] = {}
        for name, acc in acceptance.items():
            draft_kind, verify_kind = CONFIGURATIONS[name]
            rows: dict[str, dict[str, float]] = {}
            for k in range(1, min(costs["k_max"], len(acc)) + 1):
                rows[str(k)] = {}
                for b in map(str, costs["batches"]):
                    t_decode = m["target"][b]["1"].get(basis)
                    t_verify = m[verify_kind][b][str(k + 1)].get(basis)
                    t_draft = m[draft_kind][b].get(basis)
                    if None in (t_decode, t_verify, t_draft):
                        continue
                    rows[str(k)][b] = round(projected_speedup(acc, k, t_decode, t_verify, t_draft), 3)
            per[name] = rows
        out[fmt] = per
    return out


# -- shapes --------------------------------------------------------------------------------------------------------
def shapes(small: bool, head_intermediate: int, draft_vocab: int, feature_layers: tuple[int, ...],
           layers: int | None = None) -> dict[str, Any]:
    """ModelArch fields of the target and the draft, and the head's; ``small``: scaled down for a CPU smoke;
    ``layers``: the real widths with this many layers in each model (a check of the shapes on a CPU)."""
    if small:
        target = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      intermediate_size=256, vocab_size=1024)
        draft = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=1024)
        head = dict(intermediate_size=min(head_intermediate, 256), draft_vocab_size=min(draft_vocab, 256),
                    feature_layers=(1, 2))
    else:
        target = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                      intermediate_size=8960, vocab_size=151936)
        draft = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                     intermediate_size=4864, vocab_size=151936)
        head = dict(intermediate_size=head_intermediate, draft_vocab_size=draft_vocab,
                    feature_layers=feature_layers)
    if layers:
        target["num_layers"] = draft["num_layers"] = layers
        head["feature_layers"] = tuple(sorted({min(i, layers) for i in head["feature_layers"]}))
    return {"target": target, "draft": draft, "head": head}


def qwen2_arch(fields: dict[str, Any], max_positions: int):  # noqa: ANN201 - config.ModelArch
    from specserve.config import ModelArch

    return ModelArch("qwen2", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=max_positions,
                     tie_word_embeddings=True, attention_bias=True, **fields)


def random_state_dict(arch, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """HF-named random weights (Qwen2: q/k/v biases; tied: no lm_head), made on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, i, L = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim

    def mat(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    sd = {"model.embed_tokens.weight": mat(arch.vocab_size, h), "model.norm.weight": torch.ones(h, device=device,
                                                                                                dtype=dtype)}
    for n in range(L):
        p = f"model.layers.{n}."
        sd.update({p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
                   p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.q_proj.bias": mat(q),
                   p + "self_attn.k_proj.bias": mat(kv), p + "self_attn.v_proj.bias": mat(kv),
                   p + "self_attn.o_proj.weight": mat(h, q), p + "mlp.gate_proj.weight": mat(i, h),
                   p + "mlp.up_proj.weight": mat(i, h), p + "mlp.down_proj.weight": mat(h, i),
                   p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                   p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype)})
    return sd


def build_llama(arch, platform, dtype: torch.dtype, quantization: str, seed: int):  # noqa: ANN001, ANN201
    """The engine's model (``worker.model_runner.build_model``) over random weights."""
    from specserve.model.checkpoint.loader import Checkpoint
    from specserve.worker.model_runner import build_model

    sd = random_state_dict(arch, platform.device, dtype, seed)
    ckpt = Checkpoint("random", arch, sd, "hf", f"random {arch.architecture} {arch.num_layers}L")
    model = build_model(ckpt, platform, dtype, arch.max_position_embeddings, quantization)
    del sd, ckpt
    return model


def build_head(target, fields: dict[str, Any], platform, dtype: torch.dtype, seed: int):  # noqa: ANN001, ANN201
    """An EAGLE head with random weights and a draft vocabulary, prepared as ``Drafter`` prepares a loaded one."""
    from specserve.model.attention import make_backend
    from specserve.model.eagle_head import EagleConfig, EagleHead
    from specserve.model.quant import packed_linear

    arch = target.arch
    cfg = dataclasses.replace(EagleConfig.from_target(arch, "random", tuple(fields["feature_layers"])),
                              intermediate_size=fields["intermediate_size"],
                              draft_vocab_size=fields["draft_vocab_size"])
    head = EagleHead(cfg, dtype, platform.device, make_backend(platform.attention_backend),
                     arch.max_position_embeddings)
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "norm" in name:
                p.fill_(1.0)
    ids = torch.randperm(arch.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values
    head.set_draft_vocab(ids, target.lm_head_weight)
    if getattr(target, "linear", None) is packed_linear and platform.quant_kernels == "cpu":
        head.pack_weights(target.ops)  # as Drafter does for a quantized target on the CPU kernels
    target.feature_layers = cfg.feature_layers
    return head.eval()


# -- measuring -----------------------------------------------------------------------------------------------------
def timer(platform, iters: int, warmup: int) -> Callable[[Callable[[], Any]], dict[str, float]]:  # noqa: ANN001
    """Median wall ms of ``fn()`` (the device synchronized before and after each call) and, on a GPU, median
    device ms between events recorded around it."""
    gpu = platform.is_gpu

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(platform.device)  # the torch.cuda API is HIP on ROCm builds

    def run(fn: Callable[[], Any]) -> dict[str, float]:
        for _ in range(warmup):
            fn()
        sync()
        walls, devs = [], []
        for _ in range(iters):
            sync()
            if gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            if gpu:
                end.record()
            sync()
            walls.append((time.perf_counter() - t0) * 1e3)
            if gpu:
                devs.append(start.elapsed_time(end))
        out = {"wall_ms": round(statistics.median(walls), 4)}
        if devs:
            out["device_ms"] = round(statistics.median(devs), 4)
        return out
    return run


def target_call(model, step, toks: list[list[int]], starts: list[int], blocks: list[tuple[int, ...]],
                prenorm: bool) -> Callable[[], torch.Tensor]:  # noqa: ANN001
    """One target step as the runner pays it: the forward (a graph replay where captured), the LM head over
    every new row (verification needs them all), the greedy argmax."""
    def call() -> torch.Tensor:
        return model.compute_logits(step(toks, starts, blocks, prenorm=prenorm).hidden).argmax(-1)
    return call


def draft_call(model, step, toks: list[list[int]], starts: list[int], blocks: list[tuple[int, ...]]
               ) -> Callable[[], torch.Tensor]:  # noqa: ANN001
    """One draft-model step as ``Drafter._logits_step`` runs it, with the greedy pick."""
    def call() -> torch.Tensor:
        return model.compute_logits(step(toks, starts, blocks).last_hidden()).argmax(-1)
    return call


def head_call(step, toks: list[list[int]], feats: torch.Tensor, starts: list[int], blocks: list[tuple[int, ...]]
              ) -> Callable[[], torch.Tensor]:  # noqa: ANN001
    """One EAGLE head step as ``EagleProposer``'s greedy chain runs it (draft-vocabulary logits, argmax)."""
    def call() -> torch.Tensor:
        (logits, ids), _ = step(toks, feats, starts, blocks)
        best = logits.argmax(-1)
        return best if ids is None else ids[best]
    return call


def measure_format(quantization: str, sh: dict[str, Any], platform, args) -> dict[str, Any]:  # noqa: ANN001
    from specserve.model.quant import weight_bytes
    from specserve.platform import resolve_dtype, resolve_kv_dtype
    from specserve.worker.draft_steps import eagle_steps
    from specserve.worker.graphs import GraphPlan, ModelStep, select_capture

    block_size, ctx, k_max = 16, args.context, args.max_k
    batches = sorted(args.batches)
    q_max = k_max + 1
    width = -(-(ctx + q_max) // block_size)  # blocks per row
    num_blocks = 1 + batches[-1] * width  # block 0 unused, as in the engine
    tables = [tuple(range(1 + r * width, 1 + (r + 1) * width)) for r in range(batches[-1])]
    max_pos = ctx + q_max + 64
    dtype = resolve_dtype(platform, args.dtype, quantized=quantization != "none")
    kv_dtype = resolve_kv_dtype(platform, "auto", dtype)
    capture, graphs_note = select_capture(platform, args.enforce_eager)
    plan = GraphPlan(capture, batches, q_max, width, scratch_block=num_blocks) if capture is not None else None

    def kv(model, layers: int) -> list[torch.Tensor]:  # noqa: ANN001 - one extra block: the graphs' scratch
        shape = model.kv_cache_shape(num_blocks + 1, block_size)
        return [torch.zeros(shape, dtype=kv_dtype, device=platform.device) for _ in range(layers)]

    t0 = time.perf_counter()
    target = build_llama(qwen2_arch(sh["target"], max_pos), platform, dtype, quantization, seed=1)
    draft = build_llama(qwen2_arch(sh["draft"], max_pos), platform, dtype, quantization, seed=2)
    head = build_head(target, sh["head"], platform, dtype, seed=3)
    build_s = time.perf_counter() - t0
    target_step = ModelStep(target, kv(target, target.arch.num_layers), block_size, platform.device, plan=plan)
    draft_step = ModelStep(draft, kv(draft, draft.arch.num_layers), block_size, platform.device, plan=plan)
    head_kv = kv(head, 1)[0]
    head_step = eagle_steps(target, head, head_kv, block_size, platform.device).vocab_logits
    time_it = timer(platform, args.iters, args.warmup)
    vocab = target.arch.vocab_size
    h = target.arch.hidden_size
    n_feat = head.cfg.num_feature_layers

    def tokens(b: int, q: int) -> list[list[int]]:
        return [[(31 * r + 7 * j + 11) % vocab for j in range(q)] for r in range(b)]

    res: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "kv_dtype": str(kv_dtype).removeprefix("torch."),
                           "graphs": graphs_note, "build_s": round(build_s, 1),
                           "weight_bytes": {"target": weight_bytes(target), "draft": weight_bytes(draft),
                                            "head": weight_bytes(head)},
                           "target": {}, "target_prenorm": {}, "draft": {}, "head": {}, "head_first": {}}
    for b in batches:
        starts, blocks, one = [ctx] * b, list(tables[:b]), tokens(b, 1)
        for prenorm, key in ((False, "target"), (True, "target_prenorm")):
            res[key][str(b)] = {str(q): time_it(target_call(target, target_step, tokens(b, q), starts, blocks, prenorm))
                                for q in range(1, q_max + 1)}
        res["draft"][str(b)] = time_it(draft_call(draft, draft_step, one, starts, blocks))
        own = torch.zeros(b, h, dtype=dtype, device=platform.device)
        full = torch.zeros(b, n_feat * h, dtype=dtype, device=platform.device)
        res["head"][str(b)] = time_it(head_call(head_step, one, own, starts, blocks))
        res["head_first"][str(b)] = time_it(head_call(head_step, one, full, starts, blocks))
        print(f"  {quantization}: batch {b} measured", flush=True)
    res["graph_captures"] = plan.capture.num_captures if plan is not None else 0
    del target_step, draft_step, head_step, head_kv, target, draft, head
    gc.collect()
    if platform.is_gpu:
        torch.cuda.empty_cache()
    return res


def measure(args) -> dict[str, Any]:  # noqa: ANN001
    from specserve.platform import cpu_class, detect

    platform = detect(args.device)
    info = platform.describe()
    name = info.get("gpu_name") or f"CPU ({cpu_class()})"
    sh = shapes(args.small, args.head_intermediate, args.draft_vocab, tuple(args.feature_layers), args.layers)
    quants = args.quantizations or (["none", "int8", "int4"] if platform.is_gpu else ["none"])
    what = "small (CPU smoke)" if args.small else "Qwen2.5-Coder 1.5B / 0.5B widths" + \
        (f", {args.layers} layers each (NOT the real depth)" if args.layers else ", exact")
    print(f"device: {name}; shapes: {what}; "
          f"context {args.context}; batches {args.batches}; formats {quants}", flush=True)
    costs: dict[str, Any] = {"device": name, "platform": info, "small": args.small, "layers_override": args.layers,
                             "shapes": sh,
                             "context": args.context, "batches": sorted(args.batches), "k_max": args.max_k,
                             "iters": args.iters, "formats": {}}
    for quant in quants:
        costs["formats"][quant] = measure_format(quant, sh, platform, args)
    return costs


# -- report ----------------------------------------------------------------------------------------------------------
def cost_table(costs: dict[str, Any], basis: str = "wall_ms") -> str:
    """Step costs per format and batch: the target at q = 1 .. k + 1 new tokens per row, the draft model's step
    and the head's (drafts 2..k; the first draft's in brackets), each also as a multiple of the decode step."""
    q_max = costs["k_max"] + 1
    lines = [f"step costs on {costs['device']}: {basis} (x decode step), context {costs['context']}",
             "format  B    | " + " ".join(f"{'target q=' + str(q):<16}" for q in range(1, q_max + 1))
             + f" | {'draft model':<16} | {'head (first)':<24}"]

    def cell(v: float, dec: float) -> str:
        return f"{v:8.3f} ({v / dec:4.2f})"

    for fmt, m in costs["formats"].items():
        lines.append(f"{fmt} ({m['dtype']}, {m['graphs']})")
        for b in map(str, costs["batches"]):
            dec = m["target"][b]["1"][basis]
            tgt = " ".join(cell(m["target"][b][str(q)][basis], dec) for q in range(1, q_max + 1))
            hf = m["head_first"][b][basis]
            lines.append(f"{fmt:<7} {b:<4} | {tgt} | {cell(m['draft'][b][basis], dec)} | "
                         f"{cell(m['head'][b][basis], dec)} ({hf:.3f})")
    return "\n".join(lines)


def projection_table(costs: dict[str, Any], proj: dict[str, Any], basis: str) -> str:
    lines = [f"projected speedup vs plain decoding on {costs['device']} ({basis} step costs x CPU-measured "
             f"acceptance; a projection, not a measurement)",
             "format  configuration  k | " + " ".join(f"B={b:<6}" for b in costs["batches"])]
    for fmt, per in proj.items():
        for name, rows in per.items():
            for k, cells in rows.items():
                lines.append(f"{fmt:<7} {name:<14} {k} | " + " ".join(
                    f"{cells[str(b)]:<8.2f}" if str(b) in cells else f"{'-':<8}" for b in costs["batches"]))
    return "\n".join(lines)


def out_path(out: str | None) -> str | None:
    if not out:
        return None
    if out.endswith(".json"):
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        return out
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, "gpu_projection.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto | cuda | rocm | cpu (specserve.platform.detect)")
    ap.add_argument("--small", action="store_true", help="scaled-down shapes (CPU smoke of this script)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the real widths with this many layers per model (a CPU check of the shapes; not a projection)")
    ap.add_argument("--quantizations", type=lambda s: s.split(","), default=None,
                    help="--quantization modes to measure (default: none,int8,int4 on a GPU, none on CPU)")
    ap.add_argument("--dtype", default="auto", help="compute dtype (auto: the engine's choice; bf16 on a GPU)")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32])
    ap.add_argument("--max-k", type=int, default=5)
    ap.add_argument("--context", type=int, default=512, help="tokens of KV per row before the measured step")
    ap.add_argument("--head-intermediate", type=int, default=3072)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="the head's draft vocabulary (tokens)")
    ap.add_argument("--feature-layers", type=ints, default=[2, 14, 28])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true", help="no graph capture (as serve --enforce-eager)")
    ap.add_argument("--acceptance", default=None, help=f"per-position acceptance JSON (e.g. {DEFAULT_ACCEPTANCE})")
    ap.add_argument("--costs", default=None, help="project from an earlier run's JSON instead of measuring")
    ap.add_argument("--basis", choices=("wall_ms", "device_ms"), default="wall_ms",
                    help="step cost the projection uses (device_ms: GPU only)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="a .json file, or a folder for gpu_projection.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    acc, refused = None, None
    if args.acceptance:  # read first: a malformed file fails before minutes of measuring; nulls only refuse
        try:
            acc = load_acceptance(args.acceptance)
        except AcceptanceMissing as e:
            refused = str(e)
    if args.costs:
        with open(args.costs, encoding="utf-8") as f:
            loaded = json.load(f)
        costs = loaded.get("costs", loaded)
    else:
        costs = measure(args)
    print(cost_table(costs, "wall_ms"))
    if any("device_ms" in m["draft"][str(costs["batches"][0])] for m in costs["formats"].values()):
        print(cost_table(costs, "device_ms"))
    doc = {"costs": costs, "acceptance_file": args.acceptance, "acceptance": acc, "projection": None,
           "refused": refused}
    if acc is not None:
        # device_ms where measured (a GPU); a step without the figure is left out, never invented
        doc["projection"] = {"basis": args.basis, "speedup": project(costs, acc, args.basis)}
        print(projection_table(costs, doc["projection"]["speedup"], args.basis))
    if refused:
        print(f"projection refused: {refused}", file=sys.stderr)
    path = out_path(args.out)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {path}" + (f" (re-project later: --costs {path} --acceptance FILE)" if refused else ""))
    return 2 if refused else 0

if __name__ == "__main__":
    sys.exit(main())
