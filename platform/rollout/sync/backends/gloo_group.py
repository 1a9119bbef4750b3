"""A gloo process group over a TCPStore, outside torch.distributed's global state.

The trainer (rank 0) hosts the store; every engine worker joins as
``rank_offset + its rank within the engine``. One group per sync round, so a round
never inherits a dead rank from an earlier membership.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class GlooGroup:
    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float, name: str):
        timeout = timedelta(seconds=timeout_s)
        self.rank = rank
        self.world_size = world_size
        # The store's own timeout bounds the rendezvous: a rank that never joins
        # ends the round with an error instead of a hang.
        self._store = dist.TCPStore(
            master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
        )
        prefixed = dist.PrefixStore(name, self._store)
        self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._pg.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, dtype=torch.uint8))

    def close(self) -> None:
        self._pg = None
        self._store = None
