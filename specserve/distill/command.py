"""`specserve distill`: collect the target's own samples, train a draft, export it, measure held-out acceptance.

    specserve distill --target M --out DIR [--kind {model,head}] [--layers L] [--dataset NAME|FILE]
                      [--tokens N] [--steps S] [--resume]

DIR gets the draft (``--kind head``: config.json + model.safetensors of an EAGLE head, served with
``--speculative-method eagle --speculative-model DIR``; ``--kind model``: a normal HF dir with the target's
tokenizer, served with ``--speculative-model DIR``), ``distill.json`` (command, wall times, data, losses,
held-out acceptance by k), and the working files ``samples.pt`` (collected data, reused by ``--resume``) and
``checkpoint.pt`` (trainable weights + optimizer state + step).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time
from typing import Any

from specserve.datasets import TRAIN_CODE, TRAIN_JSON, VOCAB_CHAT
from specserve.platform import DEVICE_CHOICES

WORKLOADS = "chat,code,summarize,edit,instructions"


def add_distill_parser(sub: Any) -> None:
    d = sub.add_parser("distill", help="train a draft (EAGLE head or small model) on the target's own samples")
    d.add_argument("--target", default=None, help="target HF dir or .gguf (default: the embedded demo model)")
    d.add_argument("--out", required=True, help="output directory")
    d.add_argument("--kind", choices=["head", "model"], default="head",
                   help="head: EAGLE head (1 layer over target features); model: standalone small Llama")
    d.add_argument("--layers", type=int, default=2, help="--kind model: decoder layers of the draft (1-4)")
    d.add_argument("--dataset", default=WORKLOADS,
                   help=f"comma-separated sources: workloads ({WORKLOADS}), {TRAIN_CODE} / {TRAIN_JSON} (the code / "
                        f"json task over stdlib modules the benchmarks never read), {VOCAB_CHAT} (everyday requests "
                        f"about words of the target's vocabulary) and/or files (.txt one prompt per line, "
                        f".json/.jsonl workload format; an item's response_format is sampled under its grammar)")
    d.add_argument("--tokens", type=int, default=32000, help="target-sampled tokens to collect")
    d.add_argument("--text-tokens", type=int, default=0,
                   help="also teacher-force the target over this many tokens of Python standard-library source "
                        "(the benchmark workloads' modules excluded): cheap volume next to the sampled data; with "
                        "--resume, a larger figure reads on from where the earlier text ended")
    d.add_argument("--text-seq-len", type=int, default=256, help="sequence length of the teacher-forced text")
    d.add_argument("--greedy-every", type=int, default=0,
                   help="every N-th sampling batch decodes greedily (0: all sampled at --temperature)")
    d.add_argument("--steps", type=int, default=None, help="total optimizer steps (default: --epochs passes)")
    d.add_argument("--epochs", type=float, default=3.0)
    d.add_argument("--init", default=None, metavar="HEAD_DIR",
                   help="head: start from this exported head's weights and draft vocabulary (fine-tuning it on "
                        "the new data) instead of from the target's last layer")
    d.add_argument("--resume", action="store_true",
                   help="reuse DIR/samples.pt and continue DIR/checkpoint.pt; --dataset sources it lacks are "
                        "sampled (--tokens more) and added")
    d.add_argument("--max-tokens", type=int, default=128, help="tokens sampled per prompt")
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--batch", type=int, default=32, help="prompts sampled at once")
    d.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per training batch")
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--feature-layers", default="eagle3",
                   help="head: the target layers it reads, 1-based and comma-separated, ending with the last; "
                        "'last' (EAGLE-1) or 'eagle3' (a low, the middle and the last layer: 2, L/2, L)")
    d.add_argument("--head-intermediate", type=int, default=None,
                   help="head: MLP width of its decoder layer (default: the target's); a narrower one starts as "
                        "the target's last-layer MLP cut to its strongest channels")
    d.add_argument("--head-storage", choices=["float16", "int8"], default="float16",
                   help="head: how model.safetensors stores the matrices (int8: per-row scales, half the bytes)")
    d.add_argument("--unroll-weight", type=float, default=1.0, help="head: weight of the unrolled 2nd step")
    d.add_argument("--holdout", type=float, default=0.25, help="fraction of prompts held out for evaluation")
    d.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="skip longer prompts (the CPU reference attention is slow on long batched contexts)")
    d.add_argument("--draft-vocab", type=int, default=16384,
                   help="head: draft among the N most frequent tokens of the data (0: the full vocabulary)")
    d.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts decoded for acceptance (0: skip)")
    d.add_argument("--eval-max-tokens", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's dtype while collecting and evaluating (auto: what `serve` uses)")
    d.add_argument("--train-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="matmul dtype of training (autocast; weights and optimizer stay fp32). auto: bfloat16 "
                        "where the device multiplies bf16 in hardware")
    d.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    d.set_defaults(func=cmd_distill)


def cmd_distill(args: argparse.Namespace) -> int:
    """collect -> train -> export -> evaluate; every phase's wall time goes into DIR/distill.json."""
    import torch

    from specserve.llm import LLM

    if args.kind == "model" and not 1 <= args.layers <= 4:
        raise ValueError("--layers must be between 1 and 4")
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    walls: dict[str, float] = {}
    # The teacher runs float: the training code reads its weights as tensors. For a quantized GGUF that is
    # the same numbers `serve --quantization auto` multiplies with (only the summation order differs).
    engine_kw = {"dtype": args.dtype, "device": args.device, "quantization": "none"}
    llm = LLM(args.target, max_num_seqs=args.batch, enable_prefix_caching=False, **engine_kw)
    if args.kind == "head":  # collect exactly the features the head will read when serving
        llm.set_feature_layers(feature_layers(args.feature_layers, llm.target_model().arch.num_layers))
    if args.init:  # a head that cannot start this run is refused before the collection
        if args.kind != "head":
            raise ValueError("--init is for --kind head")
        check_init(args.init, llm.target_model())
    t0 = time.perf_counter()
    samples, train_prompts, held = _collect(args, llm)
    walls["collect_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    meta = _train_and_export(args, llm, samples)
    walls["train_s"] = round(time.perf_counter() - t0, 1)
    meta |= {"command": "specserve " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["distill"] else None,
             "dataset": args.dataset, "num_train_prompts": len(train_prompts),
             "held_out_prompt_ids": [p.id for p in held],
             "held_out_files": _write_held_out(args.out, args.dataset, {p.id for p in held})}
    del llm
    gc.collect()
    evaluation = None
    if args.eval_prompts > 0:
        from specserve.distill.evaluate import acceptance_by_k, format_table

        ids = [p.token_ids for p in (held or train_prompts)[:args.eval_prompts]]
        t0 = time.perf_counter()
        evaluation = acceptance_by_k(args.target, "eagle" if args.kind == "head" else "draft", args.out, ids,
                                     args.eval_max_tokens, [1, 2, 3, 4, 5], **engine_kw)
        evaluation["prompts"] = "held-out" if held else "training (no held-out prompts)"
        walls["eval_s"] = round(time.perf_counter() - t0, 1)
        print(format_table(evaluation), file=sys.stderr)
    walls["total_s"] = round(time.perf_counter() - t_start, 1)
    with open(os.path.join(args.out, "distill.json"), "w", encoding="utf-8") as f:
        json.dump({**meta, "wall_time": walls, "evaluation": evaluation}, f, indent=2)
    print(json.dumps({"out": args.out, "kind": args.kind, "steps": meta["steps"], "wall_time": walls,
                      "acceptance_by_k": {r["k"]: r["acceptance_rate"] for r in (evaluation or {}).get("by_k", [])}}))
    return 0


def _write_held_out(out: str, dataset: str, held: set[str]) -> list[str]:
    """``DIR/heldout-<workload>.jsonl`` per built-in workload: the prompts training never saw, for
    ``specserve bench offline --dataset DIR/heldout-code.jsonl`` (an honest acceptance measurement)."""
    from specserve.datasets import BUILDERS, load_dataset
    from specserve.distill.data import sources

    written = []
    for name in [n for n in sources(dataset) if n in BUILDERS]:
        items = [it for it in load_dataset(name) if it.id in held]
        if items:
            path = os.path.join(out, f"heldout-{name}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(it.to_json(), ensure_ascii=False) + "\n" for it in items)
            written.append(os.path.basename(path))
    return written


def _collect(args: argparse.Namespace, llm: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """(samples, training prompts, held-out prompts); resumes a partial or reuses a complete samples.pt.

    ``--resume`` with a ``--dataset`` naming sources that samples.pt lacks samples those sources' training
    prompts too (``--tokens`` more tokens) and appends them: more data for a head without collecting again.
    Held-out prompts keep their order (the collected sources' first), so evaluations stay comparable."""
    from specserve.distill import data as D

    path = os.path.join(args.out, "samples.pt")
    samples: list[D.Sample] = []
    meta: dict[str, Any] = {"complete": False, "next_prompt": 0}
    if args.resume and os.path.exists(path):
        samples, meta = D.load_samples(path)
        model = llm.target_model()
        want = model.arch.hidden_size * len(model.feature_layers or (0,))
        if samples and samples[0].features.shape[-1] != want:
            raise ValueError(f"{path} holds features {samples[0].features.shape[-1]} wide but --feature-layers "
                             f"{args.feature_layers} reads {want}: collect into a new --out")
        print(f"[distill] reusing {len(samples)} samples from {path}", file=sys.stderr)
    wanted = D.sources(args.dataset)
    have = D.sources(meta.get("dataset") or args.dataset) if meta.get("complete") else wanted
    added = [s for s in wanted if s not in have]
    train_prompts, held = _prompts(args, llm, ",".join(have))
    if not meta.get("complete", True):  # fresh, or a collection interrupted part-way

        def save(done: list[D.Sample], next_prompt: int, complete: bool = False) -> None:
            D.save_samples(path, done, {"dataset": args.dataset, "complete": complete, "next_prompt": next_prompt})

        samples = D.collect(llm, train_prompts, args.tokens, args.max_tokens, args.temperature, args.batch,
                            args.seed, samples=samples, start=int(meta.get("next_prompt", 0)), on_batch=save,
                            greedy_every=args.greedy_every)
        meta = {"dataset": args.dataset, "complete": True, "next_prompt": 0}
        D.save_samples(path, samples, meta)
    if added:
        new_train, new_held = _prompts(args, llm, ",".join(added))
        print(f"[distill] adding {', '.join(added)}: {len(new_train)} training prompts", file=sys.stderr)
        samples += D.collect(llm, new_train, args.tokens, args.max_tokens, args.temperature, args.batch,
                             args.seed, greedy_every=args.greedy_every)
        meta = {**meta, "dataset": ",".join(have + added)}
        D.save_samples(path, samples, meta)
        train_prompts, held = train_prompts + new_train, held + new_held
    have_text = int(meta.get("text_tokens") or 0)
    if args.text_tokens > have_text:  # fresh, or --resume asking for more text: read on where the last one ended
        from specserve.datasets import CODE_MODULES, SUMMARIZE_MODULES

        chunks = D.stdlib_code_chunks(llm.tokenizer, CODE_MODULES + SUMMARIZE_MODULES, args.text_seq_len, args.seed)
        model = llm.target_model()
        read = sum(1 for s in samples if s.prompt_len == 1)
        samples += D.collect_text(model, chunks, args.text_tokens - have_text, max(1, 2048 // args.text_seq_len),
                                  taps=model.feature_layers, skip=read)
        meta = {**meta, "text_tokens": args.text_tokens}
        D.save_samples(path, samples, meta)
    return samples, train_prompts, held


def _prompts(args: argparse.Namespace, llm: Any, dataset: str) -> tuple[list[Any], list[Any]]:
    """(training prompts, held-out prompts) of ``dataset``, each in a seeded order; prompts longer than
    --max-prompt-tokens are skipped."""
    from specserve.distill import data as D

    limit = min(args.max_prompt_tokens, llm.engine.max_model_len - args.max_tokens)
    prompts = [p for p in D.load_prompts(dataset, llm.tokenizer) if 0 < len(p.token_ids) <= limit]
    if not prompts:
        raise ValueError(f"no prompt of --dataset {dataset!r} fits {limit} tokens")
    train_prompts, held = D.split(prompts, args.holdout)
    random.Random(args.seed).shuffle(train_prompts)  # every source is sampled, however few tokens are asked
    random.Random(args.seed + 1).shuffle(held)
    return train_prompts, held


def feature_layers(layers_arg: str, num_layers: int) -> tuple[int, ...] | None:
    """--feature-layers -> the target layers (1-based) a head reads; None for the last layer alone."""
    if layers_arg == "last":
        return None
    if layers_arg == "eagle3":
        layers = sorted({min(2, num_layers), max(1, num_layers // 2), num_layers})
    else:
        try:
            layers = [int(x) for x in layers_arg.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--feature-layers {layers_arg!r}: use 'last', 'eagle3' or layer numbers like 2,15,30") from None
    if not layers or layers != sorted(set(layers)) or layers[0] < 1 or layers[-1] != num_layers:
        raise ValueError(f"--feature-layers {layers_arg!r}: increasing layer numbers from 1 that end with the last "
                         f"layer ({num_layers})")
    return None if layers == [num_layers] else tuple(layers)


def _train_dtype(name: str, device: Any) -> Any:
    """The autocast dtype of training, or None for plain fp32."""
    import torch

    from specserve.platform import detect

    if name == "auto":
        name = "bfloat16" if detect("cpu" if device.type == "cpu" else "auto").default_dtype == torch.bfloat16 else "float32"
    return torch.bfloat16 if name == "bfloat16" else None


def check_init(path: str, target: Any) -> None:
    """``--init``: the exported head's config fits the target and the feature layers this run reads."""
    from specserve.config import SpecserveError
    from specserve.model.eagle_head import read_eagle_config

    cfg = read_eagle_config(path)
    if cfg.vocab_size != target.arch.vocab_size or cfg.hidden_size != target.arch.hidden_size:
        raise SpecserveError(f"--init {path}: the head was distilled for another target (vocabulary "
                             f"{cfg.vocab_size}, hidden {cfg.hidden_size})")
    if (cfg.feature_layers or None) != (target.feature_layers or None):
        raise SpecserveError(f"--init {path} reads target layers {list(cfg.feature_layers or ['last'])}; pass the "
                             f"same --feature-layers")


def _train_and_export(args: argparse.Namespace, llm: Any, samples: list[Any]) -> dict[str, Any]:
    import torch

    from specserve.distill import data as D
    from specserve.distill.export import save_hf_model
    from specserve.distill.train import DraftModelTask, HeadTask, TrainConfig, make_batches, train
    from specserve.model.eagle_head import save_eagle_head

    target = llm.target_model()
    cfg = TrainConfig(steps=0, lr=args.lr, batch_tokens=args.batch_tokens, seed=args.seed,
                      unroll_weight=args.unroll_weight, autocast=_train_dtype(args.train_dtype, target.device))
    cfg.steps = args.steps or max(1, math.ceil(args.epochs * len(make_batches(samples, args.batch_tokens))))
    task: HeadTask | DraftModelTask
    vocab, coverage = D.draft_vocab(samples, args.draft_vocab, target.arch.vocab_size)
    if args.kind == "head":
        h = target.arch.hidden_size  # the last layer's slot: the feature the head predicts
        rms = float(torch.cat([s.features[::7, -h:].float() for s in samples]).pow(2).mean().sqrt())
        init = None
        if args.init:
            from safetensors.torch import load_file

            from specserve.model.eagle_head import dequantize_rows

            init_file = os.path.join(os.path.expanduser(args.init), "model.safetensors")
            init = dequantize_rows(dict(load_file(init_file)), init_file)  # checked
            vocab = init.pop("draft_vocab", None)  # the head keeps the vocabulary it drafts from
            top1 = torch.cat([s.top_ids[:, 0] for s in samples]).long()
            coverage = 1.0 if vocab is None else float(torch.isin(top1, vocab).float().mean())
        cfg.vocab = vocab  # train over exactly the vocabulary the head will draft from
        width = args.head_intermediate
        if args.init:
            from specserve.model.eagle_head import read_eagle_config

            width = read_eagle_config(args.init).intermediate_size
        task = HeadTask(target, cfg, rms, llm.engine.model_name, target.feature_layers, width)
        if init is not None:
            task.head.load_hf_state_dict(init, args.init)
    else:
        task = DraftModelTask(target, args.layers)
    result = train(task, samples, cfg, os.path.join(args.out, "checkpoint.pt"), args.resume)
    meta: dict[str, Any] = {
        "target": llm.engine.model_name, "kind": args.kind, "num_samples": len(samples),
        "num_generated_tokens": sum(len(s.token_ids) - s.prompt_len for s in samples if s.prompt_len > 1),
        "num_teacher_forced_text_tokens": sum(len(s.token_ids) for s in samples if s.prompt_len == 1),
        "num_positions": sum(len(s.token_ids) for s in samples), "steps": result["step"],
        "last_losses": result["history"][-5:]}
    if isinstance(task, HeadTask):
        meta["draft_vocab_top1_coverage"] = round(coverage, 4)
        save_eagle_head(task.head, args.out, draft_vocab=vocab, storage=args.head_storage)
    else:
        save_hf_model(task.model, args.out, llm.tokenizer.hf_tokenizer, extra={"specserve_distilled": True})
    return meta
