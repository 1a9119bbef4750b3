"""How a publisher reaches the coordinator: a Serve handle inside the Ray cluster, or
the HTTP ingress from anywhere. Only the control plane travels this way; tensors go
over the transfer group the round's plan describes."""

from __future__ import annotations

from typing import Any, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from rollout.errors import unwrap_remote
from rollout.sync.protocol import ParamSpec, RoundOutcome, RoundPlan, RoundRequest, SyncError

PLAN = TypeAdapter(RoundPlan)
OUTCOME = TypeAdapter(RoundOutcome)
SYNC_TOKEN_HEADER = "X-Rollout-Sync-Token"


class BeginRoundBody(BaseModel):
    """Body of ``POST /v1/sync/rounds``."""

    model_config = ConfigDict(extra="forbid")
    params: list[ParamSpec] = Field(min_length=1)
    version: Optional[int] = Field(default=None, ge=1)
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    reuse_group: Optional[str] = Field(default=None, description="The transfer group the publisher still holds from its last round.")
    checkpoint: Optional[str] = Field(default=None, min_length=1, description="Absolute path of the same weights on storage every replica reads; restores reload it.")
    copy_group: str = Field(default="", max_length=128, description="The group of two over which the publisher sends the coordinator's copy after the commit (empty: the copy receives in the round).")
    copy_port: int = Field(default=0, ge=0, le=65535, description="Where the publisher listens for that group (with copy_group).")

    @model_validator(mode="after")
    def _copy_group_needs_a_port(self) -> "BeginRoundBody":
        if self.copy_group and not self.copy_port:
            raise ValueError("copy_port: a copy_group needs the port the publisher listens on")
        return self

    @classmethod
    def of(cls, request: RoundRequest) -> "BeginRoundBody":
        if request.transfer_info is not None:
            # CUDA IPC handles only mean something on the replicas' node, and replicas
            # unpickle them: the platform never accepts them over the network.
            raise SyncError("backend: 'ipc' handles cannot travel over HTTP; publish with WeightPublisher.connect from the replicas' GPU node")
        fields = {k: getattr(request, k) for k in cls.model_fields}
        return cls(**{**fields, "params": list(request.params)})

    def request(self) -> RoundRequest:
        # ipc handles never come over HTTP: no transfer_info here.
        return RoundRequest(**{**self.model_dump(exclude={"params"}), "params": tuple(self.params)})


class FinishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    error: Optional[str] = None


class CoordinatorClient(Protocol):
    def begin_round(self, token: Optional[str], request: RoundRequest) -> RoundPlan: ...

    def finish(self, round_id: str, error: Optional[str]) -> RoundOutcome: ...

    def status(self) -> dict[str, Any]: ...


class HandleCoordinator:
    def __init__(self, handle, timeout_s: float = 600.0):
        self.handle = handle
        self.timeout_s = timeout_s  # like HttpCoordinator's: a coordinator that never answers is an error

    def _call(self, method: str, *args):
        from ray.exceptions import RayActorError

        try:
            return getattr(self.handle, method).remote(*args).result(timeout_s=self.timeout_s)
        except TimeoutError:
            raise SyncError(f"the coordinator did not answer {method} within {self.timeout_s:g}s") from None
        except Exception as e:
            cause = unwrap_remote(e)
            if isinstance(cause, RayActorError):
                # It died with the call in flight: a round it had decided may have committed.
                raise SyncError(
                    f"the coordinator died during {method} ({type(cause).__name__}); a round it was deciding may have committed: "
                    "status() has the committed version once it is back"
                ) from None
            raise cause from None

    def begin_round(self, token: Optional[str], request: RoundRequest) -> RoundPlan:
        return self._call("begin_round", token, request)

    def finish(self, round_id, error) -> RoundOutcome:
        return self._call("finish", round_id, error)

    def status(self) -> dict[str, Any]:
        return self._call("status")


class HttpCoordinator:
    def __init__(self, base_url: str, api_key: Optional[str], timeout_s: float):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def _post(self, path: str, body: dict, token: Optional[str] = None) -> Any:
        from rollout.client.http import raise_for_error

        headers = {SYNC_TOKEN_HEADER: token} if token else {}
        resp = self.client.post(path, json=body, headers=headers)
        raise_for_error(resp)
        return resp.json()

    def begin_round(self, token: Optional[str], request: RoundRequest) -> RoundPlan:
        body = BeginRoundBody.of(request).model_dump(mode="json")
        return PLAN.validate_python(self._post("/v1/sync/rounds", body, token))

    def finish(self, round_id, error) -> RoundOutcome:
        return OUTCOME.validate_python(self._post(f"/v1/sync/rounds/{round_id}/finish", {"error": error}))

    def status(self) -> dict[str, Any]:
        from rollout.client.http import raise_for_error

        resp = self.client.get("/v1/sync/status")
        raise_for_error(resp)
        return resp.json()
