"""The weight-sync backends, by name: a registry in the shape of vLLM's
``WeightTransferEngineFactory``. Each backend is one module of :mod:`rollout.sync.backends`
(``gloo``, ``nccl``, ``ipc``; their delta forms ``gloo_delta``, ``sparse_nccl``)
holding its :class:`~rollout.contracts.backend.SyncBackend`, its trainer-side sender and
what its sender offers; adding one is one new file plus one entry here (or
:func:`register_backend`). Everything else reads what the backend declares: its init info,
whether the coordinator keeps a copy (a ``CopySender``), its vLLM engines of its own
(registered by :mod:`rollout.sync.vllm_plugin`), what its engine processes need. A backend
whose replicas receive with an engine of its own adds that engine's files too (``gloo``:
``gloo_worker`` and ``gloo_trainer``, on ``gloo_group`` and ``gloo_stream``).

Backends load on first use, so config and the ingress read the names without torch. The
registry names its backends by ``"module:class"`` (as an entry point does) and imports none:
it is a contract, below the services that implement it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.contracts.backend import Sender, SyncBackend

# name -> "module:class"
_REGISTRY: dict[str, str] = {
    # CPU engines (ours; vLLM's worker side registered by rollout.sync.vllm_plugin).
    "gloo": "rollout.sync.backends.gloo:GlooBackend",
    # GPU engines, vLLM's own NCCL engine; the trainer on another GPU or node.
    "nccl": "rollout.sync.backends.nccl:NcclBackend",
    # GPU engines, vLLM's own CUDA IPC engine; the trainer on the replicas' GPU.
    "ipc": "rollout.sync.backends.ipc:IpcBackend",
}
# The same transports sending only what changed since the committed weights where that
# is cheaper (rollout.sync.delta): gloo's with our engine, vLLM's sparse NCCL engine.
_DELTA_FORMS: dict[str, str] = {
    "gloo_delta": "rollout.sync.backends.gloo_delta:GlooDeltaBackend",
    "sparse_nccl": "rollout.sync.backends.sparse_nccl:SparseNcclBackend",
}
_REGISTRY.update(_DELTA_FORMS)
_loaded: dict[str, "SyncBackend"] = {}

AUTO = "auto"


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def register_backend(name: str, target: str) -> None:
    """Add a backend (``"package.module:Class"``) under ``name``."""
    if name in _REGISTRY or name == AUTO:
        raise ValueError(f"backend: {name!r} is already registered")
    _REGISTRY[name] = target


def get_backend(name: str) -> "SyncBackend":
    if name not in _loaded:
        if name not in _REGISTRY:
            full = ", ".join(repr(n) for n in _REGISTRY if n not in _DELTA_FORMS)
            raise ValueError(f"backend: unknown {name!r} (available: {full}) or, sending deltas, ({', '.join(map(repr, _DELTA_FORMS))})")
        module, cls = _REGISTRY[name].split(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


def resolve_backend(name: str, device: str) -> str:
    """``auto`` is ``nccl`` on GPUs and ``gloo`` on CPUs."""
    if name != AUTO:
        get_backend(name)  # fail now on an unknown name
        return name
    return "nccl" if device == "cuda" else "gloo"


def make_sender(name: str) -> "Sender":
    return get_backend(name).make_sender()
