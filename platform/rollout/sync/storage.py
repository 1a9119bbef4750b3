"""Checkpoints on shared storage: written so that a reader never loads a half-written one.

A trainer with no network path to the engines publishes by writing its weights to a
directory every replica mounts (a volume, object storage through its file mount), in the
Hugging Face layout vLLM's loader reads (``model-0000k-of-0000n.safetensors`` shards and
``model.safetensors.index.json``), then ``rollout-manifest.json`` LAST: the format
version, and per shard its file name, size in bytes, digest and tensor names. Every file
is written under a temporary name, flushed to disk and renamed; the manifest is renamed
into place only after every shard and the index are, so a reader that finds the manifest
finds complete shards, and a directory without one is a checkpoint still being written.

:func:`verify_checkpoint` checks a directory against its manifest (each digest computed
streaming, in :data:`CHUNK_BYTES` chunks) and raises :class:`CheckpointError` naming the
file and what is wrong. A replica calls it before vLLM's ``reload_weights`` reads the
directory; the publisher before it opens a round.

Temporary names never end in ``.safetensors``: vLLM's loader globs that pattern.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterable, Literal, Mapping, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from rollout.contracts.sync_protocol import ParamSpec, SyncError
from rollout.errors import InvalidRequestError, loc_to_field
from rollout.sync.checkpoint import checkpoint_spec

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MANIFEST_NAME = "rollout-manifest.json"
INDEX_NAME = "model.safetensors.index.json"  # vLLM's loader loads only the shards it names
FORMAT_VERSION = 1
DEFAULT_DIGEST = "sha256"  # ~1.5 GB/s on one core here (blake2b ~1.0)
DEFAULT_SHARD_BYTES = 2 << 30
CHUNK_BYTES = 4 << 20  # digests read files this much at a time
_TEMP_SUFFIX = ".partial"
# Files of a source directory that are weights (or our own): not copied next to new weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", _TEMP_SUFFIX)
_WEIGHT_NAMES = (INDEX_NAME, "pytorch_model.bin.index.json", MANIFEST_NAME)

# What is wrong with a checkpoint, one word each (CheckpointError.problem).
Problem = Literal[
    "incomplete",  # no manifest: still being written (or not written by write_checkpoint)
    "manifest",  # the manifest is unreadable, of an unknown format, or not the one expected
    "missing",  # a file the manifest lists is not there
    "size",  # a file's size differs from the manifest's
    "digest",  # a file's bytes differ from the manifest's digest
    "duplicate",  # a tensor (or a file) listed twice
    "index",  # the index does not map the manifest's tensors to their shards
    "header",  # a shard's safetensors header does not hold the tensors the manifest lists
]


class CheckpointError(SyncError):
    """A checkpoint on shared storage is incomplete or corrupted and was not loaded.

    ``file`` names the shard (or the manifest, the index) and ``problem`` what is wrong
    with it (:data:`Problem`); the message says both, with the directory."""

    def __init__(self, directory: str, file: str, problem: Problem, detail: str):
        self.directory = str(directory)
        self.file = file
        self.problem = problem
        self.detail = detail
        super().__init__(f"checkpoint {self.directory}: {file}: {detail}")

    def __reduce__(self):
        return (type(self), (self.directory, self.file, self.problem, self.detail))


def _plain_name(name: str) -> str:
    if name in (".", ".."):
        raise ValueError(f"{name!r} is not a file name")
    return name


_FileName = Annotated[str, Field(min_length=1, pattern=r"^[^/\\]+$", description="A file of the checkpoint's directory (no path)."), AfterValidator(_plain_name)]
_HexDigest = Annotated[str, Field(min_length=16, pattern=r"^[0-9a-f]+$")]


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    file: _FileName
    bytes: int = Field(ge=0)
    digest: _HexDigest


class ShardEntry(FileEntry):
    file: Annotated[_FileName, Field(pattern=r"^[^/\\]+\.safetensors$")]
    tensors: tuple[str, ...] = Field(description="The names of the tensors the shard holds, in its header.")


class Manifest(BaseModel):
    """``rollout-manifest.json``: what a complete checkpoint holds."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    format_version: int
    digest: str = Field(description="The hashlib algorithm of every digest, e.g. sha256.")
    index: FileEntry
    shards: tuple[ShardEntry, ...] = Field(min_length=1)

    def tensor_files(self) -> dict[str, str]:
        """tensor name -> the shard holding it."""
        return {name: shard.file for shard in self.shards for name in shard.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


# ---- digests and durable writes ----------------------------------------------------------


def file_digest(path: Union[str, Path], algorithm: str = DEFAULT_DIGEST) -> str:
    """The hex digest of ``path``'s bytes, read :data:`CHUNK_BYTES` at a time."""
    h = hashlib.new(algorithm)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def manifest_id(directory: Union[str, Path]) -> str:
    """The sha256 of the directory's manifest file: names exactly this write of the
    checkpoint (a directory rewritten since has another). :class:`CheckpointError`
    ("incomplete") when there is no manifest."""
    return hashlib.sha256(_read_manifest_bytes(Path(directory))).hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    # The renames are durable only once the directory's entries are.
    try:
        _fsync_file(directory)
    except OSError as e:  # some network file systems refuse a directory fsync
        logger.warning("fsync of directory %s failed (%s); relying on the file system's own ordering", directory, e)


def _temp(path: Path) -> Path:
    return path.with_name(f".{path.name}{_TEMP_SUFFIX}")


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = _temp(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- writing ---------------------------------------------------------------------------


def _shard_groups(tensors: list[tuple[str, "torch.Tensor"]], shard_bytes: int) -> list[list[tuple[str, "torch.Tensor"]]]:
    """Consecutive tensors, at most ``shard_bytes`` a shard (a larger tensor alone)."""
    groups: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if current and size + n > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        groups.append(current)
    return groups


def _for_safetensors(group: list[tuple[str, "torch.Tensor"]]) -> dict[str, "torch.Tensor"]:
    """One shard's tensors on the host, each owning its storage: safetensors refuses
    tensors that share memory (tied weights, views of one buffer)."""
    out = {}
    seen: set[int] = set()
    for name, t in group:
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _copy_source_files(source_dir: Path, directory: Path) -> None:
    """The model's config, tokenizer and generation files, so the directory is a whole
    checkpoint a fresh engine can load too."""
    for f in sorted(source_dir.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_NAMES and not f.name.startswith("."):
            shutil.copy2(f, directory / f.name)


def write_checkpoint(
    named_tensors: Union[Mapping[str, "torch.Tensor"], Iterable[tuple[str, "torch.Tensor"]]],
    directory: Union[str, Path],
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    source_dir: Union[str, Path, None] = None,
    digest: str = DEFAULT_DIGEST,
) -> Manifest:
    """Write ``named_tensors`` (HF names) to ``directory`` as safetensors shards of at most
    ``shard_bytes``, the index, and the manifest last; return the manifest.

    ``source_dir``: a model directory whose non-weight files (config, tokenizer,
    generation config) are copied first. ``directory`` may exist (e.g. holding those
    files already) but must hold no weights: write each version to a new directory,
    since a replica may be reading the old one.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    if shard_bytes <= 0:
        raise InvalidRequestError("shard_bytes", f"must be > 0, got {shard_bytes}")
    if digest not in hashlib.algorithms_guaranteed:
        raise InvalidRequestError("digest", f"{digest!r} is not a hashlib algorithm every Python has ({', '.join(sorted(hashlib.algorithms_guaranteed))})")
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    if not items:
        raise InvalidRequestError("named_tensors", "no tensors to write")
    names: set[str] = set()
    for name, _ in items:
        if name in names:
            raise InvalidRequestError("named_tensors", f"{name!r} is given twice")
        names.add(name)
    directory.mkdir(parents=True, exist_ok=True)
    existing = sorted(f.name for f in directory.iterdir() if f.name.endswith(".safetensors") or f.name in _WEIGHT_NAMES)
    if existing:
        raise InvalidRequestError(
            "directory", f"{directory} already holds a checkpoint ({', '.join(existing[:3])}); write each version to a new directory (a replica may be reading this one)"
        )
    if source_dir is not None:
        _copy_source_files(Path(source_dir), directory)

    groups = _shard_groups(items, shard_bytes)
    shards: list[ShardEntry] = []
    for k, group in enumerate(groups, start=1):
        path = directory / f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        tmp = _temp(path)
        save_file(_for_safetensors(group), str(tmp), metadata={"format": "pt"})
        _fsync_file(tmp)
        # Digested from the file as the file system holds it, before it takes its name.
        shards.append(ShardEntry(file=path.name, bytes=tmp.stat().st_size, digest=file_digest(tmp, digest), tensors=tuple(n for n, _ in group)))
        os.replace(tmp, path)
    total = sum(t.numel() * t.element_size() for _, t in items)
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": {n: s.file for s in shards for n in s.tensors}}, indent=2).encode()
    _write_atomically(directory / INDEX_NAME, index)
    _fsync_dir(directory)  # every shard and the index are in place before the manifest names them
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        digest=digest,
        index=FileEntry(file=INDEX_NAME, bytes=len(index), digest=hashlib.new(digest, index).hexdigest()),
        shards=tuple(shards),
    )
    _write_atomically(directory / MANIFEST_NAME, manifest.model_dump_json(indent=2).encode())
    _fsync_dir(directory)
    return manifest


# ---- verifying -------------------------------------------------------------------------


def _read_manifest_bytes(directory: Path) -> bytes:
    if not directory.is_dir():
        raise CheckpointError(str(directory), MANIFEST_NAME, "incomplete", f"{directory} is not a directory this process can read")
    try:
        return (directory / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(str(directory), MANIFEST_NAME, "incomplete", "no manifest: the checkpoint is not complete (it is written last)") from None


def read_manifest(directory: Union[str, Path]) -> Manifest:
    """The parsed manifest (no file is checked against it): :class:`CheckpointError`
    when there is none or it is not a manifest of a known format."""
    return _parse_manifest(Path(directory), _read_manifest_bytes(Path(directory)))


def _parse_manifest(directory: Path, data: bytes) -> Manifest:
    def bad(detail: str) -> CheckpointError:
        return CheckpointError(str(directory), MANIFEST_NAME, "manifest", detail)

    try:
        raw = json.loads(data)
    except ValueError as e:
        raise bad(f"not JSON ({e})") from None
    if isinstance(raw, dict) and raw.get("format_version") != FORMAT_VERSION:
        raise bad(f"format_version {raw.get('format_version')!r}; this platform reads {FORMAT_VERSION}")
    try:
        manifest = Manifest.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise bad(f"{loc_to_field(first.get('loc', ())) or 'manifest'}: {first.get('msg')}") from None
    if manifest.digest not in hashlib.algorithms_guaranteed:
        raise bad(f"digest: {manifest.digest!r} is not a hashlib algorithm every Python has")
    return manifest


def _header_names(path: Path) -> list[str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__"]


def _check_structure(directory: str, manifest: Manifest) -> None:
    """No file or tensor listed twice, and the index maps every tensor to its shard."""
    files: dict[str, int] = {}
    for i, shard in enumerate(manifest.shards):
        if shard.file in files or shard.file == manifest.index.file:
            raise CheckpointError(directory, shard.file, "duplicate", f"listed twice in the manifest (shards[{files.get(shard.file, '?')}] and shards[{i}])")
        files[shard.file] = i
    holder: dict[str, str] = {}
    for shard in manifest.shards:
        for name in shard.tensors:
            if name in holder:
                where = "twice in that shard" if holder[name] == shard.file else f"also in {holder[name]}"
                raise CheckpointError(directory, shard.file, "duplicate", f"tensor {name!r} is listed {where}")
            holder[name] = shard.file


def _check_file(directory: Path, entry: FileEntry, algorithm: str, hash_it: bool) -> None:
    path = directory / entry.file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(str(directory), entry.file, "missing", "listed in the manifest but not in the directory") from None
    if size != entry.bytes:
        raise CheckpointError(str(directory), entry.file, "size", f"{size} bytes; the manifest says {entry.bytes}")
    if hash_it:
        got = file_digest(path, algorithm)
        if got != entry.digest:
            raise CheckpointError(str(directory), entry.file, "digest", f"{algorithm} {got[:16]}...; the manifest says {entry.digest[:16]}... (its bytes changed after it was written)")


def _check_index(directory: Path, manifest: Manifest) -> None:
    _check_file(directory, manifest.index, manifest.digest, hash_it=True)
    try:
        weight_map = json.loads((directory / manifest.index.file).read_bytes())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(str(directory), manifest.index.file, "index", f"not a safetensors index ({type(e).__name__}: {e})") from None
    want = manifest.tensor_files()
    for name, file in want.items():
        if weight_map.get(name) != file:
            raise CheckpointError(str(directory), manifest.index.file, "index", f"maps tensor {name!r} to {weight_map.get(name)!r}; the manifest lists it in {file}")
    extra = sorted(set(weight_map) - set(want))
    if extra:
        raise CheckpointError(str(directory), manifest.index.file, "index", f"maps tensors the manifest does not list: {', '.join(extra[:3])}")


def verify_checkpoint(directory: Union[str, Path], *, expect_manifest: Optional[str] = None) -> Manifest:
    """Check ``directory`` against its manifest; return the manifest, or raise
    :class:`CheckpointError` naming the first file found wrong.

    Cheap checks first (the manifest, each file's presence and size, the index and
    every shard's header), then every shard's digest. ``expect_manifest``: the
    :func:`manifest_id` the checkpoint must have (the one the publisher verified); a
    directory rewritten since is refused.
    """
    path = Path(directory)
    data = _read_manifest_bytes(path)
    if expect_manifest is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != expect_manifest:
            raise CheckpointError(
                str(path), MANIFEST_NAME, "manifest", f"sha256 {got[:16]}... is not the manifest published ({expect_manifest[:16]}...): the directory was rewritten since"
            )
    manifest = _parse_manifest(path, data)
    _check_structure(str(path), manifest)
    for shard in manifest.shards:
        _check_file(path, shard, manifest.digest, hash_it=False)
    _check_index(path, manifest)
    for shard in manifest.shards:
        names = _header_names(path / shard.file)
        if sorted(names) != sorted(shard.tensors):
            missing, extra = sorted(set(shard.tensors) - set(names)), sorted(set(names) - set(shard.tensors))
            raise CheckpointError(str(path), shard.file, "header", f"holds {len(names)} tensors, not the {len(shard.tensors)} listed (missing {missing[:3]}, unlisted {extra[:3]})")
    for shard in manifest.shards:
        _check_file(path, shard, manifest.digest, hash_it=True)
    return manifest


def checkpoint_params(directory: Union[str, Path], manifest: Manifest) -> list[ParamSpec]:
    """The names, dtypes and shapes of the tensors the manifest lists (from the shards'
    headers; no tensor data is read): what a storage publish is checked against the
    served model with."""
    listed = manifest.tensor_files()
    # Another *.safetensors file in the directory is not loaded (the index names the
    # shards); one named as HF names a whole model (model.safetensors) sorts after the
    # shards ("model-" < "model."), so the first spec of each name is the shard's.
    specs: dict[str, ParamSpec] = {}
    for s in checkpoint_spec(directory):
        if s.name in listed:
            specs.setdefault(s.name, s)
    return list(specs.values())
