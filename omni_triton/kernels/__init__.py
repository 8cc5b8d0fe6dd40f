"""Triton-lang kernels of the GPU fast path.

Every kernel here has a plain torch twin in ``omni_triton.models.layers`` (``snake``'s: the vocoder's
``SnakeBeta``), the CPU path and the reference; the layers call a kernel only for CUDA tensors and only while
their ``use_kernels`` switch is on. Nothing in this package is imported on a CPU-only path, so ``triton`` stays
an optional dependency: the kernel modules import it at their top and are themselves imported lazily, from
inside the CUDA branch of a layer.

On a machine without a GPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` set before
the first kernel module is imported): that is how ``tests/test_kernels.py`` checks them in CI.

Modules: ``norm`` (RMSNorm, residual add + RMSNorm, per-head q/k norm + rotary), ``routing`` (softmax top-k
router, expert-sorted token layout), ``fused_moe`` (the two grouped GEMMs of a MoE block, FP8 experts too),
``fp8_linear`` (linears with block-FP8 weights: w8a16, w8a8),
``paged_attention`` (KV store by slot mapping, single-token decode over the paged cache), ``random``
(counter-based uniforms for seeded sampling), ``sampling`` (the row sampler), ``activation`` (SiLU-and-mul),
``small_linear`` (linears for few rows with their neighbours fused in), ``wide_linear`` (the code predictor's
wide products as a TMA GEMM), ``frame_attention`` (the code predictor's attention of one step),
``snake`` (the vocoder's SnakeBeta activation), ``dependent_launch`` (programmatic dependent launch),
``scratch`` (buffers kept from call to call), ``tune_fused_moe`` (the MoE block sizes per GPU).
"""
