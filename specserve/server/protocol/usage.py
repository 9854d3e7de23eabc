"""Usage (with speculative decoding's counters) and the streamed text of one choice (``Delta``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from specserve.outputs import CompletionOutput, RequestOutput
from specserve.request import SpecStats


class SpeculativeUsage(BaseModel):
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_acceptance_length: float = 1.0
    # The same counters per draft source ("model", "lookup", "grammar", or the method), when any drafted.
    sources: dict[str, SpeculativeUsage] | None = None

    @staticmethod
    def merge(stats: list[dict[str, Any]], sources: list[dict[str, dict[str, Any]]] | None = None
              ) -> SpeculativeUsage:
        """The sum of per-request ``metrics["speculative"]`` counters (choices of one response), and of their
        ``metrics["speculative_sources"]``."""
        total = SpecStats.total(stats).as_dict()
        names = sorted({name for s in sources or [] for name in s})
        by_source = {name: SpeculativeUsage.merge([s[name] for s in sources or [] if name in s]) for name in names}
        return SpeculativeUsage(**{k: v for k, v in total.items() if k != "accepted_per_position"},
                                sources=by_source or None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage | None = None


class Delta:
    """What one choice has streamed so far. While the choice runs, the last ``hold`` characters (longest stop
    string - 1) are held back: the engine cuts a stop string out of the text only once it is complete, so
    text that may still become part of one must not be sent yet. Streamed pieces then concatenate exactly to
    the final text."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.sent = 0  # characters
        self.tokens = 0
        self.done = False

    def advance(self, comp: CompletionOutput) -> tuple[str, int, int] | None:
        """(new text, first new token index, end token index), or None once the finish was sent."""
        if self.done:
            return None
        end = len(comp.text) if comp.finished else max(self.sent, len(comp.text) - self.hold)
        text = comp.text[self.sent:end]
        self.sent = max(self.sent, end)
        t0, self.tokens = self.tokens, len(comp.token_ids)
        self.done = comp.finished
        return text, t0, self.tokens


def usage(outputs: list[RequestOutput]) -> Usage:
    """Prompt tokens once per prompt (not per choice); completion tokens over all choices."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    spec_stats = SpeculativeUsage.merge([o.metrics.get("speculative") or {} for o in outputs],
                                        [o.metrics.get("speculative_sources") or {} for o in outputs])
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 speculative=spec_stats)
