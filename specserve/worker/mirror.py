"""Mirrored model calls of tensor parallel (``worker/tensor_parallel.py`` starts the ranks).

Rank 0 broadcasts each call on a sharded model (key and arguments, pickled) before running it; the other
ranks wait in ``Mirror.follow`` and run the same call on their slices, so every collective inside meets its
peers. Messages go through a gloo group, or through shared memory (``ShmChannel``) between ranks on one host;
so do the model's collectives (``model/sharding.py``: ``Comm``, ``ShmComm``).
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from specserve.model.sharding import Comm, ShmComm

_STOP = "__stop__"
# Collectives of a step that wait longer than this fail (a rank that hangs); the message group waits for
# ever (the other ranks idle between requests).
TIMEOUT_ENV = "SPECSERVE_TP_TIMEOUT_S"


def op_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "300")))


class ShmChannel:
    """Rank 0's messages to the other ranks through a shared-memory file (ranks on one host): a frame is
    written, then its number published; each rank acknowledges a frame before the next may overwrite it.
    Waiting ranks spin briefly, then poll with short sleeps (they idle between requests)."""

    CAPACITY = 2 << 20  # bytes per frame; a larger message goes in several

    def __init__(self, path: str, rank: int, size: int, check: Callable[[], None] | None = None) -> None:
        self.rank, self.size, self.check = rank, size, check
        mm = np.memmap(path, dtype=np.uint8, mode="r+")
        self._mm = mm
        self.hdr = np.frombuffer(mm, dtype=np.int64, count=3 + size)  # seq, nbytes, more, ack[size]
        self.data = np.frombuffer(mm, dtype=np.uint8, offset=8 * (3 + size), count=self.CAPACITY)
        self.seq = 0

    @classmethod
    def nbytes(cls, size: int) -> int:
        return 8 * (3 + size) + cls.CAPACITY

    def send(self, payload: bytes) -> None:
        view = memoryview(payload)
        for a in range(0, max(len(view), 1), self.CAPACITY):
            chunk = view[a:a + self.CAPACITY]
            self.seq += 1
            acks = self.hdr[3 + 1:3 + self.size]
            spins = 0
            while (acks < self.seq - 1).any():
                spins += 1
                if spins % 4096 == 0 and self.check is not None:
                    self.check()
            self.data[:len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            self.hdr[1], self.hdr[2] = len(chunk), int(a + self.CAPACITY < len(view))
            self.hdr[0] = self.seq

    def recv(self) -> bytes:
        parts = []
        while True:
            self.seq += 1
            spins, start = 0, time.monotonic()
            while self.hdr[0] < self.seq:
                spins += 1
                if spins > 2000:  # idle between requests: poll, up to 5 ms apart after a second
                    time.sleep(min(5e-3, (time.monotonic() - start) / 200))
                    if spins % 256 == 0 and self.check is not None:
                        self.check()
            n, more = int(self.hdr[1]), int(self.hdr[2])
            parts.append(self.data[:n].tobytes())
            self.hdr[3 + self.rank] = self.seq
            if not more:
                return b"".join(parts)


class Mirror:
    """Mirrored model calls (module docstring). Without a group (``comm`` None) ``wrap`` returns the call."""

    def __init__(self, comm: Comm | None, msg_group: Any = None, device: torch.device | None = None) -> None:
        self.comm, self.msg_group, self.device = comm, msg_group, device
        # Tensor arguments (EAGLE features) travel through host memory: on a GPU they are moved out and back.
        self._moves = device is not None and device.type != "cpu"
        self.calls: dict[str, Callable[..., Any]] = {}

    @property
    def leader(self) -> bool:
        return self.comm is None or self.comm.rank == 0

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if self.comm is None:
            return fn
        if key in self.calls:
            raise ValueError(f"mirrored call {key!r} registered twice")
        self.calls[key] = fn
        if not self.leader:
            return fn

        def call(*args: Any) -> Any:
            self._send((key, _to_host(args) if self._moves else args))
            return fn(*args)
        return call

    def _send(self, msg: Any) -> None:
        _send(self.msg_group, msg)

    def _recv(self) -> Any:
        if isinstance(self.msg_group, ShmChannel):
            return pickle.loads(self.msg_group.recv())
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.msg_group)
        return box[0]

    def follow(self) -> None:
        """Ranks > 0: run the calls rank 0 makes until it stops the group."""
        while True:
            key, args = self._recv()
            if key == _STOP:
                return
            self.calls[key](*(_to_device(args, self.device) if self._moves else args))

    def stop(self) -> None:
        if self.comm is not None and self.leader:
            send_stop(self.msg_group)


def _send(msg_group: Any, msg: Any) -> None:
    if isinstance(msg_group, ShmChannel):
        msg_group.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        return
    dist.broadcast_object_list([msg], src=0, group=msg_group)


def send_stop(msg_group: Any) -> None:
    """Rank 0: end the other ranks' ``Mirror.follow`` (they then leave the process group and exit). Needs only
    the message group, so ``WorkerGroup.close`` can run from a finalizer that holds no model."""
    _send(msg_group, (_STOP, ()))


def _to_host(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(v) for v in x)
    return x


def _to_device(x: Any, device: torch.device | None) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


# -- transports ---------------------------------------------------------------------------------------------
SLOT_ELEMS = 1 << 18  # floats per rank and parity in the shared-memory collectives (1 MiB); larger go in pieces


def shm_files(size: int) -> tuple[str, str]:
    """Two fresh shared-memory files (collectives, messages), sized; in /dev/shm where it exists and has room
    (containers often give it 64 MiB; touching a page past a full tmpfs is SIGBUS), else the temp dir."""
    sizes = (("coll", ShmComm.nbytes(size, SLOT_ELEMS)), ("msg", ShmChannel.nbytes(size)))
    need = sum(n for _, n in sizes)
    base = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 4 * need \
        else tempfile.gettempdir()
    paths = []
    for kind, nbytes in sizes:
        fd, path = tempfile.mkstemp(prefix=f"specserve-tp-{kind}-", dir=base)
        os.ftruncate(fd, nbytes)
        os.close(fd)
        paths.append(path)
    return paths[0], paths[1]


def collectives(rank: int, size: int, dist_backend: str, files: tuple[str, str] | None,
                 check: Callable[[], None]) -> tuple[Comm, Any]:
    """(the model's collectives, the message group): shared memory when ``files`` (ranks on one host, CPU),
    else torch.distributed on ``dist_backend`` with a gloo group for the messages."""
    if files is not None:
        return (ShmComm(rank, size, files[0], SLOT_ELEMS, check, op_timeout().total_seconds()),
                ShmChannel(files[1], rank, size, check))
    return Comm(rank, size, dist_backend), dist.new_group(backend="gloo", timeout=datetime.timedelta(days=30))


