"""Config parsing, overrides and every rejection path."""

import pytest

from hvdtrain.config import (
    Config,
    apply_overrides,
    env_overrides,
    load_config,
    save_config,
)
from hvdtrain.errors import ConfigError

CONFIG = "configs/digits_torch.yaml"


def test_yaml_and_overrides_are_typed():
    cfg = load_config(CONFIG, ["train.epochs=3", "optim.lr=0.1", "model.options.hidden=[64, 32]"],
                      environ={})
    assert cfg.train.epochs == 3
    assert cfg.optim.lr == 0.1 and isinstance(cfg.optim.lr, float)
    assert cfg.model.options == {"hidden": [64, 32]}
    assert cfg.framework == "torch" and cfg.data.name == "digits"


def test_int_and_exponent_notation_are_accepted_where_a_float_is_wanted():
    assert load_config(CONFIG, ["optim.lr=1"], environ={}).optim.lr == 1.0
    assert load_config(CONFIG, ["optim.lr=1e-3"], environ={}).optim.lr == 0.001


def test_env_sits_between_yaml_and_cli():
    env = {"HVDTRAIN_TRAIN__EPOCHS": "4", "HVDTRAIN_OPTIM__LR": "0.2", "PATH": "/bin"}
    assert env_overrides(env) == ["optim.lr=0.2", "train.epochs=4"]
    cfg = load_config(CONFIG, ["train.epochs=5"], environ=env)
    assert cfg.train.epochs == 5 and cfg.optim.lr == 0.2


def test_defaults_without_a_file():
    cfg = load_config(None, [], environ={})
    assert cfg == Config()
    assert str(cfg.run_dir) == "runs/run"


@pytest.mark.parametrize("override, message", [
    ("optim.lr=abc", "optim.lr='abc': expected a number"),
    ("train.epochs=1.5", "train.epochs=1.5: expected an integer"),
    ("train.epochs=0", "train.epochs=0: must be >= 1"),
    ("optim.momentum=1.5", "optim.momentum=1.5: must be <= 1.0"),
    ("optim.name=lamb", "optim.name='lamb': must be one of sgd, adam, adamw"),
    ("framework=jax", "framework='jax': must be one of torch, tensorflow"),
    ("optim.scale_lr=1", "optim.scale_lr=1: expected true or false"),
    ("model.options=3", "model.options=3: expected a mapping"),
    ("data=3", "data=3: expected a mapping of keys"),
    ("optim.lrr=0.1", "unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
    ("trian.epochs=3", "unknown key 'trian'; did you mean 'train'?"),
    ("zzz=1", "unknown key 'zzz'; known keys under the top level: checkpoint, comm, data"),
    ("train.epochs", "override 'train.epochs': expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
])
def test_rejections_name_key_value_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [override], environ={})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping of keys at the top, got list"):
        load_config(bad, ["train.epochs=2"], environ={})


def test_unknown_key_inside_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epocs: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.epocs'; did you mean 'train.epochs'"):
        load_config(path, environ={})


def test_override_fills_an_empty_yaml_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\nmodel: {}\n")
    cfg = load_config(path, ["train.epochs=2", "model.options.hidden=[8]"], environ={})
    assert cfg.train.epochs == 2 and cfg.model.options == {"hidden": [8]}


def test_override_cannot_descend_into_a_value():
    with pytest.raises(ConfigError, match=r"optim.lr.x: cannot set a key inside a float"):
        apply_overrides({"optim": {"lr": 0.1}}, ["optim.lr.x=1"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CONFIG, ["train.epochs=2"], environ={})
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml", environ={}) == cfg


def _dotted_keys(obj, prefix=""):
    import dataclasses
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _dotted_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def test_config_reference_matches_the_code():
    import re
    from pathlib import Path
    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    keys = dict(_dotted_keys(Config()))
    for key, default in keys.items():
        shown = str(default).lower() if isinstance(default, bool) else (default or repr(default))
        row = f"| `{key}` | `{shown}` |".replace("`''`", '`""`')
        assert row in page, f"docs/configuration.md lacks or mis-states {row}"
    documented = re.findall(r"^\| `([\w.]+)` \| `", page, flags=re.MULTILINE)
    assert sorted(set(documented) - set(keys)) == [], "docs/configuration.md documents keys the code lacks"
    assert len(documented) == len(set(documented)), "docs/configuration.md documents a key twice"


def test_the_two_framework_configs_differ_only_in_framework_and_name():
    torch_cfg = load_config(CONFIG, environ={}).to_dict()
    tf_cfg = load_config("configs/digits_tf.yaml", environ={}).to_dict()
    assert (torch_cfg.pop("framework"), tf_cfg.pop("framework")) == ("torch", "tensorflow")
    assert (torch_cfg.pop("name"), tf_cfg.pop("name")) == ("digits_torch", "digits_tf")
    assert torch_cfg == tf_cfg
