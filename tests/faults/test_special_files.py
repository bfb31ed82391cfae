"""Issue 11 item 5: special files and absurd sizes, in the config and in host trees.

Each case runs the real command as a subprocess with a deadline and a memory
ceiling: a FIFO must not hang it, /dev/zero must not exhaust memory, and the
answer is exit 2 (config) or 3 (host tree) with one line naming the file.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.examples import hosts
from supervisor.examples.builder import FakeHost
from tests.bench.scale_bench import scratch_dir
from tests.support.daemon_support import REPO, daemon_env

DEADLINE_S = 30.0
MEMORY_CEILING = 2 << 30  # address space: /dev/zero read whole hits this within a second


def _ceiling() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CEILING, MEMORY_CEILING))


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command to its end; a hang is killed (TERM, then KILL) and fails the test."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", *args],
        cwd=REPO,
        env=env or daemon_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ceiling,  # noqa: PLW1509 - a test's ceiling, not the daemon's spawn
    )
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=5)
            how = "hung, stopped by SIGTERM"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            how = "hung, and SIGTERM did not stop it"
        pytest.fail(f"{' '.join(args)}: {how} after {DEADLINE_S}s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_error(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert result.returncode == code, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- the config and the token file ----------------------------------------------------


def config_with_token(tmp_path: Path, token: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(
        f'cgroup = "off"\n[workers]\ncommand = ["true"]\n[api]\ntoken_file = "{token}"\n'
    )
    return path


def test_a_fifo_as_token_file_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    config = config_with_token(tmp_path, str(fifo))
    one_error(run_cli("run", "--config", str(config)), 2, str(fifo), "api.token_file", "FIFO")


def test_plan_config_checks_a_fifo_token_file_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    config = config_with_token(tmp_path, str(fifo))
    result = run_cli("plan", "--config", str(config))
    assert result.returncode == 2 and f"{fifo} is not a regular file" in result.stderr


def test_dev_zero_as_token_file_is_a_clear_error(tmp_path: Path) -> None:
    config = config_with_token(tmp_path, "/dev/zero")
    one_error(run_cli("run", "--config", str(config)), 2, "/dev/zero", "character device")


@pytest.mark.parametrize("mode", [0o644, 0o602, 0o606, 0o640, 0o620])
def test_a_token_others_may_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(mode)
    config = config_with_token(tmp_path, str(token))
    one_error(run_cli("run", "--config", str(config)), 2, str(token), f"mode {mode:04o}")


def test_a_fifo_as_config_file_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    one_error(run_cli("plan", "--config", str(fifo)), 2, str(fifo), "FIFO")
    one_error(run_cli("run", "--config", str(fifo)), 2, str(fifo), "FIFO")


# -- host trees ----------------------------------------------------------------------


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def link_to(target: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.unlink(missing_ok=True)
        path.symlink_to(target)

    return make


def directory(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.mkdir()


SABOTAGE = {
    "fifo": fifo,
    "dev_zero": link_to("/dev/zero"),
    "dev_urandom": link_to("/dev/urandom"),
    "directory": directory,
}
# Required and optional files of each reader: CPUs, nodes, the supervisor's
# status, IRQs, PCI, the NVIDIA information file.
TARGETS = [
    "sys/devices/system/cpu/online",
    "sys/devices/system/cpu/cpu3/topology/core_id",
    "sys/devices/system/node/node1/distance",
    "sys/devices/system/node/node0/meminfo",
    "proc/self/status",
    "proc/interrupts",
    "sys/bus/pci/devices/0000:1b:00.0/numa_node",
    "proc/driver/nvidia/gpus/0000:1b:00.0/information",
]


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="special-", dir=scratch_dir()) as tmp:
        yield Path(tmp)


@pytest.fixture(scope="module")
def dgx(scratch: Path) -> Path:
    return hosts.dgx_h100(scratch / "pristine")


def copy_of(tree: Path) -> Path:
    """A hard-linked copy (cheap): every sabotage unlinks before it writes."""
    root = Path(tempfile.mkdtemp(dir=tree.parent.parent)) / "host"
    subprocess.run(["cp", "-al", str(tree), str(root)], check=True)
    return root


@pytest.mark.parametrize("kind", sorted(SABOTAGE))
@pytest.mark.parametrize("target", TARGETS)
def test_special_files_in_a_host_tree_exit_3_naming_the_file(
    dgx: Path, kind: str, target: str
) -> None:
    root = copy_of(dgx)
    assert (root / target).is_file()
    SABOTAGE[kind](root / target)
    command = "topology" if "nvidia" not in target else "plan"
    one_error(run_cli(command, "--root", str(root)), 3, target)


def test_snapshot_of_a_tree_with_a_fifo_exits_3(dgx: Path, tmp_path: Path) -> None:
    root = copy_of(dgx)
    fifo(root / "sys/devices/system/node/node0/distance")
    result = run_cli("snapshot", str(tmp_path / "out"), "--root", str(root))
    one_error(result, 3, "node0/distance", "FIFO")


def test_a_huge_file_is_capped_not_read_whole(dgx: Path) -> None:
    root = copy_of(dgx)
    (root / "sys/devices/system/node/node1/distance").unlink()  # hard-linked: a new file
    with open(root / "sys/devices/system/node/node1/distance", "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of NULs that take no disk
    one_error(run_cli("topology", "--root", str(root)), 3, "node1/distance", "larger than")


def test_overlapping_ranges_in_a_list_are_refused_not_expanded(dgx: Path) -> None:
    root = copy_of(dgx)
    (root / "sys/devices/system/node/node0/cpulist").unlink()
    (root / "sys/devices/system/node/node0/cpulist").write_text(",".join(["0-65535"] * 5000))
    one_error(run_cli("topology", "--root", str(root)), 3, "node0/cpulist", "overlap")


def test_kernel_attributes_printed_in_hex_parse(tmp_path: Path) -> None:
    """ubcore's `numa` is printed with %#04x ("0x02"): an Ascend host that has it."""
    host = FakeHost(tmp_path / "a3").cpus(2, 8, 2, "adjacent", nodes_per_socket=2)
    for i in range(4):
        host.ascend_npu(None, ubcore_numa=2 * (i // 2))
    for i, raw in enumerate(["0x00", "0x00", "0x02", "0x02"]):
        host.raw(f"sys/class/ubcore/udma{i}/device/numa", raw + "\n")
    root = host.build()
    result = run_cli("topology", "--json", "--root", str(root))
    assert result.returncode == 0, result.stderr
    import json  # noqa: PLC0415

    nodes = [d["numa_node"] for d in json.loads(result.stdout)["devices"]]
    assert nodes == [0, 1, 2, 3]
