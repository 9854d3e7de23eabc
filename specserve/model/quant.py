"""Weight-only quantized linears: the format every checkpoint is brought to, and the packed weights the
layers call through the one ``Linear`` seam (``linear(x, weight, bias)``).

One format, llama.cpp's: groups of ``GROUP`` = 32 along the input dimension, each with its own scale (and,
for 4 bits, its own min), ``w = scale * code + min``.
- 4 bits: codes 0..15, scale + min per group: GGUF Q4_1 exactly; Q4_0 (``d * (q - 8)``) is scale d and
  min -8d, also exact.
- 8 bits: codes -128..127, scale per group: GGUF Q8_0 exactly.
So a quantized GGUF keeps the file's own numbers; float checkpoints are requantized (``quantize``).

The packed weights are ``nn.Module``s with ``forward(x) -> x @ w.T``; which kernels run them is answered by
``platform.Platform.quant_kernels``: ``cpu`` (the x86 kernels of ``kernels/cpu_kernels.cpp``, built on first use),
``triton`` (``kernels/triton_quant.py``, GPUs of either vendor), or ``None`` (no kernel here: weights dequantized).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import CheckpointError
from specserve.model.kernels.cpu import load_cpu_kernels

log = logging.getLogger("specserve")

GROUP = 32
TILE = 16  # output columns per tile in the CPU kernels' tiled layout
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class TwoLevel:
    """The scales of llama.cpp's K-quants as the file keeps them: each is ``sub * sup``, ``sub`` an integer per
    group (6 bits in Q4_K, int8 per half group of 16 in Q6_K: ``halves`` 2) and ``sup`` an fp16 per super-block
    of 256 weights (8 groups). The CPU kernels read them in this form (a tenth of the bytes of fp32 scales); the
    product of an 8-bit integer and an fp16 is exact in fp32, so ``QuantizedTensor.scales`` / ``mins`` hold
    exactly the same numbers."""

    sub: torch.Tensor  # [N, G * halves] int8
    sup: torch.Tensor  # [N, G // 8] float32 (fp16 values)
    min_sub: torch.Tensor | None  # [N, G] int8 (mins = min_sub * min_sup), or None
    min_sup: torch.Tensor | None  # [N, G // 8] float32 (fp16 values)
    halves: int = 1

    def rows(self, index: torch.Tensor) -> TwoLevel:
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index).contiguous()

        return TwoLevel(pick(self.sub), pick(self.sup), pick(self.min_sub), pick(self.min_sup),  # type: ignore[arg-type]
                        self.halves)


@dataclass(frozen=True)
class QuantizedTensor:
    """A [N, K] weight in groups along K (``GROUP`` = 32, or 16 for Q6_K's scales):
    ``w[n, k] = scales[n, k // group] * codes[n, k] (+ mins)``; ``levels``: the same scales in K-quants'
    two-level form (kept for the kernels), or None."""

    bits: int  # 4 (codes uint8 0..15, with mins) or 8 (codes int8, mins None)
    codes: torch.Tensor  # [N, K] uint8 (4 bits) or int8 (8 bits)
    scales: torch.Tensor  # [N, K // group] float32
    mins: torch.Tensor | None  # [N, K // group] float32, or None
    levels: TwoLevel | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def format(self) -> tuple[int, int, bool]:
        """What must agree for two tensors to share one packed weight: bits, group size, two-level scales."""
        return self.bits, self.group, self.levels is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.group
        w = self.codes.float().view(n, k // g, g) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows ``index`` (GGUF's q/k un-permutation reorders output rows)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, index).contiguous()

        mins = None if self.mins is None else pick(self.mins)
        levels = None if self.levels is None else self.levels.rows(index)
        return QuantizedTensor(self.bits, pick(self.codes), pick(self.scales), mins, levels)


@dataclass(frozen=True)
class QuantizedParts:
    """Row blocks of different formats stacked along the output dimension (a fused q/k/v whose v is Q6_K and
    q, k Q4_K, as llama.cpp's Q4_K_M files have them): each part is packed as it is, and their outputs are
    concatenated, so no part is requantized."""

    parts: tuple[QuantizedTensor, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor | QuantizedParts:
    """Concatenate along the output dimension (fused q/k/v, gate/up). Neighbours of one format become one
    tensor; runs of different formats stay apart (``QuantizedParts``: Q4_K q + k, then a Q6_K v)."""
    runs: list[list[QuantizedTensor]] = []
    for p in parts:
        if runs and runs[-1][0].format == p.format:
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(runs) > 1:
        return QuantizedParts(tuple(_cat_same(r) for r in runs))
    return _cat_same(parts)


def _cat_same(parts: list[QuantizedTensor]) -> QuantizedTensor:
    if len(parts) == 1:
        return parts[0]
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
    levels = None
    if parts[0].levels is not None:
        lv = [p.levels for p in parts]

        def cat(name: str) -> torch.Tensor | None:
            ts = [getattr(v, name) for v in lv]
            return None if ts[0] is None else torch.cat(ts)

        levels = TwoLevel(cat("sub"), cat("sup"), cat("min_sub"), cat("min_sup"), lv[0].halves)  # type: ignore
    return QuantizedTensor(parts[0].bits, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           mins, levels)


def quantize(w: torch.Tensor, bits: int, name: str = "weight") -> QuantizedTensor:
    """Requantize a float [N, K] weight: 4 bits asymmetric (min/max per group, as Q4_1), 8 bits symmetric
    (absmax per group, as Q8_0). Scales and mins are fp16 values (as GGUF stores them, so the CPU kernels
    keep them in fp16); codes round to nearest against them."""
    n, k = w.shape
    if k % GROUP:
        raise CheckpointError(f"cannot quantize {name} to int{bits}: its input size {k} is not a multiple of "
                              f"the group size {GROUP} (use --quantization none)")
    g = w.detach().float().reshape(n, k // GROUP, GROUP)
    if bits == 8:
        scales = _fp16_values(g.abs().amax(-1) / 127.0)
        inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        codes = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedTensor(8, codes.view(n, k), scales.contiguous(), None)
    lo = _fp16_values(g.amin(-1))
    scales = _fp16_values((g.amax(-1) - lo) / 15.0)
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    codes = torch.round((g - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedTensor(4, codes.view(n, k), scales.contiguous(), lo.contiguous())


def _fp16_values(t: torch.Tensor) -> torch.Tensor:
    """fp32 holding the nearest fp16 values (clamped to fp16's finite range)."""
    return t.clamp(-65504.0, 65504.0).half().float()


# -- packed weights: what the layers hold and call -------------------------------------------------------------
class PackedWeight(nn.Module):
    """A weight the layers call as ``w(x) -> x @ w.T`` ([..., K] -> [..., N]); ``dequantize`` gives it back
    as a float tensor (the EAGLE head's reduced LM head, distill's training loss)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.out_features, self.in_features = shape

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.matmul(x)
        return self.matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)


class DenseWeight(PackedWeight):
    """A float weight behind the packed interface (a tensor no kernel here takes, or quantization off for it)."""

    def __init__(self, weight: torch.Tensor, linear=F.linear) -> None:  # noqa: ANN001 - the Linear seam
        super().__init__(tuple(weight.shape))  # type: ignore[arg-type]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.linear = linear

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight)


class _Quantized(PackedWeight):
    """Shared state of the kernel-backed weights: scales/mins as buffers, the dequantized reference."""

    scales: torch.Tensor  # [N, K // GROUP] float32 (fp16 in CpuQuantWeight where exact)
    mins: torch.Tensor | None
    packed: torch.Tensor  # the codes in the layout the kernel reads
    code_bits = 8  # bits a code takes in memory: 4, 8, or 5 / 6 for 8-bit codes that fit (CpuQuantWeight)

    def __init__(self, qt: QuantizedTensor, device: torch.device) -> None:
        super().__init__(tuple(qt.shape))  # type: ignore[arg-type]
        self.bits = qt.bits
        self.register_buffer("scales", qt.scales.float().contiguous().to(device))
        self.register_buffer("mins", None if qt.mins is None else qt.mins.float().contiguous().to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.unpacked().dequantize(dtype)

    def unpacked(self) -> QuantizedTensor:
        raise NotImplementedError


class CpuQuantWeight(_Quantized):
    """The C++ CPU kernels (``kernels/cpu_kernels.cpp``), in one of two layouts (``tiled``, by default where
    ``platform.cpu_has_vnni`` says the CPU has AVX-512 VNNI and the output width is a multiple of 16):

    - rows (AVX2): 4-bit codes packed as GGUF's Q4 blocks, 8-bit codes as is (5 or 6 bits where they fit, as
      Q5_0's and Q6_K's do: ``_pack_narrow``); activations on a 16-bit grid;
    - tiled (AVX-512 VNNI): tiles of 16 output columns, 4 codes per column per 32-bit lane (vpdpbusd's
      operand shape); activations on the same 16-bit grid, split into two bytes per code.

    ``act_bits`` 8 (``--activation-bits 8``, ``set_activation_bits``) rounds activations to an 8-bit grid
    instead, in either layout: half the integer work per row in the tiled one.

    Scales and mins are kept in fp16 when they are fp16 values (GGUF's blocks and ``quantize``'s output
    are): a decode step streams them with the codes, and fp16 makes that a quarter of the bytes instead of
    two fifths."""

    def __init__(self, qt: QuantizedTensor, device: torch.device, tiled: bool | None = None,
                 narrow: bool = True) -> None:
        super().__init__(qt, device)
        n, k = qt.shape
        if tiled is None:
            from specserve.platform import cpu_has_vnni

            tiled = cpu_has_vnni()
        self.tiled = tiled and n % TILE == 0
        g = k // GROUP
        # 8-bit codes that all fit 5 or 6 bits (Q5_0's, Q6_K's) are kept in those bits (``narrow``): fewer bytes
        # to stream, the same products
        self.code_bits = narrow_bits(qt.codes) if narrow and qt.bits == 8 else qt.bits
        if self.code_bits in (5, 6):
            packed = _pack_narrow(qt.codes, self.tiled, self.code_bits)
            if self.tiled:
                self.scales = _tiles(self.scales)
        elif self.tiled:  # [n / 16, g, chunks, 16 columns, 4 codes]
            # moved 4 codes at a time (an int32 each: the 4 codes of a column in a chunk stay together)
            words = qt.codes.contiguous().view(torch.int32).view(n // TILE, TILE, g, 8)
            if qt.bits == 4:  # low nibble: k = 4 j + b of the group, high nibble: 16 + 4 j + b
                c = words.view(n // TILE, TILE, g, 2, 4).permute(0, 2, 3, 4, 1).contiguous()
                packed = (c[:, :, 0] | (c[:, :, 1] << 4)).view(torch.uint8).reshape(n // TILE, g, 256)
            else:  # + 128 (the kernel's unsigned operand): the sign bit of every byte flipped
                c = words.permute(0, 2, 3, 1).contiguous() ^ torch.tensor(-0x7F7F7F80, dtype=torch.int32)
                packed = c.view(torch.uint8).reshape(n // TILE, g, 512)
            self.scales = _tiles(self.scales)
            if self.mins is not None:
                self.mins = _tiles(self.mins)
        elif qt.bits == 4:  # byte i of a group: code i (low nibble), code i + 16 (high nibble)
            c = qt.codes.view(n, g, 2, GROUP // 2)
            packed = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)
        else:
            packed = qt.codes
        self.register_buffer("packed", packed.contiguous().to(device))
        self.halves = GROUP // qt.group  # 2: scales per half group (Q6_K)
        if self.halves not in (1, 2) or (self.halves == 2 and qt.bits != 8):
            raise ValueError(f"no CPU kernel for {qt.bits}-bit weights in groups of {qt.group}")
        if qt.levels is not None:  # K-quants: the kernels read the file's two-level scales (uint8 blobs)
            lv = qt.levels
            self.halves = lv.halves
            self.scales = _blob(lv.sub, lv.sup, lv.halves, self.tiled).to(device)
            if lv.min_sub is not None:
                self.mins = _blob(lv.min_sub, lv.min_sup, 1, self.tiled).to(device)  # type: ignore[arg-type]
            return
        parts = [self.scales] + ([] if self.mins is None else [self.mins])
        if all(torch.equal(t.half().float(), t) for t in parts):
            self.scales = self.scales.half()
            if self.mins is not None:
                self.mins = self.mins.half()

    def unpacked(self) -> QuantizedTensor:
        return self.take_rows(torch.arange(self.out_features, device=self.packed.device))

    def take_rows(self, ids: torch.Tensor) -> QuantizedTensor:
        """Rows ``ids`` (output features) in the plain form, read from either layout: a tied embedding's lookup
        reads the LM head's own bytes (``TiedEmbedding``)."""
        n, k = self.shape
        g, t = k // GROUP, len(ids)
        tile, col, ar = ids // TILE, ids % TILE, torch.arange(t)
        if self.code_bits in (5, 6):
            codes = _unpack_narrow(self.packed, ids, k, self.tiled, self.code_bits)
        elif self.tiled:
            if self.bits == 8:  # [t, g, 8 chunks, 4 codes] of each row's column
                c = self.packed.view(n // TILE, g, 8, TILE, 4)[tile, :, :, col, :].reshape(t, k)
                codes = (c.to(torch.int16) - 128).to(torch.int8)
            else:  # low nibbles: codes 4 j + b, high nibbles: 16 + 4 j + b
                b = self.packed.view(n // TILE, g, 4, TILE, 4)[tile, :, :, col, :].reshape(t, g, 16)
                codes = torch.cat([b & 0xF, b >> 4], dim=-1).reshape(t, k)
        else:
            c = self.packed.index_select(0, ids)
            codes = c if self.bits == 8 else torch.stack([c.view(t, g, GROUP // 2) & 0xF, c.view(t, g, GROUP // 2) >> 4],
                                                         dim=2).reshape(t, k)

        def values(v: torch.Tensor, halves: int) -> torch.Tensor:  # [t, g * halves] fp32
            if not self.tiled:
                rows = v.index_select(0, ids)
                return _unblob(rows, t, g, halves, False) if v.dtype == torch.uint8 else rows.float()
            if v.dtype != torch.uint8:  # [n / 16, g * halves, 16]
                return v[tile, :, col].float()
            sb = g // 8
            blob = v[tile]  # [t, g / 8, 128 halves + 32]
            sub = blob[..., :128 * halves].reshape(t, sb, 8 * halves, TILE)[ar, :, :, col]  # [t, g / 8, 8 halves]
            sup = blob[..., 128 * halves:].reshape(t, sb, TILE, 2)[ar, :, col, :]  # [t, g / 8, 2] bytes
            return _unblob(torch.cat([sub, sup], dim=-1), t, g, halves, False)

        mins = None if self.mins is None else values(self.mins, 1)
        return QuantizedTensor(self.bits, codes, values(self.scales, self.halves), mins)

    act_bits = 16  # the activations' grid (8 or 16 bits per group of 32); set_activation_bits sets it

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 4:
            return torch.ops.specserve_cpu.q4_mm(x, self.packed, self.scales, self.mins, self.act_bits)
        return torch.ops.specserve_cpu.q8_mm(x, self.packed, self.scales, self.act_bits)


def set_activation_bits(model: nn.Module, bits: int) -> int:
    """Round the activations of every CPU-kernel matmul in ``model`` to a ``bits`` grid (8 or 16) from now
    on; returns how many weights took it. The fused layers' cached arguments are dropped so they pick it up."""
    if bits not in (8, 16):
        raise ValueError(f"activation bits must be 8 or 16, got {bits!r}")
    n = 0
    for m in model.modules():
        if isinstance(m, CpuQuantWeight):
            m.act_bits = bits
            n += 1
        m.__dict__.pop("_fused_args", None)
        m.__dict__.pop("_stack_args", None)
    return n


def narrow_bits(codes: torch.Tensor) -> int:
    """The fewest bits (5, 6, else 8) that hold every one of these int8 codes."""
    if codes.numel() == 0:
        return 8
    lo, hi = int(codes.min()), int(codes.max())
    return next(b for b in (5, 6, 8) if -(1 << (b - 1)) <= lo and hi < 1 << (b - 1))


def _pack_narrow(codes: torch.Tensor, tiled: bool, bits: int) -> torch.Tensor:
    """int8 codes that fit ``bits`` (5 or 6) stored + 2^(bits - 1) as the CPU kernels read them
    (kernels/cpu_kernels.cpp, "narrow"): the low 4 bits as 4-bit codes have them, then the high bits.
    - rows [n, k / 32 * 4 bits]: every group's 16 bytes of nibbles, then every group's high bits (6 bits:
      8 bytes, bits 2 s, 2 s + 1 of byte j are code j + 8 s's; 5 bits: 4 bytes, bit c % 8 of byte c / 8 is
      code c's);
    - tiled [n / 16, k / 32, 64 bits]: the 8-bit tiles' chunks j and j + 4 as one chunk of nibbles (j = 0..3),
      then the high bits (6 bits: two chunks, chunk h's bits 2 s, 2 s + 1 are chunk 4 h + s's; 5 bits: one
      chunk, bit s is chunk s's)."""
    n, k = codes.shape
    g = k // GROUP
    u = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    if tiled:
        words = u.contiguous().view(torch.int32).view(n // TILE, TILE, g, 8)
        b = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(n // TILE, g, 8, 64)
        nib = (b[:, :, :4] & 0xF) | ((b[:, :, 4:] & 0xF) << 4)  # [n / 16, g, 4, 64]
        hb = b >> 4
        per = 8 // (bits - 4)  # chunks per high chunk
        high = [sum((hb[:, :, c0 + s] << ((bits - 4) * s) for s in range(per)), torch.zeros_like(hb[:, :, 0]))
                for c0 in range(0, 8, per)]
        return torch.cat([nib.reshape(n // TILE, g, 256), *high], dim=-1).contiguous()
    v = u.view(n, g, GROUP)
    nib = (v[..., :16] & 0xF) | ((v[..., 16:] & 0xF) << 4)  # [n, g, 16]
    hv = (v >> 4).view(n, g, 4, 8)  # the high bits of codes 8 a + b at [a, b]
    if bits == 6:  # byte b: codes b, b + 8, b + 16, b + 24
        hi = hv[:, :, 0] | (hv[:, :, 1] << 2) | (hv[:, :, 2] << 4) | (hv[:, :, 3] << 6)  # [n, g, 8]
    else:  # byte a: codes 8 a .. 8 a + 7
        hi = sum((hv[..., b] << b for b in range(8)), torch.zeros_like(hv[..., 0]))  # [n, g, 4]
    return torch.cat([nib.reshape(n, g * 16), hi.reshape(n, -1)], dim=1).contiguous()


def _unpack_narrow(packed: torch.Tensor, ids: torch.Tensor, k: int, tiled: bool, bits: int) -> torch.Tensor:
    """Rows ``ids`` of ``_pack_narrow``'s codes, int8 [len(ids), k]."""
    g, t = k // GROUP, len(ids)
    w = bits - 4  # high bits a code
    if tiled:
        tile, col = ids // TILE, ids % TILE
        b = packed[tile]  # [t, g, 64 bits]
        ar = torch.arange(t)
        nib = b[..., :256].reshape(t, g, 4, TILE, 4)[ar, :, :, col]  # [t, g, 4 chunks, 4 codes]
        hi = b[..., 256:].reshape(t, g, w, TILE, 4)[ar, :, :, col]  # [t, g, high chunks, 4]
        low = torch.cat([nib & 0xF, nib >> 4], dim=2)  # [t, g, 8 chunks, 4]
        per = 8 // w
        high = torch.stack([(hi >> (w * s)) & ((1 << w) - 1) for s in range(per)], dim=3).reshape(t, g, 8, 4)
    else:
        c = packed.index_select(0, ids)
        nib, hi = c[:, :g * 16].reshape(t, g, 16), c[:, g * 16:].reshape(t, g, 4 * w)
        low = torch.cat([nib & 0xF, nib >> 4], dim=-1)  # [t, g, 32]
        if bits == 6:
            high = torch.stack([(hi >> (2 * s)) & 3 for s in range(4)], dim=2).reshape(t, g, GROUP)
        else:
            high = torch.stack([(hi >> s) & 1 for s in range(8)], dim=-1).reshape(t, g, GROUP)
    return ((low | (high << 4)).to(torch.int16) - (1 << (bits - 1))).to(torch.int8).reshape(t, k)


def _blob(sub: torch.Tensor, sup: torch.Tensor, halves: int, tiled: bool) -> torch.Tensor:
    """Two-level scales as the CPU kernels read them (``Blob`` / ``Blob16`` in kernels/cpu_kernels.cpp), uint8:
    rows [n, g / 8, 8 halves + 2] (a super-block's int8 subs, then its fp16 sup); tiled [n / 16, g / 8,
    128 halves + 32] (subs [8 groups, halves, 16 columns], then the 16 columns' fp16 sups)."""
    n, sb = sup.shape
    sub8 = sub.to(torch.int8).view(torch.uint8)
    sup8 = sup.half().view(torch.uint8).view(n, sb, 2)
    if not tiled:
        return torch.cat([sub8.view(n, sb, 8 * halves), sup8], dim=-1).contiguous()
    s = sub8.view(n // TILE, TILE, sb, 8 * halves).permute(0, 2, 3, 1).reshape(n // TILE, sb, 128 * halves)
    u = sup8.view(n // TILE, TILE, sb, 2).permute(0, 2, 1, 3).reshape(n // TILE, sb, 2 * TILE)
    return torch.cat([s, u], dim=-1).contiguous()


def _unblob(blob: torch.Tensor, n: int, g: int, halves: int, tiled: bool) -> torch.Tensor:
    """``_blob``'s inverse, as products: [n, g * halves] fp32."""
    sb = g // 8
    if tiled:
        sub = blob[..., :128 * halves].reshape(n // TILE, sb, 8 * halves, TILE).permute(0, 3, 1, 2)
        sup = blob[..., 128 * halves:].reshape(n // TILE, sb, TILE, 2).permute(0, 2, 1, 3)
    else:
        sub, sup = blob[..., :8 * halves], blob[..., 8 * halves:]
    sub = sub.contiguous().view(torch.int8).reshape(n, sb, 8 * halves).float()
    sup = sup.contiguous().view(torch.float16).reshape(n, sb, 1).float()
    return (sub * sup).reshape(n, g * halves)


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[n, g] per-group values -> [n / 16, g, 16]: the tiled layout's scale and min vectors."""
    n, g = t.shape
    return t.view(n // TILE, TILE, g).permute(0, 2, 1).contiguous()


class TritonQuantWeight(_Quantized):
    """GPU Triton kernels of ``kernels/triton_quant.py`` (either vendor): 4-bit codes, two per byte along K."""

    def __init__(self, qt: QuantizedTensor, device: torch.device) -> None:
        if qt.bits != 4:
            raise ValueError("the Triton kernels take 4-bit group weights only")
        super().__init__(qt, device)
        n, k = qt.shape
        c = qt.codes.view(n, k // 2, 2)
        self.register_buffer("packed", (c[..., 0] | (c[..., 1] << 4)).contiguous().to(device))

    def unpacked(self) -> QuantizedTensor:
        n, k = self.shape
        codes = torch.stack([self.packed & 0xF, self.packed >> 4], dim=-1).reshape(n, k)
        return QuantizedTensor(4, codes, self.scales, self.mins)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from specserve.model.kernels.triton_quant import int4_matmul

        assert self.mins is not None  # 4-bit weights always carry mins
        return int4_matmul(x.contiguous(), self.packed, self.scales, self.mins, GROUP)


class TritonQuant8Weight(_Quantized):
    """GPU Triton kernel of ``kernels/triton_quant.py`` for 8-bit codes (Q8_0, Q5_0, Q6_K) as is, int8 [N, K], with a
    scale per group of 32 or 16 (``int8_group_matmul``: any group that is a multiple of 16)."""

    def __init__(self, qt: QuantizedTensor, device: torch.device) -> None:
        if qt.bits != 8 or qt.group % 16:
            raise ValueError(f"TritonQuant8Weight takes 8-bit weights in groups of a multiple of 16, got "
                             f"{qt.bits} bits in groups of {qt.group}")
        super().__init__(qt, device)
        self.group = qt.group
        self.register_buffer("packed", qt.codes.contiguous().to(device))

    def unpacked(self) -> QuantizedTensor:
        return QuantizedTensor(8, self.packed, self.scales, None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from specserve.model.kernels.triton_quant import int8_group_matmul

        return int8_group_matmul(x.contiguous(), self.packed, self.scales, self.group)


class QuantEmbedding(nn.Module):
    """An embedding table kept in its GGUF blocks (a 1.5B model's fp32 table is 0.9 GB, its Q4_K blocks 0.13):
    ``lookup`` dequantizes only the rows it returns, to the values ``QuantizedTensor.dequantize`` gives (the
    gguf package's)."""

    codes: torch.Tensor  # [V, dim] int8, or [V, dim / 2] uint8 (two 4-bit codes a byte)
    scales: torch.Tensor  # [V, groups]: values, or with ``halves`` the int8 subs of the two-level form
    mins: torch.Tensor | None

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.bits, self.group, self.dtype = qt.bits, qt.group, dtype
        self.num_embeddings, self.embedding_dim = qt.shape
        codes = qt.codes if qt.bits == 8 else qt.codes[:, 0::2] | (qt.codes[:, 1::2] << 4)
        self.register_buffer("codes", codes.contiguous().to(device))
        lv = qt.levels
        self.halves = 0 if lv is None else lv.halves
        if lv is not None:  # the file's two-level scales: int8 subs, fp16 sups
            self.register_buffer("scales", lv.sub.to(device))
            self.register_buffer("sups", lv.sup.half().to(device))
            self.register_buffer("mins", None if lv.min_sub is None else lv.min_sub.to(device))
            self.register_buffer("min_sups", None if lv.min_sup is None else lv.min_sup.half().to(device))
        else:
            def compact(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else (t.half() if torch.equal(t.half().float(), t) else t).to(device)

            self.register_buffer("scales", compact(qt.scales))
            self.register_buffer("mins", compact(qt.mins))

    def _values(self, t: torch.Tensor | None, sups: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor | None:
        if t is None:
            return None
        rows = t.index_select(0, ids).float()  # [T, groups]
        if sups is None:
            return rows
        per = rows.shape[1] // sups.shape[1]
        return (rows.view(len(ids), -1, per) * sups.index_select(0, ids).float()[..., None]).view(len(ids), -1)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, dim] in the model's dtype."""
        c = self.codes.index_select(0, ids)
        codes = c if self.bits == 8 else torch.stack([c & 0xF, c >> 4], dim=-1).view(len(ids), -1)
        scales = self._values(self.scales, getattr(self, "sups", None), ids)
        mins = self._values(self.mins, getattr(self, "min_sups", None), ids)
        qt = QuantizedTensor(self.bits, codes, scales, mins)  # type: ignore[arg-type]
        return qt.dequantize(self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.lookup(torch.arange(self.num_embeddings, device=self.codes.device)).to(dtype)


class TiedEmbedding(nn.Module):
    """A tied embedding table read from the packed LM head it equals (a CPU kernel weight): no second copy of
    the vocabulary (Gemma 3's 262k x 640 table is 170 MiB in Q8_0). Rows dequantize to the same values a
    ``QuantEmbedding`` of the file's tensor gives."""

    def __init__(self, head: CpuQuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # not a submodule: the LM head owns (and counts) the bytes
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.shape

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, dim] in the model's dtype."""
        return self._head[0].take_rows(ids).dequantize(self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._head[0].dequantize(dtype)


def embedding(ids: torch.Tensor, table: torch.Tensor | QuantEmbedding | TiedEmbedding) -> torch.Tensor:
    """Rows ``ids`` of a float table (``F.embedding``) or of one kept in its blocks."""
    return F.embedding(ids, table) if isinstance(table, torch.Tensor) else table.lookup(ids)


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``Linear`` seam of a quantized model: every matmul weight it holds is a ``PackedWeight``."""
    y = weight(x)
    return y if bias is None else y + bias


def pack(w: torch.Tensor | QuantizedTensor | QuantizedParts, kernels: str | None, device: torch.device, dtype: torch.dtype,
         linear=F.linear) -> PackedWeight:  # noqa: ANN001 - the Linear seam
    """A weight in the form ``kernels`` runs; float tensors and weights no kernel takes stay dense."""
    if isinstance(w, QuantizedParts):
        if kernels == "cpu":
            return ConcatWeight([pack(p, kernels, device, dtype, linear) for p in w.parts])
        w = w.dequantize()
    if isinstance(w, QuantizedTensor):
        if kernels == "cpu":
            return CpuQuantWeight(w, device)
        if kernels == "triton" and w.bits == 4 and w.group == GROUP:
            return TritonQuantWeight(w, device)
        if kernels == "triton" and w.bits == 8 and w.group % 16 == 0:
            return TritonQuant8Weight(w, device)
        w = w.dequantize()
    return DenseWeight(w.to(device=device, dtype=dtype), linear)


class ConcatWeight(PackedWeight):
    """Parts of different formats stacked along the output dimension (``QuantizedParts``): each runs its own
    kernel and the outputs are concatenated."""

    def __init__(self, parts: list[PackedWeight]) -> None:
        super().__init__((sum(p.out_features for p in parts), parts[0].in_features))
        self.parts = nn.ModuleList(parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])  # type: ignore[operator]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)  # type: ignore[operator]


def quantizes(mode: str, state_dict: dict) -> bool:
    """Whether ``--quantization mode`` keeps (or makes) this checkpoint's matmul weights quantized."""
    if mode == "none":
        return False
    return mode != "auto" or any(isinstance(t, QuantizedTensor) for t in state_dict.values())


def make_packer(mode: str, kernels: str | None, state_dict: dict, device: torch.device, dtype: torch.dtype,
                linear=F.linear, quantize_head: bool = False):  # noqa: ANN001, ANN201 - returns decoder.Packer | None
    """What ``--quantization`` makes of a checkpoint's matmul weights, or None for a plain float model.

    - none: float (quantized GGUF tensors were dequantized by the loader);
    - auto: quantized GGUF tensors stay as the file has them, float tensors stay float; a checkpoint with no
      quantized tensor is a plain float model;
    - int4 / int8: every layer weight at that width (GGUF blocks of that width kept, others requantized);
      the LM head stays as the file has it when quantized, else 8 bits (as llama.cpp's Q4 files keep it);
      with ``quantize_head`` (a draft model, whose LM head is a large share of its step) it is at that width too.
    Without a kernel for this platform (``kernels`` None) weights are dequantized, with one warning.
    """
    if not quantizes(mode, state_dict):
        return None
    if kernels is None:
        log.warning("quantization %s: no weight-only kernel on this platform; weights are dequantized", mode)
        return None
    if kernels == "cpu" and not load_cpu_kernels():
        return None
    bits = {"int4": 4, "int8": 8}.get(mode)

    def packer(w: torch.Tensor | QuantizedTensor | QuantizedParts, name: str) -> PackedWeight:
        if bits is not None:
            head = name in ("lm_head.weight", "model.embed_tokens.weight") and not quantize_head
            if not (isinstance(w, QuantizedTensor) and (head or w.bits == bits)):
                w = quantize(w if isinstance(w, torch.Tensor) else w.dequantize(), 8 if head else bits, name)
        return pack(w, kernels, device, dtype, linear)

    return packer


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: parameters and the buffers packed weights keep (codes, scales, mins)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + [b for m in model.modules() if isinstance(m, (PackedWeight, QuantEmbedding))
                                         for b in m.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def describe_weights(model: nn.Module) -> str:
    """One start-up line: how many matmul weights of each kind, and their bytes."""
    kinds: dict[str, list[int]] = {}
    for m in model.modules():
        if isinstance(m, QuantEmbedding):
            kinds[f"int{m.bits} embedding"] = [0, sum(b.numel() * b.element_size() for b in m.buffers())]
        if isinstance(m, PackedWeight) and not isinstance(m, ConcatWeight):  # (its parts are counted)
            kind = f"int{m.code_bits if m.bits == 8 else m.bits}" if isinstance(m, _Quantized) else "dense"
            nbytes = sum(b.numel() * b.element_size() for b in list(m.buffers()) + list(m.parameters()))
            entry = kinds.setdefault(kind, [0, 0])
            entry[0], entry[1] = entry[0] + 1, entry[1] + nbytes
    if not kinds:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        return f"float, {total / 2**20:.0f} MiB"
    return ", ".join(f"{n} {kind} matmuls {b / 2**20:.0f} MiB" if n else f"{kind} {b / 2**20:.0f} MiB"
                     for kind, (n, b) in sorted(kinds.items()))
