"""Hugging Face hub ids as models (specserve/hub.py), offline: every test builds a hub cache laid out as
huggingface_hub lays it out (``models--org--name/refs/<branch>`` holding a commit, ``snapshots/<commit>/``
files linked to ``blobs/``) with tiny models written here, runs with HF_HUB_OFFLINE=1, and has sockets
refuse to connect, so nothing reaches a hub."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from specserve.config import CheckpointError, EngineConfig, SpeculativeConfig
from specserve.hub import parse_hub_id, pick_gguf, resolve_model
from specserve.sampling_params import SamplingParams
from tests.helpers import save_tiny_checkpoint

ENGINE = dict(dtype="float32", device="cpu", num_blocks=64)
DRAFTS = Path(__file__).resolve().parent.parent / "specserve" / "data" / "drafts" / "smollm2-135m-eagle"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, offline mode on (huggingface_hub reads both at import: its constants too)."""
    import huggingface_hub.constants as constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))

    connect = socket.socket.connect

    def loopback_only(self, address):  # the served-model test talks to its own server
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"a test tried to reach the network: {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    return root


def add_repo(cache: Path, repo_id: str, files: dict[str, Path], ref: str = "main", commit: str | None = None) -> Path:
    """Cache ``files`` (repo path -> source file) as snapshot ``commit`` of ``repo_id``, recorded under
    ``refs/<ref>``; returns the snapshot dir. Blobs are named by content hash, snapshots link to them."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    for rel, src in files.items():
        blob = storage / "blobs" / hashlib.sha256(f"{commit}/{rel}".encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if src.stat().st_size > 1 << 24:
            blob.symlink_to(src)  # the demo GGUF: not copied
        else:
            shutil.copyfile(src, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)  # NOTE: no newline, as huggingface_hub writes it
    return snapshot


def dir_files(path: Path) -> dict[str, Path]:
    return {str(p.relative_to(path)): p for p in sorted(path.rglob("*")) if p.is_file()}


def empty_gguf(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return Path(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def greedy(llm, n: int = 12) -> list[list[int]]:
    outs = llm.generate(["hello world", "abc abc abc"], SamplingParams(temperature=0, max_tokens=n))
    return [o.outputs[0].token_ids for o in outs]


def test_hub_id_loads_and_generates_like_the_local_path(cache, tiny):
    from specserve.llm import LLM
    from specserve.server.api import default_served_name

    snapshot = add_repo(cache, "org/tiny", dir_files(tiny))
    with LLM(str(tiny), **ENGINE) as local:
        want = greedy(local)
    with LLM("org/tiny", **ENGINE) as llm:
        assert llm.engine.config.model.model == str(snapshot)
        assert llm.engine.config.model.model_id == "org/tiny"
        assert default_served_name(llm.engine) == "org/tiny"  # the user's id, as vLLM serves it
        assert llm.engine.model_name == "org/tiny"  # not the snapshot's commit hash
        assert greedy(llm) == want


def test_serve_a_hub_id(cache, tiny, start_server):
    """`specserve serve org/name` as the server sees it: the model is served under the id as typed."""
    import httpx

    from specserve.server.api import create_app

    add_repo(cache, "org/tiny", dir_files(tiny))
    srv = start_server(create_app(EngineConfig.from_kwargs("org/tiny", **ENGINE)))
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=60) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["org/tiny"]
            r = http.post("/v1/completions", json={"model": "org/tiny", "prompt": "hello", "max_tokens": 4,
                                                   "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == "org/tiny"
    finally:
        srv.stop()


def test_a_local_path_wins_over_a_hub_id(cache, tiny, tmp_path, monkeypatch):
    add_repo(cache, "org/tiny", dir_files(tiny))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    shutil.copytree(tiny, tmp_path / "org" / "tiny")
    assert resolve_model("org/tiny") == "org/tiny"
    assert resolve_model(None) is None


def test_quant_tags_pick_a_gguf_file(cache, tmp_path):
    g = empty_gguf(tmp_path / "x.gguf")
    names = ["Tiny-Q8_0.gguf", "Tiny-Q4_K_M.gguf", "tiny.q4_k_s.gguf", "mmproj-Tiny-F16.gguf", "README.md"]
    snapshot = add_repo(cache, "org/tiny-GGUF", {n: g for n in names})
    assert resolve_model("org/tiny-GGUF:Q4_K_M") == str(snapshot / "Tiny-Q4_K_M.gguf")
    assert resolve_model("org/tiny-GGUF:q4_k_m") == str(snapshot / "Tiny-Q4_K_M.gguf")  # case-insensitive
    assert resolve_model("org/tiny-GGUF:Q8_0") == str(snapshot / "Tiny-Q8_0.gguf")
    assert resolve_model("org/tiny-GGUF:Q4_K_S") == str(snapshot / "tiny.q4_k_s.gguf")
    assert resolve_model("org/tiny-GGUF") == str(snapshot / "Tiny-Q4_K_M.gguf")  # no tag: llama.cpp's Q4_K_M
    with pytest.raises(CheckpointError) as e:  # Q4_K is not Q4_K_M's prefix match
        resolve_model("org/tiny-GGUF:Q4_K")
    msg = str(e.value)
    assert "no .gguf file tagged Q4_K" in msg and "Q4_K_M, Q4_K_S, Q8_0" in msg and "\n" not in msg
    assert "MMPROJ" not in msg.upper()


def test_pick_gguf_without_q4_k_m_and_ambiguous_tags():
    from specserve.hub import HubId

    assert pick_gguf(HubId("o/n"), ["a-Q8_0.gguf"]) == "a-Q8_0.gguf"  # the only one
    with pytest.raises(CheckpointError, match=r"no \.gguf file tagged Q4_K_M and no tag was given.*F16, Q8_0"):
        pick_gguf(HubId("o/n"), ["a-Q8_0.gguf", "a-f16.gguf"])
    with pytest.raises(CheckpointError, match="matches 2 files"):
        pick_gguf(HubId("o/n", "Q8_0"), ["a-Q8_0.gguf", "b-Q8_0.gguf"])
    with pytest.raises(CheckpointError, match="split into 2 files"):
        pick_gguf(HubId("o/n", "Q8_0"), ["a-Q8_0-00001-of-00002.gguf", "a-Q8_0-00002-of-00002.gguf"])
    with pytest.raises(CheckpointError, match="has no .gguf files"):
        pick_gguf(HubId("o/n", "Q8_0"), ["config.json", "model.safetensors"])


def test_a_file_in_a_repo(cache, tmp_path):
    g = empty_gguf(tmp_path / "x.gguf")
    snapshot = add_repo(cache, "org/files", {"a-Q8_0.gguf": g, "sub/b-Q4_0.gguf": g})
    assert resolve_model("org/files/a-Q8_0.gguf") == str(snapshot / "a-Q8_0.gguf")
    assert resolve_model("org/files/sub/b-Q4_0.gguf") == str(snapshot / "sub" / "b-Q4_0.gguf")


def test_revision_picks_another_snapshot(cache, tmp_path):
    g = empty_gguf(tmp_path / "x.gguf")
    main = add_repo(cache, "org/rev", {"m-Q8_0.gguf": g})
    v2 = add_repo(cache, "org/rev", {"m-Q4_K_M.gguf": g}, ref="v2")
    commit = v2.name
    assert resolve_model("org/rev") == str(main / "m-Q8_0.gguf")
    assert resolve_model("org/rev", "v2") == str(v2 / "m-Q4_K_M.gguf")
    assert resolve_model("org/rev", commit) == str(v2 / "m-Q4_K_M.gguf")
    assert resolve_model("org/rev/m-Q4_K_M.gguf", "v2") == str(v2 / "m-Q4_K_M.gguf")
    cfg = EngineConfig.from_kwargs("org/rev", revision="v2")
    assert cfg.model.model == str(v2 / "m-Q4_K_M.gguf") and cfg.model.revision == "v2"
    with pytest.raises(CheckpointError, match="at revision v3 is not in the local Hugging Face cache"):
        resolve_model("org/rev", "v3")


def test_the_gguf_demo_model_by_quant_tag(cache, tmp_path, demo_model_path):
    """The acceptance case: ``org/name:Q4_K_M`` loads from the cache (the demo GGUF under that name, another
    quant beside it), tokenizer included, and generates. (Equal tokens to the local path: the test above.)"""
    from specserve.llm import LLM

    snapshot = add_repo(cache, "org/smol-GGUF", {"SmolLM2-135M-Instruct-Q4_K_M.gguf": Path(demo_model_path),
                                                 "SmolLM2-135M-Instruct-Q8_0.gguf": empty_gguf(tmp_path / "x.gguf")})
    with LLM("org/smol-GGUF:q4_k_m", num_blocks=64) as llm:
        path = llm.engine.config.model.model
        assert path == str(snapshot / "SmolLM2-135M-Instruct-Q4_K_M.gguf")
        assert os.path.realpath(path) == os.path.realpath(demo_model_path)
        out = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4


def test_speculative_model_from_the_hub(cache, tiny):
    from specserve.llm import LLM

    draft = add_repo(cache, "org/tiny-draft", dir_files(tiny))
    head = add_repo(cache, "org/smol-eagle", {n: p for n, p in dir_files(DRAFTS).items()
                                             if n in ("config.json", "model.safetensors")}, ref="v1")
    spec = SpeculativeConfig.from_args(speculative_model="org/smol-eagle", speculative_model_revision="v1")
    assert (spec.method, spec.model, spec.revision) == ("eagle", str(head), "v1")  # an EAGLE head dir, resolved
    spec = SpeculativeConfig.from_args(speculative_config={"model": "org/smol-eagle", "revision": "v1"})
    assert (spec.method, spec.model) == ("eagle", str(head))
    with LLM(str(tiny), **ENGINE) as plain:
        want = greedy(plain)
    with LLM(str(tiny), speculative_model="org/tiny-draft", num_speculative_tokens=3, speculative_adaptive=False,
             **ENGINE) as llm:
        assert llm.engine.config.speculative.model == str(draft)
        assert llm.engine.config.speculative.method == "draft"
        assert greedy(llm) == want
        assert llm.get_metrics()["speculative"]["draft_tokens"] > 0


@pytest.mark.parametrize("spec", ["./nope", "/nonexistent/model", "~/nope.gguf", "nope.gguf", "dir/file.gguf",
                                  "mymodel", "org/../x.gguf"])
def test_a_local_looking_path_that_does_not_exist(cache, spec):
    from specserve.model.checkpoint.loader import load_checkpoint

    assert parse_hub_id(spec) is None
    assert resolve_model(spec) == spec  # the loader says it is missing, in one line
    with pytest.raises(CheckpointError, match="no such file or directory$") as e:
        load_checkpoint(EngineConfig.from_kwargs(spec).model.model)
    assert "\n" not in str(e.value)


def test_parse_hub_ids():
    h = parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert h is not None and (h.repo_id, h.tag, h.filename) == ("Qwen/Qwen2.5-0.5B-Instruct", None, None)
    h = parse_hub_id("unsloth/gemma-3-270m-it-GGUF:UD-Q4_K_XL")
    assert h is not None and (h.repo_id, h.tag, h.filename) == ("unsloth/gemma-3-270m-it-GGUF", "UD-Q4_K_XL", None)
    h = parse_hub_id("org/name/sub/f.gguf")
    assert h is not None and (h.repo_id, h.tag, h.filename) == ("org/name", None, "sub/f.gguf")
    assert parse_hub_id("org--x/name") is None and parse_hub_id("org/name:") is None


def test_offline_with_nothing_cached_is_one_line(cache):
    for spec, hint in (("org/missing", "`hf download org/missing`"),
                       ("org/missing:Q4_K_M", "`hf download org/missing`"),
                       ("org/missing/f.gguf", "`hf download org/missing f.gguf`")):
        with pytest.raises(CheckpointError) as e:
            resolve_model(spec)
        msg = str(e.value)
        assert msg.startswith(f"{spec} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1")
        assert hint in msg and "\n" not in msg


def _hub_error(cls_name: str):
    from huggingface_hub import errors

    cls = getattr(errors, cls_name)
    e = cls.__new__(cls)
    Exception.__init__(e, f"{cls_name}: 4xx from the hub\nwith details on a second line")
    return e


@pytest.mark.parametrize("where,error,expected", [
    ("snapshot_download", "GatedRepoError",
     "org/gated is a gated repository: accept its license at https://huggingface.co/org/gated and set HF_TOKEN"),
    ("list_repo_files", "RepositoryNotFoundError",
     "org/gated: no such file or directory, and no model repository org/gated on the Hugging Face hub"),
    ("list_repo_files", "RevisionNotFoundError", "org/gated has no revision 'nope' on the Hugging Face hub"),
])
def test_hub_errors_online_are_one_line(cache, monkeypatch, where, error, expected):
    """Online (a fake hub: huggingface_hub's calls replaced), each refusal of the hub is one line."""
    import huggingface_hub
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def listing(repo_id, revision=None):
        if where == "list_repo_files":
            raise _hub_error(error)
        return ["config.json", "model.safetensors", "tokenizer.json"]

    def download(*args, **kwargs):
        raise _hub_error(error)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(CheckpointError) as e:
        resolve_model("org/gated", "nope" if error == "RevisionNotFoundError" else None)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_online_without_a_connection_uses_the_cache(cache, tiny, monkeypatch):
    """HF_HUB_OFFLINE unset but the hub out of reach: the cached snapshot's listing picks the file."""
    import huggingface_hub
    import huggingface_hub.constants as constants

    snapshot = add_repo(cache, "org/cached", {"a-Q8_0.gguf": empty_gguf(cache.parent / "x.gguf")})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to host")

    def from_cache(repo_id, filename, revision=None):
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", from_cache)
    assert resolve_model("org/cached:q8_0") == str(snapshot / "a-Q8_0.gguf")
    with pytest.raises(CheckpointError, match="^cannot reach the Hugging Face hub for org/other and it is not in"):
        resolve_model("org/other")


def test_engine_flags_include_the_revisions():
    from specserve.cli import build_parser
    from specserve.engine_args import engine_kwargs

    args = build_parser().parse_args(["generate", "--model", "org/x", "--revision", "v2",
                                      "--speculative-model", "org/d", "--speculative-model-revision", "abc"])
    kw = engine_kwargs(args)
    assert kw["revision"] == "v2" and kw["speculative_model_revision"] == "abc"


def test_cli_prints_one_line_and_fails(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "--model", "org/missing"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("specserve: error:")]
    assert errors == [f"specserve: error: org/missing is not in the local Hugging Face cache ({tmp_path / 'hub'}) "
                      "and HF_HUB_OFFLINE=1: run once online or `hf download org/missing`"]
    assert "Traceback" not in proc.stderr
