"""A replica's side of LoRA adapter rounds (rollout.sync.adapters owns what an adapter is
and what a replica serves): catch-up, a publish staged beside the served adapters and
served only on a commit, an unload applied only on a commit. Nothing pauses generation,
so these run beside the weight rounds' pause-transfer-decide path of the sync agent."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Optional

from rollout.contracts.sync_protocol import AdapterRemovalRound, AdapterRound, RoundOutcome
from rollout.sync.adapters import ServedAdapters
from rollout.sync.clock import PhaseClock

logger = logging.getLogger("rollout.sync.agent")


class AdapterRounds:
    def __init__(
        self,
        served: ServedAdapters,
        coordinator: Any,
        replica_id: str,
        report: Callable[[Any, Optional[str]], Awaitable[RoundOutcome]],
        version: Callable[[], int],
    ):
        self.served, self.coordinator, self.replica_id = served, coordinator, replica_id
        self.report = report  # the agent's report of a round's result (it decides the round)
        self.version = version  # the weight version the replica serves, for ``applied``

    async def catch_up(self) -> None:
        """Serve exactly the committed adapters (catch-up: a replica that starts later, or
        re-registers after it missed rounds): unload each one it serves that is no longer
        committed (an unload ran while the coordinator had dropped it as silent), load
        every committed one it does not serve at that version, and mark those the
        coordinator holds no copy of as unavailable here (see rollout.sync.store)."""
        committed = await self.coordinator.adapters(self.replica_id)
        names = {a.name for a in committed.copies} | {h.name for h in committed.without_copy}
        for name, version in sorted({**self.served.unavailable, **self.served.versions()}.items()):
            if name not in names:
                # Without this a missed unload would leave it served here for good: catch-up
                # only loads, and the coordinator sends no second unload round.
                await self.served.remove(name)
                logger.warning(
                    "replica %s: unloaded adapter %s version %d: not committed (an unload committed while this replica was "
                    "not a member); requests naming it are refused here, as on every replica", self.replica_id, name, version,
                )
        for adapter in committed.copies:
            served = self.served.get(adapter.name)
            if served is not None and served.version >= adapter.version:
                # Newer than the committed copy: see CommittedWeights.learn_adapters.
                continue
            await self.served.commit(await self.served.stage(adapter))
            logger.info("replica %s: loaded adapter %s version %d", self.replica_id, adapter.name, adapter.version)
        for held in committed.without_copy:
            served = self.served.get(held.name)
            if served is None or served.version < held.version:
                # Learned back by a restarted coordinator, which holds no bytes of it: served
                # by the replicas that hold it, refused here until its next publish.
                await self.served.not_loadable(held)

    async def run(self, plan: AdapterRound) -> None:
        """Stage the round's adapter beside the served ones, report, and serve it only on
        a commit: on an abort (here or on any member) it is dropped and the version before
        stays served, so no replica serves a version another one lacks. Nothing pauses."""
        clock = PhaseClock()
        staged, error = None, None
        try:
            async with clock("load"):
                staged = await asyncio.wait_for(self.served.stage(plan.adapter), plan.timeout_s)
        except asyncio.TimeoutError:
            error = f"loading {plan.adapter!r} did not finish within {plan.timeout_s:.0f}s (sync.timeout_s)"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            logger.error("replica %s: %s failed: %s", self.replica_id, plan.round_id, error)
        async with clock("decision"):
            outcome = await self.report(plan, error)
        if staged is not None:
            async with clock("serve"):
                await (self.served.commit(staged) if outcome.committed else self.served.discard(staged))
        logger.info("replica %s: %s %s; took %s", self.replica_id, plan.round_id, "committed" if outcome.committed else "aborted", clock)
        await self.coordinator.applied(plan.round_id, self.replica_id, self.version(), clock.phases)

    async def remove(self, plan: AdapterRemovalRound) -> None:
        """An unload: report (nothing to prepare), and stop serving the adapter only on a
        commit, so it leaves every replica or none. Nothing pauses."""
        clock = PhaseClock()
        async with clock("decision"):
            outcome = await self.report(plan, None)
        if outcome.committed:
            async with clock("serve"):
                await self.served.remove(plan.name)
        logger.info("replica %s: %s %s; took %s", self.replica_id, plan.round_id, "committed" if outcome.committed else "aborted", clock)
        await self.coordinator.applied(plan.round_id, self.replica_id, self.version(), clock.phases)
