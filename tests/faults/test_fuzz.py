"""Seeded fuzz over host trees and configs: no traceback, no hang, one clear line.

Each case takes a fixture host (supervisor/examples/hosts.py, or one of hundreds of
nodes), replaces a few of the files discovery reads with something hostile
(a FIFO, a link to /dev/zero or /dev/urandom, a link loop, a dangling link, a
directory, garbage bytes, a huge list, a huge number, a 2 MiB line),
optionally writes a mutated config, and runs the real command (`topology`,
`plan`, `plan --config`, `snapshot`) as a subprocess with a deadline. It
must end within the deadline with 0, 2 or 3, and when not 0 with exactly
one `placement-supervisor: error:` line.

The seed is fixed (FUZZ_SEED overrides it; FUZZ_CASES the count) and every
failure message names the case, so any failure reproduces. Two cases run at
once (one per core of the CI box); the whole file stays near a minute.
Does I/O: trees under tmpfs when there is one, subprocesses.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.examples import hosts
from supervisor.hostfs import HostFS
from supervisor.topology.discover import read_topology
from supervisor.topology.model import DiscoveryOptions
from tests.bench.scale_bench import many_node_host, scratch_dir
from tests.support.daemon_support import REPO, daemon_env, free_port, stop_process, to_toml

SEED = int(os.environ.get("FUZZ_SEED", "20261201"))
CASES = int(os.environ.get("FUZZ_CASES", "120"))
DEADLINE_S = 20.0  # a healthy run takes well under a second; a hang never ends
PARALLEL = 2
PREFIX = "placement-supervisor: error: "
MEMORY_CEILING = 2 << 30
# `python -m supervisor ARGS` under an address-space ceiling, set by a tiny
# exec wrapper (preexec_fn is unsafe with the lanes' threads): a file read
# without bound fails fast as a MemoryError instead of eating the box.
CEILING = [
    sys.executable,
    "-I",
    "-S",
    "-c",
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_CEILING}, {MEMORY_CEILING})); "
    "os.execv(sys.executable, [sys.executable, '-m', 'supervisor', *sys.argv[1:]])",
]
BASES: dict[str, Callable[[Path], Path]] = {
    "dgx_h100": hosts.dgx_h100,
    "ascend_a3": hosts.ascend_a3,
    "mi300x": hosts.mi300x,
    "gb200_tray": hosts.gb200_tray,
    "container_holes": hosts.container_holes,
    "numa_unknown": hosts.numa_unknown,
    "no_accel_2node": hosts.no_accel_2node,
    "many_nodes_256": lambda base: many_node_host(base / "many_nodes_256", 256),
}


# -- what a mutation writes ---------------------------------------------------------


def _garbage(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2048)))


SPECIAL = ("fifo", "dev_zero", "dev_urandom", "directory", "link_loop", "dangling")
PLAIN = (
    "garbage",
    "empty",
    "huge_list",
    "overlap_list",
    "huge_number",
    "negative",
    "hex",
    "long_line",
    "truncated",
    "nul",
)


def _content(rng: random.Random) -> bytes | str:
    """Bytes for a plain file, or the name of a special kind (SPECIAL)."""
    kind = rng.choice(SPECIAL + PLAIN)
    if kind in SPECIAL:
        return kind
    if kind == "garbage":
        return _garbage(rng)
    if kind == "huge_list":
        return ",".join(str(i) for i in range(0, 200_000, 3)).encode()
    if kind == "overlap_list":
        return ",".join(["0-65535"] * 2000).encode()
    if kind == "huge_number":
        return b"9" * rng.choice([20, 5000, 100_000]) + b"\n"
    if kind == "negative":
        return f"-{rng.randrange(1, 1 << 40)}\n".encode()
    if kind == "hex":
        return f"0x{rng.randrange(1 << 64):x}\n".encode()
    if kind == "long_line":
        return b"1 " * (1 << 20)
    if kind == "truncated":
        return b"0-"
    if kind == "nul":
        return b"\0" * rng.randrange(1, 64)
    return b""


@dataclass(slots=True)
class Mutation:
    """One file replaced; `undo()` puts the original back."""

    path: Path
    backup: Path

    def undo(self) -> None:
        if self.path.is_dir() and not self.path.is_symlink():
            shutil.rmtree(self.path)
        else:
            self.path.unlink(missing_ok=True)
        if self.backup.exists() or self.backup.is_symlink():
            os.rename(self.backup, self.path)


def mutate(path: Path, content: bytes | str, backup: Path) -> Mutation:
    if path.exists() or path.is_symlink():
        os.rename(path, backup)
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "fifo":
        os.mkfifo(path)
    elif content == "dev_zero":
        path.symlink_to("/dev/zero")
    elif content == "dev_urandom":
        path.symlink_to("/dev/urandom")
    elif content == "directory":
        path.mkdir()
    elif content == "link_loop":
        path.symlink_to(path.name)  # ELOOP
    elif content == "dangling":
        path.symlink_to("/nonexistent/placement-supervisor-fuzz")
    else:
        assert isinstance(content, bytes)
        path.write_bytes(content)
    return Mutation(path, backup)


# -- configs -------------------------------------------------------------------------

_HOSTILE_VALUES: list[Any] = [
    -1,
    0,
    1 << 62,
    85638,
    1e308,
    "x\0y",
    "",
    "A=B",
    [],
    ["0" * 10_000],
    list(range(5000)),
    {"a": 1},
    True,
    "0000:zz:00.0",
    "../../etc/passwd",
    "/dev/zero",
]
_KEYS = [
    ("", "cpu_ranks"),
    ("", "accelerator"),
    ("", "devices"),
    ("", "stop_timeout_s"),
    ("", "cgroup"),
    ("", "visible_devices_env"),
    ("restart", "policy"),
    ("restart", "backoff_initial_s"),
    ("restart", "crash_loop_window_s"),
    ("restart", "crash_loop_limit"),
    ("placement", "strategy"),
    ("placement", "rank_roles"),
    ("placement", "devices_per_rank"),
    ("placement", "min_main_cpus"),
    ("drift", "policy"),
    ("drift", "check_interval_s"),
    ("api", "listen"),
    ("api", "token_file"),
    ("ready", "tcp"),
    ("workers", "command"),
    ("workers", "env"),
    ("engine", "command"),
    ("threads", "x"),
]


def mutated_config(rng: random.Random, command: tuple[str, ...] = ("w", "{rank}")) -> str:
    doc: dict[str, Any] = {
        "cpu_ranks": 2,
        "cgroup": "off",
        "workers": {"command": list(command), "env": {"K": "v"}},
        "placement": {"rank_roles": {"irq": 1}},
        "restart": {"policy": "on-failure"},
    }
    for _ in range(rng.randrange(1, 4)):
        table, key = rng.choice(_KEYS)
        value = rng.choice(_HOSTILE_VALUES)
        if table:
            sub = doc.setdefault(table, {})
            if isinstance(sub, dict):
                sub[key] = value
        else:
            doc[key] = value
    try:
        return to_toml(doc)
    except TypeError:
        return to_toml({"workers": {"command": "w"}})


# -- one case ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    number: int
    base: str
    files: tuple[tuple[str, bytes | str], ...]  # rel path -> content or special kind
    command: str  # topology, plan, plan-config, snapshot
    config: str | None

    def describe(self) -> str:
        files = ", ".join(
            f"{rel}={c if isinstance(c, str) else f'{len(c)} bytes'}" for rel, c in self.files
        )
        return f"case {self.number} (FUZZ_SEED={SEED}): {self.command} on {self.base}: {files}"


def plan_cases(read_files: dict[str, list[str]]) -> list[Case]:
    rng = random.Random(SEED)
    cases = []
    for number in range(CASES):
        base = rng.choice(sorted(read_files))
        files = tuple(
            (rng.choice(read_files[base]), _content(rng)) for _ in range(rng.randrange(1, 4))
        )
        command = rng.choice(["topology", "topology-json", "plan", "plan-config", "snapshot"])
        config = mutated_config(rng) if command == "plan-config" else None
        cases.append(Case(number, base, files, command, config))
    return cases


def run_case(case: Case, root: Path, work: Path) -> tuple[int | None, str | None]:
    """The exit code of `case` on the tree at `root`, and its problem (None: it behaved)."""
    backups = work / "backup"
    backups.mkdir(exist_ok=True)
    done: list[Mutation] = []
    try:
        for i, (rel, content) in enumerate(case.files):
            if any(m.path == root / rel for m in done):
                continue
            done.append(mutate(root / rel, content, backups / str(i)))
        args = ["--root", str(root)]
        if case.command == "topology-json":
            argv = ["topology", "--json", *args]
        elif case.command == "plan-config":
            config = work / "c.toml"
            assert case.config is not None
            config.write_text(case.config)
            argv = ["plan", "--config", str(config), *args]
        elif case.command == "snapshot":
            shutil.rmtree(work / "snap", ignore_errors=True)
            argv = ["snapshot", str(work / "snap"), *args]
        else:
            argv = [case.command, *args]
        try:
            result = subprocess.run(
                [*CEILING, *argv],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=DEADLINE_S,
                check=False,
            )
        except subprocess.TimeoutExpired:  # subprocess.run has killed it
            return None, f"hung for {DEADLINE_S}s"
        err = result.stderr
        if "Traceback" in err or result.returncode not in (0, 2, 3):
            return result.returncode, f"exit {result.returncode}:\n{err[-3000:]}"
        if result.returncode != 0:
            lines = err.strip().splitlines()
            if len(lines) != 1 or not lines[0].startswith(PREFIX):
                problem = f"exit {result.returncode} without one error line:\n{err[-3000:]}"
                return result.returncode, problem
        return result.returncode, None
    finally:
        for m in reversed(done):
            m.undo()


# -- the test ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trees() -> Iterator[tuple[Path, dict[str, list[str]]]]:
    """Every base host built once, and the files discovery reads on each."""
    with tempfile.TemporaryDirectory(prefix="fuzz-", dir=scratch_dir()) as tmp:
        base = Path(tmp) / "pristine"
        read_files: dict[str, list[str]] = {}
        for name, build in BASES.items():
            root = build(base)
            if root.name != name:
                root = root.rename(base / name)
            fs = HostFS(str(root), record=True)
            read_topology(fs, DiscoveryOptions())
            assert fs.log is not None
            read_files[name] = sorted(fs.log.files)
        yield Path(tmp), read_files


def test_hostile_trees_and_configs_never_traceback_or_hang(
    trees: tuple[Path, dict[str, list[str]]],
) -> None:
    tmp, read_files = trees
    cases = plan_cases(read_files)
    # One copy of every base per worker, so that two cases never share a tree.
    for w in range(PARALLEL):
        shutil.copytree(tmp / "pristine", tmp / f"w{w}", symlinks=True)
        (tmp / f"work{w}").mkdir()
    lanes = [cases[w::PARALLEL] for w in range(PARALLEL)]

    codes: list[int | None] = []

    def lane(w: int) -> list[str]:
        problems = []
        for case in lanes[w]:
            code, problem = run_case(case, tmp / f"w{w}" / case.base, tmp / f"work{w}")
            codes.append(code)
            if problem is not None:
                problems.append(f"{case.describe()}\n  {problem}")
        return problems

    with ThreadPoolExecutor(PARALLEL) as pool:
        problems = [p for found in pool.map(lane, range(PARALLEL)) for p in found]
    assert not problems, f"{len(problems)} of {len(cases)} cases misbehaved:\n" + "\n".join(
        problems[:10]
    )
    # The cases reach the readers: most end in a refusal, some still plan.
    assert codes.count(3) + codes.count(2) >= len(cases) // 3, codes
    assert codes.count(0) >= 1, codes


# -- hostile configs through `run` ------------------------------------------------------

RUN_CASES = int(os.environ.get("FUZZ_RUN_CASES", "8"))
RUN_GRACE_S = 6.0  # a config that loads runs this long, then gets SIGTERM


def test_hostile_configs_through_run_exit_clean_or_stop_on_sigterm(tmp_path: Path) -> None:
    """`run` with a mutated config: it refuses at once (2, 3; one line), or it runs
    and stops on SIGTERM with 0; never a traceback, never a hang."""
    rng = random.Random(SEED + 1)
    problems = []
    outcomes = []
    # Case 0 is the unmutated config: one that runs, whatever the seed mutates
    # (a missing command, which used to run and crash-loop, is now refused).
    unmutated = to_toml(
        {
            "cpu_ranks": 2,
            "cgroup": "off",
            "workers": {"command": ["sleep", "30"]},
            "placement": {"rank_roles": {"irq": 1}},
        }
    )
    for number in range(RUN_CASES + 1):
        text = mutated_config(rng, ("sleep", "30")) if number else unmutated
        config = tmp_path / f"run{number}.toml"
        config.write_text(text)
        env = daemon_env(RUNTIME_DIRECTORY=str(tmp_path))
        env["PLACEMENT_SUPERVISOR_INSTANCE"] = f"fuzz-{os.getpid()}-{number}"
        proc = subprocess.Popen(
            [*CEILING, "run", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _, err = proc.communicate(timeout=RUN_GRACE_S)
            ran = False
        except subprocess.TimeoutExpired:
            ran = True
            code = stop_process(proc, timeout_s=DEADLINE_S, group=False)
            err = proc.stderr.read() if proc.stderr else ""
        outcomes.append(ran)
        where = f"run case {number} (FUZZ_SEED={SEED}):\n{text}"
        if "Traceback" in err:
            problems.append(f"{where}  traceback:\n{err[-3000:]}")
        elif ran and code not in (0, -signal.SIGTERM):
            # 0: stopped in order. -SIGTERM: the signal came while it was still
            # starting (a loaded box), before the handlers, and ended it there.
            problems.append(f"{where}  ran, then exit {code} on SIGTERM:\n{err[-2000:]}")
        elif not ran:
            lines = err.strip().splitlines()
            if proc.returncode not in (2, 3) or len(lines) != 1 or not lines[0].startswith(PREFIX):
                problems.append(f"{where}  exit {proc.returncode}:\n{err[-2000:]}")
    assert not problems, "\n".join(problems)
    assert True in outcomes and False in outcomes, "the seed must give runs and refusals"
