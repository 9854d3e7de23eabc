"""Target features for EAGLE drafting (and for `specserve distill`): the last decoder layer's output before
the final norm, per request, for the positions whose KV the step verified.

A *feature sink* receives ``(req_id, first position, [n, hidden])`` for every row of a step: all computed
tokens of a prefill chunk, and for a sampling row its real token(s) plus the accepted drafts (the rejected
drafts' features are as stale as their KV and are dropped here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.outputs import ScheduledRequest

# (req_id, first position, [n, hidden] features, whether they are views of the step's own copy)
FeatureSink = Callable[[str, int, torch.Tensor, bool], None]


# A step of at most this many rows is copied once and its sinks get views of the copy; a larger one (a prefill
# chunk) is handed over as views of the forward's own output, copied per row by the sink that keeps it.
SHARED_COPY_ROWS = 256


def sink_features(rows: list[ScheduledRequest], sampled: dict[str, list[int]], prenorm: torch.Tensor,
                  sink: FeatureSink) -> None:
    """prenorm: [T, hidden] for the step's flat tokens (rows in order). A sink that keeps a row's features
    beyond the call must own them: ``spec_decode/state.FeatureBuffer.add`` copies them unless they are views of this step's
    copy (``owned``: a decode or verification step's rows share one copy instead of one per request)."""
    owned = prenorm.shape[0] <= SHARED_COPY_ROWS
    if owned:
        prenorm = prenorm.clone()  # the forward's output may be a buffer the next step reuses (graphs)
    off = 0
    for r in rows:
        valid = r.num_tokens
        if r.req_id in sampled:  # drop the rejected drafts
            valid = r.num_tokens - r.num_spec_tokens + len(sampled[r.req_id]) - 1
        if valid > 0:
            sink(r.req_id, r.num_computed_tokens, prenorm[off:off + valid], owned)
        off += r.num_tokens
