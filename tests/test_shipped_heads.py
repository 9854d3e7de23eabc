"""Every EAGLE head shipped under specserve/data/drafts/ loads into a head of its config's shape, stays within
the package budget (40 MB), drafts among valid token ids, and documents how it was made and what it held out."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specserve.model.eagle_head import EagleHead, dequantize_rows, read_eagle_config

DRAFTS = Path(__file__).resolve().parent.parent / "specserve" / "data" / "drafts"
HEADS = sorted(p for p in DRAFTS.iterdir() if (p / "config.json").exists())


def test_there_are_shipped_heads():
    assert {p.name for p in HEADS} >= {"smollm2-135m-eagle", "qwen2.5-coder-1.5b-instruct-eagle"}


@pytest.mark.parametrize("head_dir", HEADS, ids=lambda p: p.name)
def test_shipped_head_loads_and_is_documented(head_dir):
    weights = head_dir / "model.safetensors"
    assert weights.stat().st_size <= 40_000_000
    cfg = read_eagle_config(str(head_dir))
    sd = dequantize_rows(load_file(str(weights)), str(weights))
    vocab = sd.pop("draft_vocab", None)
    if vocab is not None:
        assert vocab.numel() == json.loads((head_dir / "config.json").read_text())["draft_vocab_size"]
        assert 0 <= int(vocab.min()) and int(vocab.max()) < cfg.vocab_size and vocab.unique().numel() == vocab.numel()
    head = EagleHead(cfg, torch.float32, torch.device("cpu"), None, 64)
    head.load_hf_state_dict(sd, str(weights))  # every tensor present, with the config's shapes
    assert all(torch.isfinite(p).all() for p in head.parameters())
    readme = (head_dir / "README.md").read_text()
    assert "specserve distill" in readme
    for held in head_dir.glob("heldout-*.jsonl"):
        for line in held.read_text().splitlines():
            assert json.loads(line)["id"]
    assert os.path.exists(head_dir / "distill.json")
