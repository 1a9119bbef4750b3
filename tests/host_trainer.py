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
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlparse


def main() -> None:
    url, api_key, model_dir = sys.argv[1:4]
    import socket

    import torch
    from safetensors.torch import load_file

    from rollout.api import RolloutRequest, SamplingConfig
    from rollout.client import RolloutClient
    from rollout.sync import WeightPublisher, net

    checkpoint = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        checkpoint.update(load_file(str(f)))
    client = RolloutClient.http(url, api_key=api_key)

    def weights(seed: int) -> dict[str, torch.Tensor]:
        """Seed 0: the served checkpoint's own weights; otherwise the same perturbed, the way
        test_weight_sync_e2e.py makes its 'trained' policies."""
        if seed == 0:
            return checkpoint
        g = torch.Generator().manual_seed(seed)
        return {n: t + torch.randn(t.shape, generator=g).to(t.dtype) * 0.1 if t.is_floating_point() else t for n, t in checkpoint.items()}

    def generate(cmd: dict) -> dict:
        sampling = SamplingConfig(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
        results = client.generate_sync([RolloutRequest(prompt_token_ids=p, sampling=sampling) for p in cmd["prompts"]])
        return {
            "tokens": [r.samples[0].token_ids for r in results],
            "versions": [[[s.version, s.start, s.end] for s in r.samples[0].weight_versions] for r in results],
        }

    def publish(cmd: dict) -> dict:
        if cmd.get("publisher_address"):
            os.environ[net.ADDRESS_ENV] = cmd["publisher_address"]
        else:
            os.environ.pop(net.ADDRESS_ENV, None)
        tensors = weights(cmd["seed"])
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

    ops = {"generate": generate, "publish": publish, "addresses": addresses}
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
