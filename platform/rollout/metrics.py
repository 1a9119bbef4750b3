"""The platform's Prometheus metrics.

Recorded with ``ray.util.metrics`` so Ray's metrics agent exports them from every
replica process on the node's metrics port (``--metrics-export-port``, 8080 in the
chart), with Ray's ``ray_`` prefix: ``rollout_generated_tokens_total`` is scraped as
``ray_rollout_generated_tokens_total``. vLLM's own metrics are exported the same way by
vLLM's ``RayPrometheusStatLogger`` under their current names (``ray_vllm_*``).

Labels are bounded on purpose: replica ids, outcomes, backends and failure reasons come
from small fixed sets; request ids and prompts never become labels.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from rollout.contracts.load import ReplicaLoad
from rollout.contracts.version import version_of

LATENCY_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
SYNC_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]

REQUEST_OUTCOMES = ("ok", "invalid", "cancelled", "error")
TOOL_OUTCOMES = ("ok", "error")
# A replica's start phases: well under a second (the tokenizer) to minutes (a cold compile).
START_BUCKETS = [0.5, 1, 2, 5, 10, 20, 30, 60, 120, 180, 300, 600, 1200]
TOOL_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]
SYNC_FAILURE_REASONS = ("trainer", "replica", "deadline", "keeper", "digest")


class EngineMetrics:
    """Per-replica metrics of an engine replica."""

    def __init__(self, replica_id: str, model: str, app: str):
        from ray.util import metrics as m

        tags = ("replica", "model", "app")
        self._tags = {"replica": replica_id, "model": model, "app": app}
        self.requests = m.Counter("rollout_requests", "Rollout requests by outcome.", tag_keys=tags + ("outcome",))
        self.generated = m.Counter("rollout_generated_tokens", "Tokens generated and returned to clients.", tag_keys=tags)
        self.prompt = m.Counter("rollout_prompt_tokens", "Prompt tokens of served requests.", tag_keys=tags)
        self.latency = m.Histogram(
            "rollout_request_latency_seconds", "End-to-end latency of a request inside the replica.", boundaries=LATENCY_BUCKETS, tag_keys=tags
        )
        self.running = m.Gauge("rollout_engine_running", "Sequences the engine is running.", tag_keys=tags)
        self.waiting = m.Gauge("rollout_engine_waiting", "Sequences waiting for the engine.", tag_keys=tags)
        self.kv_usage = m.Gauge("rollout_kv_cache_usage", "Fraction of KV-cache blocks in use (0-1).", tag_keys=tags)
        self.prefix_queries = m.Counter("rollout_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", tag_keys=tags)
        self.prefix_hits = m.Counter("rollout_prefix_cache_hits", "Prompt tokens found in the prefix cache.", tag_keys=tags)
        self.version = m.Gauge("rollout_replica_weight_version", "Policy version the replica serves.", tag_keys=tags)
        # Tool names come from the platform's registry (tools.functions and the built-ins), never from requests.
        self.tool_calls = m.Counter("rollout_tool_calls", "Tool calls of episodes by tool and outcome.", tag_keys=tags + ("tool", "outcome"))
        self.tool_seconds = m.Histogram("rollout_tool_call_seconds", "Time of a tool call, queueing for a worker included.", boundaries=TOOL_BUCKETS, tag_keys=tags + ("tool",))
        # 1 for the isolation the replica's python tool runs under ("none": no python tool);
        # the label is one of a few fixed spellings (rollout.tools.sandbox.Isolation.label).
        self.sandbox = m.Gauge("rollout_tool_sandbox", "Isolation of the replica's python tool calls (1 for the one in force).", tag_keys=tags + ("isolation",))
        self._sandbox_label: Optional[str] = None
        # Once per replica start (rollout.engine.startup): a histogram, which Ray does not age out.
        self.start_seconds = m.Histogram(
            "rollout_replica_start_seconds", "Seconds each phase of a replica's start took (rollout.engine.startup).", boundaries=START_BUCKETS, tag_keys=tags + ("phase",)
        )

    def start_phase(self, phase: str, seconds: float) -> None:
        self.start_seconds.observe(seconds, tags={**self._tags, "phase": phase})

    def request(self, outcome: str, n: int = 1) -> None:
        if outcome not in REQUEST_OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {REQUEST_OUTCOMES}")
        if n > 0:
            self.requests.inc(n, tags={**self._tags, "outcome": outcome})

    def tool_call(self, tool: str, ok: bool, seconds: float) -> None:
        tags = {**self._tags, "tool": tool}
        self.tool_calls.inc(1, tags={**tags, "outcome": "ok" if ok else "error"})
        self.tool_seconds.observe(seconds, tags=tags)

    def tool_sandbox(self, label: str) -> None:
        self._sandbox_label = label
        self.sandbox.set(1, tags={**self._tags, "isolation": label})

    def served(self, prompt_tokens: int, generated_tokens: int, latency_s: float) -> None:
        # Ray counters reject increments of 0.
        if prompt_tokens:
            self.prompt.inc(prompt_tokens, tags=self._tags)
        if generated_tokens:
            self.generated.inc(generated_tokens, tags=self._tags)
        self.latency.observe(latency_s, tags=self._tags)

    def prefix_cache(self, queries: int, hits: int) -> None:
        if queries:
            self.prefix_queries.inc(queries, tags=self._tags)
        if hits:
            self.prefix_hits.inc(hits, tags=self._tags)

    def gauges(self, load: ReplicaLoad) -> None:
        """Called on a fixed period, not per engine step: Ray ages out gauge series
        that are not re-reported, so an idle engine must keep reporting its zeros.
        A signal missing from ``load`` is not set: its series ages out rather than
        showing a value nobody measured."""
        version = version_of(load.weight_version) if load.weight_version is not None else None
        for gauge, value in (
            (self.running, load.running),
            (self.waiting, load.waiting),
            (self.kv_usage, load.kv_cache_usage),
            (self.version, version),
        ):
            if value is not None:
                gauge.set(value, tags=self._tags)
        if self._sandbox_label is not None:  # re-reported with the others, or Ray ages it out
            self.sandbox.set(1, tags={**self._tags, "isolation": self._sandbox_label})


class SyncMetrics:
    """Metrics of the weight-sync coordinator."""

    def __init__(self, backend: str):
        from ray.util import metrics as m

        self.backend = backend
        self.committed = m.Gauge("rollout_committed_weight_version", "Last committed policy version.")
        self.lag = m.Gauge("rollout_weight_version_lag", "Committed version minus the version a replica serves.", tag_keys=("replica",))
        self.replicas = m.Gauge("rollout_sync_replicas", "Engine replicas registered with the coordinator.")
        self.duration = m.Histogram(
            "rollout_weight_sync_duration_seconds", "Publish round duration, open to decision.", boundaries=SYNC_BUCKETS, tag_keys=("backend", "kind")
        )
        self.bytes = m.Counter("rollout_weight_sync_bytes", "Bytes of weights committed per backend.", tag_keys=("backend",))
        self.rounds = m.Counter("rollout_weight_sync_rounds", "Sync rounds by kind and result.", tag_keys=("backend", "kind", "result"))
        self.failures = m.Counter("rollout_weight_sync_failures", "Aborted sync rounds by reason.", tag_keys=("backend", "reason"))
        self.unconfirmed_replicas = m.Counter(
            "rollout_weight_sync_unconfirmed", "Replicas that did not confirm serving a committed version within the step deadline.", tag_keys=("backend",)
        )
        # A replica whose received bytes differ from what the publisher sent (the round
        # aborts; see rollout.sync.digest): one count per replica per round.
        self.digest_mismatches = m.Counter(
            "rollout_weight_sync_digest_mismatches", "Replicas whose received weights differed from the publisher's digest.", tag_keys=("backend", "replica")
        )
        self.committed.set(0)
        self.replicas.set(0)

    def round(self, kind: str, committed: bool, seconds: float, nbytes: int, reason: Optional[str]) -> None:
        tags = {"backend": self.backend, "kind": kind}
        self.duration.observe(seconds, tags=tags)
        self.rounds.inc(1, tags={**tags, "result": "committed" if committed else "aborted"})
        if committed and kind == "publish" and nbytes:
            self.bytes.inc(nbytes, tags={"backend": self.backend})
        if not committed:
            reason = reason if reason in SYNC_FAILURE_REASONS else "replica"
            self.failures.inc(1, tags={"backend": self.backend, "reason": reason})

    def digest_mismatch(self, replica_id: str) -> None:
        self.digest_mismatches.inc(1, tags={"backend": self.backend, "replica": replica_id})

    def unconfirmed(self, replicas: int) -> None:
        self.unconfirmed_replicas.inc(replicas, tags={"backend": self.backend})

    def membership(self, committed_version: int, versions: dict[str, int], gone: list[str]) -> None:
        self.committed.set(committed_version)
        self.replicas.set(len(versions))
        for rid, v in versions.items():
            self.lag.set(committed_version - v, tags={"replica": rid})
        for rid in gone:
            # A departed replica must not keep reporting its last lag forever.
            self.lag.set(0, tags={"replica": rid})


# vLLM metrics not exported through Ray, and why (logged once by each replica).
VLLM_METRICS_LEFT_OUT = {
    "vllm:inter_token_latency_seconds": (
        "one record per running request per engine step; through Ray's agent they cost the replica's node "
        "about a tenth of a core at 64 concurrent requests on 2 cores (bench: engine_throughput), and "
        "vllm:request_time_per_output_token_seconds has the same latency per finished request"
    ),
}


class _NoRecord:
    def observe(self, value) -> None:
        pass


@lru_cache(maxsize=1)
def vllm_ray_stat_logger():
    """vLLM's own metrics through Ray's agent (``ray_vllm_*``), as Ray Serve LLM does, less
    the per-token histogram (:data:`VLLM_METRICS_LEFT_OUT`), recorded once a second rather
    than once per engine step (:mod:`rollout.coalesced_stats`)."""
    import logging

    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    from rollout.coalesced_stats import coalescing

    class RolloutRayStatLogger(RayPrometheusStatLogger):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # vLLM observes it per engine: keep the mapping's keys, record nothing.
            self.histogram_inter_token_latency = {idx: _NoRecord() for idx in self.histogram_inter_token_latency}
            for name, why in VLLM_METRICS_LEFT_OUT.items():
                logging.getLogger(__name__).info("not exported: %s (%s)", name, why)

    return coalescing(RolloutRayStatLogger)
