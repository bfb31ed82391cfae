"""The project's error hierarchy. No I/O.

User-facing errors carry the exit code of docs/contracts.md §1 and one message that
names the file, field or value. Kernel errors are translated once, at the
boundary (`translate_oserror`), into a small hierarchy with fields, so callers
decide by kind (gone, denied, invalid, managed IRQ) and never by errno.
"""

from __future__ import annotations

import errno as _errno

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_INFEASIBLE = 3
# `status` only: no daemon answers (1), or one answers but is not ready (4),
# so that a script can tell "down" from "still loading" (README, Exit codes).
EXIT_UNREACHABLE = 1
EXIT_NOT_READY = 4
EXIT_RELOAD_REFUSED = 5  # `reload`: a valid config that needs a restart


class SupervisorError(Exception):
    """Base of every error this package raises on purpose."""

    exit_code = 1


class ConfigError(SupervisorError):
    """A bad config file, field, or command-line argument (exit 2)."""

    exit_code = EXIT_CONFIG


class TopologyError(SupervisorError):
    """The host tree cannot be read or makes no sense (exit 3).

    `path` is the file under the host root that was missing or garbled.
    """

    exit_code = EXIT_INFEASIBLE

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class PlanError(SupervisorError):
    """No placement satisfies the settings on this topology (exit 3)."""

    exit_code = EXIT_INFEASIBLE


class KernelError(SupervisorError):
    """A syscall or kernel file refused an operation.

    `target` names what was acted on (e.g. "tid 4242", "/proc/irq/41"),
    `errno_name` the symbolic errno ("ESRCH").
    """

    reason = "error"

    def __init__(self, target: str, err: OSError) -> None:
        self.target = target
        self.errno = err.errno or 0
        self.errno_name = _errno.errorcode.get(self.errno, str(self.errno))
        super().__init__(f"{target}: {self.errno_name} ({err.strerror or err})")


class Gone(KernelError):
    """The process, thread or file no longer exists (ENOENT, ESRCH)."""

    reason = "gone"


class Denied(KernelError):
    """The kernel refused for lack of privilege (EPERM, EACCES, EROFS)."""

    reason = "denied"


class Invalid(KernelError):
    """The kernel rejected the value (EINVAL, e.g. CPUs outside the cpuset)."""

    reason = "invalid"


class ManagedIrq(KernelError):
    """A kernel-managed IRQ whose affinity cannot be set (EIO on write)."""

    reason = "managed"


_BY_ERRNO: dict[int, type[KernelError]] = {
    _errno.ENOENT: Gone,
    _errno.ESRCH: Gone,
    _errno.EPERM: Denied,
    _errno.EACCES: Denied,
    _errno.EROFS: Denied,
    _errno.EINVAL: Invalid,
    _errno.EIO: ManagedIrq,
}


def translate_oserror(target: str, err: OSError) -> KernelError:
    """Map an OSError to the domain hierarchy; unknown errnos become KernelError."""
    return _BY_ERRNO.get(err.errno or 0, KernelError)(target, err)


def reason_of_errno(number: int | None) -> str:
    """The metric `reason` (supervisor.state.BindReason) of an errno number: the
    one errno -> reason table, shared with `translate_oserror`. None: "error"."""
    return _BY_ERRNO.get(number or 0, KernelError).reason
