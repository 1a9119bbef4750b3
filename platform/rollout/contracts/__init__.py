"""Contracts: the types, names and torch-free helpers that the layers above speak.

The lowest layer of the package's folders (``tests/test_architecture.py`` declares the
layers): nothing here imports a service, so config, the weight sync, routing, the engine,
the ingress and the clients can all import it without torch, vLLM or Ray.

- :mod:`~rollout.contracts.sync_protocol`: the weight-sync messages between publisher,
  coordinator and replicas.
- :mod:`~rollout.contracts.backend` and :mod:`~rollout.contracts.backend_registry`: what
  every weight-sync backend provides, and the backends by name (implemented in
  :mod:`rollout.sync.backends`).
- :mod:`~rollout.contracts.net`: which address and ports a transfer group advertises.
- :mod:`~rollout.contracts.load`: a replica's load, as router, autoscaler and clients read it.
- :mod:`~rollout.contracts.version`: policy versions as vLLM labels them.
"""
