"""The ``gloo_delta`` weight-transfer engine: the ``gloo`` engine that also takes deltas.

The engine keeps what the model holds in checkpoint layout (a full round's received
buffers; after a delta, patched copies of the tensors it changed): the base a delta is
checked against, by digest (:class:`~rollout.contracts.sync_protocol.DeltaBaseError` before anything
loads where it is not exactly the delta's base), and what the replica digests after a
delta, the full tensors it now holds, so the coordinator compares them with the
publisher's digests of the full new tensors.

How a delta reaches the live model on CPU: vLLM's CPU engine repacks every linear weight
after loading and leaves the layer's ``weight`` parameter empty (``dispatch_cpu_unquantized_gemm``
with ``remove_weight=True``), so vLLM's sparse loader (``load_checkpoint_weight_patches``
with indices, which patches the live parameters in place and is what ``sparse_nccl`` uses
on GPUs) has nothing to patch here. The engine applies the patch to its checkpoint-layout
copy instead, then loads the full tensors with vLLM's ``load_checkpoint_weight_patches``
(dense patches, the model's own loader) inside the layerwise reload that
``start_weight_update`` began, which repacks them as a full round does. Only the wire
carries the delta; the load is a full one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from rollout.contracts.sync_protocol import DeltaBaseError
from rollout.sync import delta, digest
from rollout.sync.backends.gloo_stream import receive_buckets
from rollout.sync.backends.gloo_worker import GlooUpdateInfo, GlooWeightTransferEngine


@dataclass
class GlooDeltaUpdateInfo(GlooUpdateInfo):
    # A delta round's (rollout.sync.backends.gloo_delta.GlooDelta); None on a full round.
    delta_base_version: Optional[int] = None
    delta_base_digest: Optional[str] = None
    delta_counts: Optional[list[int]] = None

    def __post_init__(self):
        super().__post_init__()
        if self.delta_counts is not None and (len(self.delta_counts) != len(self.names) or self.delta_base_digest is None):
            raise ValueError(f"a delta names its base digest and has one count per parameter (got {len(self.delta_counts)} counts for {len(self.names)})")


class GlooDeltaWeightTransferEngine(GlooWeightTransferEngine):
    update_info_cls = GlooDeltaUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        # What the live model holds, in checkpoint layout, and its per-tensor digests; None
        # while the model holds anything else (mid-load, after a failed round).
        self.held: Optional[dict[str, torch.Tensor]] = None
        self.held_digests: digest.TensorDigests = {}
        self._receiving: dict[str, torch.Tensor] = {}
        self._receiving_digests: Optional[digest.TensorDigests] = None

    def update_weights(self, update_info: dict) -> None:
        try:
            super().update_weights(update_info)
        except BaseException:
            self.held = None  # the live weights may be a mix: no base until a full round
            raise

    def receive_weights(self, update_info: GlooDeltaUpdateInfo) -> None:
        if update_info.delta_counts is None:
            self._receive_full(update_info)
        else:
            self._receive_delta(update_info)

    # ---- a full round ------------------------------------------------------------------

    def _receive_full(self, update_info: GlooDeltaUpdateInfo) -> None:
        self.held = None
        self._receiving, self._receiving_digests = {}, None
        super().receive_weights(update_info)
        received = self._receiving
        digests = self._receiving_digests if self._receiving_digests is not None else digest.digest_all(received.items())
        self.held, self.held_digests = received, digests
        self._receiving, self._receiving_digests = {}, None

    def _loaded(self, named) -> None:
        self._receiving.update(named)

    def _write_digests(self, path: str, received: digest.TensorDigests, seconds: float) -> None:
        self._receiving_digests = dict(received)
        super()._write_digests(path, received, seconds)

    # ---- a delta round -----------------------------------------------------------------

    def check_base(self, update_info: GlooDeltaUpdateInfo) -> dict[str, torch.Tensor]:
        """What the delta applies onto, or :class:`DeltaBaseError` when this engine does not
        hold exactly its base."""
        if self.held is None:
            raise DeltaBaseError(
                f"this engine holds no base for a delta onto version {update_info.delta_base_version} "
                "(its weights came from a checkpoint reload or a failed round): it takes a full send"
            )
        held_digest = digest.combine(self.held_digests)
        if held_digest != update_info.delta_base_digest:
            raise DeltaBaseError(
                f"the delta applies onto version {update_info.delta_base_version} with digest {update_info.delta_base_digest[:16]}…, "
                f"this engine holds digest {held_digest[:16]}…: not its base"
            )
        return self.held

    def _receive_delta(self, update_info: GlooDeltaUpdateInfo) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch, load_checkpoint_weight_patches

        if self.slot.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call init_weight_transfer_engine first")
        base = self.check_base(update_info)
        specs = update_info.specs()
        counts = update_info.delta_counts
        path = update_info.digest_path
        corrupt = bool(path) and digest.take_corruption(path)  # test hook, inert unless a test set it
        received: dict[str, torch.Tensor] = {}
        for named in receive_buckets(self.slot.group, delta.wire_specs(specs, counts), self.bucket_bytes):
            if corrupt and named:
                digest.corrupt(named[-1][1])  # as a transfer that flipped a byte would
                corrupt = False
            received.update(named)
        pieces = delta.pieces(specs, counts, received)
        # The full tensors the model holds once loaded, and their digests (the unchanged
        # ones' digests are the base's): what the coordinator compares with the publisher's.
        t0 = time.perf_counter()
        held = delta.apply(base, specs, counts, received)
        digests = dict(self.held_digests)
        for p in pieces:
            digests[p.name] = digest.tensor_digest(held[p.name])
        digest_s = time.perf_counter() - t0
        self.held = None  # the live tensors change from here
        # Every tensor, whole, through the model's loader (see the module doc for why not
        # the sparse form on CPU); the layerwise reload repacks them.
        load_checkpoint_weight_patches(self.model, [CheckpointWeightPatch(s.name, s.shape, s.torch_dtype, held[s.name].reshape(-1)) for s in specs])
        self.held, self.held_digests = held, digests
        if path:
            super()._write_digests(path, digests, digest_s)
