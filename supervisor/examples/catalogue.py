"""The named example hosts of `--example NAME` (pure data; `build_example` writes the tree).

Each entry names a builder of supervisor.examples.hosts and says, in one line,
what `topology --root` of its tree shows: sockets, NUMA nodes, CPUs and
accelerators (tests/examples/test_examples.py holds each line to the discovered tree).
A name is matched case-insensitively, "_" as "-"; an alias is the builder's
own name, as the tests call it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.errors import ConfigError
from supervisor.examples import EXAMPLE_FOR_KIND, hosts


@dataclass(frozen=True, slots=True)
class Example:
    name: str
    build: Callable[[Path], Path]
    sockets: int
    nodes: int
    cpus: int  # online CPUs
    accelerators: int
    kind: str  # the devices' kind: "nvidia", "amd", "ascend"; "cpu" for none
    model: str  # what the accelerators are, for the list ("H100 SXM")
    note: str = ""

    @property
    def aliases(self) -> tuple[str, ...]:
        alias = _normal(self.build.__name__)
        return () if alias == self.name else (alias,)

    def describe(self) -> str:
        """One line: "2 sockets, 2 NUMA nodes, 224 CPUs, 8 NVIDIA H100 SXM; ..."."""
        kinds = {"nvidia": "NVIDIA", "amd": "AMD", "ascend": "Ascend"}
        accel = (
            f"{self.accelerators} {kinds[self.kind]} {self.model}"
            if self.kind in kinds
            else "no accelerators"
        )
        sockets = f"{self.sockets} socket{'s' if self.sockets != 1 else ''}"
        line = f"{sockets}, {self.nodes} NUMA nodes, {self.cpus} CPUs, {accel}"
        return f"{line}; {self.note}" if self.note else line


EXAMPLES: tuple[Example, ...] = (
    Example(
        "dgx-h100",
        hosts.dgx_h100,
        2,
        2,
        224,
        8,
        "nvidia",
        "H100 SXM",
        "DGX H100, 2x Xeon 8480C, 8 ConnectX-7",
    ),
    Example(
        "epyc-nps4",
        hosts.dgx_a100_nps4,
        2,
        8,
        256,
        8,
        "nvidia",
        "A100",
        "DGX A100, 2x EPYC 7742 in NPS4: GPU0/1 on node 3, GPU order is not node order",
    ),
    Example(
        "gb200",
        hosts.gb200_tray,
        2,
        18,
        144,
        4,
        "nvidia",
        "GB200",
        "Grace-Blackwell tray: GPU HBM as CPU-less NUMA nodes 2-17",
    ),
    Example(
        "mi300x",
        hosts.mi300x,
        2,
        2,
        384,
        8,
        "amd",
        "MI300X",
        "2x EPYC 9654, plus a BMC display that is no accelerator",
    ),
    Example(
        "ascend-16npu",
        hosts.ascend_a3,
        4,
        8,
        640,
        16,
        "ascend",
        "910-class NPU",
        "Atlas 800T A3-class, Kunpeng, adjacent SMT numbering, logical ids not in bus order",
    ),
    Example(
        "ascend-a2",
        hosts.ascend_a2,
        4,
        8,
        192,
        8,
        "ascend",
        "910B NPU",
        "Atlas 800T A2-class: NPU0 at C1:00.0 on node 6, npu-smi captures in the tree",
    ),
    Example(
        "snc3-b200",
        hosts.xeon6_snc3_b200,
        2,
        6,
        288,
        8,
        "nvidia",
        "B200",
        "2x Xeon 6 in SNC3: no GPU on nodes 1 and 4",
    ),
    Example(
        "five-three",
        hosts.five_three,
        2,
        2,
        128,
        8,
        "nvidia",
        "L40S",
        "5 GPUs on socket 0, 3 on socket 1",
    ),
    Example(
        "adjacent-smt",
        hosts.adjacent_smt,
        2,
        2,
        64,
        2,
        "nvidia",
        "L40S",
        "SMT siblings numbered 0,1 / 2,3",
    ),
    Example(
        "numa-unknown",
        hosts.numa_unknown,
        2,
        2,
        64,
        3,
        "nvidia",
        "A10",
        "two GPUs with PCI numa_node -1 (one placed by local_cpulist)",
    ),
    Example(
        "container-holes",
        hosts.container_holes,
        2,
        2,
        96,
        4,
        "nvidia",
        "A10",
        "cgroup v2 cpuset 2-5,9,12-19,30-37,40-43",
    ),
    Example(
        "tight-container",
        hosts.tight_container,
        2,
        2,
        96,
        4,
        "nvidia",
        "A10",
        "cpuset 2-5,9,12-15,40-43: too few CPUs on node 1 (plan exits 3)",
    ),
    Example(
        "container-uuid",
        hosts.container_uuid,
        2,
        2,
        128,
        8,
        "nvidia",
        "H100 SXM",
        "a pod's cpuset; try CUDA_VISIBLE_DEVICES=<UUIDs of GPUs 6,1,5,2>",
    ),
    Example(
        "no-accel",
        hosts.no_accel_2node,
        2,
        2,
        32,
        0,
        "cpu",
        "",
        "one X710 NIC; each node stands in as a device",
    ),
)


def _normal(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def find_example(name: str) -> Example:
    """The example called `name` (or an alias); a ConfigError naming the nearest one."""
    wanted = _normal(name)
    for example in EXAMPLES:
        if wanted == example.name or wanted in example.aliases:
            return example
    known = [n for e in EXAMPLES for n in (e.name, *e.aliases)]
    # cutoff 0: some name always comes back. A kind ("amd") means the
    # example of that kind, not the nearest spelling.
    close = difflib.get_close_matches(wanted, known, n=1, cutoff=0.0)[0]
    nearest = EXAMPLE_FOR_KIND.get(wanted) or find_example(close).name
    raise ConfigError(
        f"--example {name}: unknown example; did you mean `{nearest}`? "
        f"(placement-supervisor topology --example list)"
    )


def build_example(name: str, directory: Path) -> Path:
    """Write example `name`'s host tree under `directory`; returns its root."""
    return find_example(name).build(directory)


def list_text() -> str:
    """`--example list`: one line per example, name then what it is."""
    width = max(len(e.name) for e in EXAMPLES)
    return "\n".join(f"{e.name:<{width}}  {e.describe()}" for e in EXAMPLES)
