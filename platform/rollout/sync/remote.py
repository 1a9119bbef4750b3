"""How a publisher reaches the coordinator: a Serve handle inside the Ray cluster, or
the HTTP ingress from anywhere. Only the control plane travels this way; tensors go
over the transfer group the round's plan describes."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal, Optional, Protocol, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from rollout.api import NonNegativeInt, _integral
from rollout.contracts.backend import TransferInfo
from rollout.contracts.sync_protocol import AdapterRequest, CoordinatorUnreachableError, ParamSpec, PublishWait, PushRound, RoundOutcome, RoundRequest, StorageRequest, StorageRound, SyncError
from rollout.errors import InvalidRequestError, loc_to_field
from rollout.sync.auth import SYNC_TOKEN_HEADER
from rollout.sync.backends.delta_info import DENSE, INT32_MAX, GlooDelta, SparseNcclDelta
from rollout.sync.coordinator_client import BlockingCoordinatorHandle
from rollout.wire_errors import decode

PLAN = TypeAdapter(PushRound)  # begin_round's answer: a publish round
STORAGE_PLAN = TypeAdapter(StorageRound)  # begin_storage's answer
OUTCOME = TypeAdapter(RoundOutcome)


class SyncParam(BaseModel):
    """One parameter a publish sends, as it travels over HTTP (``ParamSpec``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, description="The parameter's name in the served model (Hugging Face naming).")
    dtype: str = Field(min_length=1, description="torch's dtype name without `torch.`, e.g. `float32`; it must be the served parameter's.")
    shape: list[NonNegativeInt] = Field(description="It must be the served parameter's.")

    def spec(self) -> ParamSpec:
        return ParamSpec(self.name, self.dtype, tuple(self.shape))


# Bounds of the delta bodies' numbers: far above any model (a count is at most a tensor's
# elements, the coordinator checks), and exact as JSON numbers.
MAX_COUNT = 2**53
MAX_TENSORS = 1 << 20
Count = Annotated[int, Field(ge=DENSE, le=MAX_COUNT), BeforeValidator(_integral)]
Patched = Annotated[int, Field(ge=DENSE, le=INT32_MAX), BeforeValidator(_integral)]
BaseVersion = Annotated[int, Field(ge=0, le=MAX_COUNT), BeforeValidator(_integral)]


class GlooDeltaBody(BaseModel):
    """A ``gloo_delta`` delta (rollout.sync.backends.delta_info.GlooDelta) as it travels
    over HTTP: the base it applies onto, and what each tensor sends."""

    model_config = ConfigDict(extra="forbid", strict=True)
    info_cls: ClassVar[type[TransferInfo]] = GlooDelta
    backend: Literal["gloo_delta"]
    delta_base_version: BaseVersion = Field(description="The committed version the delta applies onto; any other is refused (409 `delta_base_error`).")
    delta_base_digest: str = Field(
        pattern="^[0-9a-f]{64}$", description="The combined digest (rollout.sync.digest.combine) of the weights it applies onto; replicas holding other bytes refuse it."
    )
    delta_counts: list[Count] = Field(
        min_length=1, max_length=MAX_TENSORS, description="Per parameter, in `params` order: -1 sent whole, 0 unchanged, k the number of changed elements sent."
    )

    def info(self) -> GlooDelta:
        return GlooDelta(self.delta_base_version, self.delta_base_digest, tuple(self.delta_counts))

    @classmethod
    def of(cls, info: GlooDelta) -> "GlooDeltaBody":
        return cls(backend="gloo_delta", delta_base_version=info.delta_base_version, delta_base_digest=info.delta_base_digest, delta_counts=list(info.delta_counts))


class SparseNcclBody(BaseModel):
    """A ``sparse_nccl`` round's counts (rollout.sync.backends.delta_info.SparseNcclDelta)
    as they travel over HTTP."""

    model_config = ConfigDict(extra="forbid", strict=True)
    info_cls: ClassVar[type[TransferInfo]] = SparseNcclDelta
    backend: Literal["sparse_nccl"]
    num_updates_list: list[Patched] = Field(
        min_length=1, max_length=MAX_TENSORS, description="Per parameter, in `params` order: -1 sent whole (its values only), 0 unchanged, k the number of elements patched (int32 indices and values)."
    )
    base_version: Optional[BaseVersion] = Field(
        default=None, description="The committed version the delta applies onto (any other is refused: 409 `delta_base_error`); null: a full round, every parameter sent whole (-1)."
    )

    def info(self) -> SparseNcclDelta:
        return SparseNcclDelta(tuple(self.num_updates_list), self.base_version)

    @classmethod
    def of(cls, info: SparseNcclDelta) -> "SparseNcclBody":
        return cls(backend="sparse_nccl", num_updates_list=list(info.num_updates_list), base_version=info.base_version)


# What a delta backend's publisher offers, by backend: the platform's backend must be the
# one named (else 400 naming ``transfer_info``). ``ipc``'s handles never travel over HTTP.
TransferInfoBody = Annotated[Union[GlooDeltaBody, SparseNcclBody], Field(discriminator="backend")]
_BODY_OF = {body.info_cls: body for body in (GlooDeltaBody, SparseNcclBody)}
_TAGS = {get_args(body.model_fields["backend"].annotation)[0] for body in _BODY_OF.values()}
TRANSFER_INFO = TypeAdapter(TransferInfoBody)


def _typed_plan(answer: Any) -> PushRound:
    """begin_round's answer: the plan, its transfer info typed again (JSON carries its
    fields; the plan's backend names its type)."""
    plan = PLAN.validate_python(answer)
    if isinstance(plan.transfer_info, dict):
        plan = replace(plan, transfer_info=TRANSFER_INFO.validate_python({**plan.transfer_info, "backend": plan.backend}).info())
    return plan


def _copy_group_needs_a_port(schema: dict) -> None:
    # The rule _copy_group_needs_a_port enforces, in the published schema too.
    schema["if"] = {"properties": {"copy_group": {"minLength": 1}}, "required": ["copy_group"]}
    schema["then"] = {"properties": {"copy_port": {"minimum": 1}}, "required": ["copy_port"]}


class BeginRoundBody(BaseModel):
    """Body of ``POST /v1/sync/rounds``. Strict, so a body is accepted exactly when the
    published schema says it is valid; what the schema cannot know (the served model's
    parameters, the committed version) is refused with a 400 naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_copy_group_needs_a_port)
    params: list[SyncParam] = Field(min_length=1, description="Every parameter of the served model, in the order the publisher sends them.")
    version: Optional[Annotated[int, Field(ge=1), BeforeValidator(_integral)]] = Field(default=None, description="Above the committed version; default: the committed version + 1.")
    master_address: str = Field(min_length=1, description="Where the publisher listens for the transfer group's rendezvous.")
    master_port: Annotated[int, Field(ge=1, le=65535), BeforeValidator(_integral)]
    reuse_group: Optional[str] = Field(default=None, description="The transfer group the publisher still holds from its last round.")
    checkpoint: Optional[str] = Field(
        default=None, min_length=1, pattern="^/", description="Absolute path of the same weights on storage every replica reads; restores reload it."
    )
    copy_group: str = Field(default="", max_length=128, description="The group of two over which the publisher sends the coordinator's copy after the commit (empty: the copy receives in the round).")
    copy_port: Annotated[int, Field(ge=0, le=65535), BeforeValidator(_integral)] = Field(default=0, description="Where the publisher listens for that group (with copy_group, at least 1).")
    transfer_info: Optional[TransferInfoBody] = Field(
        default=None, description="A delta backend's offer (`backend` names it; it must be the platform's): what the round sends instead of every byte. Null: a full send."
    )

    @field_validator("transfer_info", mode="wrap")
    @classmethod
    def _named_without_the_tag(cls, value: Any, handler: Any) -> Any:
        # pydantic puts the union's tag in an error's location (transfer_info.gloo_delta.
        # delta_counts[0]); the client is told the field it sent (transfer_info.delta_counts[0]).
        try:
            return handler(value)
        except ValidationError as e:
            first = e.errors()[0]
            loc = list(first.get("loc", ()))
            if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
                loc = ["backend"]
            elif loc and loc[0] in _TAGS:
                loc = loc[1:]
            raise InvalidRequestError(loc_to_field(["transfer_info", *loc]), first.get("msg", str(e))) from None

    @model_validator(mode="after")
    def _copy_group_needs_a_port(self) -> "BeginRoundBody":
        if self.copy_group and not self.copy_port:
            raise InvalidRequestError("copy_port", "a copy_group needs the port the publisher listens on")
        return self

    @classmethod
    def of(cls, request: RoundRequest) -> "BeginRoundBody":
        offered = request.transfer_info
        body = _BODY_OF.get(type(offered))
        if offered is not None and body is None:
            # CUDA IPC handles only mean something on the replicas' node, and replicas
            # unpickle them: the platform never accepts them over the network.
            raise SyncError(
                "backend: transfer info other than a delta ('ipc' handles) cannot travel over HTTP; publish with "
                "WeightPublisher.connect from the replicas' GPU node"
            )
        fields = {k: getattr(request, k) for k in cls.model_fields if k not in ("params", "transfer_info")}
        params = [SyncParam(name=p.name, dtype=p.dtype, shape=list(p.shape)) for p in request.params]
        return cls(**fields, params=params, transfer_info=body.of(offered) if body is not None else None)

    def request(self) -> RoundRequest:
        fields = {k: getattr(self, k) for k in type(self).model_fields if k not in ("params", "transfer_info")}
        info = self.transfer_info.info() if self.transfer_info is not None else None
        return RoundRequest(**fields, params=tuple(p.spec() for p in self.params), transfer_info=info)


class StorageRoundBody(BaseModel):
    """Body of ``POST /v1/sync/storage-rounds``: publish a checkpoint that every replica
    reads on shared storage (``WeightPublisher.publish_checkpoint``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    checkpoint: str = Field(min_length=1, pattern="^/", description="Absolute path of the checkpoint (rollout.sync.storage's layout, its manifest written last) on storage every replica reads.")
    manifest: str = Field(pattern="^[0-9a-f]{64}$", description="The sha256 of its `rollout-manifest.json`: replicas load that write of the directory and no other.")
    params: list[SyncParam] = Field(min_length=1, description="The parameters its shards hold; they must be the served model's.")
    version: Optional[Annotated[int, Field(ge=1), BeforeValidator(_integral)]] = Field(default=None, description="Above the committed version; default: the committed version + 1.")

    @classmethod
    def of(cls, request: StorageRequest) -> "StorageRoundBody":
        params = [SyncParam(name=p.name, dtype=p.dtype, shape=list(p.shape)) for p in request.params]
        return cls(checkpoint=request.checkpoint, manifest=request.manifest, params=params, version=request.version)

    def request(self) -> StorageRequest:
        return StorageRequest(checkpoint=self.checkpoint, manifest=self.manifest, params=tuple(p.spec() for p in self.params), version=self.version)


class AdapterBody(BaseModel):
    """Body of ``POST /v1/sync/adapter-rounds``: publish a LoRA adapter
    (``WeightPublisher.publish_adapter``); the answer is the round's outcome."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=128, description="What requests name: the token API's `adapter`, the OpenAI `model`.")
    config: dict[str, Any] = Field(description="PEFT's `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, ...).")
    tensors: str = Field(min_length=1, description="PEFT's `adapter_model.safetensors`, the file's bytes in base64.")
    version: Optional[Annotated[int, Field(ge=1), BeforeValidator(_integral)]] = Field(
        default=None, description="Above the adapter's committed version; default: that version + 1 (1 for a new adapter)."
    )

    @classmethod
    def of(cls, request: AdapterRequest) -> "AdapterBody":
        return cls(name=request.name, config=dict(request.config), tensors=base64.b64encode(request.tensors).decode("ascii"), version=request.version)

    def request(self) -> AdapterRequest:
        try:
            tensors = base64.b64decode(self.tensors, validate=True)
        except ValueError as e:
            raise InvalidRequestError("tensors", f"not base64: {e}") from None
        return AdapterRequest(name=self.name, config=self.config, tensors=tensors, version=self.version)


class AdapterRemovalBody(BaseModel):
    """Body of ``POST /v1/sync/adapter-removals``: unload a LoRA adapter from every replica
    (``WeightPublisher.unload_adapter``); the answer is the round's outcome."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=128, description="The published adapter to unload (404 `adapter_not_found` naming `name` when none of that name is published).")


class FinishBody(BaseModel):
    """Body of ``POST /v1/sync/rounds/{round_id}/finish``: the trainer sent everything
    (``error`` null) or gives up, which aborts the round."""

    model_config = ConfigDict(extra="forbid", strict=True)
    error: Optional[str] = Field(default=None, description="Why the trainer failed; the round aborts and every replica keeps the committed version.")
    digests: Optional[dict[str, str]] = Field(
        default=None, description="Per-tensor digests (rollout.sync.digest: position-weighted 64-bit sums and the byte length) of the bytes sent, by parameter name; a replica that received other bytes fails the round."
    )
    wait: PublishWait = Field(
        default="serving",
        description="When to answer: 'serving', once every member serves the version; 'committed', at the decision (every member received it; some may still be resuming).",
    )


class CoordinatorClient(Protocol):
    # The host the coordinator is reached at from outside the Ray cluster (the ingress's),
    # None from inside it: a publisher advertises the address of its interface that routes
    # there (rollout.contracts.net.choose).
    host: Optional[str]

    # Every call raises CoordinatorUnreachableError when the coordinator does not answer
    # within ``timeout_s`` (default: the client's own bound).
    def begin_round(self, token: Optional[str], request: RoundRequest) -> PushRound: ...

    def begin_storage(self, token: Optional[str], request: StorageRequest) -> StorageRound: ...

    def publish_adapter(self, token: Optional[str], request: AdapterRequest, timeout_s: Optional[float] = None) -> RoundOutcome: ...

    def unload_adapter(self, token: Optional[str], name: str, timeout_s: Optional[float] = None) -> RoundOutcome: ...

    def finish(
        self,
        token: Optional[str],
        round_id: str,
        error: Optional[str],
        timeout_s: Optional[float] = None,
        digests: Optional[dict[str, str]] = None,
        *,
        wait: PublishWait = "serving",
    ) -> RoundOutcome:
        """``error`` None: the trainer sent everything; else it aborts the round. Takes the
        same credential as :meth:`begin_round`: a round's id is public (``status``).
        ``digests``: per-tensor digests of what was sent (:mod:`rollout.sync.digest`).
        ``wait``: when to answer (:data:`PublishWait`)."""
        ...

    def status(self, timeout_s: Optional[float] = None) -> dict[str, Any]: ...


# Inside the Ray cluster: the coordinator's Serve handle, typed and bounded.
HandleCoordinator = BlockingCoordinatorHandle


class HttpCoordinator:
    def __init__(self, base_url: str, api_key: Optional[str], timeout_s: float):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.host = self.client.base_url.host or None

    def _request(self, method: str, path: str, timeout_s: Optional[float] = None, **kwargs: Any) -> Any:
        import httpx

        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            resp = self.client.request(method, path, timeout=timeout, **kwargs)
        except httpx.TransportError as e:
            # A link cut, an ingress gone: without this a trainer gets httpx's own error, or
            # (on a link that drops packets) waits out the client's whole timeout first.
            within = f" within {timeout_s:.3g}s" if timeout_s is not None else ""
            raise CoordinatorUnreachableError(f"the coordinator at {self.client.base_url} did not answer {method} {path}{within} ({type(e).__name__}: {e})") from None
        # The ingress answers from rollout.wire_errors' table (a SyncError: 409 "sync_error").
        error = decode(resp.status_code, resp.content, resp.headers)
        if error is not None:
            raise error
        return resp.json()

    def _post(self, path: str, body: dict, token: Optional[str] = None, timeout_s: Optional[float] = None) -> Any:
        headers = {SYNC_TOKEN_HEADER: token} if token else {}
        return self._request("POST", path, timeout_s, json=body, headers=headers)

    def begin_round(self, token: Optional[str], request: RoundRequest) -> PushRound:
        body = BeginRoundBody.of(request).model_dump(mode="json")
        return _typed_plan(self._post("/v1/sync/rounds", body, token))

    def begin_storage(self, token: Optional[str], request: StorageRequest) -> StorageRound:
        body = StorageRoundBody.of(request).model_dump(mode="json")
        return STORAGE_PLAN.validate_python(self._post("/v1/sync/storage-rounds", body, token))

    def finish(
        self,
        token: Optional[str],
        round_id: str,
        error: Optional[str],
        timeout_s: Optional[float] = None,
        digests: Optional[dict[str, str]] = None,
        *,
        wait: PublishWait = "serving",
    ) -> RoundOutcome:
        body = FinishBody(error=error, digests=digests, wait=wait).model_dump(mode="json")
        return OUTCOME.validate_python(self._post(f"/v1/sync/rounds/{round_id}/finish", body, token, timeout_s))

    def publish_adapter(self, token: Optional[str], request: AdapterRequest, timeout_s: Optional[float] = None) -> RoundOutcome:
        body = AdapterBody.of(request).model_dump(mode="json")
        return OUTCOME.validate_python(self._post("/v1/sync/adapter-rounds", body, token, timeout_s))

    def unload_adapter(self, token: Optional[str], name: str, timeout_s: Optional[float] = None) -> RoundOutcome:
        body = AdapterRemovalBody(name=name).model_dump(mode="json")
        return OUTCOME.validate_python(self._post("/v1/sync/adapter-removals", body, token, timeout_s))

    def status(self, timeout_s: Optional[float] = None) -> dict[str, Any]:
        return self._request("GET", "/v1/sync/status", timeout_s)
