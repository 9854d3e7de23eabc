"""AsyncEngine: the synchronous Engine stepped by ONE background thread, exposed to asyncio.

NOTE: the Engine is not thread-safe. Only the loop thread touches it: adds and aborts from the event loop go
through a command queue that the loop thread drains before every step, and outputs come back to each
request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``. Torch releases the GIL inside its ops, so
the event loop keeps serving HTTP while a step runs.

Every ``RequestOutput`` carries the full state of the request (full text, all token ids, all logprobs), so a
consumer that falls behind may skip intermediate outputs: :class:`RequestStream` keeps only the newest one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.outputs import RequestOutput
from specserve.sample.grammar import GrammarError
from specserve.sampling_params import SamplingParams

T = TypeVar("T")

log = logging.getLogger("specserve.async_engine")

_END = object()  # end of stream without a finished output (aborted)
# A structured output's grammar compiles in a worker thread, off the engine loop; past this it is refused
# (the compile thread finishes in the background, its result cached for a retry of the same constraint).
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


class QueueFullError(RuntimeError):
    """More than ``max_queue`` requests waiting or running (a 429 for the server)."""


class EngineClosedError(RuntimeError):
    """The engine loop was shut down (a 503 for the server)."""


class EngineStepError(RuntimeError):
    """A step raised: every request that was in the engine gets this (a 500 for the server)."""


class RequestStream:
    """Async iterator over one request's outputs; ends after the finished output (or an abort)."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._stash: Any = None

    # -- producer side (called on the event loop through call_soon_threadsafe) -------------------------------
    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    # -- consumer side --------------------------------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._stash is not None:
            item, self._stash = self._stash, None
        else:
            item = await self._queue.get()
        # Coalesce: a newer output supersedes an older unfinished one (outputs are cumulative).
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if not isinstance(nxt, RequestOutput):
                self._stash = nxt
                break
            item = nxt
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request (no-op once finished). Safe to call from a ``finally`` during cancellation."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


def build_engine(config: EngineConfig) -> Engine:
    """``Engine(config)`` for a server, whose steps run on the ``AsyncEngine`` loop thread.

    NOTE: OpenMP (the CPU kernels' threads) keeps one team of threads per thread that ever ran a parallel
    region, and once it manages more threads than there are cores its idle threads stop spinning and sleep
    after each region, so every one of the hundreds of regions of a step waits for a wake-up. Loading (and the
    start-up calibration) in the main thread and stepping in the loop thread made two teams: a 1.5B model's
    decode step took 37-38 ms instead of 27-34 (2-core EPYC, interleaved runs). A single-process engine is
    therefore built in a thread that ends when it is built, which frees its team. A tensor-parallel engine is
    built in the caller's thread: its rank processes die with the thread that started them (PR_SET_PDEATHSIG)."""
    if config.parallel.tensor_parallel_size > 1:
        return Engine(config)
    box: dict[str, Any] = {}

    def build() -> None:
        try:
            box["engine"] = Engine(config)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=build, name="specserve-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]


class AsyncEngine:
    """Owns an :class:`Engine` and the thread that steps it. Start with :meth:`start` (or lazily on the first
    request); stop with :meth:`shutdown`. ``max_queue`` bounds requests accepted but not finished (waiting
    plus running); it may be changed at any time."""

    def __init__(self, engine: Engine, max_queue: int = 256) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # guards _streams, _closed, _thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        self._snapshot: dict[str, Any] = self._collect_metrics()
        self.num_step_errors = 0
        # Requests sent to the loop thread and not yet added: the runner holds draft-model steps while any
        # wait, since the next step will carry their prefill (``ModelRunner.arrivals_pending``).
        self._adds_pending = 0
        runner = getattr(engine, "runner", None)
        if runner is not None and hasattr(runner, "arrivals_pending"):
            runner.arrivals_pending = lambda: self._adds_pending > 0
        # Why the engine can never step again (a tensor-parallel rank was lost), or None.
        self.fatal: str | None = None
        add_listener = getattr(engine, "add_failure_listener", None)
        if add_listener is not None:
            add_listener(self._on_fatal)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine has been shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop thread after the current step; pending requests end with EngineClosedError."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wakeup.set()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("engine loop did not stop within %.0fs", timeout)
        # NOTE: once the loop thread is gone this thread may touch the engine: leave it clean for a successor.
        stopped = thread is None or not thread.is_alive()
        self._fail_all(EngineClosedError("the engine was shut down"), abort_in_engine=stopped and self.fatal is None)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()  # the tensor-parallel worker processes

    def _on_fatal(self, reason: str) -> None:
        """From another thread: the engine is broken for good. Every request ends now with the reason (the loop
        thread may be stuck in a step, so the engine itself is not touched); nothing new is accepted."""
        log.error("engine failed: %s", reason)
        with self._lock:
            self.fatal = reason
            self._closed = True
        self._wakeup.set()
        self._fail_all(EngineStepError(f"the engine failed: {reason}"), abort_in_engine=False)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def num_requests(self) -> int:
        """Requests accepted and not finished (waiting + running + not yet seen by the loop)."""
        return len(self._streams)

    # -- asyncio API ----------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                          prompt_token_ids: list[int] | None = None,
                          speculative: bool = True) -> RequestStream:
        """Queue a request and wait until the loop thread has validated it: raises ValueError (bad input),
        QueueFullError or EngineClosedError here, before anything is streamed."""
        self.start()
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id)
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine has been shut down")
            if len(self._streams) >= self.max_queue:
                raise QueueFullError(f"the server is at capacity ({self.max_queue} requests waiting or "
                                     f"running); retry later")
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (loop, stream)
        try:
            grammar = await self._compile_grammar(params) if params.structured_outputs is not None else None
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            raise
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._adds_pending += 1
        self._send("add", request_id, (prompt, params, prompt_token_ids, speculative, grammar), loop, fut)
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)  # NOTE: the add is ahead of this abort in the command queue
            raise
        return stream

    async def _compile_grammar(self, params: SamplingParams) -> Any:
        """The request's grammar, compiled in a thread (other requests' steps go on meanwhile)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.engine.compile_grammar, params),
                                          GRAMMAR_COMPILE_TIMEOUT_S)
        except TimeoutError:
            assert params.structured_outputs is not None
            raise GrammarError(f"the {params.structured_outputs.kind} constraint did not compile "
                             f"within {GRAMMAR_COMPILE_TIMEOUT_S:.0f} s; simplify it") from None

    async def generate(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                       prompt_token_ids: list[int] | None = None,
                       speculative: bool = True) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; leaving early (break, cancellation) aborts it.
        Validation errors surface on the first ``__anext__``: use :meth:`add_request` to get them first."""
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids, speculative)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """``fn(engine)`` on the loop thread between two steps (never during one), e.g. ``Engine.embed``; its
        result or exception comes back here."""
        self.start()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine has been shut down")
        self._send("call", None, fn, loop, fut)
        return await fut

    def abort(self, request_id: str) -> None:
        """Thread-safe: the loop thread aborts the request before its next step (its KV is freed then)."""
        self._send("abort", request_id)

    def abort_all(self, error: Exception) -> None:
        """Thread-safe: the loop thread aborts every request before its next step (KV freed then); each
        stream raises ``error`` (e.g. a graceful shutdown's grace period is over)."""
        self._send("abort_all", None, error)

    def get_metrics(self) -> dict[str, Any]:
        """The engine's counters as of the end of the latest step (published by the loop thread)."""
        return self._snapshot

    # -- loop thread ----------------------------------------------------------------------------------------
    def _send(self, *command: Any) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        log.info("engine loop started")
        while not self._closed:
            self._wakeup.clear()
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._snapshot = self._collect_metrics()
                self._wakeup.wait(1.0)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # never let a step kill the loop: fail the requests in flight instead
                self.num_step_errors += 1
                log.exception("engine step failed; failing the %d requests in flight", len(self._streams))
                self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out, done=out.finished)
            self._snapshot = self._collect_metrics()
        self._drain_commands(closing=True)
        log.info("engine loop stopped")

    def _drain_commands(self, closing: bool = False) -> None:
        while True:
            try:
                kind, request_id, *rest = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                args, loop, fut = rest
                self._do_add(request_id, args, loop, fut, closing)
            elif kind == "abort_all":
                self._fail_all(rest[0])
            elif kind == "call":
                fn, loop, fut = rest
                self._do_call(fn, loop, fut, closing)
            else:
                self._do_abort(request_id)

    def _do_add(self, request_id: str, args: tuple[Any, ...], loop: asyncio.AbstractEventLoop,
                fut: asyncio.Future[None], closing: bool) -> None:
        prompt, params, prompt_token_ids, speculative, grammar = args
        with self._lock:
            self._adds_pending -= 1
        try:
            if closing:
                raise EngineClosedError("the engine is shutting down")
            self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                                    speculative=speculative, grammar=grammar)
        except Exception as e:
            with self._lock:
                self._streams.pop(request_id, None)
            _call_soon(loop, _settle, fut, e)
            return
        _call_soon(loop, _settle, fut, None)

    def _do_call(self, fn: Callable[[Engine], Any], loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any],
                 closing: bool) -> None:
        try:
            if closing:
                raise EngineClosedError("the engine is shutting down")
            result = fn(self.engine)
        except Exception as e:
            _call_soon(loop, _settle, fut, e)
            return
        _call_soon(loop, _resolve, fut, result)

    def _do_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("abort of %s failed", request_id)
        self._deliver(request_id, _END, done=True)

    def _deliver(self, request_id: str, item: Any, done: bool) -> None:
        with self._lock:
            entry = self._streams.pop(request_id, None) if done else self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            _call_soon(loop, stream._put, item)

    def _fail_all(self, error: Exception, abort_in_engine: bool = True) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            if abort_in_engine:
                try:
                    self.engine.abort(request_id)
                except Exception:
                    log.exception("abort of %s failed", request_id)
            self._deliver(request_id, error, done=True)

    def _collect_metrics(self) -> dict[str, Any]:
        m = dict(self.engine.get_metrics())
        stats = getattr(self.engine, "stats", None)
        m["num_prompt_tokens"] = getattr(stats, "num_prompt_tokens", 0)
        m["num_generated_tokens"] = getattr(stats, "num_generated_tokens", 0)
        return m


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():  # the awaiting handler was cancelled
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
        pass


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come; an error in one ends the merge."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
            return
        q.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
