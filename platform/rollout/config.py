"""The one source of configuration truth for the platform.

Every knob of the platform is a documented, range-checked field of
:class:`PlatformConfig`. The same models feed the CLI (``rollout serve --config``),
the Serve application (``rollout.app:build``), the configuration reference (docs/configuration.md)
and, later, the Helm chart's ``values.schema.json``; nothing is configured anywhere else.

A config file is YAML; the smallest one names only the model::

    model: {path: /models/demo}

Environment variables override the file: ``ROLLOUT_<SECTION>__<FIELD>=value``
(for example ``ROLLOUT_HTTP__PORT=9000``). Values are parsed as YAML scalars.
Secrets never live in the config: the HTTP API key comes from ``ROLLOUT_API_KEY``
or from the file named by ``http.api_key_file``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.api import RewardSpec
from rollout.contracts.backend_registry import AUTO, backend_names
from rollout.contracts.net import PortRange
from rollout.contracts.sync_protocol import DEFAULT_BUCKET_BYTES, SYNC_TOKEN_ENV, PauseMode

logger = logging.getLogger(__name__)

ENV_PREFIX = "ROLLOUT_"
ENV_NESTED_DELIMITER = "__"
API_KEY_ENV = "ROLLOUT_API_KEY"


# Why sleep mode is refused on CPU: vLLM's CPU platform (vllm.platforms.cpu) inherits
# Platform.is_sleep_mode_available(), true only for CUDA, ROCm and XPU, and its worker's
# sleep() only logs a warning.
SLEEP_ON_CPU = "vLLM's CPU platform has no sleep mode (is_sleep_mode_available() is False there: CUDA, ROCm and XPU only)"


class _Section(BaseModel):
    # Unknown keys are typos, and a typo in a config file must not be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Why the CPU refuses what only GPU engines offer (config validation, replica start, requests say the same).
CPU_NO_ROUTED_EXPERTS = (
    "not on CPU: vLLM 0.32 returns routed experts only from its V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton, "
    "and its CPU build has neither; run MoE replicas with it on GPUs (model.device: cuda)"
)
CPU_NO_FP8 = (
    "not on CPU: vLLM 0.32's CPU build has no FP8 quantization kernel (its _C::static_scaled_fp8_quant is a stub there, and an engine "
    "quantizing online fails loading the weights); run FP8 replicas on GPUs (model.device: cuda)"
)


class LoraConfig(_Section):
    """LoRA adapters published as policies (``WeightPublisher.publish_adapter``): vLLM's
    LoRA support in every engine replica, off unless enabled."""

    enabled: bool = Field(
        default=False,
        description="Start every engine with vLLM's LoRA support, so trainers can publish adapters (`publish_adapter`) and requests can name them.",
    )
    max_loras: int = Field(default=4, ge=1, le=256, description="Most adapters one engine batch runs at once (vLLM's `max_loras`), 1..256; more stay loaded and wait their turn.")
    max_lora_rank: int = Field(default=16, ge=1, le=512, description="Highest adapter rank an engine accepts (vLLM's `max_lora_rank`), 1..512; a publish of a higher rank is refused naming `config.r`.")
    max_cpu_loras: Optional[int] = Field(default=None, ge=1, le=4096, description="Adapters each engine keeps loaded in host memory (vLLM's `max_cpu_loras`), 1..4096; defaults to `max_loras`. Every live adapter should fit.")

    @model_validator(mode="after")
    def _cpu_holds_the_batch(self) -> "LoraConfig":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self


class ModelConfig(_Section):
    """The model every engine replica serves, and how vLLM runs it."""

    path: str = Field(
        description="Directory (or hub-style id already present locally) of the HF-format model weights."
    )
    tokenizer: Optional[str] = Field(
        default=None, description="Tokenizer directory; defaults to `path`."
    )
    served_name: Optional[str] = Field(
        default=None,
        description="Model name reported by `/v1/models` and accepted by the OpenAI endpoints; defaults to the directory name of `path`.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight and activation dtype passed to vLLM."
    )
    max_model_len: Optional[int] = Field(
        default=None, ge=16, le=1_048_576,
        description="Context length (prompt + generated tokens), 16..1048576; defaults to the model's own.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="GPUs per engine replica (tensor parallelism), 1..64."
    )
    max_num_seqs: int = Field(
        default=256, ge=1, le=4096, description="Most sequences one engine schedules at once, 1..4096. Replica concurrency is sized from it."
    )
    gpu_memory_utilization: Optional[float] = Field(
        default=None, gt=0.0, le=1.0,
        description=(
            "Fraction of accelerator memory (on CPU: of one NUMA node's memory, which must be free at start) vLLM may use, (0, 1]. "
            "Unset: 0.9 on GPUs; on CPU the KV cache is sized from the memory free on the replica's node (a quarter of it after the weights, "
            "256 MiB to 4 GiB, logged at start). Ignored when `kv_cache_memory_bytes` is set."
        ),
    )
    kv_cache_memory_bytes: Optional[int] = Field(
        default=None,
        ge=1 << 20,
        description="Exact KV-cache size in bytes (>= 1 MiB); overrides `gpu_memory_utilization`. A replica that cannot fit it fails at start, naming this field.",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV-cache blocks of shared prompt prefixes."
    )
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Engine seed, 0..2^31-1.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="Where replicas run: `cuda` reserves GPUs through placement groups, `cpu` none; `auto` uses GPUs when the Ray cluster has any.",
    )
    enforce_eager: bool = Field(
        default=False, description="Disable CUDA graphs / compilation (faster start, slower decode)."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters as published policies.")
    return_routed_experts: bool = Field(
        default=False,
        description="Let requests and episodes ask for the experts a mixture-of-experts model routed every token to (`return_routed_experts`; router replay "
        "in training): vLLM's `enable_return_routed_experts`. Needs a MoE model, prefix caching and a GPU: vLLM returns them only from its V2 model "
        "runner, which needs Triton (the platform sets `VLLM_USE_V2_MODEL_RUNNER=1` where unset); a replica that cannot refuses to start naming this field.",
    )
    quantization: Optional[Literal["fp8", "fp8_per_tensor", "fp8_per_channel", "fp8_per_block"]] = Field(
        default=None,
        description="Quantize the BF16/FP16 weights to FP8 as the engine loads them (vLLM's online quantization; `fp8` is its `fp8_per_tensor`), and again "
        "after every publish: trainers keep publishing full-precision weights. GPU only (vLLM's CPU build has no FP8 quantization kernel). None: the checkpoint's own "
        "(an FP8 checkpoint is served as FP8 without it).",
    )
    enable_sleep_mode: bool = Field(
        default=False,
        description="Start every engine with vLLM's sleep mode, so a trainer sharing the replicas' GPUs can free their memory between rollout phases "
        "(`/sleep`, `/wake_up`, `RolloutClient.sleep`). GPUs only: vLLM's CPU platform has no sleep mode.",
    )

    @model_validator(mode="after")
    def _gpu_features(self) -> "ModelConfig":
        if self.device == "cpu":
            if self.return_routed_experts:
                raise ValueError(f"return_routed_experts: {CPU_NO_ROUTED_EXPERTS}")
            if self.quantization is not None:
                raise ValueError(f"quantization: {CPU_NO_FP8}")
            if self.enable_sleep_mode:
                raise ValueError(f"enable_sleep_mode: {SLEEP_ON_CPU}")
        if self.return_routed_experts and not self.enable_prefix_caching:
            # vLLM keys routed experts by the prefix cache's block hashes (its AuxOutput connector).
            raise ValueError("return_routed_experts needs enable_prefix_caching: vLLM keeps routed experts by the prefix cache's block hashes")
        return self

    @property
    def vllm_quantization(self) -> Optional[str]:
        """``quantization`` as vLLM names it (its ``fp8`` means an FP8 checkpoint; online is ``fp8_per_tensor``)."""
        return "fp8_per_tensor" if self.quantization == "fp8" else self.quantization

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    @property
    def name(self) -> str:
        return self.served_name or Path(self.path).name


class AutoscalingConfig(_Section):
    """Serve autoscaling bounds and timing for the engine deployment.

    Defaults suit LLM engines (slow to start, expensive to hold), not Serve's web defaults.
    """

    min_replicas: int = Field(default=1, ge=0, le=1024, description="Fewest replicas, 0..1024 (0 allows scale to zero).")
    max_replicas: int = Field(default=4, ge=1, le=1024, description="Most replicas, 1..1024, >= min_replicas.")
    target_ongoing_requests: float = Field(
        default=64.0,
        gt=0,
        description="Sequences (running + waiting in the engine) per replica the autoscaler aims for (> 0).",
    )
    upscale_delay_s: float = Field(default=30.0, ge=0, description="Seconds load must stay high before adding replicas (>= look_back_period_s).")
    downscale_delay_s: float = Field(default=300.0, ge=0, description="Seconds load must stay low before removing replicas (>= look_back_period_s).")
    look_back_period_s: float = Field(default=30.0, gt=0, description="Window (s) over which load is averaged (> 0).")

    @model_validator(mode="after")
    def _check_bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})"
            )
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < self.look_back_period_s:
                # A delay shorter than the averaging window reacts to noise: flapping.
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be >= look_back_period_s ({self.look_back_period_s})"
                )
        return self


class RoutingConfig(_Section):
    """How requests pick an engine replica."""

    policy: Literal["affinity", "default"] = Field(
        default="affinity",
        description="`affinity`: requests sharing a session or prompt prefix go to one replica (its prefix cache), unless it is loaded `max_imbalance` above the least-loaded one; `default`: Serve's power-of-two-choices.",
    )
    max_imbalance: float = Field(default=0.25, ge=0, le=10, description="Load gap ((running+waiting)/max_num_seqs) above the least-loaded replica at which affinity yields, 0..10.")
    prefix_tokens: int = Field(default=32, ge=1, le=65536, description="Leading prompt tokens that form the affinity key, 1..65536.")
    stats_period_s: float = Field(default=1.0, gt=0, le=60, description="How often replicas report engine stats to routers (bounds their staleness), (0, 60].")


class DeploymentConfig(_Section):
    """How the engine deployment runs in Ray Serve."""

    name: str = Field(default="RolloutEngine", description="Serve deployment name of the engine.")
    replicas: int = Field(default=1, ge=0, le=1024, description="Fixed replica count when `autoscaling` is unset, 0..1024.")
    autoscaling: Optional[AutoscalingConfig] = Field(
        default=None, description="Autoscaling settings; unset means a fixed `replicas` count."
    )
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    max_ongoing_requests: Optional[int] = Field(
        default=None, ge=1, le=65536,
        description="Concurrent calls per replica, 1..65536; unset derives it from `model.max_num_seqs` (Serve's default of 5 starves an LLM engine).",
    )
    max_queued_requests: Optional[int] = Field(
        default=None, ge=1, le=1_000_000,
        description="Calls that may wait at each caller (the HTTP ingress, each handle client) for a replica slot once every replica has "
        "`max_ongoing_requests`; beyond it a call is refused at once: HTTP 429 with `Retry-After`, `OverloadedError` through the handle. "
        "Unset: unbounded (Serve's default).",
    )
    overload_retry_after_s: float = Field(default=1.0, gt=0, le=3600, description="`Retry-After` (s) of an overload refusal, (0, 3600].")
    num_cpus: float = Field(default=1.0, ge=0, description="Ray CPUs reserved per engine replica (>= 0).")
    control_resource: Optional[str] = Field(
        default=None,
        min_length=1,
        description="A Ray custom resource the HTTP ingress and the weight-sync coordinator ask a tiny share of, so they run only on nodes that "
        "offer it: the nodes holding the API key and sync token (the chart's head and engine workers), never a tool worker node. None: anywhere.",
    )
    health_check_period_s: float = Field(default=10.0, gt=0, description="Seconds between replica health checks (> 0).")
    health_check_timeout_s: float = Field(default=30.0, gt=0, description="Seconds before a health check counts as failed (> 0).")
    stuck_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A replica with work in flight that produces no token for this long is reported unhealthy (> 0).",
    )
    client_batch_size: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Requests per handle call when a batch is split across replicas, 1..4096. Fewer, larger calls keep Serve's per-call cost off the engine's CPU.",
    )

    def resolved_max_ongoing_requests(self, model: ModelConfig) -> int:
        return self.max_ongoing_requests or model.max_num_seqs


class LimitsConfig(_Section):
    """Per-request limits enforced before anything reaches the engine."""

    max_n: int = Field(default=64, ge=1, le=1024, description="Most samples per request (`n`), 1..1024.")
    max_requests_per_call: int = Field(
        default=4096, ge=1, le=1_000_000, description="Most requests in one `/v1/rollouts` body or `generate` call."
    )


class HttpConfig(_Section):
    """The HTTP ingress (token-level API and OpenAI-compatible endpoints)."""

    host: str = Field(default="0.0.0.0", description="Address Serve's HTTP proxy binds.")
    port: int = Field(default=8000, ge=1, le=65535, description="Serve HTTP port, 1..65535.")
    route_prefix: str = Field(default="/", description="Route prefix of the application.")
    api_key_file: Optional[str] = Field(
        default=None,
        description=f"File holding the Bearer API key. `{API_KEY_ENV}` takes precedence. No key means the API is open (a warning is logged).",
    )
    max_body_bytes: int = Field(
        default=32 << 20,
        ge=1 << 10,
        le=1 << 31,
        description="Largest request body the ingress reads; larger ones get 413 before they are parsed, [1 KiB, 2 GiB].",
    )
    front_door: Literal["serve_proxy", "haproxy"] = Field(
        default="serve_proxy",
        description="What listens on `port`: `serve_proxy`, Serve's Python proxy actor, which hands each request to the ingress replica; "
        "`haproxy`, HAProxy (Serve's `RAY_SERVE_ENABLE_HA_PROXY`), which forwards connections to the ingress replica serving HTTP itself: "
        "no Python hop before the ingress. Set in every Ray process's environment (`rollout serve` and the Helm chart do).",
    )
    throughput_optimized: bool = Field(
        default=False,
        description="Serve's `RAY_SERVE_THROUGHPUT_OPTIMIZED`: calls between deployments over gRPC, user code and request routers on each "
        "replica's main event loop, the garbage collector frozen after start-up. Set like `front_door`.",
    )

    def resolve_api_key(self) -> Optional[str]:
        """The API key, from the environment or the key file; ``None`` when open."""
        key = os.environ.get(API_KEY_ENV)
        if key:
            return key.strip()
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"http.api_key_file: cannot read {self.api_key_file!r}: {e}") from e
            if not key:
                raise ValueError(f"http.api_key_file: {self.api_key_file!r} is empty")
            return key
        return None


class OpenAIConfig(_Section):
    """The OpenAI routes, served by vLLM's own OpenAI server on every replica: these are
    `vllm serve`'s options, by their vLLM names (see vLLM's docs for the values)."""

    tool_call_parser: Optional[str] = Field(default=None, description="vLLM's `--tool-call-parser` (e.g. `hermes`): parses tool calls out of chat completions.")
    enable_auto_tool_choice: bool = Field(default=False, description="vLLM's `--enable-auto-tool-choice`: lets the model decide to call tools (`tool_choice: auto`); needs `tool_call_parser`.")
    reasoning_parser: Optional[str] = Field(default=None, description="vLLM's `--reasoning-parser` (e.g. `deepseek_r1`): splits reasoning content out of chat completions.")
    chat_template: Optional[str] = Field(default=None, description="vLLM's `--chat-template`: a template file or string replacing the tokenizer's.")
    chat_template_content_format: Optional[Literal["auto", "string", "openai"]] = Field(
        default=None, description="vLLM's `--chat-template-content-format` (default `auto`)."
    )

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> "OpenAIConfig":
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (vLLM refuses to start without one)")
        return self


class MetricsConfig(_Section):
    """Prometheus metrics."""

    enabled: bool = Field(default=True, description="Export Prometheus metrics.")
    port: int = Field(default=8080, ge=1, le=65535, description="Ray metrics-export port, 1..65535.")


# The registry's backends (rollout.contracts.backend_registry), and ``auto``.
SyncBackendName = Literal[(AUTO, *backend_names())]


class SyncConfig(_Section):
    """Weight sync from trainer jobs into every replica."""

    enabled: bool = Field(default=True, description="Deploy the weight-sync coordinator and let trainers publish weights.")
    backend: SyncBackendName = Field(
        default="auto",
        description="Transport between trainer and engines: `gloo` (CPU; ours, with the coordinator's weight copy for catch-up and rollback), `nccl` (GPU; vLLM's engine), `ipc` (GPU, a trainer on the replicas' GPU; vLLM's CUDA IPC engine, zero-copy); their delta forms, which send only the elements changed since the committed weights where that is cheaper: `gloo_delta` (CPU; keeps a copy of the weights on the trainer and on each replica) and `sparse_nccl` (GPU; vLLM's sparse NCCL engine); `auto` picks `gloo` or `nccl` by device.",
    )
    pause_mode: PauseMode = Field(
        default="keep",
        description="Requests in flight during an update: `keep` continues them on the new weights (their spans show the switch), `wait` finishes them first, `abort` ends them.",
    )
    prefix_cache: Literal["salt", "flush"] = Field(
        default="salt",
        description="How an update keeps KV computed under older weights from serving later requests: `salt` gives every request a prefix-cache salt "
        "(vLLM's `cache_salt`) naming the version it starts under, so it only reuses blocks of that version and older blocks age out, "
        "flushing only when `keep` carries requests across the update or a trainer's `/pause` holds it; `flush` clears vLLM's prefix cache at every update.",
    )
    timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Deadline (s) of every sync step: rendezvous, transfer, commit, (0, 3600].")
    poll_s: float = Field(
        default=5.0,
        ge=0.01,
        le=300,
        description="Longest a replica's long poll of the coordinator waits for a round, in seconds, [0.01, 300]. With `silent_polls` it bounds how fast a replica "
        "that went away is dropped from membership (a round then commits without it) and how long a replica that cannot reach the coordinator still vouches for the committed version.",
    )
    silent_polls: int = Field(
        default=3,
        ge=2,
        le=100,
        description="Polls a replica may miss before the coordinator drops it from membership (`silent_polls` x `poll_s` seconds), 2..100; "
        "a replica that heard nothing from the coordinator for as long stops vouching for the committed version.",
    )
    max_staleness: Optional[int] = Field(
        default=None, ge=0, le=1_000_000,
        description="Most versions a replica may lag the committed version and still start requests (a request's own `min_weight_version` can ask for more); unset: no bound.",
    )
    bucket_bytes: int = Field(
        default=DEFAULT_BUCKET_BYTES,
        ge=1 << 16,
        le=8 << 30,
        description="Packed transfer bucket size in bytes, 64 KiB..8 GiB. Two buckets per participant are in flight at once; smaller buckets overlap loading with transfer more finely.",
    )
    token_env: str = Field(default=SYNC_TOKEN_ENV, description="Environment variable holding the token trainers must present (see `require_token` for when they must).")
    allowed_service_accounts: list[str] = Field(
        default_factory=list,
        description="Kubernetes service accounts (`system:serviceaccount:NAMESPACE:NAME`) whose projected token, verified by a TokenReview, may publish instead of the sync token.",
    )
    require_token: Optional[bool] = Field(
        default=None,
        description="Whether publishing, finishing a round and vLLM's RL routes need the sync token (or an allowed service account's token). "
        "Unset: decided once when the app is built, true where `token_env` is set in that process's environment or `allowed_service_accounts` is given; "
        "the ingress and the coordinator both follow the decision. True with no token where the coordinator runs refuses every publish.",
    )
    rendezvous_ports: Optional[str] = Field(
        default=None,
        pattern=r"^\s*\d{1,5}(\s*-\s*\d{1,5})?\s*$",
        description="TCP port range `LOW-HIGH` where the coordinator's weight copy hosts the rendezvous of restore and catch-up rounds "
        "(replicas connect to it inside the Ray cluster); unset: a port the kernel picks from its ephemeral range. "
        "Trainers set theirs with `ROLLOUT_PUBLISHER_PORTS`; gloo's and NCCL's own listeners follow the pod's `net.ipv4.ip_local_port_range`.",
    )
    token_audience: str = Field(
        default="rollout-platform",
        min_length=1,
        max_length=256,
        description="The audience a trainer's projected ServiceAccount token must be issued for (its projected volume's `audience`); "
        "the TokenReview names it, so a token meant for the Kubernetes API server is refused.",
    )

    @model_validator(mode="after")
    def _accounts_need_auth(self) -> "SyncConfig":
        if self.require_token is False and self.allowed_service_accounts:
            raise ValueError("sync.require_token: false contradicts sync.allowed_service_accounts (service accounts authenticate publishers)")
        return self

    @model_validator(mode="after")
    def _ports_are_a_range(self) -> "SyncConfig":
        self.rendezvous_port_range()  # LOW <= HIGH, within 1..65535 (the pattern checks the shape)
        return self

    def rendezvous_port_range(self) -> Optional[PortRange]:
        return PortRange.parse(self.rendezvous_ports, "sync.rendezvous_ports") if self.rendezvous_ports else None

    def token_required(self, environ: Optional[Mapping[str, str]] = None) -> bool:
        """The one place that decides whether weight sync needs a credential besides the API key.

        A built app carries the decision in ``require_token`` (see :meth:`resolved`), so the
        ingress and the coordinator, which may run with different environments, agree."""
        if self.require_token is not None:
            return self.require_token
        env = os.environ if environ is None else environ
        return bool(env.get(self.token_env)) or bool(self.allowed_service_accounts)

    def resolved(self, environ: Optional[Mapping[str, str]] = None) -> "SyncConfig":
        """This section with ``require_token`` decided (from ``environ`` when unset)."""
        return self.model_copy(update={"require_token": self.token_required(environ)})


def _check_functions(where: str, functions: dict[str, str], builtins: Any, kind: str) -> None:
    """Registered functions: ``name: module:function``, no name of a built-in."""
    for name, path in functions.items():
        if name in builtins:
            raise ValueError(f"{where}.{name}: the name of a built-in {kind}; pick another")
        module, sep, attr = path.partition(":")
        if not (module and sep and attr):
            raise ValueError(f"{where}.{name}: {path!r} is not 'module:function'")


class RewardsConfig(_Section):
    """Inline rewards, scored next to the engine as each sample finishes."""

    functions: dict[str, str] = Field(
        default_factory=dict,
        description="Your reward functions, `name: module:function`: imported when a replica starts (a bad path fails the start), "
        "called as `fn(text, **params)` and returning a number or `(number, details)`. Requests name them; a request never names an import path.",
    )
    default: Optional[RewardSpec] = Field(default=None, description="The reward of requests that name none, e.g. `{name: math_equal, params: {answer: '42'}}`; unset: none.")
    timeout_s: float = Field(default=10.0, gt=0, le=600, description="Most seconds one sample's reward may take, (0, 600]; past it the sample gets `reward_error`.")
    workers: int = Field(default=2, ge=1, le=64, description="Threads scoring rewards on each replica, 1..64 (off the replica's event loop).")

    @model_validator(mode="after")
    def _names(self) -> "RewardsConfig":
        from rollout.rewards.builtins import BUILTINS

        _check_functions("rewards.functions", self.functions, BUILTINS, "reward")
        if self.default is not None and self.default.name not in BUILTINS and self.default.name not in self.functions:
            raise ValueError(f"rewards.default.name: {self.default.name!r} is neither a built-in ({', '.join(sorted(BUILTINS))}) nor in rewards.functions")
        return self


class EpisodesConfig(_Section):
    """Token-exact multi-turn episodes, kept on the replica that serves them."""

    max_per_replica: int = Field(default=1024, ge=1, le=1_000_000, description="Episodes one replica holds at most, 1..1000000; starting one more is refused (400).")
    max_turns: int = Field(default=64, ge=1, le=10_000, description="Model turns per episode at most, 1..10000 (an episode may ask for fewer).")
    idle_expiry_s: float = Field(default=600.0, gt=0, le=86_400, description="An episode idle this long is dropped, (0, 86400]; its next turn gets `EpisodeLostError`.")


class PythonToolConfig(_Section):
    """The built-in `python` tool: each call runs under bubblewrap in namespaces of its own
    (user, mount, PID, network, IPC, UTS), as an unprivileged host user on a read-only root,
    with a seccomp filter, a size-capped private working directory and cgroup limits where
    the host offers them. A replica whose tool workers cannot build that sandbox refuses to
    start, saying what is missing; there is no weaker mode."""

    enabled: bool = Field(default=True, description="Offer the `python` tool. When false, the tool is not registered and no sandbox is needed.")
    wall_time_s: float = Field(default=10.0, gt=0, le=600, description="Seconds a call may run, (0, 600]; then its processes are killed.")
    cpu_time_s: int = Field(default=5, ge=1, le=600, description="CPU seconds a call may use, 1..600.")
    memory_mb: int = Field(default=512, ge=64, le=65536, description="Address space of a call in MiB, 64..65536; past it, allocations fail (MemoryError). Also the call's cgroup memory limit where cgroups are offered.")
    file_mb: int = Field(default=16, ge=1, le=4096, description="Largest file a call may write, in MiB, 1..4096.")
    disk_mb: int = Field(default=64, ge=1, le=65536, description="Size of the call's private working directory (a tmpfs), in MiB, 1..65536.")
    max_processes: int = Field(default=16, ge=1, le=4096, description="Processes and threads a call may have at once, 1..4096.")
    bwrap: str = Field(default="bwrap", description="The bubblewrap executable (a name on PATH or an absolute path).")
    cgroups: Literal["auto", "required", "off"] = Field(
        default="auto",
        description="cgroup limits on memory (tmpfs and memfd included), processes and CPU per call: `auto` uses cgroup v2 or v1 where the tool worker may "
        "create groups and says which (without them it warns: memory is then bounded per process, not per call), `required` refuses to start "
        "without them, `off` relies on the rlimits alone. Processes end with the call in every mode.",
    )
    uid_base: int = Field(
        default=200_000,
        ge=1000,
        le=2**31 - 65536,
        description="A tool worker running as root runs each call as a host uid of its own from uid_base .. uid_base+uid_count-1 (one per worker on the "
        "node, leased while it lives), never as root. Nothing else on the node may use these uids; containers that share a node need disjoint ranges. "
        "A worker that is not root runs calls as its own uid.",
    )
    uid_count: int = Field(default=256, ge=1, le=65536, description="How many uids from uid_base root tool workers on one node may lease, 1..65536: at least the tool workers a node runs.")


class ToolsConfig(_Section):
    """Tools an episode's model may call, run on a pool of Ray actors beside each replica.
    Calls are read with vLLM's parser named by `openai.tool_call_parser`."""

    functions: dict[str, str] = Field(
        default_factory=dict,
        description="Your tools, `name: module:function`: imported when a replica starts (a bad path fails the start). The signature gives the "
        "arguments' JSON schema, the docstring the description; the return value (text, or anything JSON can hold) is what the model reads. "
        "Built in: `python` and `calculator`.",
    )
    workers: int = Field(default=2, ge=1, le=256, description="Tool worker actors per replica, 1..256; each runs one call at a time.")
    timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Most seconds one call may take, (0, 3600]; past it the call fails and its worker restarts.")
    output_chars: int = Field(default=4000, ge=100, le=1_000_000, description="Characters of a call's output the model reads back at most, 100..1000000.")
    max_calls_per_episode: int = Field(default=32, ge=0, le=10_000, description="Tool calls one episode may run at most, 0..10000 (an episode may ask for fewer).")
    python: PythonToolConfig = Field(default_factory=PythonToolConfig, description="The built-in `python` tool and its sandbox.")
    worker_resource: Optional[str] = Field(
        default=None, description="A Ray custom resource the tool workers ask for (a tiny share each), so they run only on nodes that offer it: the chart's hardened tool "
        "worker group. None: anywhere in the cluster.",
    )

    @model_validator(mode="after")
    def _names(self) -> "ToolsConfig":
        from rollout.tools import BUILTIN_PATHS

        _check_functions("tools.functions", self.functions, BUILTIN_PATHS, "tool")
        return self


class PlatformConfig(_Section):
    """Everything the platform needs to serve rollouts."""

    app_name: str = Field(default="rollout", description="Serve application name; clients connect by it.")
    model: ModelConfig
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    openai: OpenAIConfig = Field(default_factory=OpenAIConfig, description="The OpenAI routes (vLLM's own server on every replica).")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    episodes: EpisodesConfig = Field(default_factory=EpisodesConfig, description="Multi-turn episodes whose token ids stay on the replica (`RolloutClient.start_episode`).")
    rewards: RewardsConfig = Field(default_factory=RewardsConfig, description="Rewards scored on the replica as each sample finishes (a request names one, or `rewards.default`).")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="Tools an episode's model may call (`EpisodeStart.tools`), run beside each replica.")

    @model_validator(mode="after")
    def _quantized_models_reload(self) -> "PlatformConfig":
        if self.model.quantization is not None and self.sync.enabled and self.sync.backend == "sparse_nccl":
            # vLLM's sparse engine patches the live tensors in place, outside the layerwise
            # reload: FP8 weights would take full-precision values with their old scales.
            raise ValueError(
                "sync.backend: sparse_nccl cannot publish into model.quantization replicas (vLLM's sparse engine patches the live FP8 tensors in place, "
                "never quantizing them again); use nccl, ipc or gloo, which reload through vLLM's layerwise reload"
            )
        return self


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    sections = set(PlatformConfig.model_fields)
    tree: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or ENV_NESTED_DELIMITER not in key:
            continue
        parts = key[len(ENV_PREFIX):].lower().split(ENV_NESTED_DELIMITER)
        if parts[0] not in sections:
            continue
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def load_config(
    source: str | Path | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> PlatformConfig:
    """Load a config from a YAML file (or a mapping) and apply environment overrides."""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        text = Path(source).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a config file must be a YAML mapping, got {type(data).__name__}")
    data = _merge(data, _env_overrides(os.environ if environ is None else environ))
    return PlatformConfig.model_validate(data)
