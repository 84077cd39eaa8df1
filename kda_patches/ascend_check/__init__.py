"""Ascend compile check: every state-copy kernel variant compiled for A2/A3 and A5 on the CPU.

Runs in its own environment (triton-ascend installs as the package ``triton``): ``make ascend-check``.
Modules: ``toolchain`` (triton-ascend's stages up to bishengir's final HIVM IR), ``plan_variants``
(the variants, enumerated from the plan classes), ``calibration`` (vllm-ascend's shipping kernels and a
canary), ``run`` (the check and its verdicts), ``matrix`` (``patches/ASCEND_COMPILE.md``).
"""
