"""Checkpoint fuzzing: truncated / corrupted GGUF and safetensors files (byte flips, truncations, header fields
set to nasty values, huge declared lengths, edited safetensors headers) always end in the loader's
``CheckpointError`` naming the file, or load fine when the damage is harmless (e.g. a flipped weight byte),
never another exception, a crash, a hang (pytest-timeout) or a huge allocation (peak RSS checked)."""

from __future__ import annotations

import json
import os
import resource
import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.config import CheckpointError
from specserve.model.checkpoint.loader import load_checkpoint, read_arch

EXAMPLES = int(os.environ.get("SPECSERVE_CKPT_FUZZ_EXAMPLES", "100"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=5000, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NASTY = [0, 1, 2, 3, 7, 8, 9, 12, 13, 31, 32, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
         2**62, 2**63 - 1, 2**63, 2**64 - 1]

pytestmark = pytest.mark.timeout(300)


# -- a tiny GGUF and where its header fields are --------------------------------------------------------------
def write_tiny_gguf(path: str) -> None:
    """1-layer Llama, hidden 32 (2 heads of 16, 1 kv head), vocab 32: Q8_0, Q4_0, F16 and F32 tensors, a token
    list (string array), scores (float array) and token types (int array)."""
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-fuzz")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_token_scores([float(i) for i in range(32)])
    w.add_token_types([1] * 32)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, shape: tuple[int, ...], qtype=Q.F32) -> None:
        a = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    add("token_embd.weight", (32, 32), Q.Q8_0)
    add("blk.0.attn_q.weight", (32, 32), Q.Q4_0)
    add("blk.0.attn_k.weight", (16, 32), Q.F16)
    add("blk.0.attn_v.weight", (16, 32))
    add("blk.0.attn_output.weight", (32, 32))
    add("blk.0.ffn_gate.weight", (64, 32), Q.Q8_0)
    add("blk.0.ffn_up.weight", (64, 32))
    add("blk.0.ffn_down.weight", (32, 64))
    add("blk.0.attn_norm.weight", (32,))
    add("blk.0.ffn_norm.weight", (32,))
    add("output_norm.weight", (32,))
    add("output.weight", (32, 32), Q.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width in bytes) of every count, length, type, dim and offset field of a GGUF header."""
    fields: list[tuple[int, int]] = [(4, 4), (8, 8), (16, 8)]
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string() -> None:
        nonlocal pos
        fields.append((pos, 8))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            fields.extend([(pos, 4), (pos + 4, 8)])
            etype, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(n):
                value(etype)
        else:
            pos += sizes[vtype]

    for _ in range(n_kv):
        string()
        fields.append((pos, 4))
        vtype = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        value(vtype)
    for _ in range(n_tensors):
        string()
        fields.append((pos, 4))
        n_dims = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        fields.extend((pos + 8 * i, 8) for i in range(n_dims))
        pos += 8 * n_dims
        fields.extend([(pos, 4), (pos + 4, 8)])  # type, offset
        pos += 12
    return fields


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[bytes, list[tuple[int, int]]]:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    ckpt = load_checkpoint(path)  # the pristine file loads
    assert ckpt.arch.hidden_size == 32 and ckpt.arch.vocab_size == 32
    data = open(path, "rb").read()
    fields = gguf_fields(data)
    assert len(fields) > 50
    return data, fields


def mutations(size: int, fields: list[tuple[int, int]]) -> st.SearchStrategy:
    value = st.one_of(st.sampled_from(NASTY), st.integers(0, 2**64 - 1))
    op = st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, size - 1)),
        st.tuples(st.just("flip"), st.integers(0, size - 1), st.integers(1, 255)),
        st.tuples(st.just("field"), st.sampled_from(fields) if fields else st.just((0, 8)), value),
    )
    return st.lists(op, min_size=1, max_size=3)


def apply(data: bytes, ops: list[tuple]) -> bytes:
    b = bytearray(data)
    for op in ops:
        if op[0] == "truncate":
            del b[min(op[1], len(b)):]
        elif op[0] == "flip" and op[1] < len(b):
            b[op[1]] ^= op[2]
        elif op[0] == "field":
            (off, width), v = op[1], op[2]
            if off + width <= len(b):
                b[off:off + width] = (v % 2 ** (8 * width)).to_bytes(width, "little")
    return bytes(b)


def expect_checkpoint_error_or_ok(path: str, given_path: str | None = None) -> None:
    """load_checkpoint / read_arch either succeed or raise CheckpointError naming the file."""
    for fn in (read_arch, load_checkpoint):
        try:
            fn(given_path or path)
        except CheckpointError as e:
            assert not isinstance(e.__cause__, MemoryError), f"a corrupted file made the loader allocate: {e}"
            assert path in str(e) or (given_path or path) in str(e), str(e)
            assert "\n" not in str(e).strip(), str(e)  # one line


def _vm_data_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


class PeakRSS:
    """Fails when the process's peak RSS grew by more than ``limit_mb`` (a corrupted length allocating), and
    caps the data segment meanwhile (RLIMIT_DATA, Linux), so that a runaway allocation is a MemoryError
    (which ``expect_checkpoint_error_or_ok`` reports) instead of the OOM killer taking the machine down."""

    def __init__(self, limit_mb: float = 512) -> None:
        self.limit = limit_mb

    def __enter__(self) -> PeakRSS:
        self.start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.old = resource.getrlimit(resource.RLIMIT_DATA)
        try:
            cap = _vm_data_bytes() + 2 * 2**30
            if self.old[1] == resource.RLIM_INFINITY or cap < self.old[1]:
                resource.setrlimit(resource.RLIMIT_DATA, (cap, self.old[1]))
        except (OSError, ValueError, StopIteration):
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_DATA, self.old)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - self.start
        assert grown < self.limit, f"peak RSS grew by {grown:.0f} MB while loading fuzzed checkpoints"


def test_gguf_fuzz(tiny_gguf, tmp_path):
    data, fields = tiny_gguf
    path = str(tmp_path / "fuzzed.gguf")

    @SETTINGS
    @given(ops=mutations(len(data), fields))
    def run(ops):
        with open(path, "wb") as f:
            f.write(apply(data, ops))
        expect_checkpoint_error_or_ok(path)

    with PeakRSS():
        run()


@pytest.mark.parametrize("cut", [0, 1, 3, 4, 7, 8, 23, 24, 100])
def test_gguf_truncated_header(tiny_gguf, tmp_path, cut):
    data, _ = tiny_gguf
    path = str(tmp_path / "cut.gguf")
    with open(path, "wb") as f:
        f.write(data[:cut])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        load_checkpoint(path)


def test_gguf_huge_declared_lengths(tiny_gguf, tmp_path):
    """Every length / count field set to 2**63 and 2**64 - 1, one at a time."""
    data, fields = tiny_gguf
    path = str(tmp_path / "huge.gguf")
    with PeakRSS():
        for off, width in fields:
            if width != 8:
                continue
            for v in (2**63, 2**64 - 1):
                with open(path, "wb") as f:
                    f.write(apply(data, [("field", (off, width), v)]))
                expect_checkpoint_error_or_ok(path)


# -- safetensors (HF dir) ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> tuple[bytes, bytes]:
    from tests.helpers import tiny_hf_model

    d = tmp_path_factory.mktemp("hf")
    tiny_hf_model("llama", seed=0, layers=1, vocab=64).save_pretrained(d)
    load_checkpoint(str(d))
    return open(d / "model.safetensors", "rb").read(), open(d / "config.json", "rb").read()


def _st_header(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack_from("<Q", data, 0)[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


@st.composite
def header_edit(draw, header: dict) -> tuple[dict, bool]:
    """A safetensors header with one tensor entry damaged; and whether to keep the old header length."""
    h = json.loads(json.dumps(header))
    name = draw(st.sampled_from(sorted(k for k in h if k != "__metadata__")))
    what = draw(st.sampled_from(["dtype", "shape", "offsets", "delete", "junk"]))
    big = st.one_of(st.sampled_from(NASTY), st.integers(-(2**70), 2**70))
    if what == "dtype":
        h[name]["dtype"] = draw(st.sampled_from(["F64", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "XX",
                                                 "", 7]))
    elif what == "shape":
        h[name]["shape"] = draw(st.lists(big, min_size=0, max_size=4))
    elif what == "offsets":
        h[name]["data_offsets"] = draw(st.lists(big, min_size=0, max_size=3))
    elif what == "delete":
        del h[name][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    else:
        h[name] = draw(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers())))
    return h, draw(st.booleans())


def test_safetensors_fuzz(tiny_hf, tmp_path):
    data, config = tiny_hf
    header, rest = _st_header(data)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_bytes(config)
    st_path = str(d / "model.safetensors")
    raw = st.tuples(st.just("raw"), mutations(len(data), [(0, 8)]))
    edited = st.tuples(st.just("header"), header_edit(header))

    @SETTINGS
    @given(m=st.one_of(raw, edited))
    def run(m):
        if m[0] == "raw":
            blob = apply(data, m[1])
        else:
            h, keep_len = m[1]
            hb = json.dumps(h).encode()
            n = struct.unpack_from("<Q", data, 0)[0] if keep_len else len(hb)
            blob = struct.pack("<Q", n) + hb + rest
        with open(st_path, "wb") as f:
            f.write(blob)
        expect_checkpoint_error_or_ok(st_path, str(d))

    with PeakRSS():
        run()


def test_config_json_fuzz(tiny_hf, tmp_path):
    data, config = tiny_hf
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(data)
    cfg_path = str(d / "config.json")
    cfg = json.loads(config)
    keys = sorted(k for k, v in cfg.items() if isinstance(v, int | float) and not isinstance(v, bool))
    value = st.one_of(st.sampled_from([0, -1, 1, 2**63, 1e308, "x", None, [], {}]), st.integers(-(2**70), 2**70))

    @settings(SETTINGS, max_examples=max(20, EXAMPLES // 2))
    @given(edit=st.one_of(st.tuples(st.just("field"), st.sampled_from(keys), value),
                          st.tuples(st.just("bytes"), mutations(len(config), []))))
    def run(edit):
        if edit[0] == "field":
            blob = json.dumps({**cfg, edit[1]: edit[2]}).encode()
        else:
            blob = apply(config, edit[1])
        with open(cfg_path, "wb") as f:
            f.write(blob)
        expect_checkpoint_error_or_ok(cfg_path, str(d))

    with PeakRSS():
        run()
