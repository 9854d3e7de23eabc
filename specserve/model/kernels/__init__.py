"""The kernels under the model's layers: the C++ CPU kernels (``cpu_kernels.cpp``, built and loaded by
``cpu.py``) and the Triton kernels for GPUs (``triton_attention.py``, ``triton_quant.py``, ``triton_moe.py``;
tested on CPUs under ``TRITON_INTERPRET=1``). Which of them run is the platform's choice
(``platform.Platform``)."""
