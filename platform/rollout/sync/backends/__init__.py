"""The weight-sync backends, one module each (``gloo``, ``nccl``, ``ipc``; their delta forms
``gloo_delta``, ``sparse_nccl``) and the engine files they run on. What every backend
provides is :mod:`rollout.contracts.backend`; the registry that names them is
:mod:`rollout.contracts.backend_registry`.
"""
