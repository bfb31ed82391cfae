"""The package's import layout (docs/architecture.md): no import cycle, and the pure
layers import nothing of the I/O layers above them (reads supervisor/**/*.py).

Every `import` statement counts, wherever it stands: at module level, inside a
function (a lazy import still runs) and under `if TYPE_CHECKING:` (a cycle
there is still a layering one). Importing `supervisor.a.b` runs
`supervisor/a/__init__.py` too, so it counts as an import of `supervisor.a`.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from supervisor.topology.accelerators import KINDS, AcceleratorKind

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "supervisor"

# The layers below the process-running ones: topology (host -> Topology), the
# plan (Topology -> Placement) and the check loop's pure decisions (a pass's, an adoption's).
PURE = (
    "supervisor.topology",
    "supervisor.plan",
    "supervisor.watch.decide",
    "supervisor.watch.adoption",
)
# What they must never reach: kernel writes, processes, the API, the root.
ABOVE = (
    "supervisor.bind",
    "supervisor.run",
    "supervisor.trees",
    "supervisor.daemon",
    "supervisor.serve",
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _imported(node: ast.Import | ast.ImportFrom, me: str, is_package: bool) -> list[str]:
    """The module names one import statement names (a `from` of a submodule names it)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = me.split(".") if is_package else me.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_graph(root: Path, package: str = "supervisor") -> dict[str, set[str]]:
    """{module: the package's modules it imports}, from the source alone (no import runs)."""
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for me, path in files.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node, me, path.name == "__init__.py"):
                parts = name.split(".")
                # The module itself and every package above it run.
                for i in range(1, len(parts) + 1):
                    target = ".".join(parts[:i])
                    if target in files and target != me:
                        edges.add(target)
        graph[me] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative DFS, sorted for a stable answer)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
                continue
            nxt = todo.pop(0)
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                stack.append((nxt, sorted(graph.get(nxt, ()))))
                path.append(nxt)
                on_path.add(nxt)
    return None


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """{module: the module that imports it on one path from `start`}."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in via and nxt != start:
                via[nxt] = node
                todo.append(nxt)
    return via


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each pure module that reaches an ABOVE module, directly or through others
    (the config included: what it validates with lives below it), with the chain."""
    found = []
    for me in sorted(graph):
        if not _within(me, PURE):
            continue
        via = reachable(graph, me)
        for target in sorted(via):
            if _within(target, ABOVE):
                chain = [target]
                while chain[-1] != me:
                    chain.append(via[chain[-1]])
                found.append(" -> ".join(reversed(chain)))
    return found


# -- the package ------------------------------------------------------------------------


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 50  # the whole package was read
    assert find_cycle(graph) is None, find_cycle(graph)


def test_topology_plan_and_decide_import_nothing_of_bind_run_serve_or_the_daemon() -> None:
    graph = import_graph(ROOT)
    assert any(_within(m, ("supervisor.topology",)) for m in graph)
    assert "supervisor.watch.decide" in graph
    assert layer_violations(graph) == []


# -- the checks themselves fail when they should ----------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "supervisor" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


BASE = {
    "__init__.py": "",
    "state.py": "X = 1\n",
    "plan/__init__.py": "",
    "plan/planner.py": "from supervisor.state import X\n",
    "run/__init__.py": "",
    "run/runner.py": "from supervisor.plan import planner\n",
    "daemon.py": "import supervisor.run.runner\n",
    "watch/__init__.py": "",
    "watch/decide.py": "from supervisor import state\n",
}


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    graph = import_graph(_tree(tmp_path, BASE))
    assert graph["supervisor.run.runner"] == {
        "supervisor",
        "supervisor.plan",
        "supervisor.plan.planner",
    }
    assert find_cycle(graph) is None
    assert layer_violations(graph) == []


@pytest.mark.parametrize(
    "where",
    [
        "import supervisor.daemon\n",  # module level
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from supervisor.daemon import D\n",
        "def f():\n    from supervisor import daemon\n",  # a lazy import
    ],
)
def test_a_cycle_is_found_wherever_its_import_stands(tmp_path: Path, where: str) -> None:
    files = {**BASE, "plan/planner.py": BASE["plan/planner.py"] + where}
    graph = import_graph(_tree(tmp_path, files))
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert "supervisor.daemon" in cycle and "supervisor.plan.planner" in cycle


@pytest.mark.parametrize(
    ("module", "line", "target"),
    [
        ("plan/planner.py", "from supervisor.bind.syscalls import bind\n", "supervisor.bind"),
        ("watch/decide.py", "from ..serve import server\n", "supervisor.serve.server"),
        ("topology/cpus.py", "from supervisor.run import runner\n", "supervisor.run.runner"),
        ("plan/planner.py", "import supervisor.daemon\n", "supervisor.daemon"),
    ],
)
def test_a_pure_module_reaching_up_is_found(
    tmp_path: Path, module: str, line: str, target: str
) -> None:
    files = {
        **BASE,
        "bind/__init__.py": "",
        "bind/syscalls.py": "",
        "serve/__init__.py": "",
        "serve/server.py": "",
        "topology/__init__.py": "",
        "topology/cpus.py": "",
        module: line,
    }
    found = layer_violations(import_graph(_tree(tmp_path, files)))
    assert any(chain.endswith(target) for chain in found), found


def test_a_pure_module_reaching_up_through_another_is_found(tmp_path: Path) -> None:
    files = {**BASE, "state.py": "import supervisor.daemon\n"}
    found = layer_violations(import_graph(_tree(tmp_path, files)))
    assert "supervisor.plan.planner -> supervisor.state -> supervisor.daemon" in found


# -- module size -------------------------------------------------------------------------

LINES_MAX = 600


def oversized_modules(root: Path, lines_max: int = LINES_MAX) -> list[str]:
    """Each module of the package over `lines_max` lines, as "path: N lines"."""
    found = []
    for path in sorted((root / "supervisor").rglob("*.py")):
        count = len(path.read_text().splitlines())
        if count > lines_max:
            found.append(f"{path.relative_to(root).as_posix()}: {count} lines (max {lines_max})")
    return found


def test_modules_over_600_lines_are_named_not_failed() -> None:
    """A warning, not a rule: a ceiling modules grew into (and packed calls behind
    `fmt: skip` to stay under) said less than what matters, that no two folders
    import each other (below)."""
    for line in oversized_modules(ROOT):
        warnings.warn(f"module size: {line}", stacklevel=1)


def test_an_oversized_module_is_named_with_its_count(tmp_path: Path) -> None:
    body = "X = 1\n" * LINES_MAX
    root = _tree(tmp_path, {**BASE, "plan/planner.py": body})
    assert oversized_modules(root) == []  # exactly the limit is fine
    root = _tree(tmp_path, {**BASE, "plan/planner.py": body + '"""Over 500 lines because."""\n'})
    assert oversized_modules(root) == [
        f"supervisor/plan/planner.py: {LINES_MAX + 1} lines (max 600)"
    ]


# -- one accelerator vocabulary ---------------------------------------------------------

VOCABULARY_HOME = "supervisor/topology/accelerators.py"
# The example hosts are data: a DGX's or an Ascend box's own sysfs and procfs
# files, written into a tree as Linux has them (what the fixture trees under
# tests/ are). They describe hosts of a kind; nothing in them finds or names one.
VOCABULARY_DATA = "supervisor/examples/"


def vocabulary_terms(kinds: tuple[AcceleratorKind, ...]) -> tuple[set[str], set[str], set[int]]:
    """What only the registry module may spell out: (kind names and device node
    prefixes, matched as a whole string; fragments, matched inside any string:
    variables, device nodes, driver and sysfs paths, drivers; PCI vendor ids)."""
    names = {k.name for k in kinds}
    fragments: set[str] = set()
    for k in kinds:
        names.update(n.prefix for n in (*k.device_nodes, k.node_fallback) if n)
        names.update(p.rpartition("/")[2] for p in (k.needs_node, k.uuid_prefix) if p)
    for k in kinds:
        fragments.update(k.visibility, k.worker_drops, k.worker_defaults)
        fragments.update(f"{n.dir}/{n.prefix}" for n in (*k.device_nodes, k.node_fallback) if n)
        optional = (k.worker_var, k.driver_dir, k.numa_class, k.needs_node)
        fragments.update(p for p in optional if p)
        if k.pci is not None and k.pci.driver:
            fragments.add(k.pci.driver)
    vendors = {v for k in kinds for v in k.vendor_ids}
    return names, fragments, vendors


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        # A string statement right after an assignment documents it too (the
        # attribute-docstring convention the package uses for type aliases).
        for i, stmt in enumerate(body):
            is_text = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            if is_text and (i == 0 or isinstance(body[i - 1], ast.Assign | ast.AnnAssign)):
                found.add(id(stmt.value))
    return found


def vocabulary_leaks(root: Path, kinds: tuple[AcceleratorKind, ...], home: str) -> list[str]:
    """Each string or number constant outside `home` (and outside docstrings) that
    spells out a kind's name, variable, device node, path, driver or vendor id."""
    names, fragments, vendors = vocabulary_terms(kinds)
    leaks = []
    for path in sorted((root / "supervisor").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == home or rel.startswith(VOCABULARY_DATA):
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or id(node) in docs:
                continue
            value = node.value
            if isinstance(value, str):
                hit = value in names or any(f in value for f in fragments)
            else:
                hit = isinstance(value, int) and not isinstance(value, bool) and value in vendors
            if hit:
                leaks.append(f"{rel}:{node.lineno}: {value!r}")
    return leaks


def test_accelerator_kinds_are_spelled_out_in_the_registry_only() -> None:
    names, fragments, vendors = vocabulary_terms(KINDS)
    assert {"nvidia", "amd", "ascend"} <= names  # the registry was read
    assert "CUDA_VISIBLE_DEVICES" in fragments and 0x10DE in vendors
    assert vocabulary_leaks(ROOT, KINDS, VOCABULARY_HOME) == []


def test_a_kind_spelled_out_elsewhere_is_found(tmp_path: Path) -> None:
    home = "supervisor/topology/accelerators.py"
    clean = {
        "topology/accelerators.py": 'VAR = "CUDA_VISIBLE_DEVICES"\nNAME = "nvidia"\nV = 0x10DE\n',
        # Docstrings and comments may name them; other words may hold the letters.
        "run/spec.py": '"""Sets CUDA_VISIBLE_DEVICES for nvidia."""\n# amd too\nX = "command"\n',
        "plan/planner.py": 'def f():\n    """Not on dev/nvidia0."""\n    return 4318.5\n',
    }
    root = _tree(tmp_path, clean)
    assert vocabulary_leaks(root, KINDS, home) == []
    for module, line, shown in [
        ("run/spec.py", 'VAR = "HIP_VISIBLE_DEVICES"\n', "'HIP_VISIBLE_DEVICES'"),
        ("plan/planner.py", 'def f(d):\n    return d.kind == "cpu"\n', "'cpu'"),
        ("engines/rank_source.py", 'P = r"^/dev/davinci(\\d+)$"\n', "'^/dev/davinci(\\\\d+)$'"),
        ("topology/devices.py", 'def f(n):\n    return f"dev/nvidia{n}"\n', "'dev/nvidia'"),
        ("topology/devices.py", "VENDOR = 0x1002\n", "4098"),
        ("config.py", 'KINDS = ("auto", "ascend")\n', "'ascend'"),
    ]:
        root = _tree(tmp_path, {**clean, module: line})
        found = vocabulary_leaks(root, KINDS, home)
        assert [f.split(": ", 1)[1] for f in found] == [shown], (module, found)
        assert found[0].startswith(f"supervisor/{module}:")
        (tmp_path / "supervisor" / module).write_text(clean.get(module, ""))


# -- the package's shape: one child's life in run/, the check loop below it ---------------

RUN_MODULES_MAX = 10


def package_modules(root: Path, package: str) -> list[str]:
    """The modules of one package folder (its *.py files but __init__), sorted."""
    folder = root / package.replace(".", "/")
    return sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")


def watch_imports_of_run(graph: dict[str, set[str]]) -> list[str]:
    """Each `module -> imported` edge from supervisor.watch into supervisor.run."""
    return [
        f"{me} -> {target}"
        for me in sorted(graph)
        if _within(me, ("supervisor.watch",))
        for target in sorted(graph[me])
        if _within(target, ("supervisor.run",))
    ]


def test_a_run_folder_over_10_modules_is_named_not_failed() -> None:
    modules = package_modules(ROOT, "supervisor.run")
    assert "runner" in modules  # the folder was read
    if len(modules) > RUN_MODULES_MAX:
        warnings.warn(f"run/ holds {len(modules)} modules: {modules}", stacklevel=1)


def test_no_watch_module_imports_run() -> None:
    graph = import_graph(ROOT)
    assert "supervisor.watch.loop" in graph
    assert watch_imports_of_run(graph) == []


def test_an_eleventh_run_module_is_counted(tmp_path: Path) -> None:
    files = {**BASE, **{f"run/m{i}.py": "" for i in range(9)}}
    tree = _tree(tmp_path, files)
    assert len(package_modules(tree, "supervisor.run")) == RUN_MODULES_MAX  # runner + 9
    (tree / "supervisor/run/m9.py").write_text("")
    assert len(package_modules(tree, "supervisor.run")) == RUN_MODULES_MAX + 1


@pytest.mark.parametrize(
    "line",
    [
        "from supervisor.run.runner import R\n",
        "import supervisor.run\n",
        "def f():\n    from ..run import runner\n",
    ],
)
def test_a_watch_module_importing_run_is_found(tmp_path: Path, line: str) -> None:
    assert watch_imports_of_run(import_graph(_tree(tmp_path, BASE))) == []
    files = {**BASE, "watch/loop.py": line}
    found = watch_imports_of_run(import_graph(_tree(tmp_path, files)))
    assert found and found[0].startswith("supervisor.watch.loop -> supervisor.run"), found


# -- the picture: who imports whom, folder by folder --------------------------------------


def folder_of(module: str, package: Path = PACKAGE) -> str:
    """`supervisor.watch.loop` -> "watch/", `supervisor.config` -> "config"."""
    parts = module.split(".")
    if len(parts) == 1:
        return "supervisor"
    is_folder = (package / parts[1]).is_dir()
    return f"{parts[1]}/" if is_folder else parts[1]


def folder_graph(graph: dict[str, set[str]], package: Path = PACKAGE) -> dict[str, set[str]]:
    """{folder or root module: the other folders and root modules it imports}."""
    out: dict[str, set[str]] = {}
    for me, targets in graph.items():
        mine = folder_of(me, package)
        for target in targets:
            theirs = folder_of(target, package)
            if theirs not in (mine, "supervisor"):
                out.setdefault(mine, set()).add(theirs)
    return out


def mutual_imports(folders: dict[str, set[str]]) -> list[str]:
    """Each pair of folders (or root modules) that import each other, "a <-> b":
    one of the two holds a name that belongs below both."""
    return sorted(
        f"{a} <-> {b}"
        for a, targets in folders.items()
        for b in targets
        if a < b and a in folders.get(b, set())
    )


def test_no_two_folders_import_each_other() -> None:
    folders = folder_graph(import_graph(ROOT))
    assert len(folders) > 15  # the whole package was read
    assert mutual_imports(folders) == []


@pytest.mark.parametrize(
    ("module", "line", "pair"),
    [
        ("plan/planner.py", "from supervisor.run.runner import R\n", "plan/ <-> run/"),
        ("plan/planner.py", "def f():\n    from ..run import runner\n", "plan/ <-> run/"),
    ],
)
def test_two_folders_importing_each_other_are_found(
    tmp_path: Path, module: str, line: str, pair: str
) -> None:
    root = _tree(tmp_path, BASE)
    assert mutual_imports(folder_graph(import_graph(root), root / "supervisor")) == []
    (root / "supervisor" / module).write_text(BASE[module] + line)
    found = mutual_imports(folder_graph(import_graph(root), root / "supervisor"))
    assert pair in found, found


def test_the_folder_graph_shows_the_flow() -> None:
    folders = folder_graph(import_graph(ROOT))
    assert "run/" not in folders["watch/"] and "bind/" in folders["watch/"]
    assert not folders["plan/"] & {"bind/", "run/", "trees/", "serve/", "daemon/", "config"}
    assert {"run/", "trees/", "watch/", "serve/"} <= folders["daemon/"]
    assert "config" not in folders["engines/"] and "engines/" in folders["config"]


def unmirrored(package: Path, tests: Path) -> list[str]:
    """Each folder of the package that has no folder of tests beside the others
    (tests/<name>/): where a reader looks for a module's tests is its folder's name."""
    return sorted(
        f"{d.name}/"
        for d in package.iterdir()
        if (d / "__init__.py").is_file() and not (tests / d.name).is_dir()
    )


def test_tests_mirror_the_package_folders() -> None:
    assert len([d for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()]) > 10
    assert unmirrored(PACKAGE, ROOT / "tests") == []


def test_a_folder_without_its_tests_is_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, BASE)
    tests = tmp_path / "tests"
    for d in (root / "supervisor").iterdir():
        if (d / "__init__.py").is_file():
            (tests / d.name).mkdir(parents=True)
    assert unmirrored(root / "supervisor", tests) == []
    (root / "supervisor" / "agent").mkdir()
    (root / "supervisor" / "agent" / "__init__.py").write_text("")
    assert unmirrored(root / "supervisor", tests) == ["agent/"]


if __name__ == "__main__":  # .venv/bin/python -m tests.test_layout
    for name, targets in sorted(folder_graph(import_graph(ROOT)).items()):
        print(f"{name:16s} -> {' '.join(sorted(targets))}")
