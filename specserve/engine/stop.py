"""Append a step's emitted tokens to a request one by one, applying stop conditions *inside* the run.

A stop (EOS, stop token, stop string, max_tokens) in the middle of an accepted speculative run truncates
it exactly where decoding without speculation would have stopped.
"""

from __future__ import annotations

from typing import Any

from specserve.outputs import CompletionOutput
from specserve.request import Request, RequestStatus
from specserve.tokenizer import IncrementalDetokenizer


def append_checked(req: Request, emitted: list[int], detok: IncrementalDetokenizer, comp: CompletionOutput,
                   logprobs: list[dict[str, Any]] | None = None) -> RequestStatus | None:
    """Returns the finishing status, or None while the request goes on. Updates ``comp`` in place."""
    p = req.sampling_params
    for i, tok in enumerate(emitted):
        req.output_token_ids.append(tok)
        req.all_token_ids.append(tok)
        comp.token_ids.append(tok)
        comp.spec_accepted.append(i < len(emitted) - 1)  # all but the last emitted token were drafts
        if logprobs is not None:
            if comp.logprobs is None:
                comp.logprobs = []
            comp.logprobs.append(logprobs[i])
        prev_len = len(detok.text)
        detok.add(tok)
        text = detok.text
        status: RequestStatus | None = None
        can_stop = req.num_output_tokens >= p.min_tokens
        if can_stop and tok in req.eos_token_ids and not p.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED
        elif can_stop and tok in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        elif can_stop and p.stop:
            hit = _find_stop(text, prev_len, p.stop)
            if hit is not None:
                idx, s = hit
                text = text[:idx + len(s)] if p.include_stop_str_in_output else text[:idx]
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, s
        if status is None and req.num_output_tokens >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and not isinstance(req.stop_reason, str):
            detok.flush()  # the stream ends: emit a held-back incomplete character too
            text = detok.text
        comp.text = text
        if status is not None:
            comp.finish_reason, comp.stop_reason = status.value, req.stop_reason
            return status
    return None


def _find_stop(text: str, prev_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends in the newly added text."""
    best: tuple[int, str] | None = None
    for s in stops:
        idx = text.find(s, max(0, prev_len - len(s) + 1))
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, s)
    return best
