"""vLLM's RL control routes (``vllm serve``'s RL mode), coordinated over every replica.

Same paths, parameters and payloads as ``vllm/entrypoints/rl/online/api_router.py``
(plus ``/reset_prefix_cache`` and ``/sleep``, ``/wake_up`` and ``/is_sleeping`` from its dev
routes (``rollout.sync.sleep``), and ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` from ``vllm/entrypoints/serve/lora/api_router.py``); behind
them the coordinator turns one trainer's calls into rounds over every replica (see
``rollout/sync/sessions.py``; an adapter is an ``AdapterRound``, its unload an
``AdapterRemovalRound``).

They change every replica's weights, so they take the sync token: ``X-Rollout-Sync-Token``
or ``Authorization: Bearer <token>`` (a trainer's only header with vLLM's own clients).
Without a sync token configured they take the API key, when there is one.
``/collective_rpc`` and ``/weight_checker``'s reset run code on the engines' workers and
are refused.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Optional

from fastapi import Body, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout import wire_errors as wire
from rollout.api import NonNegativeInt
from rollout.config import PlatformConfig
from rollout.contracts.sync_protocol import AdapterRequest, FinishUpdate, FleetQuery, LoadAdapter, OpenSession, Pause, PauseMode, RouteCommand, RoundOutcome, SleepFleet, SleepTag, SyncError, UnloadAdapter, Update, WakeFleet
from rollout.errors import ForbiddenError, InvalidRequestError
from rollout.http.routes_app import REFUSED_ERRORS, SYNC_ERRORS, admit, app
from rollout.sync.adapters import CONFIG_FILE, NAME, TENSORS_FILE, read_peft_directory
from rollout.sync.auth import Operation
from rollout.sync.coordinator_client import CoordinatorHandle
from rollout.sync.sessions import parse_update_info, refuse_pickled

REFUSED = (
    "runs arbitrary methods on every engine worker, which would let any caller with the token run code "
    "there and bypass the coordinator's rounds and rollback; it is not served here"
)


# vLLM's flags that reset more than the local prefix cache: accepted by name (vLLM's
# clients send them), refused when true with a 400 naming the flag; the schema says only
# false is valid, so a generated call is never refused for a value the schema allows.
OnlyFalse = Annotated[bool, Query(json_schema_extra={"enum": [False]}, description="Only `false`: not supported here; only the local prefix cache is reset.")]


def _no_pickled_keys(schema: dict) -> None:
    # parse_update_info's refusal of pickled handles, in the published schema too.
    schema["propertyNames"] = {"not": {"anyOf": [{"pattern": "[Pp][Ii][Cc][Kk][Ll][Ee]"}, {"const": "ipc_handles"}]}}


class UpdateInfo(BaseModel):
    """``/update_weights``'s ``update_info`` (vLLM's NCCL/gloo update info): the parameters
    the trainer broadcasts next, in order. ``names``, ``dtype_names`` and ``shapes`` have
    the same length (which JSON Schema cannot say; a 400 does); all three empty reuses the
    parameters this session's last call announced (vLLM 0.33's NCCL trainer engine sends
    them only when they changed). Other keys pass through to the engines, except pickled
    handles, which nothing from the network may carry."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_no_pickled_keys)
    names: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    dtype_names: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, description="torch's dtype names (`float32` or `torch.float32`).")
    shapes: list[list[NonNegativeInt]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _as_the_coordinator_reads_it(self) -> "UpdateInfo":
        if self.names or self.dtype_names or self.shapes:
            parse_update_info(self.model_dump())  # the coordinator checks it again (handle callers skip this)
        else:  # all empty: the session's last announced ones (checked there)
            refuse_pickled(self.model_dump())
        return self


# vLLM's unload answers 404 for a name it does not serve, besides the rest.
UNLOAD_ERRORS = {**SYNC_ERRORS, **wire.responses(wire.ADAPTER_NOT_FOUND)}
ADAPTER_VERSION_HEADER = "X-Rollout-Adapter-Version"  # the version a load committed (vLLM's answer is text alone)
AdapterName = Annotated[str, Field(pattern=NAME.pattern, description="The adapter's name: what requests name (`adapter`, OpenAI `model`).")]


class LoadLoraAdapter(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest`` (``vllm/entrypoints/serve/lora/protocol.py``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: AdapterName
    lora_path: str = Field(min_length=1, description="Absolute path of a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) on a volume the platform's ingress reads.")
    load_inplace: bool = Field(False, description="`false`: refused (400) while `lora_name` is loaded, as vLLM refuses it; `true`: published as the adapter's next version.")
    is_3d_lora_weight: bool = Field(False, json_schema_extra={"enum": [False]}, description="Only `false`: 3D (fused-MoE) LoRA weights are not supported here.")


class UnloadLoraAdapter(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest``: vLLM unloads by ``lora_name`` and ignores
    ``lora_int_id`` (its clients send it); so does this route."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: AdapterName
    lora_int_id: Optional[int] = Field(None, description="Accepted and ignored, as vLLM does: the name says which adapter.")


def _as_route_field(e: InvalidRequestError) -> InvalidRequestError:
    """A refusal of the adapter the route read, naming the route's own field: the name
    is ``lora_name``; the config and the tensors are files of ``lora_path``."""
    if e.field == "name":
        return InvalidRequestError("lora_name", e.message)
    if e.field.startswith("config"):
        return InvalidRequestError("lora_path", f"{CONFIG_FILE}: {e}")
    if e.field.startswith("tensors"):
        return InvalidRequestError("lora_path", f"{TENSORS_FILE}: {e}")
    return e


def _committed(outcome: RoundOutcome, what: str) -> RoundOutcome:
    if not outcome.committed:
        raise SyncError(f"{what}: {outcome.round_id} aborted: {outcome.error}; every replica keeps what it served")
    return outcome


class VllmRlRoutes:
    """Mixed into the ingress (``self.coordinator``, ``self.config``, ``app.state.auth``)."""

    coordinator: Optional[CoordinatorHandle]
    config: PlatformConfig

    async def _drive(self, request: Request, command: RouteCommand) -> Any:
        """``command`` over every replica, on behalf of the trainer whose credential the
        request carries (rollout.sync.auth decides which: Operation.DRIVE; the coordinator
        checks it)."""
        if self.coordinator is None:
            raise SyncError("weight sync is disabled on this platform (sync.enabled: false)")
        return await self.coordinator.drive(admit(Operation.DRIVE, request), command)

    async def _acknowledge(self, request: Request, command: RouteCommand, message: str) -> dict:
        """The answer of the routes that answer ``{"message": ...}`` once done."""
        await self._drive(request, command)
        return {"message": message}

    @app.post("/pause", responses=SYNC_ERRORS)
    async def rl_pause(self, request: Request, mode: Annotated[PauseMode, Query()] = "abort", clear_cache: Annotated[bool, Query()] = True) -> dict:
        """Every live replica holds generation until `/resume`: `abort` ends in-flight requests, `wait` lets them finish, `keep` freezes them."""
        await self._drive(request, Pause(mode, clear_cache and mode != "keep"))
        return {"status": "paused"}

    @app.post("/resume", responses=SYNC_ERRORS)
    async def rl_resume(self, request: Request) -> dict:
        """Every replica generates again."""
        await self._drive(request, FleetQuery.RESUME)
        return {"status": "resumed"}

    @app.get("/is_paused", responses=SYNC_ERRORS)
    async def rl_is_paused(self, request: Request) -> dict:
        """Whether the replicas are paused by `/pause`."""
        return {"is_paused": await self._drive(request, FleetQuery.IS_PAUSED)}

    # ---- vLLM's sleep routes (its dev routes: vllm/entrypoints/serve/dev/sleep), over every replica

    @app.post("/sleep", responses=SYNC_ERRORS)
    async def rl_sleep(
        self, request: Request, level: Annotated[int, Query(ge=1, le=2, description="1: weights offloaded to host memory, KV cache dropped; 2: both discarded (level 0 is `/pause` here).")] = 1,
        mode: Annotated[PauseMode, Query(description="Requests in flight: `abort` ends them, `wait` finishes them first, `keep` freezes them until the wake (level 1 only).")] = "abort",
    ) -> dict:
        """Every live replica's engine sleeps (vLLM's sleep mode, `model.enable_sleep_mode`), freeing its GPU memory for a trainer that shares the GPUs; returns once all sleep. Requests are refused (503, retryable) and rounds refused (409 `fleet_asleep`) until `/wake_up`."""
        await self._drive(request, SleepFleet(level, mode))
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up", responses=SYNC_ERRORS)
    async def rl_wake_up(
        self, request: Request, tags: Annotated[Optional[list[SleepTag]], Query(description="What to wake (repeat for both): `weights`, `kv_cache`; none: both.")] = None
    ) -> dict:
        """Every replica wakes `tags`; after a level-2 sleep a replica whose weights wake reloads the committed version before it serves; returns once all have. `status`: `awake` once nothing sleeps."""
        fully = await self._drive(request, WakeFleet(tuple(tags) if tags else None))
        return {"status": "awake" if fully else "sleeping", "tags": tags}

    @app.get("/is_sleeping", responses=SYNC_ERRORS)
    async def rl_is_sleeping(self, request: Request) -> dict:
        """Whether the replicas sleep (any tag), by `/sleep` until `/wake_up` wakes every tag."""
        return {"is_sleeping": await self._drive(request, FleetQuery.IS_SLEEPING)}

    @app.post("/reset_prefix_cache", responses=SYNC_ERRORS)
    async def rl_reset_prefix_cache(self, request: Request, reset_running_requests: OnlyFalse = False, reset_external: OnlyFalse = False) -> dict:
        """Every replica drops its prefix cache; `success` is false where one could not (blocks still in use)."""
        if reset_running_requests or reset_external:
            raise InvalidRequestError("reset_running_requests" if reset_running_requests else "reset_external", "not supported here; only the local prefix cache is reset")
        return {"success": await self._drive(request, FleetQuery.RESET_PREFIX_CACHE)}

    @app.get("/get_world_size", responses=SYNC_ERRORS)
    async def rl_get_world_size(self, request: Request, include_dp: bool = Query(True)) -> dict:
        """Ranks the trainer's group has besides the trainer: every live replica's workers, and the coordinator's copy where the backend keeps one."""
        return {"world_size": await self._drive(request, FleetQuery.WORLD_SIZE)}

    @app.post("/init_weight_transfer_engine", responses=SYNC_ERRORS)
    async def rl_init(self, request: Request, init_info: Annotated[dict[str, Any], Body(embed=True)]) -> dict:
        """Every live replica (and the coordinator's copy) joins the trainer's weight-transfer group; returns once all have."""
        return await self._acknowledge(request, OpenSession(init_info), "Weight transfer initialized")

    @app.post("/shutdown_weight_transfer_engine", responses=SYNC_ERRORS)
    async def rl_shutdown(self, request: Request) -> dict:
        """Ends the session: the next update needs a new `/init_weight_transfer_engine`."""
        return await self._acknowledge(request, FleetQuery.SHUTDOWN_SESSION, "Weight transfer shut down")

    @app.post("/start_weight_update", responses=SYNC_ERRORS)
    async def rl_start(self, request: Request) -> dict:
        """Opens a round: returns once every member has paused and is ready to receive."""
        return await self._acknowledge(request, FleetQuery.START_UPDATE, "Weight update started")

    @app.post("/update_weights", responses=SYNC_ERRORS)
    async def rl_update(self, request: Request, update_info: Annotated[UpdateInfo, Body(embed=True)]) -> dict:
        """Every member receives the parameters the trainer broadcasts next, in order; returns once all have."""
        return await self._acknowledge(request, Update(update_info.model_dump(mode="json")), "Weights updated")

    @app.post("/finish_weight_update", responses=SYNC_ERRORS)
    async def rl_finish(self, request: Request, weight_version: Annotated[Optional[str], Body(embed=True)] = None) -> dict:
        """Commits the round (all replicas or none); `weight_version` names it in every token's version spans."""
        return await self._acknowledge(request, FinishUpdate(weight_version), "Weight update finished")

    @app.get("/weight_info", responses=SYNC_ERRORS)
    async def rl_weight_info(self, request: Request) -> dict:
        """The committed weight version, as every replica serves it."""
        return {"weight_version": str(await self._drive(request, FleetQuery.WEIGHT_VERSION))}

    @app.post("/update_weight_version", responses=SYNC_ERRORS)
    async def rl_update_weight_version(self, request: Request, new_version: Annotated[str, Body(embed=True)]) -> dict:
        """Accepts only the committed version: versions name the weights that produced each token, so they change with the weights (`/finish_weight_update`)."""
        committed = await self._drive(request, FleetQuery.WEIGHT_VERSION)
        if new_version.strip() != str(committed):
            raise SyncError(
                f"new_version: versions here name the weights that produced each token, so they change only with "
                f"the weights; pass weight_version={new_version!r} to /finish_weight_update (committed: {committed})"
            )
        return {"success": True, "new_version": new_version}

    # ---- vLLM's LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING), over every replica --------

    @app.post("/v1/load_lora_adapter", responses=SYNC_ERRORS, response_class=PlainTextResponse)
    async def rl_load_lora_adapter(self, request: Request, body: LoadLoraAdapter) -> PlainTextResponse:
        """Publishes the PEFT directory at `lora_path` as the next version of adapter `lora_name` on every replica, all or none; returns once every replica serves it (vLLM's text answer; the version in `X-Rollout-Adapter-Version`)."""
        if body.is_3d_lora_weight:
            raise InvalidRequestError("is_3d_lora_weight", "3D (fused-MoE) LoRA weights are not supported here; PEFT's per-module lora_A/lora_B tensors are")
        # The coordinator admits the caller before the ingress reads a path the caller names
        # (the ingress holds no sync token to check it against).
        await self._drive(request, FleetQuery.AUTHORIZE)
        config, tensors = await asyncio.to_thread(read_peft_directory, body.lora_path, self.config.http.max_body_bytes, "lora_path")
        command = LoadAdapter(AdapterRequest(name=body.lora_name, config=config, tensors=tensors), inplace=body.load_inplace)
        try:
            outcome = _committed(await self._drive(request, command), f"loading {body.lora_name!r}")
        except InvalidRequestError as e:
            raise _as_route_field(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.", headers={ADAPTER_VERSION_HEADER: str(outcome.version)})

    @app.post("/v1/unload_lora_adapter", responses=UNLOAD_ERRORS, response_class=PlainTextResponse)
    async def rl_unload_lora_adapter(self, request: Request, body: UnloadLoraAdapter) -> PlainTextResponse:
        """Every replica stops serving adapter `lora_name` (requests naming it are refused) and replicas that start later no longer load it; 404 for a name not loaded, as vLLM answers."""
        _committed(await self._drive(request, UnloadAdapter(body.lora_name)), f"unloading {body.lora_name!r}")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/collective_rpc", responses=REFUSED_ERRORS)
    async def rl_collective_rpc(self) -> JSONResponse:
        """Refused (403): it would run arbitrary methods on every engine worker."""
        raise ForbiddenError(f"/collective_rpc {REFUSED}")

    @app.post("/weight_checker", responses=REFUSED_ERRORS)
    async def rl_weight_checker(self) -> JSONResponse:
        """Refused (403): it resets weights through `collective_rpc`."""
        raise ForbiddenError(f"/weight_checker resets weights through collective_rpc, which {REFUSED}")
