"""The accounts engines and workers run as (reads the user and group databases).

`resolve_account` turns `[engine] user`/`group` into numeric ids once, at
start-up, so that a typo is a config error (exit 2) rather than a crash loop;
the daemon puts them on the child specs (`supervisor.run.spec.PlanSpecs`); the exec shim
then drops to them after binding, before exec.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass

from supervisor.config import Config
from supervisor.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Account:
    """A user to run a process as: ids for the shim, names for its environment."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, the primary one included
    home: str

    @property
    def shim_user(self) -> tuple[int, int, tuple[int, ...]]:
        return (self.uid, self.gid, self.groups)

    def env(self) -> dict[str, str]:
        """HOME, USER, LOGNAME of the account: the supervisor's would point at root's."""
        return {"HOME": self.home, "USER": self.user, "LOGNAME": self.user}


def resolve_account(user: str, group: str | None, where: str) -> Account:
    """Look `user` (a name or a number) and `group` up; ConfigError names `where`.

    Supplementary groups are the user's own (initgroups(3)): on AMD hosts
    /dev/kfd and /dev/dri/renderD* belong to `render`/`video`.
    """
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(f"{where}.user: no such user {user!r} on this host") from None
    gid = entry.pw_gid
    if group is not None:
        try:
            gid = grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"{where}.group: no such group {group!r} on this host") from None
    groups = sorted({gid, *os.getgrouplist(entry.pw_name, gid)})
    return Account(entry.pw_name, entry.pw_uid, gid, tuple(groups), entry.pw_dir)


def resolve_accounts(config: Config) -> dict[str, Account]:
    """{"engine": ..., "workers": ...} for the tables that name a user."""
    out: dict[str, Account] = {}
    for where, proc in (("engine", config.engine), ("workers", config.workers)):
        if proc is not None and proc.user is not None:
            out[where] = resolve_account(proc.user, proc.group, f"{config.path}: {where}")
    return out
