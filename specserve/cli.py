"""`specserve generate | serve | bench | env` -- user-facing errors print one line, never a traceback."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from specserve.config import SpecserveError
from specserve.engine_args import add_engine_args, engine_kwargs, model_arg


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    llm = LLM(model_arg(args), **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompts = args.prompt or ["Hello"]
    t0 = time.perf_counter()
    if args.chat:
        ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        outs = llm.generate(None, params, prompt_token_ids=ids)
    else:
        outs = llm.generate(prompts, params)
    secs = time.perf_counter() - t0
    n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
    if args.json:
        results = [{
            "text": o.outputs[0].text,
            "token_ids": o.outputs[0].token_ids,
            "num_prompt_tokens": len(o.prompt_token_ids),
            "num_generated_tokens": len(o.outputs[0].token_ids),
            "finish_reason": o.outputs[0].finish_reason,
            "speculative": o.metrics.get("speculative"),
        } for o in outs]
        if len(results) == 1:
            obj: dict[str, Any] = dict(results[0])
        else:
            obj = {"results": results, "num_prompt_tokens": sum(r["num_prompt_tokens"] for r in results),
                   "num_generated_tokens": n_gen, "speculative": llm.get_metrics()["speculative"]}
        obj["seconds"] = round(secs, 4)
        obj["tokens_per_s"] = round(n_gen / secs, 2) if secs > 0 else 0.0
        print(json.dumps(obj))
    else:
        for o in outs:
            print(o.outputs[0].text)
        print(f"[{n_gen} tokens in {secs:.2f}s, {n_gen / max(secs, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from specserve import platform as plat

    info = plat.runtime_versions()
    try:
        info.update(plat.detect(args.device).describe())
    except SpecserveError as e:
        info["error"] = str(e)
    for k, v in info.items():
        print(f"{k:20s} {v}")
    for w in plat.stack_warnings():
        print(f"WARNING: {w}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from specserve.server.api import run_server

    return run_server(model_arg(args), engine_kwargs(args), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.set_defaults(func=cmd_generate)

    from specserve.platform import DEVICE_CHOICES

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF dir, .gguf file, or hub id (org/name, org/name:QUANT, org/name/file.gguf); "
                        "default: the embedded demo model")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-queue", type=int, default=256)
    s.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body accepted (400 past it, before JSON parsing; default 1 MiB)")
    s.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted, in tokens (default: only the context length bounds it)")
    s.add_argument("--tool-call-parser", default="auto", choices=("auto", "hermes", "llama3_json"),
                   help="how tool calls are read from the output (auto: from the chat template)")
    s.add_argument("--pooler-config", default=None,
                   help='/v1/embeddings pooling, vLLM\'s JSON: {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true}')
    s.add_argument("--shutdown-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM: how long requests in flight may still run before they are aborted")
    s.set_defaults(func=cmd_serve)

    from specserve.bench import add_bench_parser

    add_bench_parser(sub, add_engine_args)

    from specserve.distill.command import add_distill_parser

    add_distill_parser(sub)

    e = sub.add_parser("env", help="print platform, versions and chosen backends")
    e.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    e.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("specserve").setLevel(logging.INFO)  # start-up facts (KV blocks, draft memory) always
    try:
        return int(args.func(args) or 0)
    except SpecserveError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"specserve: invalid argument: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
