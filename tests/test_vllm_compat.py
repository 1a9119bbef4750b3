"""rollout.vllm_compat: what differs between the supported vLLM versions, found by feature
detection. The installed vLLM (the CPU build, 0.32) runs its branch for real; 0.33's branch
runs against stand-ins shaped as 0.33's source has them (its wheel is GPU-only)."""

from __future__ import annotations

import asyncio
import importlib.machinery
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import pytest
import torch

from rollout import vllm_compat


def test_serve_arg_parsing_is_found_where_the_installed_vllm_keeps_it(monkeypatch):
    make, validate = vllm_compat.serve_arg_parsing()
    assert make.__module__ == "vllm.entrypoints.launchers.cli_args"  # 0.32
    assert validate.__name__ == "validate_parsed_serve_args"
    # 0.33 keeps them in vllm.entrypoints.common.cli_args: that module wins where it exists.
    moved = types.ModuleType("vllm.entrypoints.common.cli_args")
    moved.__spec__ = importlib.machinery.ModuleSpec(moved.__name__, None)
    moved.make_arg_parser, moved.validate_parsed_serve_args = "make-0.33", "validate-0.33"
    monkeypatch.setitem(sys.modules, moved.__name__, moved)
    assert vllm_compat.serve_arg_parsing() == ("make-0.33", "validate-0.33")


def test_a_tensors_source_in_vllm_032s_shape_declares_and_yields_every_tensor():
    from vllm.distributed.weight_transfer.base import WeightSource

    tensors = {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    source = vllm_compat.tensors_source(tensors)
    assert isinstance(source, WeightSource)
    assert [(m.name, m.dtype, m.shape) for m in vllm_compat.source_metadata(source)] == [("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (4,))]
    assert [(n, t is tensors[n]) for n, t in vllm_compat.source_tensors(source)] == [("a", True), ("b", True)]
    assert source.metadata()[0].name == "a" and [n for n, _ in source] == ["a", "b"]  # 0.32's own calls


@dataclass(frozen=True)
class _ParamMeta033:
    name: str
    dtype: torch.dtype
    shape: tuple


class _WeightSource033(ABC):
    """vLLM 0.33's WeightSource contract (vllm/distributed/weight_transfer/base.py): metadata
    a cached_property (checked at class creation), iter_full instead of iteration."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self):
        raise NotImplementedError

    def iter_full(self):
        raise NotImplementedError


def test_a_tensors_source_in_vllm_033s_shape_declares_and_yields_every_tensor(monkeypatch):
    from vllm.distributed.weight_transfer import base

    monkeypatch.setattr(base, "WeightSource", _WeightSource033)
    monkeypatch.setattr(base, "ParamMeta", _ParamMeta033)
    tensors = {"a": torch.zeros(2, 3), "b": torch.ones(4)}
    source = vllm_compat.tensors_source(tensors)
    assert isinstance(source, _WeightSource033)
    assert isinstance(type(source).__dict__["metadata"], cached_property)
    assert source.metadata is source.metadata  # cached: engines read it repeatedly
    assert [m.name for m in vllm_compat.source_metadata(source)] == ["a", "b"]
    assert [n for n, _ in vllm_compat.source_tensors(source)] == ["a", "b"]
    assert [n for n, _ in source.iter_full()] == ["a", "b"]


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))

        return call


def test_the_platforms_pauses_go_to_the_scheduler_so_requests_queue_in_both_versions():
    engine = types.SimpleNamespace(engine_core=_Recorder(), renderer=_Recorder(), pause_generation=None)
    asyncio.run(vllm_compat.pause_scheduler(engine, "abort", clear_cache=True))
    assert engine.renderer.calls == [("clear_mm_cache_async", (), {})]
    assert engine.engine_core.calls == [("pause_scheduler_async", (), {"mode": "abort", "clear_cache": True})]
    # An engine without the scheduler call gets pause_generation (logged once).
    bare = _Recorder()
    asyncio.run(vllm_compat.pause_scheduler(bare, "keep", clear_cache=False))
    assert bare.calls == [("pause_generation", (), {"mode": "keep", "clear_cache": False})]


def test_the_installed_vllms_async_llm_still_has_the_scheduler_pause():
    from vllm.v1.engine.core_client import AsyncMPClient

    assert hasattr(AsyncMPClient, "pause_scheduler_async")


def test_the_version_is_for_records():
    assert vllm_compat.vllm_version().startswith("0.32")
    with pytest.raises(AttributeError):
        vllm_compat.VERSION  # noqa: B018 - no module-level version to branch on
