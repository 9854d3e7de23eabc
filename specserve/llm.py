"""Offline API, shaped like vLLM's: ``LLM(model=None, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.model.decoder import DecoderModel
    from specserve.spec_decode.controller import SpecController
    from specserve.spec_decode.proposer import Draft, ProposeRequest
    from specserve.spec_decode.state import Source
    from specserve.worker.features import FeatureSink


class LLM:
    """``close()`` (or a ``with`` block) releases the engine now: tensor-parallel workers, the process group,
    the models and the KV cache. ``del llm`` releases the same once the object is garbage (the engine's
    finalizer, which also runs at interpreter exit)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._engine: Engine | None = Engine(EngineConfig.from_kwargs(model, **engine_args))
        self._engine.scheduler.closed_batches = True  # generate() adds all its requests before stepping
        self.tokenizer = self._engine.tokenizer

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("this LLM is closed: create a new one")
        return self._engine

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[list[int]] | None = None, use_tqdm: bool = False,
                 speculative: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion, batched; outputs come back in the order of the prompts."""
        if prompts is None:
            items: list[Any] = list(prompt_token_ids or [])
        elif isinstance(prompts, str):
            items = [prompts]
        else:
            items = list(prompts)
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(items)
        if len(plist) != len(items):
            raise ValueError("sampling_params must be one object or one per prompt")
        ids = [self.engine.add_request(None, p, sp, speculative=speculative) for p, sp in zip(items, plist)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(None, sampling_params, prompt_token_ids=prompts, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()

    # -- for the tools (bench, distill): speculation's controller and drafts, the target model ---------------
    def spec_controller(self) -> SpecController | None:
        """The speculation controller now in use (its acceptance, measured costs and ``cost_observers``);
        None without speculation."""
        drafter = self.engine.runner.drafter
        return drafter.controller if drafter is not None else None

    def reset_spec_controller(self, adaptive: bool | None = None, max_k: int | None = None) -> None:
        """Replace the controller with a fresh one (no fitted costs, no acceptance history): adaptive or a fixed
        k (None: as before), drafting at most ``max_k`` (None: ``--num-speculative-tokens``, the most allowed).
        Lets one loaded engine compare settings. Nothing without speculation."""
        drafter = self.engine.runner.drafter
        if drafter is not None:
            drafter.reset_controller(adaptive=adaptive, max_k=max_k)

    def target_model(self) -> DecoderModel:
        """The target model (rank 0's shard under tensor parallelism)."""
        return self.engine.runner.model

    def set_feature_layers(self, layers: tuple[int, ...] | None) -> None:
        """The target layers (1-based) whose outputs make the features ``observe_features`` hands out (None:
        the last layer's)."""
        self.engine.runner.set_feature_layers(layers)

    @contextlib.contextmanager
    def observe_features(self, sink: FeatureSink) -> Iterator[None]:
        """For the duration: every step hands the target's features of each row to ``sink`` (what ``specserve
        distill`` trains a head on)."""
        with self.engine.runner.observe_features(sink):
            yield

    @contextlib.contextmanager
    def observe_drafts(self, sink: Callable[[list[tuple[Source | None, Draft]]], None]) -> Iterator[None]:
        """For the duration: after every proposal, ``sink`` gets the step's drafts, each with its source (what
        ``benchmarks/fixed_costs.py`` prices). Nothing without speculation."""
        drafter = self.engine.runner.drafter
        if drafter is None:
            yield
            return
        propose = drafter.propose

        def observed(cands: list[ProposeRequest], draining: bool = False, hold: bool = False,
                     others: int = 0) -> dict[str, Draft]:
            out = propose(cands, draining, hold, others)
            sink([(c.spec.source, out[c.req_id]) for c in cands if c.req_id in out])
            return out

        drafter.propose = observed  # type: ignore[method-assign]
        try:
            yield
        finally:
            drafter.propose = propose  # type: ignore[method-assign]

    def graph_buckets(self) -> list[tuple[int, int, bool]]:
        """The target step's captured graph buckets so far, sorted (empty when graphs are off)."""
        static = self.engine.runner.target_step.static
        return sorted(static.graphs) if static is not None else []

    def close(self) -> None:
        """Release everything now (class docstring); idempotent. The LLM cannot generate afterwards."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
