"""Benchmark outputs: console tables, ``results.json``, ``report.md`` and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from importlib import metadata
from typing import Any

from specserve.cpu_isa import cpu_class


# -- provenance ---------------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_class": cpu_class(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_available"] = len(os.sched_getaffinity(0))
    if "torch" in sys.modules:  # never import torch just for this (bench serve does not need it)
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("specserve", "torch", "transformers", "httpx", "matplotlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def header(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """The common part of every results.json: what ran, where, with which versions, from which command."""
    return {"benchmark": kind, "command": [os.path.basename(sys.argv[0]), *sys.argv[1:]], "args": args,
            "machine": machine_info(), "versions": versions()}


def write_json(out_dir: str, doc: dict[str, Any]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    return path


def write_text(out_dir: str, name: str, text: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


# -- tables -------------------------------------------------------------------------------------------------
def _fmt(v: Any, format_spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:  # NaN
        return "-"
    return format(v, format_spec)


def table(rows: list[list[str]], headers: list[str], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


OFFLINE_HEADERS = ["batch", "off tok/s", "on tok/s", "ratio", "decode x", "acc rate", "mean acc len", "drafted",
                   "k used", "alpha", "c", "ideal", "model", "eff", "mismatch"]


def offline_rows(batches: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for b in batches:
        rows.append([
            str(b["batch_size"]), _fmt(b["off_tok_s"], ".2f"), _fmt(b["on_tok_s"], ".2f"), _fmt(b["ratio"], ".3f"),
            _fmt(b.get("decode_ratio"), ".3f"), _fmt(b["acceptance_rate"], ".3f"), _fmt(b["mean_acceptance_length"], ".2f"),
            "-" if b["drafting_pass_fraction"] is None else f"{100 * b['drafting_pass_fraction']:.0f}%",
            _fmt(b["k_used"], ".2f"),
            _fmt(b["alpha"], ".3f"), _fmt(b["c"], ".4f"), _fmt(b["ideal_speedup"], ".2f"),
            _fmt(b["model_speedup"], ".2f"), _fmt(b["efficiency"], ".2f"),
            f"{b['mismatches']}/{b['num_requests']}",
        ])
    return rows


def sources_lines(batches: list[dict[str, Any]]) -> str:
    """Per batch size, per draft source: accepted / drafted tokens and accepted tokens per engine step (the
    "grammar" source's are the tokens that came free from a structured output's grammar)."""
    lines = []
    for b in batches:
        for source, s in sorted((b.get("sources") or {}).items()):
            rate = s.get("acceptance_rate")
            lines.append(f"batch {b['batch_size']}: drafts from {source or 'the proposer'}: "
                         f"{s['accepted_tokens']}/{s['draft_tokens']} accepted"
                         f"{f' ({rate:.2f})' if rate is not None else ''}, "
                         f"{s['accepted_per_step'] or 0:.2f} accepted tokens per step")
    return "\n".join(lines)


def offline_table(batches: list[dict[str, Any]], markdown: bool = False, peer: dict[str, Any] | None = None) -> str:
    """With ``peer`` (a batch-1 peer such as llama.cpp: ``name``, ``tok_s``): its tok/s and the ratios
    specserve off / peer and on / peer next to specserve's figures, on the batch-1 row."""
    headers, rows = list(OFFLINE_HEADERS), offline_rows(batches)
    if peer:
        name = peer.get("name", "peer")
        headers[3:3] = [f"{name} tok/s", f"off/{name}", f"on/{name}"]
        for b, r in zip(batches, rows, strict=True):
            one = b["batch_size"] == 1
            r[3:3] = [_fmt(peer["tok_s"], ".2f") if one else "-", _fmt(peer.get("off_vs_peer") if one else None, ".3f"),
                      _fmt(peer.get("on_vs_peer") if one else None, ".3f")]
    return table(rows, headers, markdown)


OFFLINE_LEGEND = """\
- **off / on tok/s**: output tokens per second of one `generate` over all requests of the run (prefill
  included, prefix cache reset before every run), median over repeats; off and on runs interleaved.
- **ratio** = on / off. **decode x** = off / on mean time per output token after each request's first
  (TPOT): the speedup of the decode phase alone, which the prefill both sides share does not dilute.
  **acc rate** = accepted / drafted tokens. **mean acc len** = tokens emitted per
  verification pass that had drafts (1 + accepted / passes).
- **drafted**: share of decode passes that verified drafts (the adaptive controller picks k = 0 when its
  measurements say speculation cannot win; it still probes now and then). **k used**: mean drafts per
  drafting pass (at most the configured k).
- **alpha**: per-position acceptance of the geometric model, solved from E(alpha, k used) = mean acc len.
- **c** = T_draft(B) / T_target(B): median measured draft step (per draft token) over median target decode
  step with exactly B tokens (falls back to the controller's fitted costs).
- **ideal** = (1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)) with k = k used (verification assumed as cheap as a
  decode step). **model** = the controller's full cost model: E(alpha, k) T_target(B) / (T_target(B(k+1)) +
  k T_draft(B)), with the controller's fitted T_target. **eff** = ratio / ideal. ideal and model describe a
  drafting pass: with "drafted" well below 100% the engine mostly decoded without drafts, and eff can exceed 1.
- **mismatch**: requests whose greedy output with speculation differs from the output without it.
- with `--peer llama.cpp`: **llama.cpp tg128 tok/s** = native `llama-bench` decode rate (same GGUF, same
  thread count, median of its samples; no prefill in it) and **off/…**, **on/…** = specserve batch-1 tok/s
  (prefill included) over it (> 1: specserve is faster). The peer table adds llama-bench pp and the same
  prompts through `llama-server` (tok/s defined as above, greedy, one request at a time).
"""


def peer_rows(peer: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, r in peer["modes"].items():
        agree = "-" if r.get("agree") is None else f"{r['agree']}/{r['num_prompts']}"
        if any(d is not None for d in r.get("diverge_at") or []):  # first differing output token per prompt
            agree += " (differ from token " + ", ".join("-" if d is None else str(d) for d in r["diverge_at"]) + ")"
        rows.append([name, _fmt(r["tok_s"], ".2f"), agree])
    return rows


SERVE_METRICS = ("ttft", "tpot", "itl", "e2el")


def serve_rows(runs: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One column per run (e.g. ``spec off``, ``spec on``), one row per figure."""
    names = list(runs)
    rows = [
        ["completed / failed"] + [f"{runs[n]['completed']} / {runs[n]['failed']}" for n in names],
        ["duration (s)"] + [_fmt(runs[n]["duration_s"], ".2f") for n in names],
        ["request throughput (req/s)"] + [_fmt(runs[n]["request_throughput"], ".3f") for n in names],
        ["output throughput (tok/s)"] + [_fmt(runs[n]["output_throughput"], ".2f") for n in names],
        ["total output tokens"] + [str(runs[n]["total_output_tokens"]) for n in names],
    ]
    for m in SERVE_METRICS:
        for stat in ("mean", "median", "p99"):
            rows.append([f"{m.upper()} {stat} (ms)"] + [_fmt(runs[n][m][stat], ".1f") for n in names])
    if any(runs[n].get("speculative") for n in names):  # the server's counters (``bench serve``)
        spec = [runs[n].get("speculative") or {} for n in names]
        rows += [["drafting passes"] + [str(s.get("num_drafts", "-")) for s in spec],
                 ["draft / accepted tokens"] + [f"{s['draft_tokens']} / {s['accepted_tokens']}" if s else "-"
                                                 for s in spec],
                 ["acceptance rate"] + [_fmt(s.get("acceptance_rate"), ".3f") for s in spec],
                 ["mean acceptance length"] + [_fmt(s.get("mean_acceptance_length"), ".2f") for s in spec],
                 ["acceptance per position"] + [" ".join(_fmt(x, ".2f") for x in s.get("acceptance_per_position")
                                                         or []) or "-" for s in spec]]
    if len(names) == 2:
        a, b = (runs[n]["output_throughput"] for n in names)
        rows.append(["output throughput ratio"] + ["", _fmt(b / a if a else None, ".3f")])
    return ["metric", *names], rows


def spec_rounds(runs: dict[str, dict[str, Any]]) -> list[tuple[float | None, float | None]]:
    """(on / off output throughput, on / off TTFT median) of each round of ``--compare-spec --repeats``: the
    runs named ``spec off N`` / ``spec on N`` (or a single ``spec off`` / ``spec on``)."""
    out = []
    for name, off in runs.items():
        on = runs.get(name.replace("spec off", "spec on", 1)) if name.startswith("spec off") else None
        if on is None:
            continue
        a, b = off["output_throughput"], on["output_throughput"]
        t0, t1 = off["ttft"]["median"], on["ttft"]["median"]
        out.append((b / a if a else None, t1 / t0 if t0 and t1 is not None else None))
    return out


def spec_rounds_line(runs: dict[str, dict[str, Any]]) -> str:
    """Per-round on/off ratios and their medians (empty without rounds)."""
    rounds = spec_rounds(runs)
    if len(rounds) < 2:
        return ""

    def series(i: int) -> str:
        xs = [x for r in rounds if (x := r[i]) is not None]
        med = statistics.median(xs) if xs else None
        return ", ".join(_fmt(x, ".2f") for x in xs) + f" (median {_fmt(med, '.2f')}x)"
    return f"on / off per round, output throughput: {series(0)}; TTFT median: {series(1)}"


def serve_table(runs: dict[str, dict[str, Any]], markdown: bool = False) -> str:
    headers, rows = serve_rows(runs)
    if markdown:
        return table(rows, headers, markdown=True)
    widths = [max(len(headers[0]), *(len(r[0]) for r in rows))] + [
        max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(1, len(headers))]
    lines = ["  ".join([headers[0].ljust(widths[0])] + [h.rjust(w) for h, w in zip(headers[1:], widths[1:], strict=True)])]
    for r in rows:
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]))
    return "\n".join(lines)


# -- markdown -----------------------------------------------------------------------------------------------
def _md_header(title: str, doc: dict[str, Any]) -> list[str]:
    m, v = doc["machine"], doc["versions"]
    return [f"# {title}", "", f"Command: `{' '.join(doc['command'])}`", "",
            f"Machine: {m['platform']}, {m['cpu_count']} CPUs ({m.get('cpu_class', 'class not recorded')})"
            + (f", GPU {m['gpu']}" if m.get("gpu") else "")
            + f"; Python {m['python']}; " + ", ".join(f"{k} {val}" for k, val in v.items() if val), ""]


def offline_markdown(doc: dict[str, Any], plots: list[str]) -> str:
    lines = _md_header("specserve bench offline", doc)
    a = doc["args"]
    lines += [f"Model: `{doc['model']}`; speculation: `{json.dumps(doc['speculative'])}`; dataset "
              f"`{a['dataset']}` ({doc['num_prompts']} prompts); max_tokens {a['max_tokens']}; "
              f"repeats {a['repeats']} (medians); greedy.", "",
              offline_table(doc["batches"], markdown=True, peer=doc.get("llama_cpp")), "", OFFLINE_LEGEND]
    for b in doc["batches"]:
        for ex in b.get("mismatch_examples", []):
            lines.append(f"- batch {b['batch_size']}: request {ex['request']} diverges at output token "
                         f"{ex['position']} (off {ex['off']} vs on {ex['on']})")
    if doc.get("peer"):
        p = doc["peer"]
        lines += ["", "## Peer: HF transformers `generate` (batch 1, greedy, same prompts)", "",
                  table(peer_rows(p), ["engine", "tok/s", "same tokens as specserve (off)"], markdown=True), ""]
        lines += [f"- {n}" for n in p.get("notes", [])]
    if doc.get("llama_cpp"):
        p = doc["llama_cpp"]
        lines += ["", "## Peer: native llama.cpp (llama-bench, llama-server; same GGUF, batch 1, greedy)", "",
                  table(peer_rows(p), ["engine", "tok/s", "same tokens as specserve (off)"], markdown=True), ""]
        lines += [f"- {n}" for n in p.get("notes", [])]
    lines += [""] + [f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})" for p in plots]
    return "\n".join(lines) + "\n"


def serve_markdown(doc: dict[str, Any], plots: list[str]) -> str:
    lines = _md_header("specserve bench serve", doc)
    a = doc["args"]
    lines += [f"Base URL: `{doc.get('base_url')}`; dataset `{a['dataset']}`; request rate {a['request_rate']}; "
              f"concurrency {a['concurrency']}; {a['num_prompts']} prompts; max_tokens {a['max_tokens']}; "
              f"streaming.", "", serve_table(doc["runs"], markdown=True), "", spec_rounds_line(doc["runs"]), "",
              "TTFT: time to first content chunk. TPOT: (E2E - TTFT) / (output tokens - 1) per request. ITL: gaps "
              "between content chunks (one chunk may carry several tokens when drafts are accepted). E2EL: "
              "request latency. Percentiles over requests (ITL: over all gaps)."]
    for name, run in doc["runs"].items():
        if run.get("launch"):
            lines.append(f"- {name}: `specserve serve {run['launch']}`")
    lines += [""] + [f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})" for p in plots]
    return "\n".join(lines) + "\n"


# -- plots --------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(batches: list[dict[str, Any]], path: str, title: str = "") -> str:
    plt = _plt()
    xs = [b["batch_size"] for b in batches]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [b["off_tok_s"] for b in batches], "o-", label="speculation off")
    ax.plot(xs, [b["on_tok_s"] for b in batches], "s-", label="speculation on")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch size (max concurrent requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title or "Throughput vs batch size")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_acceptance(batches: list[dict[str, Any]], path: str, label: str = "batch {}") -> str:
    """Fraction of drafting passes that accepted draft position i, per batch size (``label`` formats each
    entry's ``batch_size``: a run's name for ``bench serve``)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    n = max(1, len(batches))
    for j, b in enumerate(batches):
        per = b.get("acceptance_per_position") or []
        xs = [i + 1 + (j - (n - 1) / 2) * 0.8 / n for i in range(len(per))]
        ax.bar(xs, per, width=0.8 / n, label=label.format(b["batch_size"]))
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of drafting passes accepting it")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance per position")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_latency_cdfs(samples: dict[str, dict[str, list[float]]], path: str) -> str:
    """``samples[run][metric]`` in seconds -> one CDF panel per metric (TTFT, ITL, E2E)."""
    plt = _plt()
    metrics = ("ttft", "itl", "e2el")
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 3.8))
    for ax, m in zip(axes, metrics, strict=True):
        for run, s in samples.items():
            xs = sorted(v * 1000 for v in s.get(m, []))
            if xs:  # empirical CDF: a step from 0 to 1
                ax.step([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], where="post",
                        label=run)
        ax.set_xlabel(f"{m.upper()} (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
