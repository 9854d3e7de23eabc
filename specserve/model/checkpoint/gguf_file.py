"""A GGUF reader of our own: header, metadata and tensor infos straight from an mmap, tensors on demand.

Metadata arrays (the 49k-entry vocabulary) are skipped, not decoded: that is most of the 2-4 s the gguf
package's GGUFReader spends on the demo model. Q4_0 / Q4_1 / Q8_0 matrices can be kept in their blocks
(model/quant.py); other quantized tensors are dequantized with the gguf package (and requantized to int8 when
kept quantized).
Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import struct
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from specserve.config import CheckpointError
from specserve.model.quant import GROUP, QuantizedTensor, TwoLevel, quantize

log = logging.getLogger("specserve")


class GGUFArray(NamedTuple):
    """A GGUF metadata array: only its length is kept (the vocabulary is read by the tokenizer)."""

    length: int


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGUF order (ne0 first): [in, out] for a weight, the reverse of torch's
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute file offset of the data
    nbytes: int


class GGUFFile(NamedTuple):
    meta: dict[str, Any]
    tensors: dict[str, TensorInfo]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]  # struct.error past the end: truncated
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.read("<Q")
        if self.pos + n > len(self.buf):
            raise EOFError("string runs past the end of the file")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            if vtype not in _SCALARS:
                raise ValueError(f"unknown metadata value type {vtype}")
            return self.read(_SCALARS[vtype])
        etype, n = self.read("<I"), self.read("<Q")
        if etype == _STRING:  # skip without decoding: this is the 2-4 s GGUFReader spends
            for _ in range(n):
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        elif etype == _ARRAY:
            for _ in range(n):
                self.value(_ARRAY)
        elif etype in _SCALARS:
            self.pos += n * struct.calcsize(_SCALARS[etype])
        else:
            raise ValueError(f"unknown metadata array type {etype}")
        return GGUFArray(n)


def parse_gguf(f: Any, file: str) -> GGUFFile:
    """Header, metadata and tensor infos of a GGUF file (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)."""
    magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{file}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
    size = os.fstat(f.fileno()).st_size
    try:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf)
            cur.pos = 4
            version = cur.read("<I")
            if version not in (2, 3):
                why = "big-endian files are not supported" if version & 0xFFFF == 0 else "only v2 and v3"
                raise CheckpointError(f"{file}: unsupported GGUF version {version} ({why})")
            n_tensors, n_kv = cur.read("<Q"), cur.read("<Q")
            meta = {}
            for _ in range(n_kv):
                key = cur.string()
                meta[key] = cur.value(cur.read("<I"))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                shape = tuple(cur.read("<Q") for _ in range(cur.read("<I")))
                infos.append((name, shape, gguf.GGMLQuantizationType(cur.read("<I")), cur.read("<Q")))
            align = int(meta.get("general.alignment", 32))
            data_start = (cur.pos + align - 1) // align * align
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{file}: truncated or corrupted GGUF header ({type(e).__name__}: {e})") from e
    tensors = {}
    for name, shape, qtype, offset in infos:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        info = TensorInfo(name, shape, qtype, data_start + offset, math.prod(shape) // block * type_size)
        if info.offset + info.nbytes > size:
            raise CheckpointError(f"{file}: truncated or corrupted (tensor {name} ends at byte "
                                  f"{info.offset + info.nbytes} but the file has {size} bytes)")
        tensors[name] = info
    return GGUFFile(meta, tensors)


# Block layouts kept quantized (model/quant.py's group-32 format): Q4_0 = f16 d + 16 bytes of codes
# (w = d * (q - 8)); Q4_1 = f16 d + f16 m + 16 bytes (w = d * q + m); Q8_0 = f16 d + 32 int8 (w = d * q).
# In a 4-bit block, byte i holds code i in its low nibble and code i + 16 in its high nibble.
_KEPT = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20, gguf.GGMLQuantizationType.Q8_0: 34}


def _quantized(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> QuantizedTensor:
    """Raw GGUF blocks of a [N, K] weight -> QuantizedTensor with the file's own numbers."""
    n, k = shape
    blocks = raw.reshape(n, k // GROUP, _KEPT[qtype])
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))  # [N, G]
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, k)
        return QuantizedTensor(8, codes, d, None)
    start = 2 if qtype == gguf.GGMLQuantizationType.Q4_0 else 4
    mins = -8.0 * d if start == 2 else torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]
                                                         .astype(np.float32))
    qs = torch.from_numpy(blocks[..., start:].copy())  # [N, G, 16]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)
    return QuantizedTensor(4, codes, d, mins)


# Block formats kept with their own numbers through another layout (quant.py's QuantizedTensor, TwoLevel), and
# their bytes per block. Q5_0 = f16 d + 32 high bits + 16 bytes of low nibbles (w = d * (q - 16)): 8-bit
# codes. K-quants (256 weights a super-block): Q4_K = f16 d, f16 dmin, 12 bytes of 6-bit scales and mins (8
# each), 128 bytes of nibbles (w = d sc_j q - dmin m_j per group j of 32); Q6_K = 128 bytes of low nibbles,
# 64 of high 2-bit pairs, 16 int8 scales (one per 16 weights), f16 d (w = d sc_j (q - 32)).
_KQ = gguf.GGMLQuantizationType
_OWN_LAYOUT = {_KQ.Q5_0: 22, _KQ.Q4_K: 144, _KQ.Q6_K: 210}
_QK = 256


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float32 from the fp16 they hold."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _q5_0(blocks: torch.Tensor, n: int, k: int) -> QuantizedTensor:
    d = _half(blocks[..., :2])  # [N, G]
    qh = blocks[..., 2:6].contiguous().view(torch.int32)  # [N, G, 1]: bit i = code i's fifth bit
    bits = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [N, G, 32]
    qs = blocks[..., 6:]
    low = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.int32)
    codes = (low | (bits << 4)) - 16
    return QuantizedTensor(8, codes.to(torch.int8).reshape(n, k), d, None)


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedTensor:
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [N, S]
    sc12 = blocks[..., 4:16].to(torch.int32).view(n, -1, 3, 4)
    a, b, c = sc12[..., 0, :], sc12[..., 1, :], sc12[..., 2, :]  # the 6-bit packing of get_scale_min
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)  # [N, S, 8]
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1)
    qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # chunk j: group 2j in low nibbles, 2j + 1 in high
    codes = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, k)
    sub, min_sub = sc.reshape(n, -1).to(torch.int8), mn.reshape(n, -1).to(torch.int8)  # [N, G]
    min_sup = -dmin
    scales = (d[..., None] * sc.float()).reshape(n, -1)
    mins = (min_sup[..., None] * mn.float()).reshape(n, -1)
    return QuantizedTensor(4, codes, scales, mins, TwoLevel(sub, d, min_sub, min_sup, 1))


def _q6_k(blocks: torch.Tensor, n: int, k: int) -> QuantizedTensor:
    s = blocks.shape[1]
    codes = torch.empty(n, s, 2, 4, 32, dtype=torch.uint8)  # per half super-block: 4 groups of 32
    ql = blocks[..., :128].reshape(n, s, 2, 2, 32)  # half h, 32-byte run r: group r (low nibble), r + 2 (high)
    qh = blocks[..., 128:192].reshape(n, s, 2, 1, 32)  # bit pairs 0-1, 2-3, 4-5, 6-7: groups 0..3 of the half
    torch.bitwise_and(ql, 0xF, out=codes[:, :, :, 0:2])
    torch.bitwise_right_shift(ql, 4, out=codes[:, :, :, 2:4])
    for j in range(4):
        codes[:, :, :, j] |= ((qh[:, :, :, 0] >> (2 * j)) & 3) << 4
    codes = codes.view(n, k).sub_(32).view(torch.int8)  # q - 32, wrapping in uint8 then read as int8
    sub = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)  # [N, K / 16]
    d = _half(blocks[..., 208:210])  # [N, S]
    scales = (d[..., None] * sub.view(n, -1, 16).float()).reshape(n, -1)
    return QuantizedTensor(8, codes, scales, None, TwoLevel(sub, d, None, None, 2))


def _own_layout(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> QuantizedTensor:
    n, k = shape
    per = GROUP if qtype == _KQ.Q5_0 else _QK
    blocks = torch.from_numpy(raw).view(n, k // per, _OWN_LAYOUT[qtype])
    return {_KQ.Q5_0: _q5_0, _KQ.Q4_K: _q4_k, _KQ.Q6_K: _q6_k}[qtype](blocks, n, k)


def read_gguf_tensor(f: Any, info: TensorInfo, file: str, keep_quantized: bool = False
                     ) -> torch.Tensor | QuantizedTensor:
    """One tensor in its torch shape (GGUF dims reversed). Q4_0 / Q4_1 / Q8_0 matrices come back as a
    ``QuantizedTensor`` with ``keep_quantized``, other quantized matrices requantized to int8 (group 32); without
    it every quantized type is dequantized to float32."""
    f.seek(info.offset)
    raw = np.fromfile(f, dtype=np.uint8, count=info.nbytes)  # a fresh writable array, no memmap aliasing
    return _decode(raw, info.qtype, tuple(reversed(info.shape)), info.name, file, keep_quantized)


def read_gguf_experts(f: Any, info: TensorInfo, file: str, keep_quantized: bool = False
                      ) -> list[torch.Tensor | QuantizedTensor]:
    """A stacked [experts, rows, cols] tensor as one [rows, cols] matrix per expert, each decoded as
    ``read_gguf_tensor`` decodes a matrix."""
    shape = tuple(reversed(info.shape))
    if len(shape) != 3:
        raise CheckpointError(f"{file}: tensor {info.name} has shape {list(shape)}, expected [experts, rows, cols]")
    f.seek(info.offset)
    raw = np.fromfile(f, dtype=np.uint8, count=info.nbytes).reshape(shape[0], -1)
    return [_decode(raw[e], info.qtype, shape[1:], info.name, file, keep_quantized) for e in range(shape[0])]


def _decode(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], name: str, file: str,
            keep_quantized: bool) -> torch.Tensor | QuantizedTensor:
    q = gguf.GGMLQuantizationType
    if keep_quantized and qtype in _KEPT and len(shape) == 2:
        return _quantized(raw, qtype, shape)
    if keep_quantized and qtype in _OWN_LAYOUT and len(shape) == 2:
        return _own_layout(raw, qtype, shape)
    if qtype == q.F32:
        return torch.from_numpy(raw.view(np.float32).reshape(shape))
    if qtype == q.F16:
        return torch.from_numpy(raw.view(np.float16).reshape(shape))
    if qtype == q.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(shape)).view(torch.bfloat16)
    try:
        data = gguf.quants.dequantize(raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype)), qtype)
    except NotImplementedError as e:
        raise CheckpointError(f"{file}: tensor {name} has unsupported type {qtype.name}") from e
    t = torch.from_numpy(data.astype(np.float32, copy=False).reshape(shape))
    if keep_quantized and len(shape) == 2 and shape[1] % GROUP == 0:
        # Other block formats (Q5_1, Q5_K, ...) are requantized to group-32 int8, said once per format: a grid
        # at least 8x finer than the file's, but not the file's own numbers (--quantization none keeps them).
        if qtype not in _REQUANTIZED:
            _REQUANTIZED.add(qtype)
            log.warning("%s: tensor %s is %s, which is not kept in its blocks: requantized to int8 in groups of 32 "
                        "(so are the file's other %s tensors; --quantization none uses the file's exact values)",
                        file, name, qtype.name, qtype.name)
        return quantize(t, 8, name)
    return t


_REQUANTIZED: set[gguf.GGMLQuantizationType] = set()
