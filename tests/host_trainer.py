"""A trainer on a host outside the Ray cluster, for test_hosts_e2e.py.

``tests/hosts.py`` runs it in the trainer host's network namespace:

    python -m tests.host_trainer URL API_KEY MODEL_DIR

It reads one JSON command per line on stdin and answers one JSON line on stdout:

- ``{"op": "generate", "prompts": [[ids]], "max_tokens": n}``: greedy rollouts over HTTP;
  ``tokens`` and each result's weight-version spans.
- ``{"op": "publish", "seed": k, "publisher_address": null | "a.b.c.d"}``: publish the
  checkpoint's weights (seed 0) or a perturbation of them (seed k) with a new
  ``WeightPublisher.http`` (gloo), ``ROLLOUT_PUBLISHER_ADDRESS`` set as asked; the
  committed version, or the error's type, message, address and port; and the seconds
  either took.
- ``{"op": "addresses"}``: what this host's hostname resolves to, and the address a
  publisher here advertises.
- ``{"op": "wait", "within_s": t}``: greedy rollouts until one is served (the platform
  is up), or ``within_s``; the seconds it took.
- ``{"op": "status"}``: the coordinator's ``/v1/sync/status``.

Two more modes, each one process that prints one JSON line:

    python -m tests.host_trainer --reference MODEL_DIR SEED OUT_DIR PROMPTS_JSON MAX_TOKENS

a fresh vLLM engine (``vllm.LLM``, as tests/reference.py builds it) on the weights of
``SEED`` (saved as a model directory under ``OUT_DIR``): its greedy tokens for the prompts;

    python -m tests.host_trainer --driver MODEL_DIR SEED STUCK_S

a trainer that joins the Ray cluster as a driver (``ray.init()``: ``RAY_ADDRESS`` and Ray's
token settings from the environment, as in a trainer pod) and publishes ``SEED``'s
weights with ``WeightPublisher.connect`` (gloo).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


def load_checkpoint(model_dir: str) -> dict[str, dict]:
    """The checkpoint's tensors, by the file that holds them."""
    from safetensors.torch import load_file

    return {f.name: load_file(str(f)) for f in sorted(Path(model_dir).glob("*.safetensors"))}


def weights(files: dict[str, dict], seed: int) -> dict:
    """Seed 0: the served checkpoint's own weights; otherwise the same perturbed, the way
    test_weight_sync_e2e.py makes its 'trained' policies."""
    import torch

    checkpoint = {n: t for tensors in files.values() for n, t in tensors.items()}
    if seed == 0:
        return checkpoint
    g = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=g).to(t.dtype) * 0.1 if t.is_floating_point() else t for n, t in checkpoint.items()}


def greedy(client: Any, cmd: dict) -> dict:
    """``{"op": "generate"}`` through ``client`` (a RolloutClient over HTTP): greedy rollouts
    of ``cmd["prompts"]``, each one's tokens, the ``[version, start, end]`` spans of the
    versions that made them and the replica that served it."""
    from rollout.api import RolloutRequest, SamplingConfig

    sampling = SamplingConfig(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
    results = client.generate_sync([RolloutRequest(prompt_token_ids=p, sampling=sampling) for p in cmd["prompts"]])
    return {
        "tokens": [r.samples[0].token_ids for r in results],
        "versions": [[[s.version, s.start, s.end] for s in r.samples[0].weight_versions] for r in results],
        "replicas": [r.replica_id for r in results],
    }


def reference(model_dir: str, seed: int, out_dir: str, prompts_json: str, max_tokens: int) -> dict:
    """A fresh engine on ``seed``'s weights: a copy of the model directory with them in
    place of the checkpoint's, loaded by vLLM as any model is."""
    import shutil

    from safetensors.torch import save_file

    files = load_checkpoint(model_dir)
    published = weights(files, seed)
    target = Path(out_dir) / f"seed-{seed}"
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    for name, tensors in files.items():
        save_file({n: published[n].contiguous() for n in tensors}, str(target / name))
    from vllm import LLM, SamplingParams

    from tests.engines import ENFORCE_EAGER, KV_BYTES, MAX_MODEL_LEN

    # As tests/reference.py builds its engine, and as the platform's replicas are configured.
    llm = LLM(model=str(target), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES, dtype="float32", seed=0, enable_prefix_caching=True, enforce_eager=ENFORCE_EAGER)
    prompts = json.loads(prompts_json)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs]}


def driver(model_dir: str, seed: int, stuck_s: float) -> dict:
    """Join the Ray cluster as a trainer pod's process does and publish ``seed``'s weights.
    Stuck for ``stuck_s``: every thread's stack into the log, and out."""
    import faulthandler

    import ray

    faulthandler.dump_traceback_later(stuck_s, exit=True)

    from rollout.contracts import net
    from rollout.sync import WeightPublisher

    tensors = weights(load_checkpoint(model_dir), seed)
    t0 = time.monotonic()
    try:
        ray.init(logging_level="ERROR", log_to_driver=False)  # RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN
    except Exception as e:
        return {"error_type": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - t0}
    joined = {"node_address": ray.util.get_node_ip_address(), "advertised": net.choose().address, "join_s": time.monotonic() - t0}
    publisher = WeightPublisher.connect(app_name="rollout", backend="gloo")
    t0 = time.monotonic()
    try:
        return {**joined, "version": publisher.publish(tensors), "elapsed_s": time.monotonic() - t0}
    except Exception as e:
        return {**joined, "error_type": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - t0}
    finally:
        publisher.close()


def main() -> None:
    if sys.argv[1] == "--reference":
        print(json.dumps(reference(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]))), flush=True)
        return
    if sys.argv[1] == "--driver":
        print(json.dumps(driver(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))), flush=True)
        return
    url, api_key, model_dir = sys.argv[1:4]
    import socket

    import httpx

    from rollout.client import RolloutClient
    from rollout.contracts import net
    from rollout.sync import WeightPublisher

    files = load_checkpoint(model_dir)
    client = RolloutClient.http(url, api_key=api_key)

    def generate(cmd: dict) -> dict:
        return greedy(client, cmd)

    def wait(cmd: dict) -> dict:
        t0 = time.monotonic()
        while True:
            try:
                return {**generate({"prompts": [[1, 2, 3]], "max_tokens": 1}), "elapsed_s": time.monotonic() - t0}
            except Exception as e:
                if time.monotonic() - t0 > cmd["within_s"]:
                    return {"error_type": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - t0}
                time.sleep(2)

    def status(cmd: dict) -> dict:
        resp = httpx.get(f"{url}/v1/sync/status", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
        resp.raise_for_status()
        return resp.json()

    def publish(cmd: dict) -> dict:
        if cmd.get("publisher_address"):
            os.environ[net.ADDRESS_ENV] = cmd["publisher_address"]
        else:
            os.environ.pop(net.ADDRESS_ENV, None)
        tensors = weights(files, cmd["seed"])
        # A new publisher each time, as a trainer started with this environment has: one
        # kept from an earlier round would reuse that round's group (and its address).
        publisher = WeightPublisher.http(url, api_key=api_key, backend="gloo")
        t0 = time.monotonic()
        try:
            version = publisher.publish(tensors)
            return {"version": version, "elapsed_s": time.monotonic() - t0}
        except Exception as e:
            return {
                "error_type": type(e).__name__,
                "message": str(e),
                "address": getattr(e, "address", None),
                "port": getattr(e, "port", None),
                "elapsed_s": time.monotonic() - t0,
            }
        finally:
            publisher.close()

    def addresses(cmd: dict) -> dict:
        return {"hostname": socket.gethostbyname(socket.gethostname()), "advertised": net.choose(toward=urlparse(url).hostname).address}

    ops = {"generate": generate, "publish": publish, "addresses": addresses, "wait": wait, "status": status}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            answer = ops[cmd["op"]](cmd)
        except Exception as e:  # the test shows it; the next command still runs
            answer = {"error_type": type(e).__name__, "message": str(e)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
