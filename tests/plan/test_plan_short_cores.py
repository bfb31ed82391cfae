"""Where cores are short (issue 27 items 3 and 4): Ascend 950 at 3 and 6 CPUs
per NPU, and a container whose cpuset splits SMT pairs on a node of 4 GPUs.

Each service is a real `plan --root TREE --json` process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.examples import hosts
from supervisor.examples.builder import FakeHost
from tests.plan.test_plan_ascend import assert_disjoint, plan_process

ROOT = Path(__file__).resolve().parents[2]
NVIDIA_CONFIGS = [
    None,
    "configs/nvidia-8gpu-vllm.toml",
    "configs/engines/vllm.toml",
    "configs/engines/sglang.toml",
    "configs/engines/torchrun.toml",
    "configs/threads.example.toml",
]
ROLES_950 = "rank_roles = { acl = 1, release = 1 }\n"


def ascend_950(base: Path, cpuset: str) -> Path:
    """An Ascend 950-like host: 2 sockets x 24 cores x 2 threads (adjacent
    numbering), 8 NPUs with no CPU affinity (numa_node -1, no ubcore: the 950
    reports none), logical id = NPU id (`npu-smi info -m` gives no Chip Logic
    ID) at buses out of NPU id order; cpuset `cpuset`."""
    h = FakeHost(base / "a950").cpus(2, 24, 2, "adjacent", nodes_per_socket=1)
    h.cgroup_v2("/system.slice/npu.service", cpuset, "0-1")
    buses = ["41", "01", "42", "02", "c1", "81", "c2", "82"]
    for bus in sorted(buses):
        h.ascend_npu(f"0000:{bus}:00.0", -1, device=0xD806)
    chips = [(i, 0, None, f"0000:{bus}:00.0", "Ascend 950") for i, bus in enumerate(buses)]
    hosts.npu_smi_capture(h, chips)
    return h.build()


def config_950(tmp: Path, allocator: str, engine: bool) -> Path:
    text = 'accelerator = "ascend"\n[workers]\ncommand = ["/opt/w", "{rank}"]\n'
    if engine:
        text += '[engine]\ncommand = ["/opt/e"]\n'
    text += f'[placement]\nallocator = "{allocator}"\n{ROLES_950}[irq]\nenabled = false\n'
    path = tmp / f"950-{allocator}-{engine}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("allocator", ["global_slice", "supervisor"])
def test_950_at_3_cpus_per_npu_gets_single_cpu_roles(tmp_path: Path, allocator: str) -> None:
    """24 CPUs (12 cores) for 8 NPUs: 3 CPUs each, main/acl/release one CPU
    each, as the document's 950 split; the NPU is the one of its NPU id."""
    root = ascend_950(tmp_path, "0-23")
    doc = plan_process(root, None, config_950(tmp_path, allocator, engine=False))
    for r in doc["ranks"]:
        base = 3 * r["rank"]
        assert r["cpus"] == [base, base + 1, base + 2]
        assert r["roles"] == {"main": [base], "acl": [base + 1], "release": [base + 2]}
    assert doc["ranks"][0]["device"]["bus_id"] == "0000:41:00.0"  # NPU id 0
    if allocator == "supervisor":
        assert any("shares by CPU (SMT siblings split between ranks)" in w for w in doc["warnings"])


def test_950_at_6_cpus_per_npu_with_an_engine(tmp_path: Path) -> None:
    """48 CPUs (24 cores) for 8 NPUs: whole-core roles take 3 cores a rank, so
    rank 0 gives the engine one core and keeps 4 CPUs, its roles by CPU."""
    root = ascend_950(tmp_path, "0-47")
    doc = plan_process(root, None, config_950(tmp_path, "supervisor", engine=True))
    assert doc["engine"]["cpus"] == [4, 5]
    assert doc["ranks"][0]["roles"] == {"main": [0, 1], "acl": [2], "release": [3]}
    for r in doc["ranks"][1:]:
        base = 6 * r["rank"]
        assert r["roles"] == {
            "main": [base, base + 1],
            "acl": [base + 2, base + 3],
            "release": [base + 4, base + 5],
        }
    assert any(w.startswith("rank 0 (ascend0)") and "roles by CPU" in w for w in doc["warnings"])
    assert_disjoint(doc)


def smt_split_container(base: Path, cpuset: str) -> Path:
    """2 sockets x 16 cores x 2 threads (siblings N, N+32): 4 GPUs on node 0,
    4 on node 1; the container's cpuset holds first threads of node 0 only."""
    h = FakeHost(base / "smt_split").cpus(2, 16, 2, "intel")
    h.cgroup_v2("/kubepods/pod-llm", cpuset, "0-1")
    for i in range(8):
        h.nvidia_gpu(f"0000:{0x10 + i * 0x10:02x}:00.0", i // 4)
    return h.build()


@pytest.mark.parametrize("config", NVIDIA_CONFIGS)
def test_smt_split_container_of_10_cpus_plans_with_every_config(
    tmp_path: Path, config: str | None
) -> None:
    """10 lone threads of node 0, GPU 0 visible, GPUs 1-3 hidden on the node,
    4-7 hidden on node 1 (no allowed CPU: no share here). Main exited 3."""
    root = smt_split_container(tmp_path, "0-9")
    doc = plan_process(
        root, "0", None if config is None else ROOT / config, env_var="CUDA_VISIBLE_DEVICES"
    )
    assert set(doc["ranks"][0]["cpus"]) | set(doc["engine"]["cpus"]) <= set(range(10))
    assert_disjoint(doc)
    dropped = [w for w in doc["warnings"] if "hidden devices' shares dropped" in w]
    assert len(dropped) == 1 and "(nvidia1, nvidia2, nvidia3)" in dropped[0]


def test_smt_split_container_services_never_overlap(tmp_path: Path) -> None:
    """16 lone threads: GPUs 0-3 take 4 each (GPUs 4-7 on node 1 take none
    here), each service's engine comes out of its own share."""
    root = smt_split_container(tmp_path, "0-15")
    docs = [plan_process(root, str(i), env_var="CUDA_VISIBLE_DEVICES") for i in range(4)]
    for i, doc in enumerate(docs):
        assert doc["ranks"][0]["cpus"] == [4 * i, 4 * i + 1, 4 * i + 2]
        assert doc["engine"]["cpus"] == [4 * i + 3]
        assert not any("dropped" in w for w in doc["warnings"])
    assert_disjoint(*docs)
