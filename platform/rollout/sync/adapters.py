"""LoRA adapters published as versioned policies: what a publish must hold, and the
adapters a replica serves.

A trainer doing LoRA RL publishes PEFT's two files (``adapter_config.json`` and
``adapter_model.safetensors``), a few MB, never the base model. The coordinator checks them
(:func:`check_adapter`) before any replica changes, names the adapter's next version and
opens an :class:`~rollout.contracts.sync_protocol.AdapterRound`; every member stages it
(:meth:`ServedAdapters.stage`: the files written to a private directory, then vLLM's
``add_lora`` under an id of that version's own) and reports. On a commit each member serves
the new version under the adapter's name (:meth:`ServedAdapters.commit`); on an abort it
drops the staged one, so every replica keeps the version before: all or none. The
coordinator keeps every committed adapter (:class:`~rollout.sync.store.CommittedWeights`),
and a replica that starts later loads them all before its first request.

Requests name an adapter (``RolloutRequest.adapter``, OpenAI ``model``); a request keeps
the version it started with to its end: versions never share a vLLM LoRA id or name, and
the files of the version before the newest stay on disk, which vLLM reloads from where it
evicted that adapter while a request still runs on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import struct
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

from rollout.contracts.sync_protocol import Adapter, AdapterRequest, HeldAdapter, ParamSpec
from rollout.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"  # PEFT's names, which vLLM's LoRA loader reads
TENSORS_FILE = "adapter_model.safetensors"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# PEFT's tensor names: ``base_model.model.<module of the base model>.lora_A.weight``.
TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors' names -> torch's


def _field(name: str) -> str:
    return f"tensors[{json.dumps(name)}]"


@dataclass(frozen=True)
class _TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_header(data: bytes) -> dict[str, _TensorInfo]:
    """The tensors a safetensors file's bytes hold (its header; no tensor is decoded).
    :class:`InvalidRequestError` on ``tensors`` for bytes that are not such a file."""
    if len(data) < 8:
        raise InvalidRequestError("tensors", f"{len(data)} bytes is not a safetensors file (adapter_model.safetensors)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise InvalidRequestError("tensors", f"the safetensors header says {n} bytes, the file has {len(data) - 8} after it: truncated")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise InvalidRequestError("tensors", f"the safetensors header is not JSON: {e}") from None
    payload = len(data) - 8 - n
    out: dict[str, _TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise InvalidRequestError(_field(name), "its safetensors header entry has no dtype, shape and data_offsets") from None
        if not 0 <= start <= end <= payload:
            raise InvalidRequestError(_field(name), f"its bytes {start}..{end} lie outside the file's {payload} bytes of data: truncated")
        if dtype not in _DTYPES:
            raise InvalidRequestError(_field(name), f"dtype {dtype} is not one an adapter may have ({', '.join(_DTYPES)})")
        out[name] = _TensorInfo(_DTYPES[dtype], shape)
    return out


def config_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as ``adapter_config.json`` holds it (PEFT's ``LoraConfig.to_dict()`` keeps
    ``target_modules`` as a set: a sorted list here); :class:`InvalidRequestError` on
    ``config`` for a value JSON cannot hold."""

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, tuple):
            return list(value)
        raise TypeError(f"{type(value).__name__} is not JSON")

    try:
        return json.loads(json.dumps(dict(config), default=plain))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError("config", f"not JSON as adapter_config.json must be: {e}") from None


def _targets(config: Mapping[str, Any]) -> list[str]:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise InvalidRequestError("config.target_modules", f"{targets!r}: a non-empty list of the base model's module names (e.g. ['q_proj', 'v_proj'])")
    return targets


def _check_config(config: Any, max_rank: Optional[int]) -> int:
    """The adapter's rank, once its config is one vLLM loads."""
    if not isinstance(config, Mapping):
        raise InvalidRequestError("config", f"{type(config).__name__}: PEFT's adapter_config.json, as a mapping")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidRequestError("config.peft_type", f"{peft_type!r}: only LORA adapters are served")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InvalidRequestError("config.r", f"{r!r}: the adapter's rank, an integer >= 1")
    if max_rank is not None and r > max_rank:
        raise InvalidRequestError("config.r", f"rank {r} is above model.lora.max_lora_rank ({max_rank}) the engines started with")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise InvalidRequestError("config.lora_alpha", f"{alpha!r}: a number > 0")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise InvalidRequestError("config.rank_pattern", "per-module ranks are not supported: one rank `r` for every module")
    _targets(config)
    return r


def check_adapter(request: AdapterRequest, base: Optional[Iterable[ParamSpec]], *, max_rank: Optional[int] = None, served_name: str = "") -> None:
    """Refuse, with :class:`InvalidRequestError` naming the field or the tensor, an adapter
    the replicas would not load: a bad name, a config vLLM refuses, tensors that are not
    PEFT's or do not fit the base model (``base``: its parameters, where known)."""
    if not isinstance(request.name, str) or not NAME.match(request.name):
        raise InvalidRequestError("name", f"{request.name!r}: 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
    if served_name and request.name == served_name:
        raise InvalidRequestError("name", f"{request.name!r} is the base model's name: an adapter needs a name of its own")
    if request.version is not None and (isinstance(request.version, bool) or not isinstance(request.version, int) or request.version < 1):
        raise InvalidRequestError("version", f"{request.version!r}: an integer >= 1")
    config = config_json(request.config) if isinstance(request.config, Mapping) else request.config
    r = _check_config(config, max_rank)
    targets = _targets(config)
    tensors = read_header(request.tensors)
    if not tensors:
        raise InvalidRequestError("tensors", "the file holds no tensor")
    params = {p.name: p for p in base} if base is not None else None
    modules: dict[str, set[str]] = {}
    for name, info in tensors.items():
        m = TENSOR_NAME.match(name)
        if m is None:
            raise InvalidRequestError(_field(name), "not a LoRA tensor PEFT names: base_model.model.<module>.lora_A.weight or .lora_B.weight")
        module, ab = m["module"], m["ab"]
        if module.rsplit(".", 1)[-1] not in targets:
            raise InvalidRequestError(_field(name), f"module {module} is not in config.target_modules {targets}")
        if len(info.shape) != 2 or (info.shape[0] if ab == "A" else info.shape[1]) != r:
            want = f"(r={r}, in)" if ab == "A" else f"(out, r={r})"
            raise InvalidRequestError(_field(name), f"shape {list(info.shape)}: lora_{ab} must be {want}")
        if params is not None:
            weight = params.get(f"{module}.weight")
            if weight is None:
                raise InvalidRequestError(_field(name), f"the base model has no {module}.weight to adapt")
            dim, side = (weight.shape[1], "in") if ab == "A" else (weight.shape[0], "out")
            got = info.shape[1] if ab == "A" else info.shape[0]
            if len(weight.shape) != 2 or got != dim:
                raise InvalidRequestError(_field(name), f"shape {list(info.shape)}: {module}.weight is {list(weight.shape)}, so its {side} dimension is {dim}")
        modules.setdefault(module, set()).add(ab)
    for module, held in modules.items():
        if held != {"A", "B"}:
            missing = "B" if "A" in held else "A"
            raise InvalidRequestError(_field(f"base_model.model.{module}.lora_{missing}.weight"), f"missing: {module} has lora_{min(held)} only")


def adapter_of(request: AdapterRequest, version: int) -> Adapter:
    """The adapter ``request`` publishes, as version ``version`` (checked already)."""
    return Adapter(name=request.name, version=version, config=config_json(request.config), tensors=bytes(request.tensors), digest=hashlib.sha256(request.tensors).hexdigest())


MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes; anything near this is not one


def read_peft_directory(path: str, max_tensor_bytes: int, field: str = "lora_path") -> tuple[dict[str, Any], bytes]:
    """PEFT's two files in directory ``path`` (what ``save_pretrained`` writes), as a
    publish takes them: ``adapter_config.json`` parsed, ``adapter_model.safetensors``'s
    bytes. Only those two are read, each a regular file inside the directory (a link
    resolving outside it is refused: the path comes from the network), of at most
    ``MAX_CONFIG_BYTES`` and ``max_tensor_bytes``. :class:`InvalidRequestError` on
    ``field`` naming the file for anything else; the contents are checked by
    :func:`check_adapter`."""
    if not os.path.isabs(path):
        raise InvalidRequestError(field, f"{path!r}: the absolute path of a PEFT adapter directory ({CONFIG_FILE}, {TENSORS_FILE}) where the platform's ingress runs")
    try:
        root = os.path.realpath(path, strict=True)
    except OSError as e:
        raise InvalidRequestError(field, f"{path}: {e.strerror or e}") from None
    if not os.path.isdir(root):
        raise InvalidRequestError(field, f"{path} is not a directory: name the PEFT adapter directory ({CONFIG_FILE}, {TENSORS_FILE})")
    raw_config = _read_inside(root, path, CONFIG_FILE, MAX_CONFIG_BYTES, field)
    tensors = _read_inside(root, path, TENSORS_FILE, max_tensor_bytes, field)
    try:
        config = json.loads(raw_config)
    except ValueError as e:
        raise InvalidRequestError(field, f"{path}/{CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(field, f"{path}/{CONFIG_FILE} holds a {type(config).__name__}, not PEFT's config object")
    return config, tensors


def _read_inside(root: str, shown: str, name: str, limit: int, field: str) -> bytes:
    real = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, real]) != root:
        raise InvalidRequestError(field, f"{shown}/{name} links to {real}, outside the directory: only files inside it are read")
    try:
        # O_NONBLOCK: a FIFO planted under the name fails the S_ISREG check below instead of
        # hanging the open; O_NOFOLLOW: what realpath resolved cannot become a link meanwhile.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        hint = " (only the safetensors file is read: save with safe_serialization=True)" if name == TENSORS_FILE and os.path.exists(os.path.join(root, "adapter_model.bin")) else ""
        raise InvalidRequestError(field, f"{shown} has no {name}: a PEFT adapter directory holds {CONFIG_FILE} and {TENSORS_FILE}{hint}") from None
    except OSError as e:
        raise InvalidRequestError(field, f"{shown}/{name}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequestError(field, f"{shown}/{name} is not a regular file")
        if info.st_size > limit:
            raise InvalidRequestError(field, f"{shown}/{name} has {info.st_size} bytes, more than the {limit} read here")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InvalidRequestError(field, f"{shown}/{name} grew past the {limit} bytes read here while it was read")
    return data


def encode_tensors(tensors: Mapping[str, "torch.Tensor"]) -> bytes:
    """PEFT's ``adapter_model.safetensors`` of ``tensors`` (host copies, contiguous)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})


# ---- the replica's side -----------------------------------------------------------------


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter version loaded into this replica's engine."""

    name: str
    version: int
    lora_id: int  # vLLM's id: one per version, never reused in this process
    path: str  # the private directory its files are in

    def lora_request(self) -> Any:
        from vllm.lora.request import LoRARequest

        # vLLM tells adapters apart by lora_name (LoRARequest.__eq__, prefix-cache keys):
        # each version has its own, so no KV of one version serves another.
        return LoRARequest(f"{self.name}@{self.version}", self.lora_id, self.path)


class ServedAdapters:
    """The adapters a replica's engine serves (name -> committed version), and the one
    staged by the round in progress. The agent changes it; requests read it."""

    def __init__(self, engine: Any, replica_id: str):
        self.engine = engine
        self.replica_id = replica_id
        self._root: Optional[str] = None  # made at the first stage: 0700, only this user reads or writes it
        self._next_id = 1
        self.served: dict[str, ServedAdapter] = {}
        # The version each name served before its newest: kept on disk (see the module doc).
        self._previous: dict[str, ServedAdapter] = {}
        # name -> the version an unload removed here (reported at registration, so a
        # restarted coordinator continues the name's versions after it).
        self._removed: dict[str, int] = {}
        # name -> a committed version this replica could not load: its coordinator learned
        # it back from other replicas after a restart and holds no copy (CommittedWeights).
        # Requests naming it are refused, retryably, until its next publish loads it here.
        self.unavailable: dict[str, int] = {}
        self._listeners: list[Callable[[str, Optional[ServedAdapter]], None]] = []

    def listen(self, served: Callable[[str, Optional[ServedAdapter]], None]) -> None:
        """Call ``served(name, adapter)`` with each adapter served now and each one a commit
        serves later, and ``served(name, None)`` when an unload removes ``name`` (the
        replica's OpenAI app keeps vLLM's name -> adapter map with it)."""
        self._listeners.append(served)
        for adapter in self.served.values():
            served(adapter.name, adapter)

    def get(self, name: str) -> Optional[ServedAdapter]:
        return self.served.get(name)

    def versions(self) -> dict[str, int]:
        return {name: a.version for name, a in self.served.items()}

    def held(self) -> tuple[HeldAdapter, ...]:
        """What this replica reports at registration: each adapter it serves, and the
        version of each that an unload removed (and none was served since)."""
        return tuple(HeldAdapter(name, a.version) for name, a in self.served.items()) + tuple(
            HeldAdapter(name, version, served=False) for name, version in self._removed.items()
        )

    async def not_loadable(self, held: HeldAdapter) -> None:
        """``held`` is committed but this replica cannot load it (no copy to load it from):
        it refuses requests naming it until the next publish of it (not an older version's
        tokens passed off as the committed one's). An older version it serves leaves the
        engine and vLLM's OpenAI map too (its ``model`` would otherwise still run it)."""
        self.unavailable[held.name] = held.version
        older = self.served.get(held.name)
        if older is not None and older.version < held.version:
            del self.served[held.name]
            for listener in self._listeners:
                listener(held.name, None)
            await self._retire(older)
        logger.warning(
            "replica %s: adapter %s version %d is committed, but the coordinator (restarted since) holds no copy of it: "
            "requests naming it are refused here (retryably: replicas that hold it serve them) until its next publish%s",
            self.replica_id, held.name, held.version, f"; version {older.version} it served is unloaded" if older is not None and older.version < held.version else "",
        )

    async def stage(self, adapter: Adapter) -> ServedAdapter:
        """Write ``adapter`` to a directory of its own, check its bytes, and load it into
        the engine beside the served ones; raises what failed (nothing stays loaded)."""
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="rollout-adapters-")
        served = ServedAdapter(adapter.name, adapter.version, self._next_id, os.path.join(self._root, f"{adapter.name}@{adapter.version}-{self._next_id}"))
        self._next_id += 1
        os.makedirs(served.path, mode=0o700)
        try:
            with open(os.path.join(served.path, TENSORS_FILE), "wb") as f:
                f.write(adapter.tensors)
            with open(os.path.join(served.path, CONFIG_FILE), "w") as f:
                json.dump(adapter.config, f)
            with open(os.path.join(served.path, TENSORS_FILE), "rb") as f:
                written = hashlib.sha256(f.read()).hexdigest()
            if written != adapter.digest:
                raise RuntimeError(f"{TENSORS_FILE} of {adapter.name} version {adapter.version}: sha256 {written} written, {adapter.digest} published")
            if not await self.engine.add_lora(served.lora_request()):
                raise RuntimeError(f"the engine did not load {adapter.name} version {adapter.version}")
        except BaseException:
            await self._unload(served)
            raise
        return served

    async def commit(self, staged: ServedAdapter) -> None:
        """Serve ``staged`` under its name from the next request on; the version before
        it leaves the engine (its files stay, for requests still running on it)."""
        before = self.served.get(staged.name)
        self.served[staged.name] = staged
        self._removed.pop(staged.name, None)
        if self.unavailable.get(staged.name, 0) <= staged.version:
            self.unavailable.pop(staged.name, None)
        for listener in self._listeners:
            listener(staged.name, staged)
        if before is not None:
            await self._retire(before)

    async def remove(self, name: str) -> None:
        """An unload committed: requests naming ``name`` are refused from now on; the
        version it served leaves the engine (its files stay for requests still running on it)."""
        before = self.served.pop(name, None)
        unloadable = self.unavailable.pop(name, None)
        removed = max(before.version if before is not None else 0, unloadable or 0)
        if removed:
            self._removed[name] = removed
        for listener in self._listeners:
            listener(name, None)
        if before is not None:
            await self._retire(before)

    async def _retire(self, before: ServedAdapter) -> None:
        """``before`` is no longer served: out of the engine, its files kept (see the module
        doc) in place of the version before it."""
        older = self._previous.pop(before.name, None)
        if older is not None:
            shutil.rmtree(older.path, ignore_errors=True)
        self._previous[before.name] = before
        try:
            await self.engine.remove_lora(before.lora_id)
        except Exception as e:  # it stays loaded until vLLM evicts it: no harm to what is served
            logger.warning("replica %s: unloading %s version %d: %s", self.replica_id, before.name, before.version, e)

    async def discard(self, staged: ServedAdapter) -> None:
        """The round did not commit: ``staged`` leaves the engine and the disk."""
        await self._unload(staged)

    async def _unload(self, served: ServedAdapter) -> None:
        try:
            await self.engine.remove_lora(served.lora_id)
        except Exception as e:
            logger.warning("replica %s: unloading %s version %d: %s", self.replica_id, served.name, served.version, e)
        shutil.rmtree(served.path, ignore_errors=True)

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
