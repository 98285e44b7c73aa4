import pickle

import pytest

from arctic_rl_core.config import ArcticRLClientConfig, TrainingConfig, WeightSyncConfig


def test_seed_defaults():
    c = ArcticRLClientConfig(model_name="m", training_gpus=1)
    assert (c.backend, c.comm_protocol, c.log_prob_engine, c.colocate, c.seed) == ("local", "http", "vllm", False, 42)
    assert (c.startup_timeout, c.health_check_interval, c.job_ready_timeout) == (300.0, 2.0, 600.0)
    assert c.ds_config == {} and c.training_config is None and c.ray_auto_attach and c.server_logs


def test_http_derives_primary_ip_and_port_7000_and_ray_derives_nothing():
    http = ArcticRLClientConfig(model_name="m", training_gpus=1)
    assert http.host and http.port == 7000
    ray = ArcticRLClientConfig(model_name="m", training_gpus=1, comm_protocol="ray")
    assert ray.host is None and ray.port is None
    explicit = ArcticRLClientConfig(model_name="m", training_gpus=1, host="10.1.2.3", port=9000)
    assert (explicit.host, explicit.port) == ("10.1.2.3", 9000)


def test_local_backend_needs_a_gpu_unless_reconnecting():
    with pytest.raises(ValueError, match="training_gpus, sampling_gpus or log_prob_gpus"):
        ArcticRLClientConfig(model_name="m")
    assert ArcticRLClientConfig(model_name="m", training_job_id=3).reconnecting


def test_remote_is_an_alias_of_dss_platform():
    assert ArcticRLClientConfig(model_name="m", backend="remote", training_job_id=1).backend == "dss-platform"


@pytest.mark.parametrize(
    "field, value, expected",
    [("comm_protocol", "grpc", "'http' or 'ray'"), ("log_prob_engine", "hf", "'vllm' or 'deepspeed'"),
     ("log_prob_gpus", -1, "greater than or equal to 0"), ("unknown_field", 1, "Extra inputs")],
)  # fmt: skip
def test_errors_name_the_field_and_the_allowed_values(field, value, expected):
    with pytest.raises(ValueError) as info:
        ArcticRLClientConfig(**{"model_name": "m", "sampling_gpus": 1, field: value})
    assert field in str(info.value) and expected in str(info.value)


def test_config_survives_pickling_for_ray():
    c = ArcticRLClientConfig(model_name="m", comm_protocol="ray", training_gpus=2, training_job_id=4)
    assert pickle.loads(pickle.dumps(c)) == c


def test_initialize_copy_never_forwards_job_ids_or_token():
    c = ArcticRLClientConfig(model_name="m", training_gpus=1, auth_token="secret", training_job_id=2)
    sent = c.for_initialize()
    assert sent.training_job_id is None and sent.auth_token is None


def test_weight_sync_config_defaults():
    w = WeightSyncConfig()
    assert (w.training_sharding, w.training_gpus, w.inference_replicas, w.inference_tp) == ("dp", 1, 1, 1)
    assert (w.base_port, w.bucket_size) == (29500, 268435456)


def test_training_config_ignores_extra_fields_and_validates_known_ones():
    t = TrainingConfig.model_validate({"optimizer": {"lr": 3e-4, "whatever": 1}, "not_a_field": True})
    assert t.optimizer.lr == 3e-4
    with pytest.raises(ValueError, match="optimizer.lr"):
        TrainingConfig.model_validate({"optimizer": {"lr": -1.0}})
