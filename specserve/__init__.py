"""specserve: an LLM serving engine built around exact, adaptive speculative decoding."""

from specserve.cpu_isa import pin_onednn_isa
from specserve.sampling_params import SamplingParams

pin_onednn_isa()  # before torch's first oneDNN call: bf16 stays bit-exact on AMX CPUs (cpu_isa.py)

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not load torch models
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)
