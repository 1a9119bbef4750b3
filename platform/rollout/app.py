"""Builds the Serve application from a :class:`PlatformConfig`.

Importable as ``rollout.app:build`` for ``serve run`` and a KubeRay ``serveConfigV2``;
``args`` is either the config mapping itself or ``{"config_file": PATH}``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Mapping

from ray import serve
from ray.serve import Application
from ray.serve.deployment import Deployment

from rollout.config import SLEEP_ON_CPU, PlatformConfig, load_config
from rollout.engine.args import placement, resolve_device

logger = logging.getLogger(__name__)

INGRESS_NAME = "RolloutIngress"
CONTROL_RESOURCE_SHARE = 0.001  # of deployment.control_resource: a node offering it hosts many such actors


def config_from_args(args: Mapping[str, Any] | PlatformConfig | None) -> PlatformConfig:
    if isinstance(args, PlatformConfig):
        return args
    args = dict(args or {})
    if "config_file" in args:
        extra = set(args) - {"config_file"}
        if extra:
            raise ValueError(f"args: config_file cannot be combined with {sorted(extra)}")
        return load_config(args["config_file"])
    return load_config(args)


def config_from_serve_app(app: Mapping[str, Any]) -> PlatformConfig:
    """The config one ``serveConfigV2`` application entry actually runs with.

    ``config_from_args(app["args"])``, with ``deployment.replicas`` taken from the entry's
    ``deployments`` override of the engine (``num_replicas``), if any. The Helm chart and the
    kustomize base keep the replica count there rather than in ``args``: Serve derives the
    app's code version from ``import_path`` and ``args``, and a new one restarts every
    replica (the weight-sync coordinator included), while a new ``num_replicas`` only scales.
    """
    cfg = config_from_args(app.get("args"))
    for d in app.get("deployments") or ():
        if d.get("name") == cfg.deployment.name and "num_replicas" in d:
            if cfg.deployment.autoscaling is not None:
                raise ValueError(f"deployments: {cfg.deployment.name} sets num_replicas, but args set deployment.autoscaling")
            data = cfg.model_dump(mode="json")
            data["deployment"]["replicas"] = d["num_replicas"]
            return PlatformConfig.model_validate(data)
    return cfg


def engine_deployment_options(cfg: PlatformConfig, device: str) -> dict[str, Any]:
    from ray.serve.config import BackpressureConfig

    d = cfg.deployment
    opts: dict[str, Any] = dict(
        name=d.name,
        max_ongoing_requests=d.resolved_max_ongoing_requests(cfg.model),
        # Serve's bound on calls waiting at each caller; -1 is its "unbounded".
        max_queued_requests=d.max_queued_requests if d.max_queued_requests is not None else -1,
        # What a refused call says (BackPressureError carries it to the ingress and handle clients).
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=d.overload_retry_after_s),
        health_check_period_s=d.health_check_period_s,
        health_check_timeout_s=d.health_check_timeout_s,
        # vLLM shuts its engine core down cleanly within this window.
        graceful_shutdown_timeout_s=30,
        **placement(cfg.model, device, d.num_cpus),
    )
    if d.autoscaling is None:
        opts["num_replicas"] = d.replicas
    else:
        a = d.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s,
            # Serve requires look_back_period_s > metrics_interval_s (it warns now and will raise):
            # at least two samples in every window.
            "metrics_interval_s": min(10.0, a.look_back_period_s / 2),
            # Sized on the engines' running + waiting sequences, not on Serve's call count.
            "policy": {"policy_function": "rollout.scaling:engine_load_policy"},
        }
    r = d.routing
    if r.policy == "affinity":
        from ray.serve.config import RequestRouterConfig

        opts["request_router_config"] = RequestRouterConfig(
            request_router_class="rollout.routing.router:AffinityRouter",
            request_router_kwargs={"max_imbalance": r.max_imbalance, "prefix_tokens": r.prefix_tokens},
            request_routing_stats_period_s=r.stats_period_s,
            request_routing_stats_timeout_s=max(1.0, r.stats_period_s),
        )
    return opts


# Deployment fields Serve applies itself (replica count, autoscaling, request router,
# queue bound, probe period): no replica reads them, so they are not constructor args.
SERVE_APPLIED_FIELDS = (
    "replicas",
    "autoscaling",
    "routing",
    "max_ongoing_requests",
    "max_queued_requests",
    "overload_retry_after_s",
    "health_check_period_s",
)


def replica_args(cfg: PlatformConfig) -> dict[str, Any]:
    """The config every replica is constructed with, minus what Serve applies itself.

    Serve restarts a deployment's replicas when their constructor arguments change;
    scaling, a new autoscaling bound or another request router must add, remove or
    re-route replicas, not restart the ones serving, nor the coordinator holding the
    committed weights.
    """
    fields = type(cfg.deployment).model_fields
    defaults = {f: fields[f].get_default(call_default_factory=True) for f in SERVE_APPLIED_FIELDS}
    fixed = cfg.deployment.model_copy(update=defaults)
    return cfg.model_copy(update={"deployment": fixed}).model_dump(mode="json")


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def pinned(deployment: Deployment, *init_args: Any) -> Deployment:
    """``deployment`` with a version derived from our code and its constructor args.

    Serve gives each deployment of an imperative ``serve.run`` a random version, so
    re-running the app to change the replica count would restart every replica (and
    the coordinator, losing its copy of the committed weights). With a version that
    changes only when the code or the constructor args do, a new replica count is a
    scale, as in a declarative (KubeRay) deploy whose args are unchanged.
    """
    digest = hashlib.sha256(json.dumps([_source_digest(), deployment.name, *init_args], sort_keys=True, default=str).encode())
    # `version` is Serve-internal in options(); it is what `serve deploy` sets from the app's code version.
    return deployment.options(version=digest.hexdigest()[:16], _internal=True)


def build_application(cfg: PlatformConfig) -> Application:
    from rollout.engine.replica import RolloutEngine
    from rollout.http.ingress import HttpIngress

    device = resolve_device(cfg.model)
    logger.info("building app %r on %s: %s", cfg.app_name, device, cfg.model.path)
    if cfg.model.enable_sleep_mode and device != "cuda":
        raise ValueError(f"model.enable_sleep_mode: true, but the replicas run on {device} (model.device: {cfg.model.device}): {SLEEP_ON_CPU}")
    # Whether weight sync needs the sync token is decided here, once, and travels in the
    # config: the ingress and the coordinator may run with different environments. So does
    # the device "auto" resolved to: the coordinator names it when it refuses sleep mode.
    cfg = cfg.model_copy(update={"sync": cfg.sync.resolved(), "model": cfg.model.model_copy(update={"device": device})})
    config = replica_args(cfg)
    coordinator, backend = None, None
    if cfg.sync.enabled:
        from rollout.contracts.backend_registry import resolve_backend
        from rollout.contracts.sync_protocol import COORDINATOR_NAME
        from rollout.sync.coordinator import WeightSyncCoordinator

        backend = resolve_backend(cfg.sync.backend, device)
        coordinator = serve.deployment(WeightSyncCoordinator).options(
            name=COORDINATOR_NAME,
            num_replicas=1,
            # Every engine replica holds one long poll open, plus publishers.
            max_ongoing_requests=10_000,
            ray_actor_options=control_actor_options(cfg),
        )
        coordinator = pinned(coordinator, config, backend).bind(config, backend)
    engine = serve.deployment(RolloutEngine).options(**engine_deployment_options(cfg, device))
    engine = pinned(engine, config, device, backend).bind(config, device, coordinator, backend)
    ingress = serve.deployment(HttpIngress).options(
        name=INGRESS_NAME,
        num_replicas=1,
        # The ingress only forwards; it must never be the bottleneck in front of the engines.
        max_ongoing_requests=4096,
        ray_actor_options=control_actor_options(cfg),
    )
    # The ingress's handle builds its request router once, from the deployment config of
    # its first call: a new router policy must restart the ingress (cheap), not the engines.
    routing = cfg.deployment.routing.model_dump(mode="json")
    return pinned(ingress, config, routing).bind(engine, config, coordinator)


def control_actor_options(cfg: PlatformConfig) -> dict[str, Any]:
    """Ray options of the ingress and the coordinator: no CPU reserved, and with
    deployment.control_resource a share of a resource only the nodes holding the secrets
    offer (never a tool worker node)."""
    options: dict[str, Any] = {"num_cpus": 0}
    if cfg.deployment.control_resource:
        options["resources"] = {cfg.deployment.control_resource: CONTROL_RESOURCE_SHARE}
    return options


def build(args: Mapping[str, Any] | None = None) -> Application:
    """Entry point for ``serve run rollout.app:build`` and RayService ``import_path``."""
    return build_application(config_from_args(args))


def deploy(cfg: PlatformConfig, blocking: bool = False) -> None:
    """Start Serve's HTTP proxy on the configured port and run the application."""
    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
    serve.run(build_application(cfg), name=cfg.app_name, route_prefix=cfg.http.route_prefix, blocking=blocking)
