"""Placement supervisor start-up hook: names, sizes and binds listed thread pools (stdlib only).

The supervisor puts this directory first on the engine's PYTHONPATH (and
`PLACEMENT_SUPERVISOR_HOOK` in its environment, see `supervisor.hook`), so
every Python process of the engine's tree runs this file at start-up
(`site` imports `sitecustomize`; multiprocessing spawn children inherit both
variables). It does I/O only in such processes: it reads /proc to check it
runs below the supervisor, and /proc/self/cgroup plus the cgroup's cpuset
CPUs (v1 cpuset.effective_cpus, v2 cpuset.cpus.effective) as each thread of
a listed pool starts.

What it changes: each `concurrent.futures.ThreadPoolExecutor` created by code
in a module under one of a role's prefixes ("vllm.v1.structured_output")
gets `max_workers` capped at the role's CPU count in the slot the supervisor
planned (`PLACEMENT_SUPERVISOR_SLOT`, never os.cpu_count()), and an
initializer that names each pool thread `<role>-N` (prctl PR_SET_NAME, the
comm the daemon matches) and, where this process still sits in the slot's
cpuset, binds it to the role's CPUs with sched_setaffinity(0, ...). Threads a
pool thread starts later (xgrammar's per-compile std::threads) inherit that
mask and the name from the kernel (clone(2) copies both), so the daemon's
role match covers them too.

Rules it keeps:
- Off unless `PLACEMENT_SUPERVISOR_HOOK` is set *and* the supervisor whose
  pid it names is an ancestor of this process: a process that merely copied
  the environment is left untouched.
- Never breaks start-up: any failure of its own is one line on stderr
  (`placement-supervisor hook: <event> key=value ... action=unhooked`), then
  the process runs as it would have without the hook.
- Chains to the `sitecustomize` that would have run without it (the next one
  on sys.path after this directory), as ddtrace's and signalfx-tracing's
  bootstrap sitecustomize modules do.
- The mechanism is opentelemetry-instrument's (its directory first on
  PYTHONPATH: opentelemetry-instrumentation auto_instrumentation/__init__.py
  run()), with one difference: OpenTelemetry's initialize() takes its
  directory out of PYTHONPATH so subprocesses are not instrumented; this hook
  keeps it, because the pools it is for live in spawn children.
- Costs almost nothing where unused: concurrent.futures is not imported here
  (about 10 ms); a meta-path finder patches it when the program imports it.

Early rank binding: where the engine's tree carries `PLACEMENT_SUPERVISOR_EARLY_RANK`
(supervisor.engines.early: an env rank such as torchrun's LOCAL_RANK, or the
multiprocessing target vLLM and SGLang start their workers with), a process
below the engine that one rule names puts itself on its rank's CPUs and
MPOL_BIND to its rank's nodes at once: at start-up for an env rank, just
before the multiprocessing target runs for a call rule. That is before CUDA
or ACL initialise and before the worker allocates, and a memory policy is
something only the process itself can set (set_mempolicy(2) acts on the
calling thread); the daemon's adoption confirms the rank later.

Limits: `python -I`, `-E` or `-S` ignore PYTHONPATH (or site), so such
interpreters are not hooked; multiprocessing children repeat their parent's
flags (subprocess._args_from_interpreter_flags). Neither vLLM (`vllm serve`,
spawn workers) nor SGLang (spawn schedulers) passes them.
"""

# Imports inside functions are deliberate: each one is paid only by a process
# that gets that far (a listed pool), never by every Python start-up.
# ruff: noqa: PLC0415

from __future__ import annotations

import _thread
import os
import sys

# Only the type checker reads these: typing and collections.abc would cost
# every Python process of the tree an import at start-up.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from types import CodeType, FrameType, ModuleType
    from typing import Any

HOOK_ENV = "PLACEMENT_SUPERVISOR_HOOK"
SLOT_ENV = "PLACEMENT_SUPERVISOR_SLOT"
# The engine's tree also carries every rank's slot ({"<rank>": slot}): a process
# the daemon adopted into rank N's cgroup (an SGLang scheduler) sizes and binds
# its pools by rank N's slot, not by the engine's it inherited.
RANK_SLOTS_ENV = "PLACEMENT_SUPERVISOR_RANK_SLOTS"
TARGET = "concurrent.futures.thread"
EARLY_ENV = "PLACEMENT_SUPERVISOR_EARLY_RANK"
# Beside this file; a name no engine's own module has (this directory is first on sys.path).
EARLY_MODULE = "placement_supervisor_early"
COMM_MAX_BYTES = 15  # TASK_COMM_LEN - 1 (prctl(2) PR_SET_NAME)
PR_SET_NAME = 15  # <linux/prctl.h>
MAX_ANCESTORS = 256  # a walk up the tree longer than this is a loop or a bug
# ThreadPoolExecutor.__init__(max_workers, thread_name_prefix, initializer,
# initargs): the same four leading parameters from 3.8 to 3.14.
POOL_PARAMS = ("max_workers", "thread_name_prefix", "initializer", "initargs")
MARK = "_placement_supervisor_hook"

_warned = False


def warn_once(event: str, action: str = "unhooked", **fields: object) -> None:
    """One line on stderr for the first failure of this process, then silence."""
    global _warned
    if _warned:
        return
    _warned = True
    try:
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        sys.stderr.write(f"placement-supervisor hook: {event} {text} action={action}\n")
    except Exception:  # stderr closed or broken: nothing left to tell
        pass


# -- the hook's own variable (pure) -----------------------------------------------------------


def parse_hook_env(text: str) -> tuple[int, dict[str, tuple[str, ...]]]:
    """`pid=SUP;ROLE=PREFIX,PREFIX;...` -> (supervisor pid, {role: prefixes}).

    A plain format, not JSON: parsing it must not import json (and re) into
    every Python process of the tree. ValueError says what is wrong.
    """
    pid = 0
    roles: dict[str, tuple[str, ...]] = {}
    for part in text.split(";"):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"bad part {part!r}")
        if name == "pid":
            pid = int(value)
        else:
            prefixes = tuple(p for p in value.split(",") if p)
            if not prefixes:
                raise ValueError(f"role {name!r} lists no module prefix")
            roles[name] = prefixes
    if pid <= 0:
        raise ValueError("no supervisor pid")
    return pid, roles


def module_role(module: str, roles: dict[str, tuple[str, ...]]) -> str | None:
    """The role whose prefix is `module` or a package above it (pure)."""
    for role, prefixes in roles.items():
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                return role
    return None


def parse_cpulist(text: str) -> frozenset[int]:
    """ "0-3,8" -> {0, 1, 2, 3, 8} (the kernel's list format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


# -- where this process runs (I/O: /proc, /sys) -------------------------------------------------


def parent_pid(pid: int) -> int:
    """The ppid in /proc/PID/stat (fields after the comm's last ')'); 0 when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1])  # state, ppid, ...


def below(ancestor: int) -> bool:
    """Whether `ancestor` is a parent, grandparent, ... of this process.

    A double-forked process reparented to init (or to a subreaper outside the
    tree) is no longer below it; in a new pid namespace the walk ends at 0.
    """
    pid = os.getppid()
    for _ in range(MAX_ANCESTORS):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        pid = parent_pid(pid)
    return False


def cgroup_lines() -> list[str] | None:
    try:
        with open("/proc/self/cgroup") as f:
            return f.read().splitlines()
    except OSError:
        return None


def cgroup_rank() -> int | None:
    """N when this process sits in the supervisor's cgroup of rank N (".../rankN") in
    any hierarchy (on v1 a rank has a memory cgroup only), else None."""
    for line in cgroup_lines() or ():
        path = line.split(":", 2)[-1]
        last = path.rstrip("/").rsplit("/", 1)[-1]
        if last.startswith("rank") and last[4:].isdigit():
            return int(last[4:])
    return None


def cgroup_cpus() -> frozenset[int] | None:
    """The CPUs of this process's cpuset cgroup (v1 cpuset, else v2), or None when unknown."""
    lines = cgroup_lines()
    if lines is None:
        return None
    # Where the controllers are usually mounted; an engine in a container
    # sees its own namespace's root in both.
    found = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpuset" in controllers.split(","):
            found = f"/sys/fs/cgroup/cpuset{path.rstrip('/')}/cpuset.effective_cpus"
            break
        if controllers == "":
            found = f"/sys/fs/cgroup{path.rstrip('/')}/cpuset.cpus.effective"
    if found is None:
        return None
    try:
        with open(found) as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return None


_slot_cache: tuple[str, dict[str, Any] | None] | None = None


def slot_doc() -> dict[str, Any] | None:
    """The slot this process belongs to: its rank's, when the daemon adopted it
    into a rank's cgroup and the tree carries the ranks' slots; else the one the
    supervisor wrote for this tree (parsed once per value)."""
    global _slot_cache
    ranks = os.environ.get(RANK_SLOTS_ENV)
    if ranks:
        rank = cgroup_rank()
        if rank is None:
            early = sys.modules.get(EARLY_MODULE)
            rank = getattr(early, "bound_rank", None)
        if rank is not None:
            import json

            docs = json.loads(ranks)
            doc = docs.get(str(rank)) if isinstance(docs, dict) else None
            if isinstance(doc, dict):
                return doc
    raw = os.environ.get(SLOT_ENV)
    if raw is None:
        return None
    if _slot_cache is not None and _slot_cache[0] == raw:
        return _slot_cache[1]
    import json  # only where a listed pool is created

    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError(f"{SLOT_ENV} is not a JSON object")
    _slot_cache = (raw, doc)
    return doc


def role_cpus(role: str) -> tuple[int, ...]:
    """The role's CPUs in the slot, else `main`'s, else the slot's (as Slot.role_cpus)."""
    doc = slot_doc()
    if doc is None:
        return ()
    roles = doc.get("roles") or {}
    cpus = roles.get(role) or roles.get("main") or doc.get("cpus") or ()
    return tuple(int(c) for c in cpus)


def bind_target(cpus: Sequence[int]) -> tuple[int, ...]:
    """`cpus` when this process still sits in the slot they belong to, else ().

    The slot variable is inherited: a worker the engine spawned carries the
    engine's slot until the daemon adopts it into its rank's cgroup. There
    the engine's CPUs are not in the cpuset, so the hook leaves the binding
    to the daemon, which matches the `<role>-N` names against the rank's slot.
    """
    if not cpus:
        return ()
    allowed = cgroup_cpus()
    if allowed is not None and not set(cpus) <= allowed:
        return ()
    return tuple(cpus)


# -- naming and binding a pool thread --------------------------------------------------------------


def _load_prctl() -> Callable[..., int]:
    import ctypes

    # The running process's own symbols (libc is loaded): find_library would
    # run `ldconfig -p` in a subprocess.
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


_prctl: Callable[..., int] | None = None
_counters: dict[str, int] = {}
_lock = _thread.allocate_lock()


def name_thread(name: str) -> None:
    """prctl(PR_SET_NAME) on the calling thread: its comm, cut at 15 bytes."""
    global _prctl
    prctl = _prctl
    if prctl is None:
        prctl = _prctl = _load_prctl()
    import ctypes

    raw = name.encode("ascii", "replace")[:COMM_MAX_BYTES]
    if prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_NAME, {name!r}) failed")


def pool_initializer(
    role: str, cpus: tuple[int, ...], inner: Callable[..., object] | None
) -> Callable[..., None]:
    """Name the thread `<role>-N`, bind it to `cpus` where `bind_target` allows,
    then run `inner`.

    N counts the role's pool threads in this process. Whether to bind is
    decided as each thread starts (pools start threads on demand, maybe after
    the daemon adopted the process). `inner`, the caller's own initializer,
    runs as before and may raise (the pool then breaks, as it would have);
    our own failures are one warning and no more.
    """

    def initialize(*initargs: object) -> None:
        with _lock:
            n = _counters.get(role, 0)
            _counters[role] = n + 1
        try:
            name_thread(f"{role}-{n}")
        except Exception as err:
            warn_once("pool thread", role=role, error=repr(err))
        try:
            target = bind_target(cpus)
            if target:
                # pid 0: the calling thread only (sched_setaffinity(2)).
                os.sched_setaffinity(0, target)
        except Exception as err:
            # The daemon still binds the thread by its name.
            shown = ",".join(map(str, cpus))
            warn_once("bind failed", "skip", role=role, cpus=shown, error=repr(err))
        if inner is not None:
            inner(*initargs)

    return initialize


# -- the ThreadPoolExecutor patch ------------------------------------------------------------------


def init_codes(executor: object) -> frozenset[CodeType]:
    """The __init__ code objects of `executor`'s classes: frames to skip when a
    subclass's __init__ calls ours through super()."""
    codes = set()
    for klass in type(executor).__mro__:
        code = getattr(klass.__dict__.get("__init__"), "__code__", None)
        if isinstance(code, _CODE_TYPE):
            codes.add(code)
    return frozenset(codes)


_CODE_TYPE = type(init_codes.__code__)  # types.CodeType without importing types


def creator_module(frame: FrameType | None, skip: frozenset[CodeType]) -> str:
    """The module name of the first frame outside the executor's own __init__s."""
    while frame is not None and frame.f_code in skip:
        frame = frame.f_back
    if frame is None:
        return ""
    name = frame.f_globals.get("__name__")
    return name if isinstance(name, str) else ""


def adjust_pool_args(
    role: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The executor's arguments with max_workers capped and our initializer."""
    if len(args) > len(POOL_PARAMS) or any(p in kwargs for p in POOL_PARAMS[: len(args)]):
        return args, kwargs  # not the signature we know: leave it to the original
    params = dict(zip(POOL_PARAMS, args, strict=False))
    params.update(kwargs)
    cpus = role_cpus(role)
    max_workers = params.get("max_workers")
    if cpus and (max_workers is None or (isinstance(max_workers, int) and max_workers > len(cpus))):
        params["max_workers"] = len(cpus)
    inner = params.get("initializer")
    if inner is not None and not callable(inner):
        return args, kwargs  # the original raises its TypeError
    params["initializer"] = pool_initializer(role, cpus, inner)
    return (), params


def patch_executor(module: ModuleType, roles: dict[str, tuple[str, ...]]) -> None:
    """Wrap `module.ThreadPoolExecutor.__init__` in place (covers names imported earlier)."""
    klass = module.ThreadPoolExecutor
    original = klass.__init__
    if getattr(original, MARK, False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            # 3.14's InterpreterPoolExecutor runs its initializer in another
            # interpreter, where our closure cannot go: left alone.
            if any(k.__name__ == "InterpreterPoolExecutor" for k in type(self).__mro__):
                original(self, *args, **kwargs)
                return
            skip = init_codes(self)
            role = module_role(creator_module(sys._getframe(1), skip), roles)
            if role is not None:
                args, kwargs = adjust_pool_args(role, args, kwargs)
        except Exception as err:
            warn_once("pool", error=repr(err))
        original(self, *args, **kwargs)

    __init__.__doc__ = original.__doc__
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(__init__, MARK, True)
    klass.__init__ = __init__


class _PatchingLoader:
    """Runs the real loader, then patches the module it loaded."""

    def __init__(self, loader: Any, on_load: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.on_load = on_load

    def create_module(self, spec: Any) -> ModuleType | None:
        created: ModuleType | None = self.loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps the real loader (tracebacks, inspect.getsource).
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        try:
            self.on_load(module)
        except Exception as err:
            warn_once("patch", module=module.__name__, error=repr(err))


class PatchOnImport:
    """A meta-path finder that patches `target` when the program first imports it."""

    def __init__(self, on_load: Callable[[ModuleType], None], target: str = TARGET) -> None:
        self.on_load = on_load
        self.target = target

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        if self in sys.meta_path:  # once; and not asked again by find_spec below
            sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.on_load)  # type: ignore[assignment]
            return spec
        except Exception as err:
            warn_once("import hook", module=fullname, error=repr(err))
            return None


def patch_on_import(name: str, on_load: Callable[[ModuleType], None]) -> None:
    """`on_load(module)` now if `name` is imported, else when the program imports it."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        on_load(loaded)
    else:
        sys.meta_path.insert(0, PatchOnImport(on_load, name))


def install(text: str) -> bool:
    """Hook this process when `text` (the hook variable) says so and it runs
    below that supervisor; True when hooked."""
    pid, roles = parse_hook_env(text)
    early = os.environ.get(EARLY_ENV)
    if not (roles or early) or not below(pid):
        return False
    # The engine itself (the supervisor's child) is never a rank.
    if early and os.getppid() != pid:
        try:
            import placement_supervisor_early  # type: ignore[import-not-found]

            placement_supervisor_early.install_early(early, patch_on_import, warn_once)
        except Exception as err:
            warn_once("early bind", error=repr(err))
    if not roles:
        return True

    def on_load(module: ModuleType) -> None:
        patch_executor(module, roles)

    patch_on_import(TARGET, on_load)
    return True


# -- chaining -----------------------------------------------------------------------------------


def later_path(path: Iterable[str], here: str) -> list[str]:
    """The sys.path entries after the first one that is `here` (and not `here`)."""
    out: list[str] = []
    found = False
    for entry in path:
        same = os.path.abspath(entry or os.curdir) == here
        if found and not same:
            out.append(entry)
        found = found or same
    return out


def chain(here: str) -> None:
    """Run the sitecustomize that would have run without us, as `sitecustomize`.

    Its own errors propagate: `site` reports them exactly as it would have.
    """
    try:
        import importlib.machinery
        import importlib.util

        rest = later_path(sys.path, here)
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
    except Exception as err:
        warn_once("chain", "skip", error=repr(err))
        return
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        raise


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    text = os.environ.get(HOOK_ENV)
    if text:
        try:
            install(text)
        except Exception as err:
            warn_once("start-up", error=repr(err))
    chain(here)


if __name__ == "sitecustomize":
    main()
