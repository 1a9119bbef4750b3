"""rollout.vllm_compat: what differs between the supported vLLM versions, found by feature
detection. The installed vLLM (the CPU build, 0.32, in CI; 0.33's GPU wheel imports on a CPU
machine too) runs its branch for real; the other version's branch runs against stand-ins
shaped as that version's source has them. Every test passes under either version."""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
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
    # 0.32: vllm.entrypoints.launchers.cli_args; 0.33: vllm.entrypoints.common.cli_args.
    installed = [name for name in vllm_compat._CLI_ARGS if _module_exists(name)]
    assert make.__module__ == installed[0]
    assert validate.__name__ == "validate_parsed_serve_args"
    # 0.33 keeps them in vllm.entrypoints.common.cli_args: that module wins where it exists.
    moved = types.ModuleType("vllm.entrypoints.common.cli_args")
    moved.__spec__ = importlib.machinery.ModuleSpec(moved.__name__, None)
    moved.make_arg_parser, moved.validate_parsed_serve_args = "make-0.33", "validate-0.33"
    monkeypatch.setitem(sys.modules, moved.__name__, moved)
    assert vllm_compat.serve_arg_parsing() == ("make-0.33", "validate-0.33")


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_a_tensors_source_in_the_installed_vllms_shape_declares_and_yields_every_tensor():
    from vllm.distributed.weight_transfer.base import WeightSource

    tensors = {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    source = vllm_compat.tensors_source(tensors)
    assert isinstance(source, WeightSource)
    assert [(m.name, m.dtype, m.shape) for m in vllm_compat.source_metadata(source)] == [("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (4,))]
    assert [(n, t is tensors[n]) for n, t in vllm_compat.source_tensors(source)] == [("a", True), ("b", True)]
    if hasattr(WeightSource, "iter_full"):  # 0.33's own calls
        assert source.metadata[0].name == "a" and [n for n, _ in source.iter_full()] == ["a", "b"]
    else:  # 0.32's
        assert source.metadata()[0].name == "a" and [n for n, _ in source] == ["a", "b"]


class _WeightSource032(ABC):
    """vLLM 0.32's WeightSource contract (vllm/distributed/weight_transfer/base.py): metadata()
    a method, the tensors by iteration."""

    @abstractmethod
    def metadata(self):
        raise NotImplementedError

    @abstractmethod
    def __iter__(self):
        raise NotImplementedError


def test_a_tensors_source_in_vllm_032s_shape_declares_and_yields_every_tensor(monkeypatch):
    from vllm.distributed.weight_transfer import base

    monkeypatch.setattr(base, "WeightSource", _WeightSource032)
    monkeypatch.setattr(base, "ParamMeta", _ParamMeta033)  # the same three fields in 0.32
    tensors = {"a": torch.zeros(2, 3), "b": torch.ones(4)}
    source = vllm_compat.tensors_source(tensors)
    assert isinstance(source, _WeightSource032)
    assert [m.name for m in vllm_compat.source_metadata(source)] == ["a", "b"]
    assert [n for n, _ in vllm_compat.source_tensors(source)] == ["a", "b"]
    assert source.metadata()[0].name == "a" and [n for n, _ in source] == ["a", "b"]


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
    assert vllm_compat.vllm_version().startswith(("0.32", "0.33"))
    with pytest.raises(AttributeError):
        vllm_compat.VERSION  # noqa: B018 - no module-level version to branch on


def test_a_turn_skips_special_tokens_unless_the_parser_said_otherwise():
    # 0.33's ChatCompletionRequest leaves skip_special_tokens None where neither the request
    # nor the parser set it; 0.32's says True. Either way a turn skips them, as vLLM's server does.
    assert vllm_compat.skip_special_tokens(None) is True
    assert vllm_compat.skip_special_tokens(True) is True
    assert vllm_compat.skip_special_tokens(False) is False


def test_the_installed_vllms_parser_leaves_a_turn_that_an_adapter_can_read(model_dir):
    from transformers import AutoTokenizer

    from rollout.tools import ToolRegistry
    from rollout.tools.calling import ToolCalling

    calling = ToolCalling(AutoTokenizer.from_pretrained(model_dir), "hermes")
    tools = ToolRegistry({}).offered(["calculator"])
    # hermes keeps special tokens where tools may be called (its <tool_call> tags are special).
    assert vllm_compat.skip_special_tokens(calling.plan(tools, "auto").skip_special_tokens) is False
    none = calling.plan(tools, "none").skip_special_tokens
    assert none in (True, None)  # 0.32: the request's default; 0.33: unset
    assert vllm_compat.skip_special_tokens(none) is True
