"""A trainer that is a Ray driver, as in a trainer pod, for test_hosts_driver_e2e.py.

``tests/hosts.py`` runs it in a pod of the trainer host (:func:`tests.hosts.pod_argv`: PID and
mount namespaces of its own, a private ``/tmp``), after that pod's ``ray start`` joined the
cluster, as ``k8s/examples/trainer-job.yaml`` does:

    python -m tests.host_driver_trainer URL API_KEY MODEL_DIR

It answers ``{"ready": true}`` once it has the checkpoint, then reads one JSON command per
line on stdin and answers one JSON line on stdout:

- ``{"op": "connect"}``: ``WeightPublisher.connect(app_name="rollout", backend="gloo")``, the
  driver's first Ray call (Serve connects the process to the cluster by ``RAY_ADDRESS``,
  with ``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN``); the node the driver attached to, the
  address the publisher advertises, the raylets this process can see, the cluster's nodes.
- ``{"op": "publish", "seed": k}``: the checkpoint's weights (seed 0) or a perturbation of
  them (tests/host_trainer.py's); the committed version, or the error, and the seconds.
- ``{"op": "generate", "prompts": [[ids]], "max_tokens": n}``: greedy rollouts over HTTP.

A command that does not answer within its ``stuck_s`` (default 240) writes every thread's
stack to stderr (the test's log), so a hang shows where it is.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time


def main() -> None:
    url, api_key, model_dir = sys.argv[1:4]
    # Answers only on stdout: Ray copies the cluster's worker logs to a driver's stdout
    # (log_to_driver, left on as a trainer has it), so they go to stderr, the test's log.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from rollout.client import RolloutClient
    from tests.host_trainer import greedy, load_checkpoint, weights

    files = load_checkpoint(model_dir)
    client = RolloutClient.http(url, api_key=api_key)
    state: dict = {}

    def connect(cmd: dict) -> dict:
        import psutil
        import ray

        from rollout.contracts import net
        from rollout.sync import WeightPublisher

        t0 = time.monotonic()
        state["publisher"] = WeightPublisher.connect(app_name="rollout", backend="gloo")
        return {
            "join_s": time.monotonic() - t0,
            "node_address": ray.util.get_node_ip_address(),
            "advertised": net.choose().address,
            # What Ray's find_node_ids lists to pick "this host's" raylet.
            "raylets_seen": [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"],
            "nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
        }

    def publish(cmd: dict) -> dict:
        tensors = weights(files, cmd["seed"])
        t0 = time.monotonic()
        try:
            return {"version": state["publisher"].publish(tensors), "elapsed_s": time.monotonic() - t0}
        except Exception as e:
            return {"error_type": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - t0}

    ops = {"connect": connect, "publish": publish, "generate": lambda cmd: greedy(client, cmd)}
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        faulthandler.dump_traceback_later(cmd.get("stuck_s", 240))
        try:
            answer = ops[cmd["op"]](cmd)
        except Exception as e:  # the test shows it; the next command still runs
            answer = {"error_type": type(e).__name__, "message": str(e)}
        finally:
            faulthandler.cancel_dump_traceback_later()
        print(json.dumps(answer), file=answers, flush=True)
    if "publisher" in state:
        state["publisher"].close()


if __name__ == "__main__":
    main()
