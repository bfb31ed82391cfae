"""The instance lock on real files: one holder, the holder's pid in the refusal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.daemon.instance_lock import (
    InstanceBusy,
    hold_instance_lock,
    lock_name,
    runtime_dirs,
)


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    env = {"RUNTIME_DIRECTORY": str(tmp_path)}
    with hold_instance_lock("gpu0-1234abcd", env, "c.toml") as held:
        assert Path(held.path) == tmp_path / "gpu0-1234abcd.lock"
        assert Path(held.path).read_text() == f"{os.getpid()}\n"
        # flock(2) locks belong to the open file: a second open conflicts even here.
        with pytest.raises(
            InstanceBusy, match=f"c.toml: another daemon \\(pid {os.getpid()}\\)"
        ) as busy:
            hold_instance_lock("gpu0-1234abcd", env, "c.toml")
        assert busy.value.exit_code == 2 and busy.value.pid == os.getpid()
        with hold_instance_lock("other", env, "d.toml"):  # another instance is free
            pass
    assert not (tmp_path / "gpu0-1234abcd.lock").exists()
    with hold_instance_lock("gpu0-1234abcd", env, "c.toml"):  # free again once released
        pass


def test_an_unusable_runtime_dir_falls_back_to_the_next(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    env = {"RUNTIME_DIRECTORY": f"{not_a_dir}:{tmp_path}/second"}
    assert runtime_dirs(env)[0] == str(not_a_dir)
    with hold_instance_lock("x", env, "c.toml") as held:
        assert not held.path.startswith(str(not_a_dir))


def test_lock_names_are_safe_file_names() -> None:
    assert lock_name("") == "default.lock"
    assert lock_name("svc-a_1.2") == "svc-a_1.2.lock"
    odd = lock_name("../etc/passwd")
    assert "/" not in odd and odd != lock_name("__etc_passwd") and not odd.startswith(".")
