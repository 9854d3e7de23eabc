"""Tensor parallel across processes: rank 0 is the engine's own worker, ranks 1..N-1 follow it.

Every rank builds the same ``ModelRunner`` over its slice of the weights (``model/sharding.py``).
Rank 0 runs the engine: the scheduler, sampling and verification, the controller, the proposers' logic.
Every model call it makes on a sharded model (the target step with its logits, layer-skip and sharded
draft steps, EAGLE head steps) is a *mirrored call*:
- rank 0 broadcasts the call's key and arguments once (a pickled message);
- the other ranks, waiting in ``Mirror.follow``, run the same call on their slices;
- so every all-reduce and all-gather inside the call meets its peers.
The ranks see only model inputs (token ids, positions, block ids): requests, sampling and the accepted
tokens live on rank 0, so every rank agrees on them by construction. A draft model at
``draft_tensor_parallel_size`` 1 lives on rank 0 alone and its calls are not mirrored.

The mirror and its shared-memory transport are in ``worker/mirror.py``.

Executors start ranks 1..N-1: ``mp`` runs local processes (one GPU each), ``ray`` places actors with a
placement group on a running Ray cluster. Ray places processes and keeps them alive; the collectives are
torch.distributed's (``Platform.dist_backend``), or shared memory between CPU ranks on one host. A monitor
thread watches the workers: one that exits or dies is logged with its rank and cause, the rest are
stopped, and the failure listeners (the server) are told.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch

from specserve.config import EngineConfig, SpecserveError
from specserve.model.checkpoint.loader import Checkpoint, load_checkpoint
from specserve.model.sharding import check_tensor_parallel
from specserve.platform import Platform, check_tensor_parallel_devices, configure_threads, detect
from specserve.worker.mirror import collectives, op_timeout, send_stop, shm_files
from specserve.worker.model_runner import ModelRunner

log = logging.getLogger("specserve")

STARTUP_TIMEOUT_S = 600.0


# -- rank 0: the group ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def start_tensor_parallel(config: EngineConfig, platform: Platform, target: Checkpoint) -> WorkerGroup:
    """Check the split, then start ranks 1..N-1 and form the group (rank 0 is the calling process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise SpecserveError("a tensor-parallel engine is still open in this process (torch.distributed allows one "
                             "default process group per process): close() it, or `del` it, before starting another")
    size = config.parallel.tensor_parallel_size
    check_tensor_parallel(target.arch, size, "the target")
    spec = config.speculative
    if spec.method == "draft" and config.draft_tensor_parallel_size > 1:
        check_tensor_parallel(load_checkpoint(spec.model or "", keep_quantized=True).arch, size, "the draft model")
    if config.parallel.distributed_executor_backend == "mp":
        check_tensor_parallel_devices(platform, size)
    return WorkerGroup(config, platform.dist_backend, platform.shared_memory_collectives)


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1: starts them, joins the process group, watches them, stops them."""

    def __init__(self, config: EngineConfig, dist_backend: str, shm: bool) -> None:
        import torch.distributed as dist

        self.size = config.parallel.tensor_parallel_size
        self.backend = config.parallel.distributed_executor_backend
        self.failure: str | None = None
        # Bound methods are held weakly (a server's AsyncEngine listens): the group must not keep its engine
        # alive, or the engine's finalizer (which closes this group) would never run.
        self._listeners: list[Callable[[], Callable[[str], None] | None]] = []
        self._closing = False
        self._lock = threading.Lock()
        self.workers: _Executor = _RayExecutor() if self.backend == "ray" else _MpExecutor()
        host = self.workers.host()
        port = _free_port()
        store = dist.TCPStore(host, port, self.size, is_master=True,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)
        files = shm_files(self.size) if shm and self.backend == "mp" else None
        self.workers.start(config, self.size, host, port, files)
        try:
            self._wait_ready(store)
            dist.init_process_group(dist_backend, store=store, rank=0, world_size=self.size, timeout=op_timeout())
            self.comm, self.msg_group = collectives(0, self.size, dist_backend, files, self._raise_if_lost)
        except BaseException:
            self.workers.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        finally:
            for path in files or ():  # every rank has mapped them by now: nothing is left behind on a crash
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._monitor = threading.Thread(target=self._watch, name="specserve-tp-monitor", daemon=True)
        self._monitor.start()
        log.info("tensor parallel: %d ranks, collectives over %s (%s executor)", self.size, self.comm.backend,
                 self.backend)

    def _lost_rank(self, wait: float = 0.0) -> str | None:
        """"tensor-parallel worker rank R <why>" for the first worker that is gone (waiting up to ``wait``
        seconds for one to go), or None."""
        dead = self.workers.wait_dead(wait) if wait > 0 else self.workers.dead()
        if not dead:
            return None
        rank, why = dead[0]
        return f"tensor-parallel worker rank {rank} {why}"

    def _raise_if_lost(self) -> None:
        """Called while rank 0 spins in a shared-memory collective: a gone worker ends the wait."""
        reason = self._lost_rank()
        if reason is not None:
            raise RuntimeError(reason)

    def _wait_ready(self, store: Any) -> None:
        """Every rank checks in on the store before the process group forms; a worker that dies first is
        reported with its rank instead of a rendezvous timeout."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        keys = [f"ready{r}" for r in range(1, self.size)]
        while not store.check(keys):
            reason = self._lost_rank()
            if reason is not None:
                raise SpecserveError(f"{reason} during start-up (its log is above)")
            if time.monotonic() > deadline:
                raise SpecserveError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def startup_error(self, e: BaseException) -> SpecserveError | None:
        """A clearer error for a collective that failed while the model was being built: the dead rank."""
        reason = self._lost_rank(0.5)
        return None if reason is None else SpecserveError(f"{reason} while loading (its log is above): {e}")

    def lost(self, wait: float = 3.0) -> str | None:
        """After a collective failed: the lost rank, if a worker is gone within ``wait`` seconds (a dead peer's
        socket can fail a collective before its exit is visible). Reported as the group's failure."""
        reason = self._lost_rank(wait)
        if reason is None:
            return None
        self._fail(reason)
        return self.failure

    def add_failure_listener(self, fn: Callable[[str], None]) -> None:
        ref: Callable[[], Callable[[str], None] | None] = \
            weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)  # type: ignore[arg-type]
        with self._lock:
            self._listeners.append(ref)
            failure = self.failure
        if failure is not None:
            fn(failure)

    def _watch(self) -> None:
        while not self._closing:
            reason = self._lost_rank(0.5)
            if reason is not None and not self._closing:
                self._fail(reason)
                return

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            listeners = [fn for fn in (ref() for ref in self._listeners) if fn is not None]
        log.error("%s; stopping the other ranks", reason)
        self.workers.kill()  # the survivors would wait for the dead rank in their next collective
        for fn in listeners:
            try:
                fn(reason)
            except Exception:
                log.exception("failure listener failed")

    def close(self, stop: bool = True, timeout: float = 10.0) -> None:
        """Stop the followers (``stop``: send them the stop message; False while they may not be following
        yet), wait for them, kill what is left, stop the monitor and leave the process group. Idempotent."""
        import torch.distributed as dist

        with self._lock:
            if self._closing:
                return
            self._closing = True
        if stop and self.failure is None:
            try:
                send_stop(self.msg_group)
            except Exception:
                log.warning("tensor parallel: could not send stop to the workers", exc_info=True)
        self.workers.join(timeout)
        self.workers.kill()
        if self._monitor is not threading.current_thread():
            self._monitor.join(5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                log.debug("destroy_process_group failed", exc_info=True)


class _Executor:
    def host(self) -> str:
        return "127.0.0.1"

    def start(self, config: EngineConfig, size: int, host: str, port: int, files: tuple[str, str] | None) -> None:
        raise NotImplementedError

    def dead(self) -> list[tuple[int, str]]:
        """(rank, why) of workers that are gone."""
        raise NotImplementedError

    def wait_dead(self, timeout: float) -> list[tuple[int, str]]:
        time.sleep(timeout)
        return self.dead()

    def join(self, timeout: float) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError


class _MpExecutor(_Executor):
    """Local worker processes: ``python -m specserve.worker.tensor_parallel``, a fresh interpreter each (no
    forked torch state, and unlike multiprocessing's spawn the caller's script is not imported again)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, config: EngineConfig, size: int, host: str, port: int, files: tuple[str, str] | None) -> None:
        for rank in range(1, size):
            p = subprocess.Popen([sys.executable, "-m", "specserve.worker.tensor_parallel"], stdin=subprocess.PIPE)
            assert p.stdin is not None
            p.stdin.write(pickle.dumps((config, rank, size, host, port, files, os.getpid())))
            p.stdin.close()
            self.procs.append(p)

    def dead(self) -> list[tuple[int, str]]:
        return [(i + 1, _describe_exit(p.returncode)) for i, p in enumerate(self.procs) if p.poll() is not None]

    def wait_dead(self, timeout: float) -> list[tuple[int, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead:
                return dead
            time.sleep(0.05)
        return self.dead()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel worker pid %d did not die", p.pid)


class _RayExecutor(_Executor):
    """Ray actors, one per rank > 0, in a placement group on the cluster at RAY_ADDRESS (or ``auto``)."""

    def __init__(self) -> None:
        try:
            import ray
        except ImportError:
            raise SpecserveError("--distributed-executor-backend ray needs Ray: pip install 'specserve[ray]'") from None
        self.ray = ray
        address = os.environ.get("RAY_ADDRESS", "auto")
        if not ray.is_initialized():
            _check_reachable(address)
            try:
                ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError) as e:
                raise SpecserveError(f"--distributed-executor-backend ray: no Ray cluster reachable at "
                                     f"{address!r} (start one with `ray start --head`, or set RAY_ADDRESS): {e}"
                                     ) from None
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self.pg: Any = None
        self._dead: dict[int, str] = {}

    def host(self) -> str:
        return str(self.ray.util.get_node_ip_address())

    def start(self, config: EngineConfig, size: int, host: str, port: int, files: tuple[str, str] | None) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = torch.cuda.is_available() and config.model.device != "cpu"
        bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        self.pg = placement_group([bundle] * (size - 1), strategy="PACK")
        ready, _ = self.ray.wait([self.pg.ready()], timeout=60)
        if not ready:
            self.ray.util.remove_placement_group(self.pg)
            raise SpecserveError(f"the Ray cluster cannot place {size - 1} workers with {bundle} each "
                                 f"(`ray status` shows its resources)")
        worker: Any = self.ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)(_RayWorker)
        for rank in range(1, size):
            actor = worker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=rank - 1)).remote()
            self.actors.append(actor)
            self.refs.append(actor.run.remote(config, rank, size, host, port, None))

    def _poll(self, timeout: float) -> None:
        pending = [r for i, r in enumerate(self.refs) if i + 1 not in self._dead]
        if not pending:
            return
        done, _ = self.ray.wait(pending, num_returns=1, timeout=timeout)
        for ref in done:
            rank = self.refs.index(ref) + 1
            try:
                self.ray.get(ref)
                self._dead[rank] = "exited"
            except Exception as e:  # RayActorError: the actor's process died
                self._dead[rank] = f"died ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"

    def dead(self) -> list[tuple[int, str]]:
        self._poll(0)
        return sorted(self._dead.items())

    def wait_dead(self, timeout: float) -> list[tuple[int, str]]:
        self._poll(timeout)
        return sorted(self._dead.items())

    def join(self, timeout: float) -> None:
        try:
            self.ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        except Exception:
            pass

    def kill(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:
                pass
        self.actors = []
        if self.pg is not None:
            try:
                self.ray.util.remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None


def _check_reachable(address: str) -> None:
    """A ``host:port`` Ray address must accept a connection within seconds (``ray.init`` would retry for
    minutes); ``auto`` and ``ray://`` addresses are left to Ray."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as e:
        raise SpecserveError(f"--distributed-executor-backend ray: no Ray cluster reachable at {address!r} "
                             f"(start one with `ray start --head`, or set RAY_ADDRESS): {e}") from None


class _RayWorker:
    """A Ray actor holding one rank; ``run`` returns when rank 0 stops the group."""

    def run(self, config: EngineConfig, rank: int, size: int, host: str, port: int, files: None) -> None:
        run_follower(config, rank, size, host, port, files)


# -- ranks > 0 ---------------------------------------------------------------------------------------------------
def _mp_main(config: EngineConfig, rank: int, size: int, host: str, port: int, files: tuple[str, str] | None,
             parent: int) -> None:
    _die_with_parent(parent)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp{rank} %(levelname)s %(message)s")
    try:
        run_follower(config, rank, size, host, port, files, parent)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when rank 0's process dies, so no worker outlives the server."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def run_follower(config: EngineConfig, rank: int, size: int, host: str, port: int,
                 files: tuple[str, str] | None = None, parent: int | None = None) -> None:
    """Rank ``rank``: join the group, build this rank's slice of everything rank 0 builds, then follow."""
    import torch.distributed as dist

    configure_threads(size)
    platform = detect(config.model.device, rank)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    def check() -> None:
        if parent is not None and os.getppid() != parent:
            raise RuntimeError("rank 0 is gone")

    # The shared-memory files are mapped before checking in: rank 0 unlinks them once the group has formed.
    shm = collectives(rank, size, platform.dist_backend, files, check) if files is not None else None
    store.set(f"ready{rank}", "1")
    dist.init_process_group(platform.dist_backend, store=store, rank=rank, world_size=size, timeout=op_timeout())
    comm, msg_group = shm or collectives(rank, size, platform.dist_backend, None, check)
    target = load_checkpoint(config.model.model, keep_quantized=config.model.quantization != "none")
    runner = ModelRunner(config, platform, target, comm=comm, msg_group=msg_group)
    runner.mirror.follow()
    dist.destroy_process_group()


if __name__ == "__main__":  # an mp worker: its arguments come pickled on stdin
    # Through the package's own module object: run as __main__ this file is a second copy of the module,
    # whose classes the rest of the package would not recognise.
    from specserve.worker import tensor_parallel

    tensor_parallel._mp_main(*pickle.loads(sys.stdin.buffer.read()))
