"""The guardian: ends the trees of a daemon that died unclean; leftovers at start (does I/O).

What the kernel offers, and what it does not:
- A direct child of the daemon gets SIGKILL when the daemon dies: the shim
  sets PR_SET_PDEATHSIG=KILL before exec (prctl(2)). That reaches only the
  child itself, never its descendants, and `setsid` does not matter to it.
- A descendant (torchrun's `start_new_session=True` workers, a worker's own
  child) has no such signal from us, and the kernel has no "kill my subtree
  when I die". So the daemon starts one small guardian process first, in a
  session of its own, holding the read end of a pipe whose only write end
  the daemon holds. The daemon tells it the cgroups and the processes of its
  trees as they change. When the daemon dies by any means (SIGKILL
  included), the kernel closes the write end, the guardian reads EOF and
  SIGKILLs every process in those cgroups (`cgroup.kill` where v2 has it)
  and every listed process still the same (pid + start time), then removes
  the cgroups, then puts the IRQs the daemon moved back from its checkpoint
  file (supervisor.bind.irq_checkpoint) and removes that. A clean stop writes
  "bye" first, and the guardian exits without killing.
- A guardian that dies alone is replaced within a check (`Guardian.replace_if_dead`,
  called by the daemon's guardian task): the new one is told everything the old
  one was.
- What cannot be covered: a SIGKILL of the guardian and the daemon together
  (`kill -9 -PGID` of both, the OOM killer taking both). The daemon's next
  start then ends what its instance's cgroups still hold (`sweep_leftovers`)
  and says so, and restores the IRQ checkpoint; processes without a cgroup
  are beyond reach then.
  Under systemd, KillMode=control-group also ends the unit's whole cgroup.

The guardian is `python -I -S -c GUARDIAN_STUB` (standard library only).
Protocol, one line each: "cgroup DIR" (it and every cgroup below it), "pid PID START",
"forget PID", "irqs PID PATH" (the IRQ checkpoint file that daemon PID writes), "bye".
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from supervisor.bind.cgroup import SUPERVISOR_LEAF, CgroupManager
from supervisor.bind.irq_checkpoint import restore_checkpoint
from supervisor.errors import KernelError
from supervisor.hostfs import HostFS
from supervisor.logs import format_fields, setup_logging
from supervisor.procfs.files import CMDLINE_HEAD_BYTES
from supervisor.procfs.identity import ProcessId
from supervisor.procfs.stat import read_proc_stat
from supervisor.procfs.walk import walk_host
from supervisor.trees.tree import read_cgroup_procs

log = logging.getLogger("placement_supervisor.guardian")

KILL_ROUNDS_S = 5.0  # keep killing (a fork racing the kill) for at most this long

GUARDIAN_TAG = "placement-supervisor-guardian"
GUARDIAN_STUB = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from supervisor.trees.guardian import guardian_main; guardian_main()"
)


# -- the guardian process (standard library only) ---------------------------------------


def kill_cgroup(directory: str, deadline: float) -> int:
    """SIGKILL everything in one cgroup until it is empty or `deadline`; returns kills sent."""
    kill_file = os.path.join(directory, "cgroup.kill")
    if os.path.exists(kill_file):  # cgroup v2, Linux 5.14: the kernel kills them all at once
        with contextlib.suppress(OSError), open(kill_file, "w") as f:
            f.write("1")
    sent = 0
    me = os.getpid()
    host = HostFS("/")  # `directory` is absolute
    while time.monotonic() < deadline:
        pids = [p for p in read_cgroup_procs(host, directory) if p != me]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                sent += 1
        time.sleep(0.01)  # a killed process leaves cgroup.procs once reaped
    return sent


def cgroup_tree(directory: str) -> list[str]:
    """`directory` and every cgroup below it, deepest first."""
    out: list[str] = []
    for parent, dirs, _files in os.walk(directory, topdown=False):
        out.extend(os.path.join(parent, d) for d in dirs)
    return [*out, directory] if os.path.isdir(directory) else out


def remove_cgroup_dir(directory: str, deadline: float) -> bool:
    while True:
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
        time.sleep(0.02)


def guardian_main() -> None:
    """Read orders from stdin until EOF; on EOF without "bye", kill the trees."""
    # The daemon's pid, from our argv (after the package root, the tag and the
    # instance): once it has died we are reparented (to init or a subreaper)
    # and getppid() names that instead, even at start if it died that soon.
    given = sys.argv[4] if len(sys.argv) > 4 else ""
    supervisor_pid = int(given) if given.isdigit() else os.getppid()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # only the daemon's death ends us
    cgroups: dict[str, None] = {}
    pids: dict[int, int] = {}
    checkpoint: tuple[int, str] | None = None  # (its writer's pid, its path)
    clean = False
    for raw in sys.stdin.buffer:
        line = raw.decode(errors="replace")
        words = line.split()
        if not words:
            continue
        if words[0] == "irqs" and len(words) >= 3 and words[1].isdigit():
            # The pid comes with it: a daemon may die before this process has
            # even started, and then our parent is no longer the writer.
            checkpoint = int(words[1]), line.rstrip("\n").split(" ", 2)[2]  # spaces in a path
            continue
        if words[0] == "bye":
            clean = True
            break
        if words[0] == "cgroup" and len(words) == 2:
            cgroups[words[1]] = None
        elif words[0] == "pid" and len(words) == 3:
            pids[int(words[1])] = int(words[2])
        elif words[0] == "forget" and len(words) == 2:
            pids.pop(int(words[1]), None)
    if clean:
        return
    deadline = time.monotonic() + KILL_ROUNDS_S
    killed = 0
    fs = HostFS("/")
    for pid, start in pids.items():
        if ProcessId(pid, start).send_signal(fs, signal.SIGKILL):
            killed += 1
    # Each named cgroup stands for its whole subtree (the instance dir: every
    # per-process cgroup below it, whenever it was made).
    dirs = [d for top in cgroups for d in cgroup_tree(top)]
    for directory in dirs:
        killed += kill_cgroup(directory, deadline)
    for directory in dirs:
        remove_cgroup_dir(directory, deadline)
    sys.stderr.write(
        f"guardian: supervisor gone pid={supervisor_pid} killed={killed} "
        f"cgroups={len(cgroups)} action=ended its trees\n"
    )
    if checkpoint is not None:
        restore_irqs(checkpoint[1], checkpoint[0])


def restore_irqs(checkpoint: str, daemon: int) -> None:
    """The dead daemon's IRQs back from its checkpoint (only its own: `daemon` wrote it)."""
    setup_logging()
    try:
        restore_checkpoint(HostFS("/"), checkpoint, owner=daemon)
    except Exception as err:  # the guardian's last act: say it, never a traceback
        sys.stderr.write(f"guardian: irq restore failed path={checkpoint} error={err!r}\n")


# -- the daemon's side ----------------------------------------------------------------


class Guardian:
    """The daemon's handle on its guardian process; every call is best effort.

    It keeps what it told the guardian (cgroups, members with their start
    times, the IRQ checkpoint): a guardian that died (SIGKILLed, the OOM killer)
    is replaced by `replace_if_dead` and the new one told all of it, so a later
    death of the daemon still ends every tree. The tree keeper's thread tells it
    members while the check loop's executor may replace it: one lock."""

    def __init__(self, proc: subprocess.Popen[bytes], argv: list[str] | None = None) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.argv = argv or []
        self._sent_pids: dict[int, int] = {}  # pid -> start time
        self._cgroups: dict[str, None] = {}  # in the order told
        self._irqs: tuple[int, str] | None = None  # (writer, path)
        self._lock = threading.Lock()
        self.replaced = 0

    @classmethod
    def start(cls, python: str = sys.executable, instance: str = "") -> Guardian | None:
        """Start it (its own session: a signal to the daemon's group does not reach it).

        `instance` (the instance cgroup dir) is only shown in its argv: a
        daemon that starts with the same instance sees this one is alive
        (`live_guardian`) and leaves its cgroups alone."""
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        argv = [
            python,
            "-I",
            "-S",
            "-c",
            GUARDIAN_STUB,
            package_root,
            GUARDIAN_TAG,
            instance,
            str(os.getpid()),
        ]
        proc = _spawn(argv)
        return None if proc is None else cls(proc, argv)

    def _send(self, line: str) -> None:
        stdin = self.proc.stdin
        if stdin is None:
            return
        try:
            os.write(stdin.fileno(), (line + "\n").encode())
        except OSError as err:  # full (65 KiB of orders) or the guardian died
            log.warning("guardian write failed %s", format_fields(error=err, action="skip"))

    def cgroup(self, directory: str) -> None:
        with self._lock:
            if directory not in self._cgroups:
                self._cgroups[directory] = None
                self._send(f"cgroup {directory}")

    def process(self, ident: ProcessId) -> None:
        with self._lock:
            if ident.pid not in self._sent_pids:
                self._sent_pids[ident.pid] = ident.start_time
                self._send(f"pid {ident.pid} {ident.start_time}")

    def irq_checkpoint(self, path: str, writer: int) -> None:
        """The IRQ checkpoint file that `writer` (the daemon's pid) keeps: restored by
        the guardian if the daemon dies unclean."""
        with self._lock:
            self._irqs = (writer, path)
            self._send(f"irqs {writer} {path}")

    def forget(self, pid: int) -> None:
        with self._lock:
            if self._sent_pids.pop(pid, None) is not None:
                self._send(f"forget {pid}")

    def replace_if_dead(self) -> int | None:
        """When the guardian has died: log it, start a new one and tell it every
        cgroup, member and IRQ checkpoint the old one knew. Returns the dead one's
        pid (None while it lives). A failed start is logged and tried again at
        the next call: until then a death of the daemon ends no tree."""
        with self._lock:
            code = self.proc.poll()  # reaps it: our own child
            if code is None or not self.argv:
                return None
            old = self.pid
            log.warning(
                "guardian gone %s",
                format_fields(pid=old, returncode=code, action="start a new one"),
            )
            proc = _spawn(self.argv)
            if proc is None:
                return old
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            self.proc, self.pid = proc, proc.pid
            self.replaced += 1
            for directory in self._cgroups:
                self._send(f"cgroup {directory}")
            for pid, start in self._sent_pids.items():
                self._send(f"pid {pid} {start}")
            if self._irqs is not None:
                self._send(f"irqs {self._irqs[0]} {self._irqs[1]}")
            log.warning(
                "guardian replaced %s",
                format_fields(
                    old=old,
                    pid=proc.pid,
                    cgroups=len(self._cgroups),
                    pids=len(self._sent_pids),
                    irqs=self._irqs is not None,
                    action="told what the old one knew",
                ),
            )
            return old

    def close(self, timeout_s: float = 5.0) -> None:
        """A clean stop: "bye", close the pipe, reap the guardian."""
        self._send("bye")
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _spawn(argv: list[str]) -> subprocess.Popen[bytes] | None:
    """The guardian process: its own session, the read end of a pipe as stdin."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
        )
    except OSError as err:
        log.warning("guardian not started %s", format_fields(error=err, action="degrade"))
        return None
    assert proc.stdin is not None
    os.set_blocking(proc.stdin.fileno(), False)
    return proc


# -- leftovers of an earlier instance --------------------------------------------------


def live_guardian(fs: HostFS, instance: str) -> tuple[int, int] | None:
    """(guardian pid, daemon pid) of a daemon still running with `instance`, else None.

    A guardian whose daemon died is reparented (to init or a subreaper): then
    its parent no longer runs the supervisor, and what it guards is leftover.
    Every process of the host is looked at by the head of its command line (a
    guardian's is short; anyone's may be megabytes), and one that cannot be read
    is skipped and counted (`walk_host`): no process of another user stops a start.
    """
    for pid, words in walk_host(fs, "guardian search", lambda pid: _cmdline_words(fs, pid)):
        if GUARDIAN_TAG not in words or instance not in words:
            continue
        stat = read_proc_stat(fs, pid)
        ppid = stat.ppid if stat is not None else 0
        parent: list[str] = []
        if ppid > 1:
            with contextlib.suppress(KernelError):  # its parent unreadable: not our daemon
                parent = _cmdline_words(fs, ppid) or []
        if "supervisor" in " ".join(parent) and "run" in parent:
            return pid, ppid
    return None


def _cmdline_words(fs: HostFS, pid: int) -> list[str] | None:
    """The NUL-separated words of the head of `pid`'s command line; None when gone."""
    raw = fs.read_head(f"proc/{pid}/cmdline", CMDLINE_HEAD_BYTES, f"pid {pid}")
    return None if raw is None else raw.decode("utf-8", "replace").split("\0")


def sweep_leftovers(manager: CgroupManager, timeout_s: float = 5.0) -> list[str]:
    """End the processes in, and remove, the per-process cgroups an earlier
    instance of this config left behind (it died with its guardian). Logs each.

    Call after `manager.prepare()` and before anything is spawned: every
    per-process dir under the instance dir is then a leftover. Returns the
    dirs found (relative to the HostFS root).
    """
    fs: HostFS = manager.fs
    found: list[str] = []
    deadline = time.monotonic() + timeout_s
    instance = fs.path(manager.instance_dirs[0])
    live = live_guardian(fs, instance)
    if live is not None:
        # Another daemon of this config runs now: its processes are not leftovers.
        log.warning(
            "instance in use %s",
            format_fields(cgroup=instance, daemon=live[1], guardian=live[0], action="no sweep"),
        )
        return found
    for inst in manager.instance_dirs:
        try:
            names = fs.listdir(inst)
        except OSError:
            continue
        for name in sorted(names):
            rel = f"{inst}/{name}"
            if name == SUPERVISOR_LEAF or not fs.is_dir(rel):
                continue
            found.append(rel)
            path = fs.path(rel)
            pids = read_cgroup_procs(fs, rel)
            if pids:
                log.warning(
                    "leftover processes %s",
                    format_fields(
                        cgroup=path,
                        pids=",".join(map(str, pids)),
                        action="kill (an earlier instance of this config left them)",
                    ),
                )
                kill_cgroup(path, deadline)
            removed = remove_cgroup_dir(path, deadline)
            log.warning(
                "leftover cgroup %s",
                format_fields(
                    cgroup=path, processes=len(pids), action="removed" if removed else "kept (busy)"
                ),
            )
    return found
