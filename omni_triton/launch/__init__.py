"""The launcher: what `omni-triton serve` runs in its own process before and around tritonserver.

Which tritonserver and Python backend (tritonserver.py, python_backend.py), the GPU memory plan (memory_plan.py),
the serve options (options.py, serve.py), the rendered model repository (repository.py), CUDA MPS (mps.py) and
Kubernetes manifests (deploy.py). Nothing here runs inside a stage stub: that is ``omni_triton.stages``; the two
share only ``omni_triton.shared``.
"""
