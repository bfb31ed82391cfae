"""The IRQ checkpoint: its format and fit rules (table tests), its file, and
restoring it on a host tree of plain files (boot id, online CPUs, proc/irq)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from pathlib import Path

import pytest

from supervisor.bind.irq import IrqBinder
from supervisor.bind.irq_checkpoint import (
    CheckpointUnwritable,
    IrqCheckpoint,
    restore_checkpoint,
)
from supervisor.bind.irq_checkpoint_data import (
    CheckpointError,
    IrqCheckpointData,
    _checksum,
    format_checkpoint,
    misfit_fields,
    parse_checkpoint,
    plan_restore,
)
from supervisor.daemon.state_dir import irq_checkpoint_name, irq_checkpoint_path, state_dirs
from supervisor.hostfs import HostFS
from tests.support.poll import poll

BOOT = "4cae50d6-cca6-4a55-bee8-e690cd2dbebd"
DATA = IrqCheckpointData(BOOT, 4242, {41: frozenset({0, 1}), 42: frozenset({2, 3})})


# -- format and parse ---------------------------------------------------------------------


def test_format_parse_round_trip() -> None:
    text = format_checkpoint(DATA)
    doc = json.loads(text)
    assert doc["version"] == 1 and doc["boot_id"] == BOOT and doc["pid"] == 4242
    assert doc["irqs"] == {"41": "0-1", "42": "2-3"}
    assert doc["checksum"].startswith("sha256:")
    back = parse_checkpoint(text)
    assert (back.boot_id, back.pid, dict(back.originals)) == (BOOT, 4242, dict(DATA.originals))


def _edited(**changes: object) -> str:
    """DATA's file with fields changed and the checksum left as it was."""
    doc = json.loads(format_checkpoint(DATA))
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "not JSON"),
        ('{"version": 1, "boot_id": "x", "irqs": {"41": "0-1"', "not JSON"),  # torn
        ("[1, 2]", "not a JSON object"),
        (_edited(version=2), "version 2"),
        (_edited(irqs={"41": "0"}), "checksum mismatch"),  # edited by hand
        (_edited(boot_id="another"), "checksum mismatch"),
        (_edited(checksum="sha256:00"), "checksum mismatch"),
        (format_checkpoint(DATA).replace('"checksum"', '"checksun"'), "checksum mismatch"),
    ],
)
def test_garbled_checkpoints_are_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(CheckpointError, match=why):
        parse_checkpoint(text)


def _signed(body: dict[str, object]) -> str:
    """A file with a correct checksum over whatever `body` holds (a bug's, not a disk's)."""
    return json.dumps({**body, "checksum": _checksum(body)})


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"version": 1, "boot_id": BOOT, "pid": 1, "irqs": {"x": "0"}}, "irq entry 'x'"),
        ({"version": 1, "boot_id": BOOT, "pid": 1, "irqs": {"41": "0-"}}, "irq 41"),
        ({"version": 1, "boot_id": BOOT, "pid": 1, "irqs": {"41": 3}}, "irq entry '41'"),
        ({"version": 1, "boot_id": 7, "pid": 1, "irqs": {}}, "wrong type"),
        ({"version": 1, "boot_id": BOOT, "pid": 1, "irqs": {}, "extra": 1}, "fields"),
    ],
)
def test_well_signed_but_malformed_checkpoints_are_refused(
    body: dict[str, object], why: str
) -> None:
    with pytest.raises(CheckpointError, match=why):
        parse_checkpoint(_signed(body))


# -- what still fits ---------------------------------------------------------------------------


ALL = frozenset(range(4))


Fit = tuple[dict[int, set[int]], tuple[int, ...], dict[int, set[int]], tuple[int, ...]]


@pytest.mark.parametrize(
    ("irqs", "online", "expected"),  # expected: writes, gone, narrowed (offline CPUs), unfit
    [
        ({41, 42}, ALL, ({41: {0, 1}, 42: {2, 3}}, (), {}, ())),  # fits
        ({41, 42}, None, ({41: {0, 1}, 42: {2, 3}}, (), {}, ())),  # online unknown
        ({41}, ALL, ({41: {0, 1}}, (42,), {}, ())),  # IRQ 42 gone
        ({41, 42}, frozenset({0, 1, 2}), ({41: {0, 1}, 42: {2}}, (), {42: {3}}, ())),
        ({41, 42}, frozenset({0, 1}), ({41: {0, 1}}, (), {}, (42,))),  # none of 42's online
        (set(), ALL, ({}, (41, 42), {}, ())),  # every IRQ gone
    ],
)
def test_plan_restore_applies_as_far_as_it_fits(
    irqs: set[int], online: frozenset[int] | None, expected: Fit
) -> None:
    writes, gone, narrowed, unfit = expected
    plan = plan_restore(DATA, boot_id=BOOT, irqs=irqs, online_cpus=online)
    assert not plan.other_boot
    assert dict(plan.writes) == {k: frozenset(v) for k, v in writes.items()}
    assert (plan.gone, plan.unfit) == (gone, unfit)
    assert dict(plan.narrowed) == {k: frozenset(v) for k, v in narrowed.items()}
    assert plan.fits == (not gone and not narrowed and not unfit)


def test_a_checkpoint_of_another_boot_writes_nothing() -> None:
    plan = plan_restore(DATA, boot_id="another", irqs={41, 42}, online_cpus=ALL)
    assert plan.other_boot and dict(plan.writes) == {}


def test_misfit_is_one_line_naming_everything_that_did_not_fit() -> None:
    plan = plan_restore(DATA, boot_id=BOOT, irqs={42}, online_cpus=frozenset({2}))
    assert misfit_fields(plan) == {
        "irqs_gone": "41",
        "irqs_narrowed": "42",
        "cpus_offline": "3",
        "irqs_unfit": None,
        "action": "applied as far as it fits",
    }
    fitting = plan_restore(DATA, boot_id=BOOT, irqs={41, 42}, online_cpus=ALL)
    assert misfit_fields(fitting) is None


# -- the file ------------------------------------------------------------------------------------


def test_checkpoint_file_adds_only_new_irqs_and_goes_when_empty(tmp_path: Path) -> None:
    path = tmp_path / "x.irqs.json"
    cp = IrqCheckpoint(str(path), BOOT, pid=7)
    cp.add({41: {0, 1}})
    cp.add({41: {0}, 42: {1}})  # 41 keeps its first original
    data = parse_checkpoint(path.read_text())
    assert dict(data.originals) == {41: frozenset({0, 1}), 42: frozenset({1})}
    assert data.pid == 7 and data.boot_id == BOOT
    assert [p.name for p in tmp_path.iterdir()] == ["x.irqs.json"]  # no temp file left
    cp.discard([41])
    assert dict(parse_checkpoint(path.read_text()).originals) == {42: frozenset({1})}
    cp.discard([42])
    assert not path.exists()


def test_an_unwritable_state_dir_keeps_nothing_and_says_why(tmp_path: Path) -> None:
    # Issue 30 item 7: an original kept in memory only is lost to a SIGKILL, so
    # `add` refuses (the binder then moves no IRQ) instead of warning and going on.
    cp = IrqCheckpoint(str(tmp_path / "missing" / "x.irqs.json"), BOOT)
    with pytest.raises(CheckpointUnwritable, match=r"missing/x\.irqs\.json"):
        cp.add({41: {0}})
    assert 41 not in cp
    assert cp.probe() is not None and "missing" in (cp.probe() or "")


def test_state_dir_and_name() -> None:
    assert state_dirs({"STATE_DIRECTORY": "/a:/b"})[:2] == ["/a", "/var/lib/placement-supervisor"]
    assert state_dirs({})[0] == "/var/lib/placement-supervisor"
    assert irq_checkpoint_name("") == "default.irqs.json"
    assert irq_checkpoint_name("gpu-a") == "gpu-a.irqs.json"
    assert irq_checkpoint_name("a/b").startswith("a_b-")  # as the instance lock names it


def test_checkpoint_path_uses_state_directory(tmp_path: Path) -> None:
    path = irq_checkpoint_path("inst", {"STATE_DIRECTORY": str(tmp_path / "s")})
    assert path == str(tmp_path / "s" / "inst.irqs.json")
    assert (tmp_path / "s").is_dir()


# -- restoring on a host tree ---------------------------------------------------------------


def _host(tmp_path: Path, affinity: dict[int, str], online: str = "0-3") -> HostFS:
    root = tmp_path / "host"
    for irq, cpus in affinity.items():
        d = root / f"proc/irq/{irq}"
        d.mkdir(parents=True)
        (d / "smp_affinity_list").write_text(cpus + "\n")
    (root / "proc/sys/kernel/random").mkdir(parents=True)
    (root / "proc/sys/kernel/random/boot_id").write_text(BOOT + "\n")
    (root / "sys/devices/system/cpu").mkdir(parents=True)
    (root / "sys/devices/system/cpu/online").write_text(online + "\n")
    return HostFS(str(root))


def _affinities(fs: HostFS, *irqs: int) -> dict[int, str]:
    return {i: fs.read_text(f"proc/irq/{i}/smp_affinity_list").strip() for i in irqs}


def test_binder_saves_the_original_before_its_first_write(tmp_path: Path) -> None:
    fs = _host(tmp_path, {41: "0-3", 42: "0-3"})
    path = tmp_path / "c.json"
    binder = IrqBinder(fs, IrqCheckpoint(str(path), BOOT))
    binder.bind(41, {1})
    assert dict(parse_checkpoint(path.read_text()).originals) == {41: frozenset(range(4))}
    binder.bind(41, {2})  # a second write keeps the first original
    binder.save_originals([41, 42])
    assert dict(parse_checkpoint(path.read_text()).originals) == {
        41: frozenset(range(4)),
        42: frozenset(range(4)),
    }
    assert binder.restore_all() == [(41, None)]
    assert _affinities(fs, 41, 42) == {41: "0-3", 42: "0-3"}
    assert not path.exists()  # 42 was saved but never moved: it goes too


def test_restore_puts_back_what_fits_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # IRQ 43 is gone; 42's original had CPU 3, now offline.
    fs = _host(tmp_path, {41: "2", 42: "0"}, online="0-2")
    path = tmp_path / "c.json"
    data = IrqCheckpointData(BOOT, 99, {41: frozenset({0, 1}), 42: frozenset({2, 3}), 43: {0}})
    path.write_text(format_checkpoint(data))
    with caplog.at_level(logging.INFO, logger="placement_supervisor"):
        report = restore_checkpoint(fs, str(path))
    assert report is not None and report.restored == (41, 42) and report.failed == ()
    assert _affinities(fs, 41, 42) == {41: "0-1", 42: "2"}
    assert not path.exists()
    misfit = [r.getMessage() for r in caplog.records if "misfit" in r.getMessage()]
    assert misfit == [
        f"irq checkpoint misfit path={path} irqs_gone=43 irqs_narrowed=42 cpus_offline=3 "
        'irqs_unfit=- action="applied as far as it fits"'
    ]
    assert any(r.getMessage().startswith("irq checkpoint restored") for r in caplog.records)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{garbled", "not JSON"),
        (format_checkpoint(IrqCheckpointData("another-boot", 1, {41: frozenset({0})})), "other"),
        (_edited(irqs={"41": "3"}), "checksum mismatch"),
    ],
)
def test_unusable_checkpoints_are_discarded_with_a_line_and_write_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, reason: str
) -> None:
    fs = _host(tmp_path, {41: "2"})
    path = tmp_path / "c.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="placement_supervisor"):
        report = restore_checkpoint(fs, str(path))
    assert report is not None and report.discarded is not None and reason in report.discarded
    assert _affinities(fs, 41) == {41: "2"}
    assert not path.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("irq checkpoint discarded path=")
    assert f"reason={reason}" in lines[0] or f'reason="{reason}' in lines[0]


def test_the_guardian_leaves_another_daemons_checkpoint_alone(tmp_path: Path) -> None:
    fs = _host(tmp_path, {41: "2"})
    path = tmp_path / "c.json"
    path.write_text(format_checkpoint(IrqCheckpointData(BOOT, 1234, {41: frozenset({0})})))
    assert restore_checkpoint(fs, str(path), owner=999) is None
    assert path.exists() and _affinities(fs, 41) == {41: "2"}
    assert restore_checkpoint(fs, str(path), owner=1234) is not None
    assert _affinities(fs, 41) == {41: "0"} and not path.exists()


def test_a_checkpoint_is_restored_once_when_two_reach_it(tmp_path: Path) -> None:
    """The guardian and a new daemon both find the file: the second waits for the
    first's lock, then sees it unlinked, and writes nothing."""
    fs = _host(tmp_path, {41: "2"})
    path = tmp_path / "c.json"
    path.write_text(format_checkpoint(IrqCheckpointData(BOOT, 1, {41: frozenset({0})})))
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the first restorer, mid-way
    results: list[object] = []
    second = threading.Thread(target=lambda: results.append(restore_checkpoint(fs, str(path))))
    second.start()

    def opened_twice() -> bool:
        fds = os.listdir("/proc/self/fd")
        return sum(_links_to(f"/proc/self/fd/{n}", path) for n in fds) >= 2

    poll(opened_twice, timeout_s=20, what="the second restorer has the file open")
    # The first one finishes: its writes, then unlink, then the lock goes.
    fs.write_text("proc/irq/41/smp_affinity_list", "0")
    os.unlink(path)
    fs.write_text("proc/irq/41/smp_affinity_list", "3")  # the new daemon's own bind
    os.close(fd)
    second.join(timeout=20)
    assert results == [None]
    assert _affinities(fs, 41) == {41: "3"}


def _links_to(link: str, path: Path) -> bool:
    try:
        return os.readlink(link) == str(path)
    except OSError:
        return False


def test_a_checkpoint_path_that_is_no_file_is_one_line_and_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = _host(tmp_path, {41: "2"})
    path = tmp_path / "c.json"
    path.mkdir()
    with caplog.at_level(logging.WARNING, logger="placement_supervisor"):
        assert restore_checkpoint(fs, str(path)) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"irq checkpoint unreadable path={path}")
    assert path.is_dir() and _affinities(fs, 41) == {41: "2"}


# -- the originals are the host's: instances of one host share them (issue 30 item 7) ----


def test_two_binders_of_one_host_keep_the_hosts_original_and_the_last_restores(
    tmp_path: Path,
) -> None:
    fs = _host(tmp_path, {41: "0-3"})
    state = tmp_path / "state"
    state.mkdir()
    # Two live daemons' checkpoints in one state directory (this process and its parent).
    a = IrqBinder(fs, IrqCheckpoint(str(state / "a.irqs.json"), BOOT, pid=os.getppid()))
    b = IrqBinder(fs, IrqCheckpoint(str(state / "b.irqs.json"), BOOT, pid=os.getpid()))
    a.bind(41, {1})
    b.bind(41, {2})  # reads "1", A's: the host's original is A's record of it
    assert dict(parse_checkpoint((state / "b.irqs.json").read_text()).originals) == {
        41: frozenset(range(4))
    }
    assert a.restore_all() == [(41, None)]  # B still holds it: A writes nothing
    assert _affinities(fs, 41) == {41: "2"}
    assert not (state / "a.irqs.json").exists()
    assert b.restore_all() == [(41, None)]  # the last user writes the host's value
    assert _affinities(fs, 41) == {41: "0-3"}
    assert not (state / "b.irqs.json").exists()


def test_a_dead_daemons_checkpoint_leaves_what_a_live_one_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The guardian (or the next start) restores a killed daemon's IRQs, except one
    # another live instance still binds: that one writes the original at its end.
    fs = _host(tmp_path, {41: "2", 42: "2"})
    state = tmp_path / "state"
    state.mkdir()
    dead = IrqCheckpointData(BOOT, 2**22 + 1, {41: frozenset({0, 1}), 42: frozenset({0, 1})})
    (state / "dead.irqs.json").write_text(format_checkpoint(dead))
    live = IrqCheckpointData(BOOT, os.getpid(), {41: frozenset({0, 1})})
    (state / "live.irqs.json").write_text(format_checkpoint(live))
    with caplog.at_level(logging.INFO, logger="placement_supervisor"):
        report = restore_checkpoint(fs, str(state / "dead.irqs.json"))
    assert report is not None and report.restored == (42,)
    assert _affinities(fs, 41, 42) == {41: "2", 42: "0-1"}
    shared = [r.getMessage() for r in caplog.records if "shared" in r.getMessage()]
    assert len(shared) == 1 and f"irqs=41 holders={os.getpid()}" in shared[0], shared
    assert not (state / "dead.irqs.json").exists()
