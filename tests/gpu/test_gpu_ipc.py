"""Issue 41's IPC publish on a real GPU, one GPU enough: a trainer on the replica's GPU
publishes over ``ipc`` and the replica copies from its mapped tensors with the direct plan.
Moved out of test_gpu_platform.py (whose checks need two GPUs) so a one-GPU machine runs it:
the replica, the trainer and the bare reference engine share the GPU.

Run by ``tests/gpu/check.sh`` (``run 600 -k ipc``; this check alone: ``-k test_ipc_publish``);
skipped without a GPU.
"""

from __future__ import annotations

import statistics
import time

import torch

from tests.gpu.machine import needs_gpus
from tests.gpu.test_gpu_platform import MODEL, _clean_stage_after_a_failure, cluster, first_mismatch, greedy, load_weights, on_platform, perturbed, platform_cfg, stage  # noqa: F401 - fixtures

pytestmark = needs_gpus(1)
IPC_PUBLISHES = 5  # the first maps the trainer's export; the rest offer it again (the steady state)
IPC_STEP_AT = 2  # the publish before which the trainer writes the perturbed weights in place
IPC_GOAL_S = 0.020  # issue 41: a steady IPC publish of the 2.96 GB model, trainer to committed
# Then steady publishes with wait="committed" (publish returns at the decision, not once the
# replica resumed): the "trainer to committed", what the goal is judged on.
IPC_COMMITTED_PUBLISHES = 5


def test_ipc_publish_from_a_trainer_on_the_replica_gpu_costs_it_no_copy(stage, perturbed, record):
    """A trainer on the replica's GPU publishes over ``ipc``: the replica's engine (ours,
    rollout.sync.backends.ipc_worker) maps the trainer's tensors once and copies them into
    the parameters with the direct plan. The first publish maps the export; the steady ones
    offer the same export again (the trainer's tensors did not move) and map nothing. The
    first two publish the original weights; then the trainer writes the perturbed policy
    into the same tensors in place (as an optimizer step does) and publishes three more
    times: the replica must serve the new values through the export it kept.

    Recorded: every publish's seconds and where they went (the trainer's steps and the
    replica's, as a median waterfall per wait mode), and the floor: one ``_foreach_copy_`` of
    the same bytes on this GPU. After IPC_PUBLISHES publishes with the default wait
    ("serving": returns once the replica resumed) come IPC_COMMITTED_PUBLISHES with
    wait="committed" (returns at the commit). The goal (issue 41) is a steady publish,
    trainer to committed, under IPC_GOAL_S, judged on the "committed" ones; a miss is
    recorded as its number (``goal_met`` false), not failed: the check fails only where the
    replica does not serve exactly the published weights or the trainer's memory grew."""
    from rollout.sync import WeightPublisher

    app = stage.app_for(platform_cfg("gpu-ipc", "ipc"))
    record(replica_start_s=round(app.start_s, 1))
    want = stage.reference(perturbed)
    replica_gpu = app.replica_gpu
    device = torch.device("cuda", replica_gpu)
    tensors = load_weights(MODEL, str(device))
    trained = load_weights(perturbed, "cpu")  # what the "optimizer step" writes in place
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    floor_s = _device_copy_floor(list(tensors.values()), device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    app.published = True
    pub = WeightPublisher.connect(app_name=app.name, backend="ipc")
    seconds, trainer_phases, replica_phases, reused, by_id, round_ids = [], [], [], [], [], []
    for i in range(IPC_PUBLISHES + IPC_COMMITTED_PUBLISHES):
        if i == IPC_STEP_AT:
            with torch.no_grad():
                for name, t in tensors.items():
                    t.copy_(trained[name])  # host to device, into the published storage
        wait = "serving" if i < IPC_PUBLISHES else "committed"
        t0 = time.perf_counter()
        version = pub.publish(tensors, checkpoint=str(perturbed if i >= IPC_STEP_AT else MODEL), wait=wait)
        seconds.append(round(time.perf_counter() - t0, 4))
        trainer_phases.append({k: round(v, 5) for k, v in pub.last_phases.items()})
        replica_phases.append({rid: {k: round(v, 5) for k, v in ph.items()} for rid, ph in pub.last_outcome.phases.items()})
        reused.append(pub._sender.export_reused)
        by_id.append(pub._sender.by_reference)  # the export named by id alone: no handles in the round's messages
        round_ids.append(pub.last_outcome.round_id)
    peak_growth = torch.cuda.max_memory_allocated(device) - before
    pub.close()
    got = greedy(on_platform(app.handle))
    # A "committed" publish returned before its replica confirmed: its phases reached the
    # coordinator's outcome after (status()), by the time the next publish (or the greedy) ran.
    recent = {r["round_id"]: r for r in pub.status()["recent_rounds"]}
    for i in range(IPC_PUBLISHES, len(round_ids)):
        got_phases = (recent.get(round_ids[i]) or {}).get("phases") or {}
        replica_phases[i] = {rid: {k: round(v, 5) for k, v in ph.items()} for rid, ph in got_phases.items()}
    serving_steady = statistics.median(seconds[1:IPC_PUBLISHES])
    committed_steady = statistics.median(seconds[IPC_PUBLISHES:])
    record(
        replica_gpu=replica_gpu,
        publish_s=seconds,
        publish_wait=["serving"] * IPC_PUBLISHES + ["committed"] * IPC_COMMITTED_PUBLISHES,
        steady_publish_s=round(serving_steady, 4),  # wait="serving" (the default): every replica resumed
        steady_committed_s=round(committed_steady, 4),  # wait="committed": the trainer to committed
        goal_s=IPC_GOAL_S,
        goal_met=committed_steady < IPC_GOAL_S,
        device_copy_floor_s=round(floor_s, 5),
        export_reused=reused,
        export_by_id=by_id,
        weights_bytes=nbytes,
        tensors=len(tensors),
        trainer_peak_growth_bytes=peak_growth,
        greedy=first_mismatch(got, want),
        # The steady round's waterfall, the median of each phase in order: the trainer's
        # (open = open.prepare + open.ask, send, commit) and the replica's (pause, join, start,
        # receive, decision, finish, version, resume), per wait mode.
        waterfall={
            "serving": _waterfall(trainer_phases[1:IPC_PUBLISHES], replica_phases[1:IPC_PUBLISHES]),
            "committed": _waterfall(trainer_phases[IPC_PUBLISHES:], replica_phases[IPC_PUBLISHES:]),
        },
        trainer_phases=trainer_phases,
        replica_phases=replica_phases,
        phases=replica_phases[-1],
        version=version,
    )
    del tensors, trained
    torch.cuda.empty_cache()
    assert got == want, first_mismatch(got, want)
    assert peak_growth < 0.05 * nbytes, f"the trainer's GPU memory grew by {peak_growth} bytes for {nbytes} bytes of weights"
    steady = len(seconds) - 1
    assert reused == [False] + [True] * steady, f"the trainer's tensors did not move, so every publish after the first offers the same export: {reused}"
    assert by_id == [False] + [True] * steady, f"after the first commit every publish names the export by id, without its handles: {by_id}"


def _waterfall(trainer: list[dict], replica: list[dict]) -> dict:
    """The median seconds of each phase over ``trainer``'s and ``replica``'s rounds, in the
    order the phases ran (the replica's: of its one replica)."""

    def medians(rounds: list[dict]) -> dict:
        names = list(dict.fromkeys(k for r in rounds for k in r))
        return {k: round(statistics.median(r[k] for r in rounds if k in r), 5) for k in names}

    return {"trainer": medians(trainer), "replica": medians([next(iter(r.values())) for r in replica if r])}


def _device_copy_floor(tensors: list, device) -> float:
    """Seconds of one ``_foreach_copy_`` of ``tensors`` into fresh tensors on ``device``
    (the best of five, after a warm-up): what moving the bytes costs, nothing else."""
    dst = [torch.empty_like(t) for t in tensors]
    best = float("inf")
    with torch.cuda.device(device):
        for i in range(6):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            torch._foreach_copy_(dst, tensors)
            torch.cuda.synchronize(device)
            if i:
                best = min(best, time.perf_counter() - t0)
    del dst
    torch.cuda.empty_cache()
    return best


# ---- sparse NCCL publish (deltas) -----------------------------------------------
