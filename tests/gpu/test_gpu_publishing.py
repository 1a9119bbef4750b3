"""Issue 30's ways of publishing on a real GPU, one GPU enough: a gloo publish from a trainer
on the host into a GPU replica with the fleet digest (every replica's digest of what it
received equals the trainer's of what it sent, and what each side's digest cost), and the
prefix cache salted by weight version (after a commit a long prompt finds none of the
blocks cached under the old weights, is served exactly as a fresh engine with the new
weights serves it, and is cached again under them), and a LoRA adapter published as a
versioned policy (the replica serves what a fresh engine with the same adapter serves,
version after version, judged on tokens and logprobs as vLLM's model tests judge two
engines: ``tests.gpu.compare``).

Run by ``tests/gpu/check.sh`` like the other GPU checks (``run 600 -k publishing``); skipped
without a GPU. It shares :class:`tests.gpu.test_gpu_platform.Stage` and its helpers; its
Ray cluster is its own, exporting Ray's metrics every second (the prefix-cache counters are
read from there, as Prometheus reads them).
"""

from __future__ import annotations

import statistics
import time

import pytest

from tests.gpu.machine import MODEL, WORK, gpu_cluster, needs_gpus
from tests.gpu.test_gpu_platform import MAX_TOKENS, PROMPTS, Stage, coordinator_status, first_mismatch, greedy, load_weights, on_engine, on_platform, perturbed, platform_cfg, requests, stage  # noqa: F401 - perturbed and stage are fixtures (stage's cluster is this module's)

pytestmark = needs_gpus(1)
APP = "gpu-gloo"
METRICS_PORT = 18124
PUBLISHES = 4
# vLLM's GPU KV blocks hold 16 tokens and a prompt's last token is always computed: a
# prompt of 16 whole blocks and one token can hit on 256 tokens.
LONG = [100] + [(i * 37 + 11) % 1000 + 3 for i in range(256)]
LONG_TOKENS = 16


@pytest.fixture(scope="module")
def cluster():
    # Ray's agent exports the replicas' metrics here every second (default 10 s).
    with gpu_cluster(_metrics_export_port=METRICS_PORT, _system_config={"metrics_report_interval_ms": 1000}):
        yield


def settled_counters() -> tuple[float, float]:
    """(hits, queries) of the app's prefix caches, once two reads 2 s apart agree."""
    import asyncio

    from rollout.bench.scaling import settled_prefix_counters

    return asyncio.run(settled_prefix_counters(f"http://127.0.0.1:{METRICS_PORT}/metrics", APP))


def long_reference(stage: Stage, weights) -> list[int]:
    """The bare engine's greedy tokens for LONG on ``weights``."""
    import ray

    bare = stage.bare_engine(0)
    if stage.bare_weights != weights:
        stage.bare_weights = None
        ray.get(bare.reload.remote(str(weights)), timeout=300)
        stage.bare_weights = weights
    return on_engine(bare)(requests([LONG], max_tokens=LONG_TOKENS))[0]


def test_a_gloo_publish_into_a_gpu_replica_is_digested_on_both_sides_and_serves_exactly_the_published_weights(stage, perturbed, record):
    """A trainer's tensors over gloo into the GPU replica, PUBLISHES times from the host and
    PUBLISHES times from the GPU (an RL trainer's weights live there; its digest then runs
    there too): every round commits with the replica's digest equal to the trainer's,
    status shows them, and the replica serves the bare engine's greedy tokens on the same
    checkpoint. Recorded: what each side's digest cost, as a share of the steady publish."""
    from rollout.sync import WeightPublisher

    want = stage.reference(perturbed)
    app = stage.app_for(platform_cfg(APP, "gloo"))
    pub = WeightPublisher.connect(app_name=APP, backend="gloo")
    numbers = {}
    try:
        for trainer_on in ("cpu", "cuda"):
            tensors = load_weights(perturbed, trainer_on)
            numbers[trainer_on] = publish_digested(pub, tensors, perturbed)
            del tensors
    finally:
        pub.close()
    version = pub.last_outcome.version
    app.published, app.committed = True, version
    status = coordinator_status(APP)
    committed = status["committed_digest"]
    assert committed["version"] == version and committed["digest"] == pub.last_outcome.digest, committed
    assert all(r["received"] == committed for r in status["replicas"].values()), status["replicas"]
    got = greedy(on_platform(app.handle))
    assert got == want, first_mismatch(got, want)
    # Top level: the host trainer's (as recorded before GPU trainers were); from_gpu: the GPU trainer's.
    record(**numbers["cpu"], from_gpu=numbers["cuda"], committed_digest=committed["digest"][:16], greedy="equal")


def publish_digested(pub, tensors, checkpoint) -> dict:
    """PUBLISHES publishes of ``tensors``, each committed with every replica's digest equal
    to the trainer's; their times and digest costs (the first round forms the group, so the
    shares are of the steady ones)."""
    seconds, send_digest, receive, receive_digest = [], [], [], []
    for _ in range(PUBLISHES):
        t0 = time.perf_counter()
        pub.publish(tensors, checkpoint=str(checkpoint))
        seconds.append(time.perf_counter() - t0)
        outcome = pub.last_outcome
        assert outcome.committed and outcome.digest, outcome
        assert set(outcome.replica_digests.values()) == {outcome.digest}, outcome.replica_digests
        send_digest.append(pub.last_phases.get("send.digest", 0.0))
        for phases in outcome.phases.values():
            receive.append(phases.get("receive", 0.0))
            receive_digest.append(phases.get("receive.digest", 0.0))
    steady = statistics.median(seconds[1:])
    return dict(
        bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        tensors=len(tensors),
        publish_s=[round(s, 4) for s in seconds],
        publish_steady_median_s=round(steady, 4),
        send_digest_s=[round(s, 4) for s in send_digest],
        receive_s=[round(s, 4) for s in receive],
        receive_digest_s=[round(s, 4) for s in receive_digest],
        digest_share_of_publish_sender=round(statistics.median(send_digest[1:]) / steady, 4),
        digest_share_of_publish_replica=round(statistics.median(receive_digest[1:]) / steady, 4),
    )


def test_after_a_commit_a_long_prompt_is_not_served_from_the_old_versions_kv_on_the_gpu(stage, perturbed, record):
    """sync.prefix_cache: salt (the default). LONG cached under the served weights hits its
    256 cacheable tokens; after a publish of other weights it hits none of them and equals the
    bare engine on those weights; then it hits again under the new version."""
    from rollout.sync import WeightPublisher

    want_model = long_reference(stage, MODEL)
    app = stage.app_for(platform_cfg(APP, "gloo"))
    assert app.cfg.sync.prefix_cache == "salt"
    counters = [settled_counters()]

    def serve_long(tag: str):
        (r,) = app.handle.generate_sync(requests([LONG], max_tokens=LONG_TOKENS, session=f"salted-{tag}"))
        counters.append(settled_counters())
        (h0, q0), (h1, q1) = counters[-2:]
        return r, h1 - h0, q1 - q0

    first, _, _ = serve_long("first")
    again, hits_same, _ = serve_long("again")
    assert hits_same >= 256, f"the same version reuses its blocks ({hits_same} tokens hit)"
    # The model's own weights, published: other weights than those served (the perturbed
    # checkpoint's, committed by the check before, or here when this check runs alone).
    pub = WeightPublisher.connect(app_name=APP, backend="gloo")
    try:
        if app.committed is None:
            pub.publish(load_weights(perturbed, "cpu"), checkpoint=str(perturbed))
            first, _, _ = serve_long("first-perturbed")
            again, hits_same, _ = serve_long("again-perturbed")
            assert hits_same >= 256, f"the same version reuses its blocks ({hits_same} tokens hit)"
        version = pub.publish(load_weights(MODEL, "cpu"), checkpoint=str(MODEL))
    finally:
        pub.close()
    app.published, app.committed = True, version
    after, hits_after, queries_after = serve_long("after")
    assert queries_after >= len(LONG) and hits_after == 0, f"{hits_after} prompt tokens came from blocks computed under the old weights"
    assert after.samples[0].token_ids == want_model, first_mismatch([after.samples[0].token_ids], [want_model])
    assert [(s.version, s.start, s.end) for s in after.samples[0].weight_versions] == [(str(version), 0, LONG_TOKENS)]
    cached, hits_cached, _ = serve_long("cached")
    assert hits_cached >= 256, f"the new version's blocks are reused ({hits_cached} tokens hit)"
    assert cached.samples[0].token_ids == want_model
    record(
        prompt_tokens=len(LONG),
        hits_same_version=hits_same,
        hits_after_commit=hits_after,
        queries_after_commit=queries_after,
        hits_new_version_again=hits_cached,
        greedy_after_commit="equal",
        one_replica=len({r.replica_id for r in (first, again, after, cached)}) == 1,
    )


LORA_APP = "gpu-lora"
LORA_RANK = 16
LORA_NAME = "math"
# The reference's logprobs at each position: vLLM's model tests judge with 5.
LORA_TOP_LOGPROBS = 5


def test_a_lora_adapter_published_into_a_gpu_replica_serves_like_a_fresh_engine_with_it(stage, record):
    """Two versions of one adapter (PEFT's layout, built in code), each published with
    ``publish_adapter`` into a GPU replica started with LoRA on: requests naming it get what
    a fresh vLLM engine given the same adapter generates, judged as vLLM's model tests judge
    two engines (``tests.gpu.compare.judge``): the same greedy tokens, or tokens that part
    only at a near-tie of the reference (the platform's token in its top 5, at most
    ``TIE_TOL`` behind), after a prefix whose every logprob agrees within ``LP_TOL``; and at
    least one whole sequence of each version exactly equal. Spans name the adapter's
    version; requests naming no adapter get the base model's tokens. Both engines run
    eager: the check is about the bytes, and an eager start fits the GPU check's time.

    Recorded per version, before anything is asserted (a failing run still says how close
    it came): how many prompts were equal, each near-tie (prompt, position, gap, deviation
    before it), each prompt's largest logprob deviation, any failure's reason, and how many
    prompts the judgement would accept against the other version's reference: a control
    that must be none, or the judgement could not tell a wrong adapter from the right one."""
    import ray

    from rollout.api import RolloutRequest, SamplingConfig
    from rollout.sync import WeightPublisher
    from tests.gpu.compare import LP_TOL, TIE_TOL, judge
    from tests.gpu.test_gpu_platform import GPU_IDLE_BYTES, gpu_memory_used, start_engine, stop, wait_for
    from tests.lora import demo_adapter, write_adapter

    # One GPU holds the replica and the reference, nothing else.
    stage.reset()
    lora = {"enabled": True, "max_loras": 2, "max_lora_rank": LORA_RANK}
    # float16: bf16 (9d22249) and float16 (0bbbf80) each matched the reference for the first
    # prompt and part of the second (25 and 4 tokens), then one token went the other way, so
    # tokens alone cannot tell a near-tie of two engines' rounding from other adapter bytes:
    # the check now judges the logprobs too (tests.gpu.compare). float16 stays: its finer
    # mantissa gives two engines smaller logprob deviations than bf16's to judge.
    # Not float32: vLLM's GPU LoRA kernels take only float16 and bfloat16 (its punica
    # lora_shrink asserts it; the engine failed its memory profiling at bc84563).
    cfg = platform_cfg(LORA_APP, "gloo", lora=lora, enforce_eager=True, dtype="float16")
    versions = [demo_adapter(MODEL, seed, r=LORA_RANK, scale=0.05) for seed in (1, 2)]
    dirs = [write_adapter(WORK / f"lora-v{v}", tensors, config) for v, (tensors, config) in enumerate(versions, 1)]
    sampling = SamplingConfig(max_tokens=MAX_TOKENS, temperature=0.0)
    assert sampling.logprobs, "the platform's samples carry each token's logprob (SamplingConfig's default)"

    bare, bare_start_s = start_engine("0", cfg.model.model_dump(mode="json"))
    try:
        # One prompt a call, as the platform is asked below: the batch changes the numerics.
        want = {
            v: [
                ray.get(bare.generate_with_logprobs.remote(requests([p]), LORA_TOP_LOGPROBS, (f"reference-{v}", v, dirs[v - 1])), timeout=300)[0]
                for p in PROMPTS
            ]
            for v in (1, 2)
        }
        base = greedy(on_engine(bare))
    finally:
        stop(bare)
    # The stage reads where the replica went from the GPU memory its deploy took.
    assert wait_for(lambda: gpu_memory_used()[0] < GPU_IDLE_BYTES, 120, 2.0), f"the reference engine's GPU memory is not back: {gpu_memory_used()}"
    want_tokens = {v: [t for t, _ in outs] for v, outs in want.items()}
    assert want_tokens[1] != base and want_tokens[2] != want_tokens[1], "each adapter version changes the greedy tokens"

    record(
        rank=LORA_RANK,
        adapter_tensors=len(versions[0][0]),
        adapter_bytes=sum(t.numel() * t.element_size() for t in versions[0][0].values()),
        reference_start_s=round(bare_start_s, 1),
        top_logprobs=LORA_TOP_LOGPROBS,
        lp_tol=LP_TOL,
        tie_tol=TIE_TOL,
    )
    app = stage.app_for(cfg)
    pub = WeightPublisher.connect(app_name=LORA_APP, backend="gloo")
    publish_s, judged = [], {}
    try:
        for v, (tensors, config) in enumerate(versions, 1):
            t0 = time.perf_counter()
            assert pub.publish_adapter(LORA_NAME, tensors, config) == v
            publish_s.append(time.perf_counter() - t0)
            other = 2 if v == 1 else 1
            verdicts, controls, spans = [], [], []
            for p, (want_ids, want_top), (other_ids, other_top) in zip(PROMPTS, want[v], want[other]):
                (r,) = app.handle.generate_sync([RolloutRequest(prompt_token_ids=p, sampling=sampling, adapter=LORA_NAME)])
                sample = r.samples[0]
                verdicts.append(judge(sample.token_ids, sample.logprobs, want_ids, want_top))
                # The control: the same output against the other version's reference, which
                # the judgement must refuse, or its tolerances cannot tell adapters apart.
                controls.append(judge(sample.token_ids, sample.logprobs, other_ids, other_top))
                spans.append({(s.adapter, s.adapter_version) for s in sample.weight_versions})
            judged[str(v)] = lora_summary(verdicts)
            judged[str(v)]["accepted_against_the_other_version"] = sum(c.ok for c in controls)
            record(replica_start_s=round(app.start_s, 1), publish_adapter_s=[round(s, 3) for s in publish_s], versions=judged)
            failed = [f"prompt {i}: {j.reason}" for i, j in enumerate(verdicts) if not j.ok]
            assert not failed, f"adapter version {v}: " + "; ".join(failed)
            # A wrong adapter (or its bytes scaled otherwise) would not reproduce a whole
            # sequence of MAX_TOKENS greedy tokens; near-ties alone could hide it on short prefixes.
            assert any(j.equal for j in verdicts), f"adapter version {v}: no prompt's {MAX_TOKENS} tokens equal the reference's: {judged[str(v)]}"
            assert all(s == {(LORA_NAME, v)} for s in spans), spans
            assert not any(c.ok for c in controls), (
                f"adapter version {v}'s output passes against version {other}'s reference for prompts "
                f"{[i for i, c in enumerate(controls) if c.ok]}: the tolerances do not tell the adapters apart"
            )
    finally:
        pub.close()
    assert greedy(on_platform(app.handle)) == base, "requests naming no adapter get the base model's tokens"
    record(base="equal")


def lora_summary(verdicts) -> dict:
    """What the record keeps of one version's verdicts (``tests.gpu.compare.Verdict``): the
    numbers to tighten the tolerances from, and the reasons of any that failed."""
    return {
        "prompts": len(verdicts),
        "exactly_equal": sum(j.equal for j in verdicts),
        "near_ties": [
            {"prompt": i, "position": j.position, "gap": round(j.gap, 4), "max_deviation_before": round(j.max_deviation, 4), "deviation_at": round(j.deviation_at, 4)}
            for i, j in enumerate(verdicts)
            if j.ok and not j.equal
        ],
        "max_deviation": [round(j.max_deviation, 4) for j in verdicts],
        "failures": [
            {"prompt": i, "position": j.position, "gap": None if j.gap is None else round(j.gap, 4), "reason": j.reason}
            for i, j in enumerate(verdicts)
            if not j.ok
        ],
    }
