"""PlatformConfig: the one source of configuration, loaded from YAML plus environment."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout.app import config_from_args, engine_deployment_options
from rollout.config import PlatformConfig, load_config


def test_smallest_config_names_only_the_model(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /models/demo}\n")
    cfg = load_config(f, environ={})
    assert cfg.model.path == "/models/demo" and cfg.model.name == "demo"
    assert cfg.http.port == 8000


def test_http_port_moves_the_port(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /m}\nhttp: {port: 9123}\n")
    assert load_config(f, environ={}).http.port == 9123


def test_environment_overrides_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /m, max_num_seqs: 8}\nhttp: {port: 9123}\n")
    cfg = load_config(f, environ={"ROLLOUT_HTTP__PORT": "9999", "ROLLOUT_MODEL__ENABLE_PREFIX_CACHING": "false", "ROLLOUT_API_KEY": "x"})
    assert cfg.http.port == 9999 and cfg.model.enable_prefix_caching is False and cfg.model.max_num_seqs == 8


@pytest.mark.parametrize(
    "data,field",
    [
        ({"model": {"path": "/m", "tensor_parallel_size": 0}}, "tensor_parallel_size"),
        ({"model": {"path": "/m", "gpu_memory_utilization": 1.5}}, "gpu_memory_utilization"),
        ({"model": {"path": "/m"}, "http": {"port": 70000}}, "port"),
        ({"model": {"path": "/m"}, "deployment": {"replicas": -1}}, "replicas"),
        ({"model": {"path": "/m", "dtpye": "float32"}}, "dtpye"),
        ({"model": {"path": "/m"}, "deployment": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas"),
        ({"model": {"path": "/m"}, "deployment": {"autoscaling": {"upscale_delay_s": 5, "look_back_period_s": 30}}}, "upscale_delay_s"),
        ({}, "model"),
    ],
)
def test_invalid_config_is_rejected_naming_the_field(data, field):
    with pytest.raises(ValidationError) as exc:
        load_config(data, environ={})
    assert field in str(exc.value)


def test_api_key_comes_from_environment_first_then_file(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("from-file\n")
    cfg = load_config({"model": {"path": "/m"}, "http": {"api_key_file": str(key)}}, environ={})
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    assert cfg.http.resolve_api_key() == "from-file"
    monkeypatch.setenv("ROLLOUT_API_KEY", "from-env")
    assert cfg.http.resolve_api_key() == "from-env"


def test_no_api_key_means_open(monkeypatch):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    assert load_config({"model": {"path": "/m"}}, environ={}).http.resolve_api_key() is None


def test_max_ongoing_requests_is_derived_from_the_engine_when_unset():
    cfg = load_config({"model": {"path": "/m", "max_num_seqs": 96}}, environ={})
    assert engine_deployment_options(cfg, "cpu")["max_ongoing_requests"] == 96
    cfg = load_config({"model": {"path": "/m"}, "deployment": {"max_ongoing_requests": 7}}, environ={})
    assert engine_deployment_options(cfg, "cpu")["max_ongoing_requests"] == 7


def test_tensor_parallel_replicas_reserve_one_gpu_bundle_per_rank():
    cfg = load_config({"model": {"path": "/m", "tensor_parallel_size": 4}}, environ={})
    opts = engine_deployment_options(cfg, "cuda")
    assert [b.get("GPU", 0) for b in opts["placement_group_bundles"]] == [0, 1, 1, 1, 1]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert "num_gpus" not in opts["ray_actor_options"]
    assert "placement_group_bundles" not in engine_deployment_options(cfg, "cpu")


def test_autoscaling_settings_reach_serve():
    cfg = load_config({"model": {"path": "/m"}, "deployment": {"autoscaling": {"min_replicas": 0, "max_replicas": 3}}}, environ={})
    opts = engine_deployment_options(cfg, "cpu")
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"]["min_replicas"] == 0 and opts["autoscaling_config"]["max_replicas"] == 3


@pytest.mark.parametrize("look_back_period_s", [0.5, 2.0, 30.0, 120.0])
def test_serve_accepts_the_autoscaling_settings_without_a_warning(look_back_period_s):
    import warnings

    from ray.serve.config import AutoscalingConfig

    a = {"look_back_period_s": look_back_period_s, "upscale_delay_s": look_back_period_s, "downscale_delay_s": look_back_period_s}
    cfg = load_config({"model": {"path": "/m"}, "deployment": {"autoscaling": a}}, environ={})
    serve_cfg = dict(engine_deployment_options(cfg, "cpu")["autoscaling_config"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # "look_back_period_s must be greater than metrics_interval_s"
        AutoscalingConfig(**serve_cfg)


def test_app_args_accept_a_config_file_or_the_config_itself(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /m}\n")
    assert config_from_args({"config_file": str(f)}).model.path == "/m"
    assert config_from_args({"model": {"path": "/n"}}).model.path == "/n"
    with pytest.raises(ValueError, match="config_file"):
        config_from_args({"config_file": str(f), "model": {"path": "/n"}})


def test_every_config_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            yield model.__name__, name, field
            ann = field.annotation
            for t in (ann, *getattr(ann, "__args__", ())):
                if isinstance(t, type) and issubclass(t, PlatformConfig.__mro__[1]):
                    yield from walk(t)

    missing = [f"{m}.{n}" for m, n, f in walk(PlatformConfig) if not f.description and n not in {"model", "deployment", "limits", "http", "metrics", "sync", "routing"}]
    assert not missing, missing


def _deployment_versions(cfg: PlatformConfig) -> dict[str, str]:
    from rollout.app import build_application

    app = build_application(cfg)
    seen, stack = {}, [app._bound_deployment]
    while stack:  # the ingress, then what it was bound with
        d = stack.pop()
        seen[d.name] = d.version
        stack += [a._bound_deployment for a in d._replica_config.init_args if hasattr(a, "_bound_deployment")]
    return seen


def test_changing_replica_count_autoscaling_or_router_keeps_every_deployment_version_so_serve_does_not_restart_replicas():
    base = PlatformConfig.model_validate({"model": {"path": "/m"}})
    scaled = PlatformConfig.model_validate({"model": {"path": "/m"}, "deployment": {"replicas": 3}})
    autoscaled = PlatformConfig.model_validate({"model": {"path": "/m"}, "deployment": {"autoscaling": {"min_replicas": 0, "max_replicas": 4}}})
    rerouted = PlatformConfig.model_validate({"model": {"path": "/m"}, "deployment": {"routing": {"policy": "default"}, "health_check_period_s": 2}})
    versions = _deployment_versions(base)
    assert set(versions) == {"RolloutIngress", "RolloutEngine", "WeightSyncCoordinator"} and all(versions.values())
    assert _deployment_versions(scaled) == versions == _deployment_versions(autoscaled)
    # A new router restarts only the ingress, whose engine handle holds the router.
    rerouted = _deployment_versions(rerouted)
    assert rerouted["RolloutIngress"] != versions["RolloutIngress"]
    assert {k: v for k, v in rerouted.items() if k != "RolloutIngress"} == {k: v for k, v in versions.items() if k != "RolloutIngress"}
    changed = _deployment_versions(PlatformConfig.model_validate({"model": {"path": "/m", "max_model_len": 1024}}))
    assert all(changed[name] != versions[name] for name in versions), "a new engine config restarts the replicas"
