"""Tensor parallelism inside the model: which slice of every weight a rank holds, and the two collectives
its forward needs (Megatron-style).

A rank holds
- q heads ``[q0, q1)`` with the KV heads they read: with at least as many KV heads as ranks, whole GQA groups
  (KV heads split as evenly as they go, uneven counts allowed: SmolLM2's 3 KV heads over 2 ranks are 2 + 1);
  with fewer, each KV head is replicated on ``size / num_kv_heads`` ranks and its group's q heads are split
  among them;
- the fused qkv projection's rows of those heads (column parallel) and the o projection's columns (row
  parallel): one all-reduce after o;
- a slice of the MLP's intermediate dimension (gate/up rows, down columns; MoE experts each sliced the same
  way, the router replicated): one all-reduce after down. Slices are whole 32-column groups where the
  intermediate size allows, so quantized weights shard without requantization;
- ``ceil(vocab / size)`` rows of the embedding and of the LM head (the last rank's padded with zeros): an
  embedding lookup is masked to the rank's rows and all-reduced; logits are all-gathered and the padding cut.
Norms and rope are replicated. ``local_arch`` is the architecture of one rank's slice: the decoder is built
from it unchanged, and the KV cache a rank allocates holds only its KV heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from specserve.config import ModelArch, SpecserveError
from specserve.model.quant import GROUP, QuantizedTensor, TwoLevel


@dataclass(frozen=True)
class ShardSpec:
    """What rank ``rank`` of ``size`` holds of a model; ranges are [start, end)."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]  # dense MLP intermediate columns
    moe_ffn: tuple[int, int]  # each expert's intermediate columns
    vocab: tuple[int, int]  # padded vocabulary rows; the rows >= the real vocabulary are zeros
    vocab_size: int  # the real vocabulary


def _split(n: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) of part ``index`` when n is cut into ``parts`` nearly equal pieces of whole ``unit``s."""
    units = n // unit
    base, extra = divmod(units, parts)
    start = index * base + min(index, extra)
    end = start + base + (1 if index < extra else 0)
    return start * unit, (end * unit if index < parts - 1 else n)


def check_tensor_parallel(arch: ModelArch, size: int, name: str = "the model") -> None:
    """Raise a SpecserveError naming the limit when ``arch`` cannot be split over ``size`` ranks."""
    if size < 1:
        raise SpecserveError(f"--tensor-parallel-size must be >= 1, got {size}")
    if size == 1:
        return
    h, kv = arch.num_heads, arch.num_kv_heads
    if size > h:
        raise SpecserveError(f"--tensor-parallel-size {size} is larger than {name}'s {h} attention heads: "
                             f"every rank needs at least one head")
    if kv < size:
        if size % kv:
            raise SpecserveError(f"--tensor-parallel-size {size} must be a multiple of {name}'s {kv} KV heads "
                                 f"when it exceeds them (each KV head is replicated on size / {kv} ranks)")
        if h // kv < size // kv:
            raise SpecserveError(f"--tensor-parallel-size {size}: {name} has {h // kv} query heads per KV head, "
                                 f"fewer than the {size // kv} ranks that would share each KV head")
    if arch.qk_norm_full:
        raise SpecserveError(f"tensor parallelism does not support {name}'s q/k norms over the whole projection "
                             f"(OLMoE) yet: use --tensor-parallel-size 1")
    inter = arch.intermediate_size
    if inter < size or (arch.num_experts and arch.moe_intermediate_size < size):
        raise SpecserveError(f"--tensor-parallel-size {size} is larger than {name}'s MLP width")


def shard_spec(arch: ModelArch, rank: int, size: int) -> ShardSpec:
    h, kv = arch.num_heads, arch.num_kv_heads
    group = h // kv
    if kv >= size:
        k0, k1 = _split(kv, size, rank)
        q0, q1 = k0 * group, k1 * group
    else:
        per = size // kv  # ranks sharing one KV head
        k0 = rank // per
        k1 = k0 + 1
        g0, g1 = _split(group, per, rank % per)
        q0, q1 = k0 * group + g0, k0 * group + g1

    def ffn(n: int) -> tuple[int, int]:
        return _split(n, size, rank, GROUP if n % GROUP == 0 and n // GROUP >= size else 1)

    per_rank = -(-arch.vocab_size // size)
    return ShardSpec(rank, size, (q0, q1), (k0, k1), ffn(arch.intermediate_size),
                     ffn(arch.moe_intermediate_size) if arch.num_experts else (0, 0),
                     (rank * per_rank, (rank + 1) * per_rank), arch.vocab_size)


def local_arch(arch: ModelArch, spec: ShardSpec) -> ModelArch:
    """The architecture of one rank's slice (heads, MLP width and vocabulary rows it holds)."""
    return replace(arch, num_heads=spec.q_heads[1] - spec.q_heads[0],
                   num_kv_heads=spec.kv_heads[1] - spec.kv_heads[0],
                   intermediate_size=spec.ffn[1] - spec.ffn[0],
                   moe_intermediate_size=spec.moe_ffn[1] - spec.moe_ffn[0] if arch.num_experts else 0,
                   vocab_size=spec.vocab[1] - spec.vocab[0])


def shard_tensor(t: Any, role: str, spec: ShardSpec, head_dim: int) -> Any:
    """The rank's slice of an HF-named checkpoint tensor (float or QuantizedTensor) with role ``role``:
    q / kv / ffn_out / moe_out / vocab slice rows (output features), o / ffn_in / moe_in columns."""
    if role == "q":
        return _rows(t, spec.q_heads[0] * head_dim, spec.q_heads[1] * head_dim)
    if role == "kv":
        return _rows(t, spec.kv_heads[0] * head_dim, spec.kv_heads[1] * head_dim)
    if role == "o":
        return _cols(t, spec.q_heads[0] * head_dim, spec.q_heads[1] * head_dim)
    if role == "ffn_out":
        return _rows(t, *spec.ffn)
    if role == "ffn_in":
        return _cols(t, *spec.ffn)
    if role == "moe_out":
        return _rows(t, *spec.moe_ffn)
    if role == "moe_in":
        return _cols(t, *spec.moe_ffn)
    if role == "vocab":
        start, end = spec.vocab
        part = _rows(t, start, min(end, spec.vocab_size))
        missing = end - max(start, min(end, spec.vocab_size))
        return _pad_rows(part, missing) if missing else part
    raise ValueError(f"unknown tensor-parallel role {role!r}")


def _rows(t: Any, a: int, b: int) -> Any:
    return t.rows(torch.arange(a, b)) if isinstance(t, QuantizedTensor) else t[a:b].contiguous()


def _cols(t: Any, a: int, b: int) -> Any:
    if isinstance(t, QuantizedTensor):
        if a % GROUP or b % GROUP:
            return _cols(t.dequantize(), a, b)  # a slice inside a group: float (requantized by the packer)
        ga, gb = a // t.group, b // t.group

        def part(x: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
            return None if x is None else x[:, lo:hi].contiguous()

        lv = t.levels  # K-quants' two-level scales survive a slice of whole super-blocks (256 columns)
        levels = None if lv is None or a % 256 or b % 256 else TwoLevel(
            part(lv.sub, ga, gb), part(lv.sup, a // 256, b // 256), part(lv.min_sub, ga, gb),  # type: ignore[arg-type]
            part(lv.min_sup, a // 256, b // 256), lv.halves)
        return QuantizedTensor(t.bits, t.codes[:, a:b].contiguous(), part(t.scales, ga, gb),  # type: ignore[arg-type]
                               part(t.mins, ga, gb), levels)
    return t[:, a:b].contiguous()


def _pad_rows(t: Any, n: int) -> Any:
    if isinstance(t, QuantizedTensor):
        def z(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(n, *x.shape[1:])])
        lv = t.levels
        levels = None if lv is None else TwoLevel(z(lv.sub), z(lv.sup), None if lv.min_sub is None else z(lv.min_sub),
                                                 None if lv.min_sup is None else z(lv.min_sup), lv.halves)
        return QuantizedTensor(t.bits, z(t.codes), z(t.scales), None if t.mins is None else z(t.mins), levels)
    return torch.cat([t, t.new_zeros(n, *t.shape[1:])])


class Comm:
    """The collectives of one tensor-parallel group (torch.distributed's default group). Tensors a backend
    cannot reduce in their dtype (gloo and bf16 / fp16) are reduced in fp32."""

    def __init__(self, rank: int, size: int, backend: str) -> None:
        self.rank, self.size, self.backend = rank, size, backend

    def _wide(self, x: torch.Tensor) -> bool:
        return self.backend == "gloo" and x.dtype in (torch.bfloat16, torch.float16)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self._wide(x):
            y = x.float()
            dist.all_reduce(y)
            return y.to(x.dtype)
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (all the same shape)."""
        src = x.float() if self._wide(x) else x.contiguous()
        parts = [torch.empty_like(src) for _ in range(self.size)]
        dist.all_gather(parts, src)
        return torch.cat(parts, dim=-1).to(x.dtype)


@dataclass(frozen=True)
class TensorParallel:
    """A model's place in a tensor-parallel group: its slice and its collectives."""

    spec: ShardSpec
    comm: Comm

    @staticmethod
    def create(arch: ModelArch, comm: Comm) -> TensorParallel:
        check_tensor_parallel(arch, comm.size)
        return TensorParallel(shard_spec(arch, comm.rank, comm.size), comm)


class ShmComm(Comm):
    """The collectives of ranks on one x86 host through a shared-memory file, without sockets.

    Measured on a 2-core AVX2 EPYC (torch 2.13): gloo's all-reduce of 576 floats between two local processes
    takes ~1.3 ms (its TCP pairs and I/O threads), which made the demo model's 61 collectives a token cost
    more than the forward itself. Here a collective is: copy this rank's tensor into its slot, publish the op's
    number, spin until every rank has published, read all slots and sum them in rank order (so every rank
    gets the same bits), publish that it is done reading. A slot is reused two ops later, once every rank
    is done with it. x86 keeps stores in order (TSO), so a published number implies its slot's data.

    Layout: ``posted[size]``, ``done[size]`` (int64 op numbers), then two parities x ``size`` slots of
    ``slot_elems`` float32. Tensors larger than a slot go in pieces. ``check`` is called while spinning (a lost
    peer raises there); a collective that waits longer than ``timeout`` raises too.
    """

    def __init__(self, rank: int, size: int, path: str, slot_elems: int, check: Any = None,
                 timeout: float = 300.0) -> None:
        super().__init__(rank, size, "shm")
        self.path, self.slot_elems, self.check, self.timeout = path, slot_elems, check, timeout
        mm = np.memmap(path, dtype=np.uint8, mode="r+")
        self._mm = mm
        flags = np.frombuffer(mm, dtype=np.int64, count=2 * size)
        self.posted, self.done = flags[:size], flags[size:]
        data = np.frombuffer(mm, dtype=np.float32, offset=16 * size, count=2 * size * slot_elems)
        self.slots = torch.from_numpy(data).view(2, size, slot_elems)
        self.op = 0

    @staticmethod
    def nbytes(size: int, slot_elems: int) -> int:
        return 16 * size + 4 * 2 * size * slot_elems

    def _wait(self, flags: Any, at_least: int) -> None:
        if (flags >= at_least).all():
            return
        start = time.monotonic()
        spins = 0
        while not (flags >= at_least).all():
            spins += 1
            if spins % 4096 == 0:
                if self.check is not None:
                    self.check()
                if time.monotonic() - start > self.timeout:
                    raise RuntimeError(f"tensor parallel: a rank did not reach collective {at_least} within "
                                       f"{self.timeout:.0f} s")

    def _exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """[n] float32 of this rank -> [size, n]: every rank's (views of shared memory, valid until this
        rank's collective after next)."""
        self.op += 1
        s = self.op
        self._wait(self.done, s - 1)  # every rank has finished reading the slots of op s - 2
        slot = self.slots[s % 2]
        slot[self.rank, :flat.numel()].copy_(flat)
        self.posted[self.rank] = s
        self._wait(self.posted, s)
        return slot[:, :flat.numel()]

    def _finish(self) -> None:
        self.done[self.rank] = self.op

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        out = torch.empty(flat.shape, dtype=torch.float32)
        for a in range(0, flat.numel(), self.slot_elems):
            b = min(a + self.slot_elems, flat.numel())
            parts = self._exchange(flat[a:b].float())
            acc = parts[0].clone()
            for j in range(1, self.size):
                acc += parts[j]
            out[a:b] = acc
            self._finish()
        x.copy_(out.view(x.shape))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1).float()
        if flat.numel() > self.slot_elems:  # large: through the all-reduce of zero-padded pieces
            full = torch.zeros(self.size, flat.numel())
            full[self.rank] = flat
            self.all_reduce(full)
            parts = list(full.view(self.size, *x.shape))
        else:
            got = self._exchange(flat)
            parts = [p.view(x.shape).clone() for p in got]
            self._finish()
        return torch.cat(parts, dim=-1).to(x.dtype)
