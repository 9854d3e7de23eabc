"""`specserve bench offline | serve`: speculation off vs on, measured side by side.

- ``offline``: one process, one loaded target, the same prompts with speculation off and on, per batch size,
  next to the cost model's ideal speedup from measured acceptance and cost (``bench/offline.py``).
- ``serve``: an OpenAI-API streaming load generator (Poisson arrivals), TTFT / TPOT / ITL percentiles; it can
  launch ``specserve serve`` itself, with speculation off and then on (``bench/serve.py``).
- workloads: ``code``, ``summarize``, ``chat``, ``edit`` built from the Python stdlib (``datasets.py``).

Module imports stay light (no torch) so that building the CLI parser is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def add_bench_parser(sub: Any, add_engine_args: Callable[[Any], None]) -> None:
    """Register ``bench`` (with ``offline`` and ``serve``) on the CLI's subparsers."""
    import argparse

    from specserve.bench import offline, serve

    b = sub.add_parser("bench", help="benchmarks: speculation off vs on (offline, or against an HTTP server)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = b.add_subparsers(dest="bench_command", required=True)
    offline.add_parser(bsub, add_engine_args)
    serve.add_parser(bsub)
