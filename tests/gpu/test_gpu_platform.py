"""The platform's GPU paths on real GPUs: serving, NCCL and IPC publishing, catch-up,
tensor parallelism and a trainer killed mid-publish, with the numbers the README quotes.

Run by ``tests/gpu/check.sh`` on a lent machine with two GPUs (see the README, "Verified
on GPU"); skipped elsewhere. The checks run in file order and share one Ray cluster and
the models the script built: a ~1.5B-parameter bf16 Qwen2-shaped model
(``rollout.modelbuild`` preset ``1.5b``) and a perturbed copy of it saved as a checkpoint.
The serving app (one NCCL replica) carries the checks from serving to catch-up in turn:
serving, the OpenAI SDK, NCCL publishes, vLLM's RL routes, a trainer killed mid-publish,
then scaling it to two replicas; one app deployed once saves the machine's time. The IPC
and tensor-parallel checks deploy their own apps; each app is deleted before the next, so
the next one finds the GPUs free.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA GPUs (this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0}); run tests/gpu/check.sh on a GPU machine",
)

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("ROLLOUT_GPU_WORK", ROOT / "build" / "gpu"))
MODEL = Path(os.environ.get("ROLLOUT_GPU_MODEL", WORK / "model-1.5b"))
API_KEY = "gpu-check-key"
HTTP_PORT = 18123
MAX_TOKENS = 32
# Prompts of several lengths; token ids below the built tokenizer's vocabulary.
PROMPTS = [[5, 17, 42, 99, 3], [100, 200, 300], [7] * 40, list(range(10, 74)), [1, 2, 3, 4, 5, 6, 7, 8], [900, 12, 77], [31] * 5 + [8] * 5, [250, 251, 252, 253]]
THROUGHPUT_CONCURRENCY = (64, 256)
THROUGHPUT_ROUNDS = 3
THROUGHPUT_TOKENS = 128
PUBLISHES = 4  # the first forms the NCCL group; the rest are the steady state
# Below this a GPU holds no engine (a replica takes gpu_memory_utilization of ~80 GB).
GPU_IDLE_BYTES = 8 << 30

# What the checks hand on to later ones (the perturbed policy's greedy reference, ...).
state: dict = {}


# ---- helpers ----------------------------------------------------------------------


def model_cfg(path: Path = MODEL, **overrides) -> dict:
    cfg = {
        "path": str(path),
        "dtype": "bfloat16",
        "device": "cuda",
        "max_model_len": 2048,
        "max_num_seqs": 256,
        # Two engines share a GPU in several checks (replica + reference).
        "gpu_memory_utilization": 0.35,
        "seed": 0,
    }
    cfg.update(overrides)
    return cfg


def platform_cfg(app: str, backend: str, replicas: int = 1, **model_overrides):
    from rollout.config import load_config

    key_file = WORK / "api-key"
    key_file.write_text(API_KEY + "\n")
    return load_config(
        {
            "app_name": app,
            "model": model_cfg(**model_overrides),
            "http": {"port": HTTP_PORT, "host": "127.0.0.1", "api_key_file": str(key_file)},
            # Short health-check period: a replica whose engine is blocked is replaced quickly.
            "deployment": {"replicas": replicas, "health_check_period_s": 2.0},
            "sync": {"backend": backend, "timeout_s": 20},
        },
        environ={},
    )


def deploy(cfg, timeout_s: float = 600.0) -> float:
    """Deploy (or rescale) ``cfg``'s app; seconds until every replica is up. Serve retries
    a replica that fails to start, so a failure surfaces here as the deadline."""
    from concurrent.futures import ThreadPoolExecutor

    from rollout.app import deploy as deploy_app

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(deploy_app, cfg).result(timeout=timeout_s)
    finally:
        pool.shutdown(wait=False)
    return time.perf_counter() - t0


def delete(app: str, timeout_s: float = 120.0) -> None:
    """Delete ``app`` and wait until its engines have given their GPU memory back."""
    from ray import serve

    serve.delete(app)
    wait_for(lambda: all(used < GPU_IDLE_BYTES for used in gpu_memory_used()), timeout_s, 2.0)


def gpu_memory_used() -> list[int]:
    used = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        used.append(total - free)
    return used


def requests(prompts=PROMPTS, max_tokens: int = MAX_TOKENS, session: str | None = None):
    from rollout.api import RolloutRequest, SamplingConfig

    sampling = SamplingConfig(max_tokens=max_tokens, temperature=0.0)
    return [RolloutRequest(prompt_token_ids=p, sampling=sampling, session_id=session) for p in prompts]


def throughput_requests(n: int):
    from rollout.api import RolloutRequest, SamplingConfig

    sampling = SamplingConfig(max_tokens=THROUGHPUT_TOKENS, temperature=1.0, ignore_eos=True)
    return [RolloutRequest(prompt_token_ids=[10 + (i * 7 + j) % 1000 for j in range(16)], sampling=sampling) for i in range(n)]


def tokens(results) -> list[list[int]]:
    return [r.samples[0].token_ids for r in results]


def greedy(run, session: str | None = None) -> list[list[int]]:
    """Greedy tokens of every prompt, one request at a time: in bf16 the batch a request
    shares changes its numerics, so references are compared on the same (single) batches."""
    return [run(requests([p], session=session))[0] for p in PROMPTS]


def RolloutClientFor(app: str):
    from rollout.client import RolloutClient

    return RolloutClient.connect(app_name=app)


def on_platform(client):
    return lambda reqs: tokens(client.generate_sync(reqs))


def on_engine(engine):
    import ray

    return lambda reqs: ray.get(engine.generate.remote(reqs), timeout=300)


def first_mismatch(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            k = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            return f"prompt {i}: first difference at token {k}: got {g[k:k + 6]}, want {w[k:k + 6]}"
    return "equal" if len(got) == len(want) else f"{len(got)} results, {len(want)} expected"


def gpu_by_memory() -> tuple[int, int]:
    """(busiest GPU, freest GPU) by memory in use: the replica's GPU and the trainer's."""
    used = gpu_memory_used()
    order = sorted(range(len(used)), key=lambda i: used[i])
    return order[-1], order[0]


def start_engine(gpus: str, model: dict, weight_transfer: str | None = None):
    from tests.gpu.engines import BareEngine, on_gpus

    actor = on_gpus(BareEngine, gpus).remote()
    seconds = __import__("ray").get(actor.start.remote(model, weight_transfer), timeout=900)
    return actor, seconds


def stop(actor) -> None:
    import ray

    try:
        ray.get(actor.shutdown.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - killed next anyway
        pass
    ray.kill(actor)
    time.sleep(3)


def load_weights(path: Path, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f), device=device))
    return tensors


def parameter_count(path: Path) -> int:
    import math

    from safetensors import safe_open

    n = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def coordinator_status(app: str) -> dict:
    from rollout.sync import WeightPublisher

    return WeightPublisher.connect(app_name=app).status()


def wait_for(predicate, timeout_s: float, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


# ---- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import cloudpickle, serve

    import tests.gpu.engines

    WORK.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ROLLOUT_SYNC_TOKEN", "gpu-check-sync-token")
    ray.init(namespace="rollout-gpu", log_to_driver=False)
    # Workers cannot import the tests package: ship the actors' code by value.
    cloudpickle.register_pickle_by_value(tests.gpu.engines)
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def perturbed(cluster) -> Path:
    """A checkpoint of the model with every tensor perturbed (the 'trained' policy),
    saved like ``save_pretrained`` where every replica can read it."""
    from safetensors.torch import save_file

    out = WORK / "checkpoint-perturbed"
    if not (out / "model.safetensors").exists():
        device = f"cuda:{state.get('trainer_gpu', 1)}"
        tensors = load_weights(MODEL, device)
        g = torch.Generator(device=device).manual_seed(1234)
        with torch.no_grad():
            for t in tensors.values():
                noise = torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32)
                t.add_((noise * (0.5 * float(t.float().std()) + 1e-3)).to(t.dtype))
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: t.cpu() for n, t in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        torch.cuda.empty_cache()
        for f in MODEL.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)
    return out


# ---- serving -------------------------------------------------------------------


def test_serving_on_gpu_equals_a_fresh_vllm_engine_and_keeps_its_throughput(cluster, record):
    """Greedy through the handle and HTTP equals a fresh engine with the same arguments on
    the same GPU; then rollout tok/s through the handle and HTTP against that bare
    ``AsyncLLM``, same requests, rounds interleaved."""
    import ray

    from rollout.client import RolloutClient

    cfg = platform_cfg("gpu-nccl", "nccl")
    record(replica_start_s=round(deploy(cfg), 1), model_parameters_b=round(parameter_count(MODEL) / 1e9, 3))
    replica_gpu, trainer_gpu = gpu_by_memory()
    state.update(replica_gpu=replica_gpu, trainer_gpu=trainer_gpu)
    handle = RolloutClient.connect(app_name=cfg.app_name, batch_size=cfg.deployment.client_batch_size)
    http = RolloutClient.http(f"http://127.0.0.1:{HTTP_PORT}", api_key=API_KEY)
    state.update(handle=handle, http=http, app=cfg.app_name)

    bare, start_s = start_engine(str(replica_gpu), cfg.model.model_dump(mode="json"), weight_transfer="nccl")
    state["bare"] = bare
    record(bare_engine_start_s=round(start_s, 1), replica_gpu=replica_gpu)
    want = greedy(on_engine(bare))
    state["reference_v0"] = want
    via_handle = greedy(on_platform(handle))
    via_http = greedy(on_platform(http))
    record(handle_greedy=first_mismatch(via_handle, want), http_greedy=first_mismatch(via_http, want))

    points = []
    for n in THROUGHPUT_CONCURRENCY:
        rates: dict[str, list[float]] = {"bare": [], "handle": [], "http": []}

        def platform_round(client):
            t0 = time.perf_counter()
            results = client.generate_sync(throughput_requests(n))
            return sum(len(r.samples[0].token_ids) for r in results), time.perf_counter() - t0

        runs = {"bare": lambda: ray.get(bare.timed.remote(throughput_requests(n))), "handle": lambda: platform_round(handle), "http": lambda: platform_round(http)}
        for fn in runs.values():
            fn()  # warm-up
        for _ in range(THROUGHPUT_ROUNDS):
            for name, fn in runs.items():  # interleaved: drift hits every path alike
                generated, seconds = fn()
                rates[name].append(round(generated / seconds))
        med = {k: statistics.median(v) for k, v in rates.items()}
        points.append(
            {
                "concurrency": n,
                "bare_tokens_per_s": med["bare"],
                "handle_tokens_per_s": med["handle"],
                "http_tokens_per_s": med["http"],
                "handle_vs_bare": round(med["handle"] / med["bare"], 3),
                "http_vs_bare": round(med["http"] / med["bare"], 3),
                "rounds": rates,
            }
        )
    record(throughput=points, throughput_goal="handle_vs_bare >= 0.95", max_tokens=THROUGHPUT_TOKENS)
    assert via_handle == want, first_mismatch(via_handle, want)
    assert via_http == want, first_mismatch(via_http, want)


# ---- OpenAI front door ---------------------------------------------------------


def test_the_openai_sdk_through_the_platform_gets_the_fresh_engines_greedy_tokens(cluster, record):
    """The stock OpenAI SDK against the platform's /v1/completions (vLLM's own OpenAI
    layer on each replica): greedy completions of the token prompts, their token ids
    returned by vLLM's ``return_token_ids``, equal the fresh engine's."""
    import openai

    if "reference_v0" not in state:
        pytest.skip("not run: the serving check left no reference")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    got, versions = [], set()
    t0 = time.perf_counter()
    for p in PROMPTS:
        raw = client.completions.with_raw_response.create(
            model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"return_token_ids": True}
        )
        versions.add(raw.headers.get("x-rollout-weight-version"))
        got.append(list(raw.parse().choices[0].token_ids))
    want = state["reference_v0"]
    record(model=model, seconds=round(time.perf_counter() - t0, 2), greedy=first_mismatch(got, want), weight_version_headers=sorted(map(str, versions)))
    assert got == want, first_mismatch(got, want)
    assert None not in versions, versions


# ---- NCCL publish --------------------------------------------------------------


def test_nccl_publish_from_the_second_gpu_serves_exactly_the_published_weights(cluster, perturbed, record):
    """A trainer that sees both GPUs publishes from the one the replica does not use
    (its tensors on ``cuda:<trainer>``, its current device ``cuda:0``); then the wire
    floor (raw NCCL broadcast of the same bytes) and one RPC + broadcast per tensor."""
    import ray
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group, trainer_init

    from rollout.sync import WeightPublisher
    from rollout.sync.net import free_port, own_address
    from tests.gpu.engines import FloorReceiver, on_gpus

    if "app" not in state:
        pytest.skip("not run: the serving check did not deploy the app")
    # The trainer sees both GPUs; its tensors are on the one the replica does not use,
    # whatever its current device is (the smoke test's `NCCL error: invalid usage`).
    trainer = torch.device("cuda", state["trainer_gpu"])
    tensors = load_weights(perturbed, str(trainer))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    record(trainer_gpu=trainer.index, current_device=torch.cuda.current_device(), bytes=nbytes, tensors=len(tensors))

    pub = WeightPublisher.connect(app_name=state["app"], backend="nccl")
    seconds, phases = [], []
    for _ in range(PUBLISHES):
        t0 = time.perf_counter()
        version = pub.publish(tensors, checkpoint=str(perturbed))
        seconds.append(round(time.perf_counter() - t0, 4))
        phases.append({"trainer": {k: round(v, 4) for k, v in pub.last_phases.items()}, "replicas": pub.last_outcome.phases})
    state["committed"] = version
    record(publish_s=seconds, publish_phases=phases, version=version)

    results = [state["handle"].generate_sync(requests([p]))[0] for p in PROMPTS]
    got = tokens(results)
    spans = {s.version for r in results for s in r.samples[0].weight_versions}

    # The reference: the same bare engine, reloaded by vLLM itself from the checkpoint.
    bare = state["bare"]
    # One RPC + one broadcast per tensor into that engine (OpenRLHF-style loops).
    address, port = own_address(), free_port()
    with torch.cuda.device(trainer):
        begun = bare.begin_update.remote(address, port, 2)
        group = trainer_init({"master_address": address, "master_port": port, "world_size": 2})
        ray.get(begun, timeout=120)
        stream = torch.cuda.current_stream()
        t0 = time.perf_counter()
        for name, t in tensors.items():
            pending = bare.update_one.remote(name, str(t.dtype).removeprefix("torch."), list(t.shape))
            group.broadcast(t, src=0, stream=stream)
            ray.get(pending, timeout=120)
        torch.cuda.synchronize()
        ray.get(bare.finish_update.remote("per-tensor"), timeout=120)
        per_tensor_s = time.perf_counter() - t0
        group.destroy()
    reload_s = ray.get(bare.reload.remote(str(perturbed)), timeout=300)
    want = greedy(on_engine(bare))
    state["reference_perturbed"] = want
    record(per_tensor_rpc_s=round(per_tensor_s, 4), reference_reload_s=round(reload_s, 2))

    # The wire floor: the same bytes, one flat NCCL broadcast GPU to GPU, group formed beforehand.
    receiver = on_gpus(FloorReceiver, str(state["replica_gpu"])).remote()
    port = free_port()
    with torch.cuda.device(trainer):
        joined = receiver.join.remote(address, port)
        group = stateless_init_process_group(address, port, rank=0, world_size=2, device=trainer.index)
        ray.get(joined, timeout=120)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
        stream = torch.cuda.current_stream()
        floor = []
        for sizes in (None, None, None, None):
            pending = receiver.receive.remote(nbytes, sizes)
            group.broadcast(torch.empty(1, device=trainer), src=0, stream=stream)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            group.broadcast(flat, src=0, stream=stream)
            torch.cuda.synchronize()
            floor.append(time.perf_counter() - t0)
            ray.get(pending, timeout=120)
        # The same bytes as one broadcast per tensor, still no RPC.
        pending = receiver.receive.remote(nbytes, [t.numel() * t.element_size() for t in tensors.values()])
        group.broadcast(torch.empty(1, device=trainer), src=0, stream=stream)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in tensors.values():
            group.broadcast(t.reshape(-1).view(torch.uint8), src=0, stream=stream)
        torch.cuda.synchronize()
        per_tensor_wire_s = time.perf_counter() - t0
        ray.get(pending, timeout=120)
        group.destroy()
    ray.kill(receiver)
    wire = min(floor[1:])  # the first includes NCCL's channel set-up
    steady = statistics.median(seconds[1:])
    record(
        wire_floor_s=round(wire, 5),
        wire_gb_per_s=round(nbytes / wire / 1e9, 1),
        per_tensor_wire_s=round(per_tensor_wire_s, 5),
        publish_steady_s=steady,
        publish_vs_wire=round(steady / wire, 1),
        per_tensor_rpc_vs_wire=round(per_tensor_s / wire, 1),
        publish_vs_per_tensor_rpc=round(steady / per_tensor_s, 3),
        goal="publish_vs_wire <= 2",
        served_spans=sorted(spans),
        greedy=first_mismatch(got, want),
        greedy_changed=got != state["reference_v0"],
    )
    del tensors, flat
    torch.cuda.empty_cache()
    assert got == want, first_mismatch(got, want)
    assert got != state["reference_v0"], "the published weights did not change the served tokens"
    assert spans == {str(version)}, spans


# ---- vLLM's RL routes ----------------------------------------------------------


def test_a_trainer_written_for_vllm_serve_updates_the_replicas_over_nccl_through_the_routes(cluster, perturbed, record):
    """vLLM's own NCCL trainer engine, through the platform's RL routes (vLLM's HTTP client
    with the sync token): /pause (keep) → /get_world_size → /init_weight_transfer_engine →
    /start_weight_update → /update_weights + broadcast → /finish_weight_update → /resume.
    It sends the original weights back; served greedy must equal the fresh engine's."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    from rollout.sync import WeightPublisher
    from rollout.sync.net import free_port, own_address
    from rollout.sync.route_client import WeightRoutesClient

    if "reference_perturbed" not in state:
        pytest.skip("not run: the NCCL check left no committed perturbed policy")

    class Tensors(WeightSource):
        def __init__(self, tensors):
            self.tensors = tensors

        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

        def __iter__(self):
            return iter(self.tensors.items())

    trainer = torch.device("cuda", state["trainer_gpu"])
    routes = WeightRoutesClient(f"http://127.0.0.1:{HTTP_PORT}", token=os.environ["ROLLOUT_SYNC_TOKEN"])
    before = int(routes.weight_version())
    rounds = []
    with torch.cuda.device(trainer):
        t0 = time.perf_counter()
        routes.pause(mode="keep")
        world = routes.get_world_size()
        info = NCCLTrainerInitInfo(master_address=own_address(), master_port=free_port(), world_size=1 + world, rank=0)
        engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=routes, source=Tensors(load_weights(MODEL, str(trainer))))
        init_s = time.perf_counter() - t0
        for _ in range(3):  # the session's group serves every round
            t1 = time.perf_counter()
            engine.send_weights()
            rounds.append(round(time.perf_counter() - t1, 4))
        routes.resume()
    version = int(routes.weight_version())
    results = [state["handle"].generate_sync(requests([p]))[0] for p in PROMPTS]
    got = tokens(results)
    spans = {s.version for r in results for s in r.samples[0].weight_versions}
    record(world_size=world, init_s=round(init_s, 3), round_s=rounds, versions=[before, version], greedy=first_mismatch(got, state["reference_v0"]))
    engine.shutdown()
    del engine
    torch.cuda.empty_cache()
    # Put the perturbed policy back, with its checkpoint, for the catch-up check.
    state["committed"] = WeightPublisher.connect(app_name=state["app"], backend="nccl").publish(load_weights(perturbed, str(trainer)), checkpoint=str(perturbed))
    torch.cuda.empty_cache()
    assert version == before + 3, (before, version)
    assert got == state["reference_v0"], first_mismatch(got, state["reference_v0"])
    assert spans == {str(version)}, spans


# ---- trainer killed mid-publish ------------------------------------------------


KILLED_TRAINER = r"""
import sys, time
import ray, torch
import vllm.distributed.weight_transfer.packed_tensor as packed
from safetensors.torch import load_file
from rollout.sync import WeightPublisher

app, weights, device = sys.argv[1], sys.argv[2], sys.argv[3]
real = packed.packed_nccl_broadcast_producer

def stalled(iterator, **kwargs):
    items = list(iterator)
    def halfway():
        for i, item in enumerate(items):
            if i == len(items) // 2:
                torch.cuda.synchronize()
                print("MIDWAY", flush=True)   # half the buckets are on the replicas: kill me now
                time.sleep(3600)
            yield item
    return real(iterator=halfway(), **kwargs)

packed.packed_nccl_broadcast_producer = stalled
ray.init(address="auto", namespace="rollout-gpu", log_to_driver=False)
tensors = load_file(weights, device=device)
WeightPublisher.connect(app_name=app, backend="nccl").publish(tensors)
"""


def test_a_trainer_killed_mid_publish_leaves_every_replica_on_the_committed_version(cluster, perturbed, record):
    """On the serving app, where the perturbed policy is committed with its checkpoint, a
    second trainer process publishes the original weights and is killed with half of the
    buckets delivered."""
    if "committed" not in state or "reference_perturbed" not in state:
        pytest.skip("not run: the NCCL checks left no committed perturbed policy")
    if "bare" in state:
        stop(state.pop("bare"))  # frees the replica GPU's second engine for the replacement replica
    cfg = platform_cfg(state["app"], "nccl")
    trainer_gpu, committed = state["trainer_gpu"], state["committed"]
    before = coordinator_status(cfg.app_name)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, cfg.app_name, str(MODEL / "model.safetensors"), f"cuda:{trainer_gpu}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith("MIDWAY") or time.monotonic() > deadline:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.monotonic()
    record(trainer_output_tail=lines[-5:], killed_midway=any(l.startswith("MIDWAY") for l in lines))
    assert any(l.startswith("MIDWAY") for l in lines), "\n".join(lines[-20:])

    client = RolloutClientFor(cfg.app_name)
    want = state["reference_perturbed"]

    def recovered():
        try:
            status = coordinator_status(cfg.app_name)
            if status["round_in_progress"] or status["committed_version"] != committed:
                return None
            if not status["replicas"] or any(r["version"] != committed for r in status["replicas"].values()):
                return None
            return status if greedy(on_platform(client)) == want else None
        except Exception:  # noqa: BLE001 - replicas being replaced answer with errors meanwhile
            return None

    status = wait_for(recovered, timeout_s=300, interval_s=2.0)
    recovery_s = time.monotonic() - killed_at
    outcome = (status or coordinator_status(cfg.app_name)).get("last_outcome")
    record(
        recovered=bool(status),
        recovery_s=round(recovery_s, 1),
        sync_timeout_s=cfg.sync.timeout_s,
        last_outcome=outcome,
        replicas_before=list(before["replicas"]),
        replicas_after=list((status or {}).get("replicas", {})),
    )
    assert status, f"not every replica served version {committed} within 300 s of the kill; last outcome {outcome}"
    assert outcome and not outcome["committed"], outcome


# ---- catch-up ------------------------------------------------------------------


def test_a_replica_added_after_a_commit_serves_the_committed_version_from_the_checkpoint(cluster, perturbed, record):
    """Scale 1 -> 2 once the trainer's GPU is free: the new replica reloads the committed
    checkpoint while it starts, before Serve routes it any request."""
    if "committed" not in state:
        pytest.skip("not run: the NCCL check did not commit a version")
    if "bare" in state:
        stop(state.pop("bare"))  # frees the replica GPU's second engine
    before = set(coordinator_status(state["app"])["replicas"])
    scale_s = deploy(platform_cfg(state["app"], "nccl", replicas=2))
    status = coordinator_status(state["app"])
    new = set(status["replicas"]) - before
    record(scale_s=round(scale_s, 1), replicas=status["replicas"], committed=status["committed_version"])
    assert len(new) == 1, status
    (new_id,) = new
    assert status["replicas"][new_id]["version"] == state["committed"], status

    want = state["reference_perturbed"]
    seen_new, mismatches = 0, []
    for attempt in range(40):
        results = [state["handle"].generate_sync(requests([p], session=f"catch-up-{attempt}-{i}"))[0] for i, p in enumerate(PROMPTS)]
        for r, w in zip(results, want):
            if r.samples[0].token_ids != w:
                mismatches.append((r.replica_id, first_mismatch([r.samples[0].token_ids], [w])))
            if r.replica_id == new_id:
                seen_new += 1
                assert {s.version for s in r.samples[0].weight_versions} == {str(state["committed"])}
        if seen_new >= len(PROMPTS):
            break
    record(results_from_new_replica=seen_new, mismatches=mismatches[:5])
    assert seen_new > 0, "no request reached the new replica"
    assert not mismatches, mismatches[:5]
    delete(state["app"])


# ---- IPC publish ---------------------------------------------------------------


def test_ipc_publish_from_a_trainer_on_the_replica_gpu_costs_it_no_copy(cluster, perturbed, record):
    from rollout.sync import WeightPublisher

    if "reference_perturbed" not in state:
        pytest.skip("not run: the NCCL check produced no reference for the perturbed weights")
    cfg = platform_cfg("gpu-ipc", "ipc")
    record(replica_start_s=round(deploy(cfg), 1))
    replica_gpu, _ = gpu_by_memory()
    device = torch.device("cuda", replica_gpu)
    tensors = load_weights(perturbed, str(device))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    pub = WeightPublisher.connect(app_name=cfg.app_name, backend="ipc")
    seconds = []
    for _ in range(3):
        t0 = time.perf_counter()
        version = pub.publish(tensors, checkpoint=str(perturbed))
        seconds.append(round(time.perf_counter() - t0, 4))
    peak_growth = torch.cuda.max_memory_allocated(device) - before
    pub.close()
    got = greedy(on_platform(RolloutClientFor(cfg.app_name)))
    want = state["reference_perturbed"]
    record(
        replica_gpu=replica_gpu,
        publish_s=seconds,
        weights_bytes=nbytes,
        trainer_peak_growth_bytes=peak_growth,
        greedy=first_mismatch(got, want),
        phases=pub.last_outcome.phases,
        version=version,
    )
    del tensors
    torch.cuda.empty_cache()
    delete(cfg.app_name)
    assert got == want, first_mismatch(got, want)
    assert peak_growth < 0.05 * nbytes, f"the trainer's GPU memory grew by {peak_growth} bytes for {nbytes} bytes of weights"


# ---- tensor parallelism --------------------------------------------------------


def test_a_tensor_parallel_replica_serves_like_a_fresh_tp_engine_and_takes_a_gloo_publish(cluster, perturbed, record):
    """TP=2 over both GPUs; the trainer cannot share a GPU with an NCCL rank, so the
    publish goes over gloo (the backend that fits a machine whose GPUs all serve)."""
    import ray

    from rollout.sync import WeightPublisher

    # Eager on both sides: TP correctness needs no CUDA graphs, and on a fresh machine
    # (cold compile cache) compiling the TP=2 graphs took 250 s of the machine's stay.
    cfg = platform_cfg("gpu-tp", "gloo", tensor_parallel_size=2, enforce_eager=True)
    record(replica_start_s=round(deploy(cfg), 1))
    client = RolloutClientFor(cfg.app_name)
    reference, start_s = start_engine("0,1", cfg.model.model_dump(mode="json"))
    try:
        want = greedy(on_engine(reference))
        got = greedy(on_platform(client))
        record(reference_start_s=round(start_s, 1), greedy=first_mismatch(got, want))
        assert got == want, first_mismatch(got, want)

        tensors = load_weights(perturbed, "cpu")
        pub = WeightPublisher.connect(app_name=cfg.app_name, backend="gloo")
        t0 = time.perf_counter()
        version = pub.publish(tensors, checkpoint=str(perturbed))
        publish_s = time.perf_counter() - t0
        pub.close()
        ray.get(reference.reload.remote(str(perturbed)), timeout=300)
        want = greedy(on_engine(reference))
        results = [client.generate_sync(requests([p]))[0] for p in PROMPTS]
        got = tokens(results)
        record(publish_s=round(publish_s, 3), version=version, phases=pub.last_outcome.phases, greedy_after_publish=first_mismatch(got, want))
        assert got == want, first_mismatch(got, want)
        assert {s.version for r in results for s in r.samples[0].weight_versions} == {str(version)}
    finally:
        stop(reference)
        delete(cfg.app_name)
