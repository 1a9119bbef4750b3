"""What the receiving engines that replay a :class:`~rollout.sync.backends.direct_plan.DirectPlan`
share (``nccl_worker``'s and ``ipc_worker``'s): whether a round may go direct at all, the
plan for a round's names (baked once, re-baked when the names or the live tensors change),
the one warning per reason a round takes vLLM's own path instead, and how a round ends
(finished only where it took vLLM's path, a failed one finalized so no layer stays on meta).

A mix-in for a vLLM ``WeightTransferEngine`` subclass: it reads the engine's
``vllm_config``, ``parallel_config``, ``model``, ``device``; vLLM is imported only where a
plan is baked.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from rollout.sync.backends.direct_plan import DirectPlan, bake, plan_key

logger = logging.getLogger(__name__)

DIRECT, VLLM = "direct", "vllm"


class DirectReceiver:
    """Mixed into a vLLM weight-transfer engine (before it in the bases)."""

    def _direct_init(self) -> None:
        self._plan: Optional[DirectPlan] = None
        self._mode: Optional[str] = None  # this round's path: None until its first chunk
        self._logged: set[str] = set()
        # The path the last chunk took ("direct" or "vllm"), for checks and logs.
        self.last_path: Optional[str] = None

    def _static_reason(self) -> Optional[str]:
        """Why no round of this engine (as configured now) can take the direct path."""
        vc, pc = self.vllm_config, self.parallel_config
        if torch.device(self.device).type != "cuda":
            return f"device {self.device} is not CUDA (vLLM repacks weights after loading there)"
        if vc.quant_config is not None or getattr(self.model_config, "quantization", None):
            return "the model is quantized (weights are processed after loading)"
        if vc.lora_config is not None:
            return "LoRA is enabled"
        if pc.pipeline_parallel_size != 1 or pc.tensor_parallel_size != 1:
            return f"pipeline/tensor parallel {pc.pipeline_parallel_size}/{pc.tensor_parallel_size} (the direct path is TP=1, PP=1 only)"
        if self.model is not self._default_model:
            return "a draft-model update"
        return None

    # ---- a round's start and end, the same for every direct engine -----------------------

    def start_weight_update(self) -> None:
        # The path is chosen at the round's first chunk (its names decide the plan); a round
        # that cannot go direct starts vLLM's layerwise reload here, before any bytes.
        reason = self._static_reason()
        if reason is not None:
            self._fall_back(reason)
            self._start_vllm()
        else:
            self._mode = None

    def _start_vllm(self) -> None:
        """vLLM's own start (its layerwise reload) for a round that takes its path. Its
        ``super()`` is the vLLM engine's, also when a subclass calls this from its receive."""
        super().start_weight_update()
        self._mode = VLLM

    def update_weights(self, update_info: dict) -> None:
        try:
            super().update_weights(update_info)  # vLLM's engine: parse, receive, synchronize
        except BaseException:
            if self._mode == VLLM:
                # vLLM's worker ends a failed session without finishing it, which would
                # leave layers on meta (and the next start_weight_update fails). Finalizing
                # materializes them again; the replica stays paused until a restore round.
                self._finish()
            self._mode = None
            raise

    def finish_weight_update(self) -> None:
        # Direct: nothing to finish. The copies landed in the live storage (update_weights
        # synchronized), no layer left it, and nothing vLLM's finalize runs applies to an
        # unquantized model's weights: attention's process_weights_after_loading only sets
        # default k/v scales (untouched by the copies), and linear layers process nothing
        # on CUDA (CPU repacking is why CPU never goes direct).
        if self._mode == VLLM:
            self._finish()
        self._mode = None

    def _finish(self) -> None:
        self._mode = None
        super().finish_weight_update()

    def _fall_back(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("weight update: vLLM's layerwise reload for this round, not the direct copy: %s", reason)
        else:
            logger.debug("weight update: vLLM's path: %s", reason)

    def _plan_for(self, names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> DirectPlan:
        """The baked plan for this round's names (re-baked when they, or the live
        tensors' storage, changed), or Ineligible."""
        key = plan_key([(n, getattr(torch, d), tuple(s)) for n, d, s in zip(names, dtype_names, shapes)])
        plan = self._plan
        if plan is not None and plan.key == key:
            stale = plan.stale(self.model)
            if stale is None:
                return plan
            logger.info("weight update: direct plan baked again: %s", stale)
        self._plan = None
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        specs = [(n, getattr(torch, d), tuple(s)) for n, d, s in key]
        with disable_mtp_completeness_check():
            plan = bake(self.model, specs)
        logger.info("weight update: direct plan baked: %d names into %d copies (%d fills, %d dropped)", len(specs), plan.num_copies, len(plan.fills), len(plan.dropped))
        self._plan = plan
        return plan
