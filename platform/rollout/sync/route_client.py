"""A client for vLLM's RL routes on the platform, for trainers written for ``vllm serve``.

vLLM's ``HTTPVLLMWeightSyncClient`` sends no credentials, and the platform's routes need
the sync token. This is that client plus the token, and the routes around a weight
update that vLLM's client leaves to the trainer (pause, resume, world size)::

    client = WeightRoutesClient("http://rollout:8000")           # token: ROLLOUT_SYNC_TOKEN
    client.pause(mode="keep")
    world = client.get_world_size()
    engine = NCCLTrainerWeightTransferEngine.trainer_init(NCCLTrainerInitInfo(..., world_size=1 + world, rank=0), client=client, source=ModuleSource(model))
    engine.send_weights()
    client.resume()
"""

from __future__ import annotations

import os
from typing import Any, Optional

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from rollout.contracts.sync_protocol import SYNC_TOKEN_ENV
from rollout.sync.remote import SYNC_TOKEN_HEADER


class WeightRoutesClient(HTTPVLLMWeightSyncClient):
    def __init__(self, base_url: str, token: Optional[str] = None, timeout: float = 300) -> None:
        super().__init__(base_url, timeout)
        token = token if token is not None else os.environ.get(SYNC_TOKEN_ENV)
        self.headers = {SYNC_TOKEN_HEADER: token} if token else {}

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import requests

        response = requests.request(method, f"{self.base_url}/{path}", headers=self.headers, timeout=self.timeout, **kwargs)
        if response.status_code >= 400:
            # The platform's error names the problem: keep it in the exception.
            raise requests.HTTPError(f"{response.status_code} on /{path}: {response.text}", response=response)
        return response.json()

    def _post(self, path: str, json: Optional[dict[str, Any]] = None) -> None:
        self._request("POST", path, json=json)

    def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        self._request("POST", "pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    def resume(self) -> None:
        self._request("POST", "resume")

    def get_world_size(self) -> int:
        return int(self._request("GET", "get_world_size")["world_size"])

    def weight_version(self) -> Optional[str]:
        return self._request("GET", "weight_info")["weight_version"]
