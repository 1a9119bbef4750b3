"""A trainer on the trainer host for test_hosts_faults_e2e.py: rollouts, publishes that a
test can hold mid-transfer, and a trainer written for ``vllm serve``.

``tests/hosts.py``'s namespaces run it on the trainer host:

    python -m tests.host_routes_trainer URL API_KEY MODEL_DIR

One JSON command per line on stdin; answers are JSON lines on stdout, in order:

- ``{"op": "generate", "prompts": [[ids]], "max_tokens": n, "rounds": r, "tag": s}``:
  greedy rollouts over HTTP, each prompt ``rounds`` times with its own session id (so the
  affinity router spreads them over the replicas); per result its tokens, the version
  spans that made them and the replica that served it.
- ``{"op": "publish", "seed": k, "hold": bool}``: publish the checkpoint's weights (seed 0)
  or a perturbation (seed k) with ``WeightPublisher.http`` (gloo). With ``hold``, the
  transfer stops after its first bucket reached every replica (the round is open, every
  member joined its group and is receiving) and the trainer answers
  ``{"held": round_id}``; it goes on at ``{"op": "release"}`` (no answer of its own). The
  publish's answer follows: the committed version or the error's type and message, with
  the seconds since the round opened and since the release.
- ``{"op": "routes", "seed": k}``: the same weights through vLLM's RL routes, as a trainer
  written for ``vllm serve`` sends them (vLLM's HTTP weight-sync client with the sync
  token, and the trainer-engine interface, gloo): pause, world size, init, send, resume.
- ``{"op": "status"}``: the coordinator's ``/v1/sync/status``.

Holding the transfer is this process's own doing (its gloo group's broadcasts wait for the
test); the replicas, the coordinator and the network are the real ones.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

_print_lock = threading.Lock()


def say(answer: dict) -> None:
    with _print_lock:
        print(json.dumps(answer), flush=True)


class Hold:
    """Stops the armed publish's transfer once its first bucket has been delivered."""

    def __init__(self) -> None:
        self.armed = False
        self.round_id = ""
        self.released = threading.Event()
        self.released_at = None
        self._first = None

    def arm(self) -> None:
        self.armed, self._first, self.released_at = True, None, None
        self.released.clear()

    def release(self) -> None:
        self.released_at = time.monotonic()
        self.released.set()

    def install(self) -> None:
        from rollout.sync.backends import gloo_group

        original = gloo_group.GlooGroup.broadcast_async
        hold = self

        def broadcast_async(group, tensor, root: int = 0):
            # Only the round's own group: the coordinator's copy goes over "copy-..." after a commit.
            if hold.armed and not group.name.startswith("copy-"):
                if hold._first is None:
                    hold._first = original(group, tensor, root)
                    return hold._first
                hold.armed = False
                hold._first.wait()  # bucket 0 reached every rank: all of them are receiving
                say({"held": hold.round_id, "group": group.name})
                if not hold.released.wait(120):
                    raise RuntimeError("the test never released the held transfer")
            return original(group, tensor, root)

        gloo_group.GlooGroup.broadcast_async = broadcast_async


def main() -> None:
    url, api_key, model_dir = sys.argv[1:4]
    import torch
    from safetensors.torch import load_file

    from rollout.api import RolloutRequest, SamplingConfig
    from rollout.client import RolloutClient
    from rollout.contracts import net
    from rollout.sync import WeightPublisher
    from rollout.sync.remote import HttpCoordinator

    checkpoint = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        checkpoint.update(load_file(str(f)))
    client = RolloutClient.http(url, api_key=api_key)
    coordinator = HttpCoordinator(url, api_key, timeout_s=30)
    hold = Hold()
    hold.install()

    def weights(seed: int) -> dict[str, torch.Tensor]:
        """tests/host_trainer.py's: seed 0 is the checkpoint, any other a perturbation of it."""
        if seed == 0:
            return checkpoint
        g = torch.Generator().manual_seed(seed)
        return {n: t + torch.randn(t.shape, generator=g).to(t.dtype) * 0.1 if t.is_floating_point() else t for n, t in checkpoint.items()}

    def generate(cmd: dict) -> dict:
        sampling = SamplingConfig(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
        out = []
        for k in range(cmd.get("rounds", 1)):
            for i, prompt in enumerate(cmd["prompts"]):
                request = RolloutRequest(prompt_token_ids=prompt, session_id=f"{cmd.get('tag', 'g')}-{k}-{i}", sampling=sampling)
                (r,) = client.generate_sync([request])
                s = r.samples[0]
                out.append({"prompt": i, "tokens": s.token_ids, "versions": [[w.version, w.start, w.end] for w in s.weight_versions], "replica": r.replica_id})
        return {"results": out}

    def publish(cmd: dict) -> dict:
        tensors = weights(cmd["seed"])
        publisher = WeightPublisher.http(url, api_key=api_key, backend="gloo")
        opened = {}
        begin = publisher._coordinator.begin_round

        def begin_round(token, request):
            plan = begin(token, request)
            opened["at"], hold.round_id = time.monotonic(), plan.round_id
            return plan

        publisher._coordinator.begin_round = begin_round  # to time the answer from the round's opening
        if cmd.get("hold"):
            hold.arm()
        answer: dict = {}
        try:
            answer["version"] = publisher.publish(tensors)
        except Exception as e:
            answer.update(error_type=type(e).__name__, error_types=[c.__name__ for c in type(e).__mro__], message=str(e))
        finally:
            hold.armed = False
            done = time.monotonic()
            answer["since_open_s"] = done - opened["at"] if "at" in opened else None
            answer["since_release_s"] = done - hold.released_at if cmd.get("hold") and hold.released_at else None
            try:
                publisher.close()
            except Exception as e:  # a group left behind by a lost peer: reported, not fatal
                answer["close_error"] = f"{type(e).__name__}: {e}"
        return answer

    def routes(cmd: dict) -> dict:
        from rollout.sync.backends.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
        from rollout.sync.route_client import WeightRoutesClient
        from rollout.vllm_compat import tensors_source  # the trainer's weights by name, in the installed vLLM's WeightSource shape

        tensors = weights(cmd["seed"])

        client = WeightRoutesClient(url, timeout=120)  # the sync token: ROLLOUT_SYNC_TOKEN
        t0 = time.monotonic()
        client.pause("keep")
        world = client.get_world_size()
        info = GlooTrainerInitInfo(
            master_address=net.own_address(toward=urlparse(url).hostname), master_port=net.free_port(),
            world_size=1 + world, rank=0, timeout_s=cmd.get("timeout_s", 30), bucket_bytes=1 << 18,
        )  # fmt: skip
        engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=tensors_source(tensors))
        try:
            engine.send_weights()  # /start_weight_update, /update_weights while broadcasting, /finish_weight_update
        finally:
            engine.shutdown()
            client.resume()
        return {"world_size": world, "master_address": info.master_address, "version": client.weight_version(), "elapsed_s": time.monotonic() - t0}

    def status(cmd: dict) -> dict:
        return coordinator.status()

    def run(op, cmd) -> None:
        try:
            answer = op(cmd)
        except Exception as e:  # the test shows it; the next command still runs
            answer = {"error_type": type(e).__name__, "message": str(e)}
        say(answer)

    ops = {"generate": generate, "publish": publish, "routes": routes, "status": status}
    say({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "release":
            hold.release()
        elif cmd["op"] == "publish" and cmd.get("hold"):
            # In the background: this loop must still take the release.
            threading.Thread(target=run, args=(publish, cmd), daemon=True).start()
        else:
            run(ops[cmd["op"]], cmd)


if __name__ == "__main__":
    main()
