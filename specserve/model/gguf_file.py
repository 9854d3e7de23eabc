"""A GGUF reader of our own: header, metadata and tensor infos straight from an mmap, tensors on demand.

Metadata arrays (the 49k-entry vocabulary) are skipped, not decoded: that is most of the 2-4 s the gguf
package's GGUFReader spends on the demo model. Q4_0 / Q4_1 / Q8_0 matrices can be kept in their blocks
(model/quant.py); other quantized tensors are dequantized with the gguf package (and requantized to int8 when
kept quantized).
Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from specserve.config import CheckpointError
from specserve.model.quant import GROUP, QuantizedTensor, quantize


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
        # Other block formats (Q5_0, Q4_K, Q6_K, ...) stay quantized as group-32 int8: a grid at least 8x finer
        # than the file's, so the weights are the file's to within a small fraction of its own rounding.
        return quantize(t, 8, name)
    return t
