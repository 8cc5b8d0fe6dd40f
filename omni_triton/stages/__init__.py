"""What runs inside the stage stub processes that tritonserver starts (model_repository/*/1/model.py).

Triton tensors <-> the stage services (stage_io.py), the launch settings read back (model_args.py), the
orchestrator and its BLS calls (orchestrator.py, bls_clients.py), admission (admission.py), the code2wav
requests (code2wav_requests.py) and its call log (code2wav_call_log.py), metrics (metrics.py) and the watch on other stages' stubs (stage_supervisor.py).
Nothing here is imported by the launcher (``omni_triton.launch``); the two share only ``omni_triton.shared``.
"""
