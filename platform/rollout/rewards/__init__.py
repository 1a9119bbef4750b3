"""Inline rewards: each sample scored next to the engine as it finishes.

A request names a reward (``RolloutRequest.reward``, else ``rewards.default``): a built-in
(:mod:`rollout.rewards.builtins`) or a function registered in ``rewards.functions``
(``name: module:function``, imported when the replica starts, so a bad path fails the start,
not a request). Requests only ever name registered functions, never an import path: what
runs is what the operator configured.

A function gets the sample's text and the spec's params (``fn(text, **params)``) and returns
a number, or ``(number, details)``. It runs on a small thread pool, never on the replica's
event loop, under ``rewards.timeout_s``. One that raises, times out or returns something
else gives ``reward=None`` and ``reward_error`` on that sample; the request itself succeeds.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pydantic import ValidationError

from rollout.api import RewardSpec
from rollout.errors import InvalidRequestError
from rollout.rewards.builtins import BUILTINS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardOutcome:
    reward: Optional[float]
    details: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None

    def fields(self) -> dict[str, Any]:
        """As the fields of a ``Sample`` or a sample's last ``RolloutChunk``."""
        return {"reward": self.reward, "reward_details": self.details or None, "reward_error": self.error}


def import_function(path: str) -> Callable[..., Any]:
    """``module:function`` -> the function; raises ValueError saying what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not 'module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn


Scorer = Callable[[str], Any]  # the sample's text -> the function's raw return


class RewardScorer:
    """One per replica: resolves specs when requests arrive, scores samples when they finish."""

    def __init__(self, functions: dict[str, str], default: Optional[RewardSpec], timeout_s: float, workers: int):
        self.functions = {name: import_function(path) for name, path in functions.items()}
        self.default = default
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")

    @classmethod
    def from_config(cls, cfg) -> "RewardScorer":
        return cls(dict(cfg.functions), cfg.default, cfg.timeout_s, cfg.workers)

    def resolve(self, spec: Optional[RewardSpec]) -> Optional[Scorer]:
        """The scorer for ``spec`` (None: no reward); raises InvalidRequestError naming the
        field (``reward.name``, ``reward.params.<key>``) when it cannot run."""
        if spec is None:
            return None
        if spec.name in BUILTINS:
            fn, model = BUILTINS[spec.name]
            try:
                params = model.model_validate(spec.params)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise InvalidRequestError(f"reward.params.{where}" if where else "reward.params", f"{spec.name}: {err['msg']}") from None
            return lambda text: fn(text, params)
        if spec.name in self.functions:
            fn = self.functions[spec.name]
            try:
                inspect.signature(fn).bind("", **spec.params)
            except TypeError as e:
                raise InvalidRequestError("reward.params", f"{spec.name}: {e}") from None
            except ValueError:  # no signature to read (a builtin in C): let the call say
                pass
            params = dict(spec.params)
            return lambda text: fn(text, **params)
        known = sorted(BUILTINS) + sorted(self.functions)
        raise InvalidRequestError("reward.name", f"unknown reward {spec.name!r}; this platform has {', '.join(known)} (register more under rewards.functions)")

    async def score(self, scorer: Scorer, text: str) -> RewardOutcome:
        loop = asyncio.get_running_loop()
        try:
            raw = await asyncio.wait_for(loop.run_in_executor(self._pool, scorer, text), self.timeout_s)
        except asyncio.TimeoutError:
            logger.warning("a reward function ran past rewards.timeout_s=%s", self.timeout_s)
            return RewardOutcome(None, error=f"timed out after rewards.timeout_s={self.timeout_s:g} s")
        except Exception as e:  # the user's function failed: the sample says why
            return RewardOutcome(None, error=f"{type(e).__name__}: {e}"[:1000])
        return _outcome(raw)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _outcome(raw: Any) -> RewardOutcome:
    value, details = raw if isinstance(raw, tuple) and len(raw) == 2 else (raw, {})
    if not isinstance(value, (int, float)) or not math.isfinite(value):  # (a bool is an int: 1.0 or 0.0)
        return RewardOutcome(None, error=f"the reward function returned {raw!r:.200}, not a finite number (or a (number, details) pair)")
    if not isinstance(details, dict):
        return RewardOutcome(float(value), error=f"details must be a dict, got {type(details).__name__}")
    # Details travel in JSON: what JSON cannot hold is written as its str().
    return RewardOutcome(float(value), json.loads(json.dumps({str(k): v for k, v in details.items()}, default=str)))
