"""Sleep and wake, coordinated over every replica: vLLM's sleep mode for trainers that share
the replicas' GPUs (verl, OpenRLHF, NeMo-RL's colocated mode) and free them between rollout
phases.

The fleet's sleep is part of the coordinator's :class:`~rollout.contracts.sync_protocol.Control`
(``Control.sleep``), set by ``/sleep`` and ``/wake_up`` (or ``RolloutClient.sleep`` /
``wake_up``) and applied by every replica on its next poll, as ``/pause`` is: the route
returns once every live replica applied it, and a replica that starts later converges to it.

This module holds the rules, on both sides:

* the coordinator's: whether sleep mode is on at all (:func:`unavailable`), the fleet's next
  :class:`Sleep` after a ``/sleep`` (:func:`after_sleep`) or a ``/wake_up``
  (:func:`after_wake`), and the refusal of a round while the weights sleep
  (:func:`refuse_round`);
* a replica's: :class:`ReplicaSleep` converges one engine to the fleet's sleep. After a
  level-2 sleep the engine's weights are discarded (vLLM's wake leaves whatever the
  re-mapped memory holds), so when they wake the replica restores the committed version
  through the coordinator's usual restore (``rollout.sync.store``: the committed checkpoint,
  the coordinator's copy, the model itself at version 0, else it waits for the next
  publish) and refuses requests until then.

While any tag sleeps a replica refuses requests with the retryable ``NotServingError``;
its health check passes and the autoscaler keeps the replica count (``ReplicaLoad.sleep_level``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Awaitable, Callable, Optional, Sequence

from rollout.config import SLEEP_ON_CPU, ModelConfig
from rollout.contracts.sync_protocol import SLEEP_TAGS, FleetAsleepError, PauseMode, Sleep
from rollout.errors import InvalidRequestError

logger = logging.getLogger(__name__)

LEVELS = (1, 2)  # vLLM's level 0 pauses scheduling only: that is /pause here


# ---- the coordinator's rules ---------------------------------------------------------------


def unavailable(model: ModelConfig) -> Optional[str]:
    """Why the replicas cannot sleep (None: they can). ``model.device`` is the one the app
    was built for (``rollout.app`` resolves ``auto``)."""
    if model.enable_sleep_mode:
        return None
    if model.device == "cpu":
        return f"sleep mode is not available on this platform: its replicas run on CPU (model.device: cpu), and {SLEEP_ON_CPU}"
    return "sleep mode is off: the engines started without vLLM's sleep mode; set model.enable_sleep_mode: true (the replicas restart with it)"


def after_sleep(current: Optional[Sleep], level: int, mode: PauseMode) -> Sleep:
    """The fleet's sleep after ``/sleep?level=&mode=``; the same sleep again is accepted."""
    if level not in LEVELS:
        raise InvalidRequestError("level", f"{level}: 1 (offload the weights to host memory, drop the KV cache) or 2 (discard both); level 0 is /pause here")
    if level == 2 and mode == "keep":
        raise InvalidRequestError("mode", "keep: level 2 discards the weights and the KV cache that kept requests would continue on; use abort or wait")
    wanted = Sleep(level, mode)
    if current is None or (current.level == level and current.asleep == SLEEP_TAGS):
        return wanted if current is None else current
    raise FleetAsleepError(f"the replicas are {current.describe()}: /wake_up before a /sleep at level {level}", current.describe())


def after_wake(current: Optional[Sleep], tags: Optional[Sequence[str]]) -> Optional[Sleep]:
    """The fleet's sleep after ``/wake_up?tags=`` (None: every tag); None once awake. Tags
    already awake are left as they are, as vLLM's executor leaves them."""
    if tags is not None:
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown or not tags:
            raise InvalidRequestError("tags", f"{unknown or 'empty'}: tags are {' and '.join(SLEEP_TAGS)} (none: both)")
    if current is None:
        return None
    asleep = tuple(t for t in current.asleep if tags is not None and t not in tags)
    return dataclasses.replace(current, asleep=asleep) if asleep else None


def refuse_round(current: Optional[Sleep], what: str) -> None:
    """:class:`FleetAsleepError` while the replicas' weights sleep: a round would load into
    weights offloaded (level 1) or discarded (level 2). With only the KV cache asleep a
    round runs (a trainer wakes the weights, publishes, then wakes the KV cache)."""
    if current is not None and "weights" in current.asleep:
        where = "offloaded to host memory" if current.level == 1 else "discarded"
        raise FleetAsleepError(
            f"{what} refused: the replicas are {current.describe()}, their weights {where}; /wake_up (tags=weights at least) first",
            current.describe(),
        )


# ---- a replica's side ----------------------------------------------------------------------


class ReplicaSleep:
    """One replica's engine, converging to the fleet's sleep (``Control.sleep``)."""

    def __init__(self, engine: Any, replica_id: str):
        self.engine = engine  # vLLM's AsyncLLM: sleep(level, mode), wake_up(tags)
        self.replica_id = replica_id
        self.state: Optional[Sleep] = None  # what the engine has asleep now (None: nothing)
        # The engine's weights were discarded by a level-2 sleep and not restored since.
        self.discarded = False
        self.restoring = False  # reloading the committed weights after a level-2 sleep

    @property
    def refusal(self) -> Optional[str]:
        """Why this replica refuses requests now (asleep, or restoring after level 2), or None."""
        if self.state is not None:
            return f"replica {self.replica_id} is {self.state.describe()} (a trainer's /sleep; /wake_up wakes it)"
        if self.restoring:
            return f"replica {self.replica_id} is reloading the committed weights after a level-2 sleep"
        return None

    @property
    def level(self) -> int:
        """The sleep level it is at (0: awake)."""
        return self.state.level if self.state is not None else 0

    async def converge(self, want: Optional[Sleep], restore: Callable[[], Awaitable[None]]) -> bool:
        """Bring the engine to ``want``. ``restore`` brings it to the committed weights (the
        agent's restore). Returns whether the engine woke fully here: vLLM's wake resumes
        its scheduler, so the caller pauses it again under a trainer's ``/pause``."""
        have = self.state
        if want == have:
            return False
        if have is not None and want is not None and (want.level != have.level or not set(want.asleep) <= set(have.asleep)):
            # Asleep otherwise than the fleet (it missed a wake while it did not poll): wake
            # fully, then sleep as the fleet does.
            await self.converge(None, restore)
            have = None
        if have is None:
            if want is None:
                return False
            await self.engine.sleep(level=want.level, mode=want.mode)
            self.state = have = Sleep(want.level, want.mode)
            self.discarded = self.discarded or want.level >= 2
            logger.info("replica %s: engine %s", self.replica_id, have.describe())
        waking = [t for t in have.asleep if want is None or t not in want.asleep]
        if not waking:
            return False
        await self.engine.wake_up(waking)
        left = tuple(t for t in have.asleep if t not in waking)
        self.state = dataclasses.replace(have, asleep=left) if left else None
        logger.info("replica %s: woke %s%s", self.replica_id, ", ".join(waking), f" ({', '.join(left)} still asleep)" if left else "")
        if "weights" in waking and self.discarded:
            # vLLM's wake maps the weights' memory back with nothing in it: the committed
            # version is reloaded before this replica serves (refused meanwhile).
            self.restoring = True
            try:
                await restore()
            finally:
                self.restoring, self.discarded = False, False
        return self.state is None
