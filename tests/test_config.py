import pytest

from fp16doctor.config import DoctorConfig, apply_patch, build_config, explain, load_yaml, overrides_patch
from fp16doctor.diagnosis.stages import StageContext
from fp16doctor.errors import ConfigError


def test_defaults_match_the_documented_contract():
    config = build_config()
    assert (config.steps, config.seed, config.device, config.dtype, config.lr) == (50, 0, "auto", "float16", 1e-3)
    assert config.max_grad_norm is None
    s = config.scaler
    assert (s.enabled, s.init_scale, s.growth_factor, s.backoff_factor, s.growth_interval) == (
        True,
        65536.0,
        2.0,
        0.5,
        2000,
    )


def test_layers_override_in_order_and_merge_nested_keys():
    config = build_config(
        {"steps": 5, "scaler": {"init_scale": 1024}}, {"steps": 7}, {"scaler": {"growth_interval": 10}}
    )
    assert config.steps == 7
    assert config.scaler.init_scale == 1024 and config.scaler.growth_interval == 10


def test_a_fix_adds_to_the_modules_the_user_keeps_in_fp32_where_a_config_layer_replaces_them():
    user = build_config({"overrides": {"fp32_modules": ["head"]}, "scaler": {"init_scale": 1024}})
    fix = {**overrides_patch(fp32_modules=["body.0", "head"]), "scaler": {"init_scale": 256}}
    patched = apply_patch(user.to_dict(), fix)
    assert patched["overrides"]["fp32_modules"] == ["head", "body.0"]
    assert patched["scaler"]["init_scale"] == 256
    # a fix trial is built from the user's config the same way: it never drops the user's own fp32 modules
    ctx = StageContext(bench=None, config=user, evidence=None)  # type: ignore[arg-type]
    assert ctx.with_config(overrides_patch(fp32_modules=["body.0"])).overrides.fp32_modules == ["head", "body.0"]
    # a config layer (a file, then --set) replaces a list: the user's last word is the list
    assert build_config(user.to_dict(), {"overrides": {"fp32_modules": ["body.0"]}}).overrides.fp32_modules == [
        "body.0"
    ]


def test_unknown_key_names_it_and_the_closest_valid_key():
    with pytest.raises(ConfigError) as info:
        build_config({"scaler": {"init_scal": 8}})
    assert "scaler.init_scal" in info.value.message and "scaler.init_scale" in info.value.message


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError) as info:
        build_config({"steps": "many"})
    assert "'steps'" in info.value.message and "integer" in info.value.message
    with pytest.raises(ConfigError, match="boolean"):
        build_config({"scaler": {"enabled": "yes"}})


def test_bad_values_are_rejected():
    for layer in ({"dtype": "float8"}, {"device": "tpu"}, {"steps": 0}, {"scaler": {"backoff_factor": 2.0}}):
        with pytest.raises(ConfigError):
            build_config(layer)


def test_yaml_number_without_dot_is_read_as_a_number(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-3\nmax_grad_norm: 1\n")
    config = build_config(load_yaml(path))
    assert config.lr == pytest.approx(1e-3) and config.max_grad_norm == 1.0


def test_yaml_errors_point_at_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("steps: 3\nscaler: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    assert info.value.location and info.value.location.startswith(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")


def test_yaml_uses_safe_load(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("steps: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError):
        load_yaml(path)


def test_every_field_is_documented():
    rows = explain()
    assert {key for key, _, _ in rows} >= {"steps", "scaler.init_scale", "overrides.fp32_modules"}
    assert all(doc for _, _, doc in rows)


def test_shipped_configs_are_valid():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        assert isinstance(build_config(load_yaml(path)), DoctorConfig)
