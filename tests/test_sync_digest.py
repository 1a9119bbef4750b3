"""Fleet integrity (rollout.sync.digest): the digest function, the file hand-off from the
receiving engine to the agent, the test hook, the sender's digests of packed buckets, and
the coordinator's comparison, in one process (no Ray, no engines)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.contracts.sync_protocol import ParamSpec, RoundRequest
from rollout.sync import digest
from rollout.sync.backends.gloo_stream import SentDigests
from rollout.sync.coordinator import WeightSyncCoordinator
from rollout.sync.wire import pack, plan_buckets, unpack

SPECS = [ParamSpec("w", "float32", (2, 2)), ParamSpec("b", "bfloat16", (3,))]


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(2, 2, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)}


# ---- the digest ----------------------------------------------------------------------


def test_a_digest_is_of_the_bytes_the_same_for_a_copy_a_view_and_any_dtype_and_changes_with_one_bit():
    t = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    d = digest.tensor_digest(t)
    assert d.endswith(f":{64 * 33 * 4}") and len(d.split(":")[0]) == 48
    assert digest.tensor_digest(t.clone()) == d
    assert digest.tensor_digest(t.view(torch.uint8)) == d, "the bytes, not the dtype"
    assert digest.tensor_digest(t.t().contiguous()) != d, "row-major order: a transpose is other bytes"
    assert digest.tensor_digest(t.to(torch.bfloat16)) != d
    flipped = t.clone()
    flipped.view(torch.int32)[17, 3] ^= 1  # one bit of one element
    assert digest.tensor_digest(flipped) != d
    assert digest.tensor_digest(t.to(torch.bfloat16)) == digest.tensor_digest(t.to(torch.bfloat16).clone())
    assert digest.tensor_digest(torch.zeros(4, dtype=torch.uint8)) != digest.tensor_digest(torch.zeros(8, dtype=torch.uint8)), "the length counts"


def test_every_single_bit_flip_and_a_swap_in_a_row_or_a_column_changes_the_digest():
    t = torch.randint(-(2**62), 2**62, (3 * digest.ROW + 5,), generator=torch.Generator().manual_seed(2), dtype=torch.int64)
    d = digest.tensor_digest(t)
    for index in (0, digest.ROW - 1, digest.ROW, 2 * digest.ROW + 7, 3 * digest.ROW, 3 * digest.ROW + 4):  # rows and the tail
        for bit in (0, 31, 62, 63):
            flipped = t.clone()
            flipped[index] ^= (1 << bit) if bit < 63 else -(2**63)
            assert digest.tensor_digest(flipped) != d, (index, bit)
    for a, b in ((0, 1), (0, digest.ROW), (5, 2 * digest.ROW + 5), (3 * digest.ROW, 3 * digest.ROW + 1)):
        swapped = t.clone()
        swapped[[a, b]] = swapped[[b, a]]
        assert digest.tensor_digest(swapped) != d, (a, b)


def test_a_digest_does_not_depend_on_alignment_and_an_odd_sized_tensor_has_one():
    data = torch.randint(0, 256, (4 * 8 * digest.ROW + 3,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), data])
    assert digest.tensor_digest(buffer[3:]) == digest.tensor_digest(data.clone()), "a view at an odd offset digests a copy"
    assert digest.tensor_digest(torch.ones(3, dtype=torch.bfloat16)) != digest.tensor_digest(torch.zeros(3, dtype=torch.bfloat16))


def test_the_combined_digest_depends_on_every_tensor_and_its_name_not_on_the_order_sent():
    d = {"a": "00", "b": "11"}
    base = digest.combine(d)
    assert digest.combine({"b": "11", "a": "00"}) == base, "a publish and a restore send in different orders"
    assert digest.combine({"a": "00", "b": "12"}) != base
    assert digest.combine({"a": "00", "c": "11"}) != base
    assert digest.combine({"a": "00"}) != base


def test_differing_names_every_tensor_that_differs_is_missing_or_extra():
    sent = {"a": "1", "b": "2", "c": "3"}
    assert digest.differing(sent, dict(sent)) == []
    assert digest.differing(sent, {"a": "1", "b": "x", "d": "4"}) == ["b", "c", "d"]
    names = [f"t{i}" for i in range(12)]
    assert digest.describe(names) == "12 tensors (t0, t1, t2, t3, t4, t5, t6, t7 and 4 more)"
    assert digest.describe(["x"]) == "1 tensor (x)"


def test_the_sender_digests_each_tensor_it_packs_as_the_bytes_of_its_packed_bucket():
    ts = tensors()
    sent = SentDigests()
    packed = {}
    for bucket in plan_buckets(SPECS, 16):  # two buckets
        specs = [SPECS[i] for i in bucket]
        sent.add([(s.name, ts[s.name]) for s in specs])
        packed.update(digest.digest_all(unpack(pack(ts[s.name] for s in specs), specs)))
    assert sent.digests == packed == {n: digest.tensor_digest(t) for n, t in ts.items()}
    assert list(sent.digests) == [s.name for s in SPECS] and sent.seconds >= 0


def test_what_a_receiver_digests_from_unpacked_views_matches_and_a_flipped_byte_does_not():
    ts = tensors()
    buffer = pack(ts[s.name] for s in SPECS)
    views = list(unpack(buffer, SPECS))
    assert digest.digest_all(views) == {n: digest.tensor_digest(t) for n, t in ts.items()}
    digest.corrupt(views[1][1])
    got = digest.digest_all(unpack(buffer, SPECS))
    assert digest.differing({n: digest.tensor_digest(t) for n, t in ts.items()}, got) == ["b"]


# ---- from the engine to the agent, and the test hook ---------------------------------


def test_each_engine_rank_writes_its_digests_and_the_agent_reads_them_once(tmp_path):
    path = str(tmp_path / "round-1")
    assert digest.read_received(path) is None, "no engine wrote any: None, not a guess"
    d = {"w": "aa", "b": "bb"}
    digest.write_received(path, 0, d, 0.5)
    digest.write_received(path, 1, dict(d), 0.25)
    assert digest.read_received(path) == digest.Received(d, 0.5), "the slowest rank's time"
    assert digest.read_received(path) is None, "read once: the files are removed"
    digest.write_received(path, 0, d, 0.0)
    digest.write_received(path, 1, {"w": "aa", "b": "cc"}, 0.0)
    with pytest.raises(ValueError, match=r"ranks disagree.*1 tensor \(b\)"):
        digest.read_received(path)


def test_the_corruption_hook_is_inert_unless_its_marker_is_set_and_fires_once(tmp_path, monkeypatch):
    monkeypatch.setattr(digest.tempfile, "gettempdir", lambda: str(tmp_path))
    path = digest.received_path("app#Replica#x/1", "round-1-abc")
    assert path.startswith(str(digest.replica_dir("app#Replica#x/1"))) and "/" not in digest.replica_dir("app#Replica#x/1").name
    assert not digest.take_corruption(path)
    (digest.replica_dir("app#Replica#x/1") / digest.CORRUPT_MARKER).touch()
    assert digest.take_corruption(path)
    assert not digest.take_corruption(path), "one-shot"


def test_digests_go_only_to_a_directory_no_other_user_can_write_or_redirect(tmp_path, monkeypatch, caplog):
    # In a shared /tmp, another local user could otherwise plant the marker or a link that
    # steers the engine's writes: such a directory is refused and nothing is collected.
    import os

    monkeypatch.setattr(digest.tempfile, "gettempdir", lambda: str(tmp_path))
    made = digest.replica_dir("r1")
    assert digest.received_path("r1", "round-1") is not None
    assert made.stat().st_mode & 0o777 == 0o700 and made.parent.stat().st_mode & 0o777 == 0o700
    os.chmod(made, 0o777)
    assert digest.received_path("r1", "round-2") is None
    assert "not a private directory" in caplog.text
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, digest.replica_dir("r2"))
    assert digest.received_path("r2", "round-3") is None


# ---- the coordinator's comparison ----------------------------------------------------


def coordinator(backend: str = "nccl") -> WeightSyncCoordinator:
    return WeightSyncCoordinator({"model": {"path": "/m"}, "metrics": {"enabled": False}, "sync": {"timeout_s": 1, "require_token": False}}, backend)


SENT = {"w": "0" * 64, "b": "1" * 64}


async def run_round(c: WeightSyncCoordinator, received: dict[str, dict | None], sent=SENT, version: int = 1):
    for rid in received:
        await c.register(rid, 1, 0, SPECS)
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", version))
    reports = [asyncio.create_task(c.report(plan.round_id, rid, None, None, d)) for rid, d in received.items()]
    finish = asyncio.create_task(c.finish(None, plan.round_id, None, sent))
    await asyncio.sleep(0.05)
    if c.store.version == plan.version:
        for rid in received:
            await c.applied(plan.round_id, rid, plan.version)
    outcome = await asyncio.wait_for(finish, 2)
    assert all(r.done() and r.result() == outcome for r in reports)
    return plan, outcome


async def test_a_member_whose_received_bytes_differ_aborts_the_round_and_is_named_with_the_tensors():
    c = coordinator()
    bad = {**SENT, "b": "f" * 64}
    plan, outcome = await run_round(c, {"a": dict(SENT), "z": bad})
    assert not outcome.committed and c.store.version == 0, "every replica keeps the committed version"
    assert outcome.failed_replicas == ["z"] and outcome.mismatched == {"z": ["b"]}
    assert "z: received bytes differ from those sent in 1 tensor (b)" in outcome.error
    assert "a:" not in outcome.error
    assert outcome.replica_digests["a"] == outcome.digest != outcome.replica_digests["z"]
    status = await c.status()
    assert status["committed_digest"] is None and all(r["received"] is None for r in status["replicas"].values())


async def test_matching_digests_commit_and_status_shows_each_replicas_digest_and_version():
    c = coordinator()
    plan, outcome = await run_round(c, {"a": dict(SENT), "b": dict(SENT)})
    assert outcome.committed and outcome.mismatched == {}
    want = digest.combine(SENT)
    assert outcome.digest == want and outcome.replica_digests == {"a": want, "b": want}
    status = await c.status()
    assert status["committed_digest"] == {"version": 1, "digest": want}
    assert {rid: (r["version"], r["received"]) for rid, r in status["replicas"].items()} == {
        "a": (1, {"version": 1, "digest": want}),
        "b": (1, {"version": 1, "digest": want}),
    }


async def test_a_member_missing_a_tensor_fails_and_one_that_reports_no_digests_is_not_compared():
    c = coordinator()
    _, outcome = await run_round(c, {"a": {"w": SENT["w"]}, "b": None})
    assert not outcome.committed and outcome.mismatched == {"a": ["b"]}
    c2 = coordinator()
    _, outcome2 = await run_round(c2, {"a": None})
    assert outcome2.committed, "a backend whose engine digests nothing commits as before"
    c3 = coordinator()
    _, outcome3 = await run_round(c3, {"a": dict(SENT)}, sent=None)
    assert outcome3.committed and outcome3.digest == "", "a publisher that sent no digests: nothing to compare"


def test_the_host_digest_equals_the_device_one_byte_for_byte():
    """A GPU publisher digests with torch on its device, a CPU replica with numpy: both
    must give the same sums (here torch's path runs on the CPU), tails and odd offsets too."""
    g = torch.Generator().manual_seed(4)
    for n in (0, 5, 8 * digest.ROW, 8 * digest.ROW + 1, 3 * 8 * digest.ROW + 13, 100_003):
        data = torch.randint(0, 256, (n + 3,), generator=g, dtype=torch.uint8)
        for b in (data[:n], data[3:]):  # aligned, and a view at an odd offset
            assert both(b) == (digest._format(digest._host_sums(b.numpy()), n),) * 2, n
    big = torch.randint(-(2**63), 2**63 - 1, (64 * digest.ROW,), generator=g, dtype=torch.int64)  # sums that wrap
    host, device = both(big.view(torch.uint8))
    assert host == device


def both(b: torch.Tensor) -> tuple[str, str]:
    """The digest of the bytes ``b`` from numpy's sums and from torch's (read back as a
    bucket's are, in one stacked tensor)."""
    return digest._format(digest._host_sums(b.numpy()), b.numel()), digest._format(digest._device_sums(b).tolist(), b.numel())
