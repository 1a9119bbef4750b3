"""Checkpoints on shared storage (rollout.sync.storage): written manifest last, verified
against it before anything loads them. One process, real files, no Ray, no engine."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout import wire_errors
from rollout.contracts.sync_protocol import SyncError
from rollout.errors import InvalidRequestError
from rollout.sync import storage
from rollout.sync.storage import INDEX_NAME, MANIFEST_NAME, CheckpointError, verify_checkpoint, write_checkpoint
from tests.inprocess import InProcess, RecordingEngine

SHARD_BYTES = 4096


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(32, 16, generator=g)
    return {
        "model.embed_tokens.weight": base,
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=g),
        # Tied to the embedding (shares its storage) and a view of part of a buffer:
        # safetensors refuses both unless each tensor owns its storage.
        "lm_head.weight": base,
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=g)[16:32],
    }


@pytest.fixture
def written(tmp_path) -> tuple[Path, storage.Manifest]:
    directory = tmp_path / "policy-v7"
    return directory, write_checkpoint(tensors(), directory, shard_bytes=SHARD_BYTES)


def refused(directory, **kwargs) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(directory, **kwargs)
    return e.value


# ---- writing and reading back ------------------------------------------------------------


def test_a_written_checkpoint_verifies_and_holds_exactly_the_tensors_in_shards_the_index_names(written, model_dir, tmp_path):
    directory, manifest = written
    assert verify_checkpoint(directory) == manifest
    assert storage.read_manifest(directory) == manifest
    want = tensors()
    n = len(manifest.shards)
    assert n > 1, "small shards: several files"
    assert [s.file for s in manifest.shards] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    loaded = {}
    for shard in manifest.shards:
        path = directory / shard.file
        assert shard.bytes == path.stat().st_size
        assert shard.digest == hashlib.sha256(path.read_bytes()).hexdigest()
        in_file = load_file(path)
        assert sorted(in_file) == sorted(shard.tensors)
        loaded.update(in_file)
        assert shard.bytes <= SHARD_BYTES + 1024 or len(shard.tensors) == 1, "a shard past the bound holds one tensor"
    assert loaded.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(loaded[name], t), name
    index = json.loads((directory / INDEX_NAME).read_text())
    assert index["weight_map"] == manifest.tensor_files()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    assert not [f for f in os.listdir(directory) if f.endswith(".partial")], "no temporary file is left"
    # The model's own files, copied from a source directory: a fresh engine could load it.
    other = tmp_path / "with-config"
    write_checkpoint(tensors(), other, source_dir=model_dir)
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (other / f).read_bytes() == (model_dir / f).read_bytes()
    assert not (other / "model.safetensors").exists(), "the source's weights are not copied"


def test_vllms_loader_reads_exactly_the_shards_the_index_names(written):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    directory, manifest = written
    # A stray file of a crashed earlier write is not loaded: the index names the shards.
    (directory / "model-00001-of-00009.safetensors").write_bytes((directory / manifest.shards[0].file).read_bytes())
    _, files, use_safetensors, _ = DefaultModelLoader(LoadConfig())._prepare_weights(str(directory), None, None, True, None)
    assert use_safetensors and sorted(Path(f).name for f in files) == sorted(s.file for s in manifest.shards)
    loaded = dict(safetensors_weights_iterator(files, False))
    assert loaded.keys() == tensors().keys()
    assert all(torch.equal(loaded[n], t) for n, t in tensors().items())


def test_the_manifest_is_the_last_file_written_and_every_shard_is_complete_when_it_appears(tmp_path, monkeypatch):
    renamed: list[str] = []
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == MANIFEST_NAME:
            # Every shard and the index are in place, whole, before the manifest names them.
            manifest = json.loads(Path(src).read_text())
            for entry in [manifest["index"], *manifest["shards"]]:
                assert (tmp_path / "ckpt" / entry["file"]).stat().st_size == entry["bytes"], entry["file"]
        real_replace(src, dst)
        renamed.append(Path(dst).name)

    monkeypatch.setattr(storage.os, "replace", replace)
    manifest = write_checkpoint(tensors(), tmp_path / "ckpt", shard_bytes=SHARD_BYTES)
    assert renamed[-1] == MANIFEST_NAME and renamed.count(MANIFEST_NAME) == 1
    assert sorted(renamed[:-1]) == sorted([s.file for s in manifest.shards] + [INDEX_NAME])
    newest = max((tmp_path / "ckpt").iterdir(), key=lambda f: f.stat().st_mtime_ns)
    assert newest.name == MANIFEST_NAME


def test_a_write_that_dies_before_its_manifest_leaves_a_checkpoint_refused_as_incomplete(tmp_path, monkeypatch):
    real_replace = os.replace

    def crash_at_manifest(src, dst):
        if Path(dst).name == MANIFEST_NAME:
            raise OSError("the trainer was preempted")
        real_replace(src, dst)

    monkeypatch.setattr(storage.os, "replace", crash_at_manifest)
    with pytest.raises(OSError, match="preempted"):
        write_checkpoint(tensors(), tmp_path / "ckpt", shard_bytes=SHARD_BYTES)
    monkeypatch.undo()
    assert list((tmp_path / "ckpt").glob("*.safetensors")), "the shards are there"
    e = refused(tmp_path / "ckpt")
    assert (e.file, e.problem) == (MANIFEST_NAME, "incomplete")
    assert "not complete" in str(e) and str(tmp_path / "ckpt") in str(e)
    assert refused(tmp_path / "never-written").problem == "incomplete"


# ---- each failure names its file -----------------------------------------------------------


def test_a_missing_shard_is_named(written):
    directory, manifest = written
    victim = manifest.shards[1].file
    (directory / victim).unlink()
    e = refused(directory)
    assert (e.file, e.problem) == (victim, "missing") and victim in str(e)


def test_a_truncated_shard_is_named_with_both_sizes(written):
    directory, manifest = written
    victim = manifest.shards[-1]
    with open(directory / victim.file, "r+b") as f:
        f.truncate(victim.bytes - 7)
    e = refused(directory)
    assert (e.file, e.problem) == (victim.file, "size")
    assert f"{victim.bytes - 7} bytes" in str(e) and str(victim.bytes) in str(e)


def test_one_changed_byte_in_a_shard_is_named_as_a_digest_mismatch(written, monkeypatch):
    directory, manifest = written
    victim = manifest.shards[1]
    data = bytearray((directory / victim.file).read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's data: same size, same header
    (directory / victim.file).write_bytes(bytes(data))
    monkeypatch.setattr(storage, "CHUNK_BYTES", 1000)  # streamed in several chunks
    e = refused(directory)
    assert (e.file, e.problem) == (victim.file, "digest") and "sha256" in str(e)
    assert [s.file for s in manifest.shards if s.file != victim.file], "the other shards are fine"


def rewrite_manifest(directory: Path, change) -> None:
    raw = json.loads((directory / MANIFEST_NAME).read_text())
    change(raw)
    (directory / MANIFEST_NAME).write_text(json.dumps(raw))


def test_a_tensor_listed_twice_is_named_with_both_shards(written):
    directory, manifest = written
    first, second = manifest.shards[0], manifest.shards[1]
    rewrite_manifest(directory, lambda m: m["shards"][1]["tensors"].append(first.tensors[0]))
    e = refused(directory)
    assert (e.file, e.problem) == (second.file, "duplicate")
    assert first.tensors[0] in str(e) and first.file in str(e)


def test_an_index_that_maps_a_tensor_elsewhere_is_refused(written):
    directory, manifest = written
    index = json.loads((directory / INDEX_NAME).read_text())
    name = manifest.shards[0].tensors[0]
    index["weight_map"][name] = manifest.shards[1].file
    data = json.dumps(index).encode()
    (directory / INDEX_NAME).write_bytes(data)
    rewrite_manifest(directory, lambda m: m["index"].update(bytes=len(data), digest=hashlib.sha256(data).hexdigest()))
    e = refused(directory)
    assert (e.file, e.problem) == (INDEX_NAME, "index") and name in str(e)


def test_a_manifest_of_another_write_or_format_or_not_json_is_refused(written):
    directory, manifest = written
    published = storage.manifest_id(directory)
    assert verify_checkpoint(directory, expect_manifest=published) == manifest
    e = refused(directory, expect_manifest="0" * 64)
    assert (e.file, e.problem) == (MANIFEST_NAME, "manifest") and "rewritten" in str(e)
    rewrite_manifest(directory, lambda m: m.update(format_version=99))
    assert "format_version 99" in str(refused(directory))
    rewrite_manifest(directory, lambda m: m.update(format_version=1, digest="md4-of-my-own"))
    assert "digest" in str(refused(directory))
    rewrite_manifest(directory, lambda m: m.update(digest="sha256") or m["shards"][0].update(file="../../etc/passwd"))
    e = refused(directory)
    assert e.problem == "manifest" and "shards[0].file" in str(e)
    (directory / MANIFEST_NAME).write_text("{not json")
    assert refused(directory).problem == "manifest"


def test_a_directory_that_holds_weights_is_not_written_over_and_bad_arguments_name_the_field(written, tmp_path):
    directory, _ = written
    with pytest.raises(InvalidRequestError, match="directory.*already holds a checkpoint"):
        write_checkpoint(tensors(), directory)
    with pytest.raises(InvalidRequestError, match="shard_bytes"):
        write_checkpoint(tensors(), tmp_path / "a", shard_bytes=0)
    with pytest.raises(InvalidRequestError, match="named_tensors.*given twice"):
        write_checkpoint([("w", torch.zeros(2)), ("w", torch.ones(2))], tmp_path / "b")
    with pytest.raises(InvalidRequestError, match="digest"):
        write_checkpoint(tensors(), tmp_path / "c", digest="nope")


def test_blake2b_digests_verify_too(tmp_path):
    manifest = write_checkpoint(tensors(), tmp_path / "b2", digest="blake2b")
    assert manifest.digest == "blake2b" and verify_checkpoint(tmp_path / "b2") == manifest


def test_a_checkpoint_error_is_a_sync_error_that_pickles_and_answers_409_over_http():
    e = CheckpointError("/shared/v7", "model-00002-of-00003.safetensors", "digest", "sha256 differs")
    back = pickle.loads(pickle.dumps(e))
    assert (back.directory, back.file, back.problem, str(back)) == (e.directory, e.file, e.problem, str(e))
    assert isinstance(back, SyncError)
    answer = wire_errors.encode(e)
    assert answer.status == 409 and "model-00002-of-00003.safetensors" in answer.body["error"]["message"]


# ---- a publish through shared storage: coordinator, agents and publisher in one process ----


class FromThread:
    """The publisher's blocking calls (it runs in a thread), answered by the coordinator on this loop."""

    host = None

    def __init__(self, coordinator, loop):
        self.coordinator, self.loop = coordinator, loop

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def begin_storage(self, token, request):
        return self._call(self.coordinator.begin_storage(token, request))

    def finish(self, token, round_id, error, timeout_s=None, digests=None):
        return self._call(self.coordinator.finish(token, round_id, error))

    def status(self, timeout_s=None):
        return self._call(self.coordinator.status())


def checkpoint_of(model_dir: Path, directory: Path) -> Path:
    write_checkpoint(load_file(model_dir / "model.safetensors"), directory, shard_bytes=256 << 10, source_dir=model_dir)
    return directory


def corrupted_copy(directory: Path, to: Path, shard: int = 1) -> str:
    import shutil

    shutil.copytree(directory, to)
    victim = storage.read_manifest(to).shards[shard].file
    data = bytearray((to / victim).read_bytes())
    data[-1] ^= 0x40
    (to / victim).write_bytes(bytes(data))
    return victim


async def settled(*agents, timeout_s: float = 5.0) -> None:
    """Until no agent is in a round."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while any(a._incoming is not None for a in agents) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)


async def test_a_storage_publish_is_verified_by_every_replica_before_it_reloads_and_a_corrupted_one_loads_nowhere(model_dir, tmp_path):
    import asyncio as aio

    from rollout.contracts.sync_protocol import StorageRequest
    from rollout.sync.agent import SyncAgent
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator
    from rollout.sync.publisher import WeightPublisher

    good = checkpoint_of(model_dir, tmp_path / "policy-v1")
    assert len(storage.read_manifest(good).shards) > 1
    bad = tmp_path / "policy-v1-bad"
    victim = corrupted_copy(good, bad)
    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 5, "require_token": False}}, "nccl")
    engines = {rid: RecordingEngine() for rid in "ab"}
    agents = {rid: SyncAgent(engine=e, coordinator=InProcess(coordinator), replica_id=rid, ranks=1, model_path=str(model_dir)) for rid, e in engines.items()}
    for agent in agents.values():
        await agent.start()
    publisher = WeightPublisher(FromThread(coordinator, aio.get_running_loop()), "auto", None)
    try:
        # The trainer's own check: refused before any round opens, naming the shard.
        with pytest.raises(CheckpointError) as e:
            await aio.to_thread(publisher.publish_checkpoint, bad)
        assert (e.value.file, e.value.problem) == (victim, "digest")
        assert coordinator.rounds.current is None and all(e.calls == [] for e in engines.values())
        (tmp_path / "being-written").mkdir()
        with pytest.raises(CheckpointError, match="not complete"):
            await aio.to_thread(publisher.publish_checkpoint, tmp_path / "being-written")
        with pytest.raises(InvalidRequestError, match="directory.*absolute"):
            await aio.to_thread(publisher.publish_checkpoint, "relative/policy")

        # A round whose replicas find the checkpoint corrupted (their mount differs, or it
        # changed after the trainer checked it): nothing loads, the round aborts at the
        # first refusal naming the replica and the shard, and every replica keeps the
        # committed version.
        specs = tuple(checkpoint_spec(model_dir))
        plan = await coordinator.begin_storage(None, StorageRequest(str(bad), storage.manifest_id(bad), specs))
        outcome = await aio.wait_for(coordinator.finish(None, plan.round_id), 10)
        await settled(*agents.values())
        assert not outcome.committed and outcome.version == 0 and outcome.failed_replicas
        assert all(f"{rid}: CheckpointError: checkpoint {bad}: {victim}: sha256" in outcome.error for rid in outcome.failed_replicas)
        for rid, engine in engines.items():
            assert [c[0] for c in engine.calls] == ["pause_generation", "resume_generation"], rid
            assert agents[rid].version == 0 and not agents[rid].broken
            engine.calls.clear()

        # A good one: every replica verifies, reloads it, and serves the new version.
        assert await aio.to_thread(publisher.publish_checkpoint, good) == 1
        assert set(publisher.last_phases) == {"verify", "open", "commit"}
        for rid, engine in engines.items():
            assert [c[0] for c in engine.calls] == ["pause_generation", "collective_rpc", "update_weight_version", "resume_generation"], rid
            assert engine.calls[1] == ("collective_rpc", "reload_weights", {"weights_path": str(good)})
            assert agents[rid].version == 1
        status = await coordinator.status()
        assert status["committed_version"] == 1 and status["recent_rounds"][-1]["round_id"].startswith("storage-1-")

        # It is what a replica that starts later reloads, verified against the same manifest.
        late = RecordingEngine()
        c = SyncAgent(engine=late, coordinator=InProcess(coordinator), replica_id="c", ranks=1, model_path=str(model_dir))
        await c.start()
        c.stop()
        assert c.version == 1 and not c.broken
        assert ("collective_rpc", "reload_weights", {"weights_path": str(good)}) in late.calls
        # Rewritten since (another write of the same directory): refused, nothing loads.
        (good / storage.MANIFEST_NAME).write_text((good / storage.MANIFEST_NAME).read_text() + " ")
        later = RecordingEngine()
        d = SyncAgent(engine=later, coordinator=InProcess(coordinator), replica_id="d", ranks=1, model_path=str(model_dir))
        await d.start()
        d.stop()
        assert d.version == 0 and "weights are not the committed version" in d.broken
        assert not [call for call in later.calls if call[0] == "collective_rpc"]
    finally:
        for agent in agents.values():
            agent.stop()


async def test_a_storage_publish_is_checked_like_any_publish_and_forgets_the_kept_transfer_group(model_dir):
    from rollout.contracts.sync_protocol import RoundRequest, StorageRequest
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 1, "require_token": False}}, "nccl")
    specs = tuple(checkpoint_spec(model_dir))
    await coordinator.register("a", 1, 0, list(specs))
    bad = [
        (StorageRequest("/shared/v1", "0" * 64, specs[1:]), "missing"),
        (StorageRequest("shared/v1", "0" * 64, specs), "checkpoint.*absolute"),
        (StorageRequest("/shared/v1", "0" * 64, specs, version=0), "version"),
    ]
    for request, words in bad:
        with pytest.raises(InvalidRequestError, match=words):
            await coordinator.begin_storage(None, request)
    assert coordinator.rounds.current is None

    async def commit(plan):
        asyncio.get_running_loop().create_task(coordinator.report(plan.round_id, "a", None))
        finish = asyncio.create_task(coordinator.finish(None, plan.round_id))
        await asyncio.sleep(0.05)
        await coordinator.applied(plan.round_id, "a", plan.version)
        assert (await finish).committed

    push = await coordinator.begin_round(None, RoundRequest(specs, "127.0.0.1", 1001))
    await commit(push)
    storage_plan = await coordinator.begin_storage(None, StorageRequest("/shared/v2", "ab" * 32, specs))
    assert (storage_plan.kind, storage_plan.version, storage_plan.checkpoint, storage_plan.manifest) == ("storage", 2, "/shared/v2", "ab" * 32)
    await commit(storage_plan)
    again = await coordinator.begin_round(None, RoundRequest(specs, "127.0.0.1", 1002, reuse_group=push.group))
    assert again.transfer.group_name == "", "the replicas forgot the group in the storage round: a new one forms"
    await coordinator.report(again.round_id, "a", "receive failed")  # aborts: version 2 stays committed
    # Restores reload the committed checkpoint, verified against its manifest.
    plan = await coordinator.restore("a")
    assert (plan.kind, plan.checkpoint, plan.manifest, plan.version) == ("reload", "/shared/v2", "ab" * 32, 2)


def test_a_storage_round_travels_over_http_as_it_was_asked_and_the_schema_documents_its_route():
    from pydantic import ValidationError

    from rollout.contracts.sync_protocol import ParamSpec, StorageRequest
    from rollout.http.ingress import app
    from rollout.sync.remote import StorageRoundBody

    request = StorageRequest("/shared/v7", "ab" * 32, (ParamSpec("w", "float32", (2, 3)),), version=7)
    body = StorageRoundBody.of(request).model_dump(mode="json")
    assert StorageRoundBody.model_validate(body).request() == request
    for field, value in (("checkpoint", "shared/v7"), ("manifest", "not-a-digest"), ("params", [])):
        with pytest.raises(ValidationError, match=field):
            StorageRoundBody.model_validate({**body, field: value})
    route = app.openapi()["paths"]["/v1/sync/storage-rounds"]["post"]
    assert "409" in route["responses"] and "StorageRoundBody" in str(route["requestBody"])
