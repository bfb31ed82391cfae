"""Two supervisors on one host keep their per-process cgroups apart."""

from __future__ import annotations

from pathlib import Path

from supervisor.config import load_config
from supervisor.daemon.cgroups import INSTANCE_ENV, instance_suffix


def write(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[workers]\ncommand = ["w", "{rank}"]\n')
    return path


def test_each_config_gets_its_own_cgroup_instance(tmp_path: Path) -> None:
    a = load_config(str(write(tmp_path / "a" / "gpu0.toml")))
    b = load_config(str(write(tmp_path / "b" / "gpu0.toml")))
    # Same file name, different services: different dirs, named for a person to read.
    assert instance_suffix(a, {}) != instance_suffix(b, {})
    assert instance_suffix(a, {}).startswith("gpu0-")
    # A restarted supervisor with the same config finds its own dir again.
    assert instance_suffix(a, {}) == instance_suffix(load_config(str(tmp_path / "a/gpu0.toml")), {})


def test_the_environment_names_the_instance(tmp_path: Path) -> None:
    a = load_config(str(write(tmp_path / "gpu0.toml")))
    assert instance_suffix(a, {INSTANCE_ENV: "svc-a"}) == "svc-a"
    assert instance_suffix(a, {INSTANCE_ENV: ""}) == ""
