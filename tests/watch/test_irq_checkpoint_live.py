"""The IRQ checkpoint with a real daemon on this machine's real /proc/irq (root).

The daemon binds virtio3's MSI-X IRQs (0000:00:04.0, IRQs 40-43 here: they
accept affinity writes) to its rank's irq CPU, then ends clean or unclean; the
host's own affinities must come back either way. Every test first moves them
to a known value (tests/support/real_irqs.py: never the daemon's, and never
assumed from what another run left) and puts the values from before back in
a finalizer, even when it fails half-way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.bind.irq_checkpoint import read_boot_id, restore_checkpoint
from supervisor.bind.irq_checkpoint_data import IrqCheckpointData, format_checkpoint
from supervisor.cpulist import format_cpulist, parse_cpulist
from supervisor.hostfs import HostFS
from supervisor.trees.guardian import GUARDIAN_TAG, KILL_ROUNDS_S
from tests.support.daemon_support import (
    INSTANCE_ENV,
    DaemonProcess,
    daemon_env,
)
from tests.support.poll import poll
from tests.support.real_irqs import affinity, known_irqs, write_affinity

DEVICE = "0000:00:04.0"
STOP_TIMEOUT_S = 5
# After the daemon's death its guardian kills what is left for at most
# KILL_ROUNDS_S (a worker's own stop at most STOP_TIMEOUT_S), then writes the IRQs
# back and unlinks the checkpoint in one call: twice that on a loaded host.
GUARDIAN_DONE_S = 2 * (KILL_ROUNDS_S + STOP_TIMEOUT_S)


@pytest.fixture
def originals(need_root: None) -> Iterator[dict[int, str]]:
    """The device's IRQs moved to a known value (all our CPUs, never the daemon's
    one irq CPU) under the host-wide test IRQ lock: the affinity each starts the
    test with, which the daemon must give back. The values from before the test
    are put back afterwards."""
    path = f"/sys/bus/pci/devices/{DEVICE}/msi_irqs"
    if not os.path.isdir(path):
        pytest.skip(f"{DEVICE} is not on this machine")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: the irq role's and another to move the IRQs from")
    with known_irqs(int(n) for n in os.listdir(path)) as start:
        yield start


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "irqs.toml"
    path.write_text(
        f'devices = ["{DEVICE}"]\n'
        'accelerator = "pci"\n'
        f"stop_timeout_s = {STOP_TIMEOUT_S}\n"
        'cgroup = "off"\n'
        "[workers]\n"
        'command = ["python", "-c", "import time; time.sleep(3600)"]\n'
        "[placement]\n"
        "rank_roles = { irq = 1 }\n"
        'on_shortage = "merge"\n'
        "[placement.engine]\n"
        "enabled = false\n"
    )
    return path


def _setup(tmp_path: Path, name: str) -> tuple[Path, dict[str, str], Path]:
    """Config, environment (own instance and state dir), and the checkpoint's path."""
    state = tmp_path / "state"
    instance = f"irqckpt-{name}-{os.getpid()}"
    env = daemon_env(**{INSTANCE_ENV: instance, "STATE_DIRECTORY": str(state)})
    return _config(tmp_path), env, state / f"{instance}.irqs.json"


def _bound(d: DaemonProcess, irqs: dict[int, str]) -> str | None:
    """The daemon's irq CPUs once every IRQ is on them and its rank runs, else None."""
    doc = d.running()
    if doc is None:
        return None
    cpus = format_cpulist(doc["ranks"][0]["roles"]["irq"])
    return cpus if all(affinity(irq) == cpus for irq in irqs) else None


def _guardian_of(pid: int) -> int:
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and GUARDIAN_TAG in cmdline.split("\0"):
            return int(name)
    raise AssertionError(f"no guardian under pid {pid}")


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _moved(originals: dict[int, str], cpus: str) -> None:
    """The test can fail: the daemon's value differs from the host's."""
    assert any(parse_cpulist(v) != parse_cpulist(cpus) for v in originals.values()), (
        f"IRQs already on {cpus}: nothing to tell apart"
    )


def test_both_killed_the_next_start_restores_the_hosts_originals(
    tmp_path: Path, originals: dict[int, str]
) -> None:
    """SIGKILL of the daemon and its guardian leaves our IRQ values; the next start
    puts the host's back first and takes those, not ours, as the originals."""
    config, env, checkpoint = _setup(tmp_path, "both")
    with DaemonProcess(config, tmp_path / "first.log", env=env) as first:
        cpus = poll(lambda: _bound(first, originals), timeout_s=60, what="IRQs bound")
        _moved(originals, cpus)
        guardian = _guardian_of(first.pid)
        os.kill(guardian, signal.SIGKILL)
        poll(lambda: _dead(guardian), timeout_s=20, what="the guardian dead")
        first.proc.kill()
        first.proc.wait()
    assert {irq: affinity(irq) for irq in originals} == dict.fromkeys(originals, cpus)
    left = checkpoint.exists()

    with DaemonProcess(config, tmp_path / "second.log", env=env) as second:
        poll(lambda: _bound(second, originals), timeout_s=60, what="IRQs bound again")
        log = second.tail(20000)
        code = second.stop()
    assert code == 0, log
    # The host's own values, not the first daemon's (which today's second start
    # took for the originals and "restored").
    assert {irq: affinity(irq) for irq in originals} == originals, log
    assert left and "irq checkpoint restored" in log and f"pid={first.pid}" in log, log
    assert not checkpoint.exists()


def test_daemon_killed_the_guardian_restores_the_originals(
    tmp_path: Path, originals: dict[int, str]
) -> None:
    config, env, checkpoint = _setup(tmp_path, "guardian")
    with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
        cpus = poll(lambda: _bound(d, originals), timeout_s=60, what="IRQs bound")
        _moved(originals, cpus)
        d.proc.kill()
        d.proc.wait()

        def put_back() -> bool:
            return {irq: affinity(irq) for irq in originals} == originals

        poll(put_back, timeout_s=GUARDIAN_DONE_S, what=f"originals back: {d.tail()}")
        poll(lambda: not checkpoint.exists(), timeout_s=GUARDIAN_DONE_S, what="checkpoint removed")
        assert "irq checkpoint restored" in d.tail(), d.tail()


def test_clean_stop_restores_and_leaves_no_checkpoint(
    tmp_path: Path, originals: dict[int, str]
) -> None:
    config, env, checkpoint = _setup(tmp_path, "clean")
    with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
        cpus = poll(lambda: _bound(d, originals), timeout_s=60, what="IRQs bound")
        _moved(originals, cpus)
        doc = json.loads(checkpoint.read_text())
        assert doc["pid"] == d.pid and doc["boot_id"] == read_boot_id(HostFS("/"))
        assert doc["irqs"] == {str(irq): cpus for irq, cpus in originals.items()}
        code = d.stop()
    assert code == 0, d.tail()
    assert {irq: affinity(irq) for irq in originals} == originals
    assert not checkpoint.exists()
    assert list(checkpoint.parent.iterdir()) == []  # no temp file either


def test_a_checkpoint_of_another_boot_is_ignored_with_a_line(
    tmp_path: Path, originals: dict[int, str]
) -> None:
    config, env, checkpoint = _setup(tmp_path, "boot")
    irq = next(iter(originals))
    stale = "1" if originals[irq] != "1" else "0"  # a value the host does not have now
    checkpoint.parent.mkdir(parents=True)
    data = IrqCheckpointData("not-this-boot", 1, {irq: parse_cpulist(stale)})
    checkpoint.write_text(format_checkpoint(data))
    with DaemonProcess(config, tmp_path / "d.log", env=env) as d:
        poll(lambda: _bound(d, originals), timeout_s=60, what="IRQs bound")
        code = d.stop()
    log = d.log.read_text()
    assert code == 0, log
    lines = [line for line in log.splitlines() if "irq checkpoint" in line]
    assert len(lines) == 1 and "irq checkpoint discarded" in lines[0], lines
    assert 'reason="other boot"' in lines[0] and "boot_id=not-this-boot" in lines[0]
    # Had it been applied, the daemon would have taken `stale` for the original.
    assert affinity(irq) == originals[irq] != stale
    assert not checkpoint.exists()


def test_a_checkpoint_that_no_longer_fits_is_applied_as_far_as_it_fits(
    tmp_path: Path, originals: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """On the real /proc/irq: one IRQ gone (no such IRQ), one whose original names a
    CPU that is not online: that one gets its online part, with one log line."""
    fs = HostFS("/")
    online = parse_cpulist(fs.read_text("sys/devices/system/cpu/online"))
    offline = max(online) + 1
    irq = next(iter(originals))
    keep = min(online)
    absent = max(int(n) for n in os.listdir("/proc/irq") if n.isdigit()) + 1000
    path = tmp_path / "c.irqs.json"
    data = IrqCheckpointData(
        read_boot_id(fs), 1, {irq: frozenset({keep, offline}), absent: frozenset({keep})}
    )
    path.write_text(format_checkpoint(data))
    write_affinity(irq, str(max(online)))
    with caplog.at_level("INFO", logger="placement_supervisor"):
        report = restore_checkpoint(fs, str(path))
    assert report is not None and report.restored == (irq,)
    assert affinity(irq) == str(keep)
    misfit = [r.getMessage() for r in caplog.records if "misfit" in r.getMessage()]
    assert len(misfit) == 1, misfit
    assert f"irqs_gone={absent}" in misfit[0] and f"cpus_offline={offline}" in misfit[0]
    assert not path.exists()


# -- issue 30 item 7: the originals are the host's, not one instance's -------------------


def _two(tmp_path: Path) -> tuple[Path, dict[str, str], dict[str, str]]:
    """One config, two instances sharing one state directory (as two units of one host)."""
    state = tmp_path / "state"
    env_a = daemon_env(**{INSTANCE_ENV: f"irqa-{os.getpid()}", "STATE_DIRECTORY": str(state)})
    env_b = daemon_env(**{INSTANCE_ENV: f"irqb-{os.getpid()}", "STATE_DIRECTORY": str(state)})
    return _config(tmp_path), env_a, env_b


@pytest.mark.parametrize("first_to_stop", ["a", "b"])
def test_two_instances_on_one_device_leave_the_hosts_values_in_any_stop_order(
    tmp_path: Path, originals: dict[int, str], first_to_stop: str
) -> None:
    """A binds the device's IRQs, B starts and binds them too (B reads A's value);
    both stop cleanly, in either order: the host's own values come back (before,
    B recorded A's moved value as its original and, stopping last, wrote it)."""
    config, env_a, env_b = _two(tmp_path)
    with DaemonProcess(config, tmp_path / "a.log", env=env_a) as a:
        cpus = poll(lambda: _bound(a, originals), timeout_s=60, what="A's IRQs bound")
        _moved(originals, cpus)
        # B starts once A has moved them: what B reads first is A's value.
        with DaemonProcess(config, tmp_path / "b.log", env=env_b) as b:
            poll(lambda: _bound(b, originals), timeout_s=60, what="B's IRQs bound")
            first, last = (a, b) if first_to_stop == "a" else (b, a)
            assert first.stop() == 0, first.tail()
            assert last.stop() == 0, last.tail()
    assert {irq: affinity(irq) for irq in originals} == originals, (a.tail(), b.tail())
    assert list((tmp_path / "state").glob("*.irqs.json")) == []  # both checkpoints gone


def test_a_full_state_dir_moves_no_irq_and_reports_the_capability(
    tmp_path: Path, originals: dict[int, str]
) -> None:
    """A state directory with no room: the checkpoint cannot be written, so no IRQ
    is moved (before: bound with the originals in memory only, one warning), and
    /placement's irq capability says why."""
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(state)], check=True
    )
    try:
        fd = os.open(state / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
        try:  # the file system full: written until ENOSPC
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * 4096):
                    pass
        finally:
            os.close(fd)
        env = daemon_env(**{INSTANCE_ENV: f"irqfull-{os.getpid()}", "STATE_DIRECTORY": str(state)})
        with DaemonProcess(_config(tmp_path), tmp_path / "d.log", env=env) as d:
            doc = poll(d.running, timeout_s=60, what="the rank running")
            cap = doc["supervisor"]["capabilities"]["irq"]
            assert cap["available"] is False and "irq checkpoint cannot be written" in cap["reason"]
            # A few passes of the check loop (enforce would re-bind): nothing moved.
            checks = d.get("/healthz")["checks"]
            poll(lambda: d.get("/healthz")["checks"] >= checks + 3, 30, what="three passes")
            assert {irq: affinity(irq) for irq in originals} == originals, d.tail()
            assert d.stop() == 0, d.tail()
    finally:
        subprocess.run(["umount", str(state)], check=False)
    assert {irq: affinity(irq) for irq in originals} == originals
