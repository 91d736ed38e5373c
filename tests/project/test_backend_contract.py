"""The contract every backend in `registry.ENGINES` and `registry.FRAMEWORKS` keeps, on its library's real classes.

(a) instrument() then uninstrument() leaves every class `__dict__` entry identical (`is`) to what it was;
(b) instrument() twice patches once;
(c) what the original returns reaches the caller as it is, and what it raises is the same exception object;
(d) a failure inside a wrapper's own code is counted as a `wrapper_error` drop and never raised.

(a) and (b) run on the real classes as the library defines them. For (c) and (d) each patched method is called,
through the backend's own wrapper, around a stand-in original installed on the real class for the test: the real
methods need a live engine (GPU memory, a peer, a scheduler loop). The call's arguments are unreadable (every
attribute, item, length, number, text or truth value of them raises), so every observer that looks at them fails:
each such failure must be counted and swallowed, while the stand-in's answer goes through untouched.

vLLM is installed in its own virtualenv only: its case runs this same file there, with pytest.
A new backend needs nothing here: a line in `registry.py` and it is held to the contract.
"""

import asyncio
import gc
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import traceback

import pytest
import wrapt
from support import vllm_ascend_source
from support.parts import require_part
from support.paths import ROOT

from otel_kvtransfer import config, registry, semconv
from otel_kvtransfer.recording import clock, integration, records
from otel_kvtransfer.recording.patching import Backend, EngineSpec, FrameworkSpec, is_ours, observe_call
from otel_kvtransfer.recording.recorder import RECORDER, Sink

IN_PROCESS = "KVT_CONTRACT_IN_PROCESS"  # set when this file runs inside another virtualenv
# Backends whose library lives in another virtualenv: the test runs this file there.
ELSEWHERE = {"otel_kvtransfer.frameworks.vllm": "vllm", "otel_kvtransfer.frameworks.vllm_ascend": "vllm_ascend"}
BACKENDS = registry.ENGINES + registry.FRAMEWORKS


class Unreadable(Exception):
    """What every read of a `Poison` raises: not an AttributeError, so `getattr(x, name, default)` raises it too."""


class Poison:
    """An argument (or instance) no observer can read."""

    def _fail(self, *_args, **_kwargs):
        raise Unreadable("unreadable argument")

    __getattr__ = __len__ = __iter__ = __getitem__ = __contains__ = _fail
    __int__ = __index__ = __float__ = __bool__ = __hash__ = __str__ = __format__ = _fail
    __eq__ = __lt__ = __le__ = __gt__ = __ge__ = __call__ = _fail

    def __repr__(self):
        return "<Poison>"


class Boom(Exception):
    """The stand-in original's own exception."""


class StandIn:
    """A stand-in original for `owner.attr`: answers `sentinel`, or raises `error` while `raising`."""

    def __init__(self, coroutine: bool):
        self.sentinel, self.error, self.raising, self.calls = object(), Boom("the original failed"), False, 0
        stand_in = self

        def original(*_args, **_kwargs):
            stand_in.calls += 1
            if stand_in.raising:
                raise stand_in.error
            return stand_in.sentinel

        async def original_coroutine(*args, **kwargs):
            return original(*args, **kwargs)

        self.function = original_coroutine if coroutine else original
        self.code = original.__code__


def _module_classes(module) -> list:
    """The classes defined in a module, and their bases: every owner a backend may patch there."""
    found = {}
    for value in list(vars(module).values()):
        if isinstance(value, type):
            for klass in inspect.getmro(value):
                if klass is not object:
                    found[id(klass)] = klass
    return list(found.values())


def _snapshot(classes) -> dict:
    return {klass: dict(vars(klass)) for klass in classes}


def _changed(snapshot: dict) -> list:
    """Entries not identical (`is`) to the snapshot's, or added or removed, as 'Class.attr'."""
    changed = []
    for klass, entries in snapshot.items():
        now = vars(klass)
        for name in set(entries) | set(now):
            if name not in entries or name not in now or now[name] is not entries[name]:
                changed.append(f"{klass.__qualname__}.{name}")
    return sorted(changed)


def _outcome(value):
    """The call's answer; a coroutine (vLLM's async methods) is run to its answer."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


class Recording(Sink):
    """The real recorder, started on its own: the backends' wrappers record (and count drops) only while it is."""

    def __init__(self):
        self.drops, self.records = {}, []
        self.take = self.records.append
        RECORDER.start(config.load(), self)

    def count_drops(self, reason, amount):
        self.drops[reason] = self.drops.get(reason, 0) + amount

    def wrapper_errors(self) -> int:
        RECORDER.drain()  # hands over the records and reports the drops counted so far
        return self.drops.get("wrapper_error", 0)


@pytest.fixture
def recording():
    if RECORDER.active:
        RECORDER.stop()
    yield Recording()
    RECORDER.stop()


def _load(name: str):
    """The backend and its library's real modules, imported; skips (with why) what this virtualenv lacks."""
    backend = importlib.import_module(name)
    loaded = []
    for module_name in backend.modules():
        try:
            loaded.append(importlib.import_module(module_name))
        except ImportError as error:
            require_part(False, f"{module_name}, which {name} patches ({error})")
    return backend, loaded


def _run_elsewhere(name: str, venv: str) -> None:
    """This file's case for `name`, run by pytest in the virtualenv that holds the backend's library."""
    from vllm_serving import harness

    python = harness.vllm_python()
    require_part(harness.vllm_ready(python), f"the {venv} virtualenv at {python} (run `bash scripts/setup-vllm.sh`)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
    env.update({IN_PROCESS: "1", "PYTHONPATH": os.pathsep.join(_elsewhere_path(venv))})
    # the one case by its id (`-k vllm` would also pick vllm_ascend's)
    done = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_backend_contract[{name}]"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


def _elsewhere_path(module: str) -> tuple:
    """What the vLLM venv needs first on its path for `module`: vllm-ascend's source and the stand-in of its NPU
    library (tests/frameworks/vllm_ascend), or nothing but this checkout."""
    if module != "vllm_ascend":
        return (ROOT,)
    require_part(vllm_ascend_source.ready(),
                 f"vllm-ascend's source at {vllm_ascend_source.source_dir()} (run `bash scripts/setup-vllm-ascend.sh`)")
    return vllm_ascend_source.STANDIN, vllm_ascend_source.source_dir(), ROOT


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_contract(name, recording):
    if name in ELSEWHERE and not os.environ.get(IN_PROCESS):
        if importlib.util.find_spec(ELSEWHERE[name]) is None:
            _run_elsewhere(name, ELSEWHERE[name])
            return
    backend, modules = _load(name)
    assert isinstance(backend, Backend)
    assert isinstance(backend.SPEC, EngineSpec if name in registry.ENGINES else FrameworkSpec)
    classes = [klass for module in modules for klass in _module_classes(module)]
    before = _snapshot(classes)
    try:
        # (a), (b) on the real classes.
        assert backend.instrument() is True
        patched = backend.patcher.patched()
        assert patched, f"{name} patched nothing in {backend.modules()}"
        assert all(is_ours(vars(owner)[attr]) for owner, attr in patched)
        assert {id(owner) for owner, _ in patched} <= {id(klass) for klass in classes}
        entries = [vars(owner)[attr] for owner, attr in patched]
        assert backend.instrument() is True
        assert backend.patcher.patched() == patched
        assert all(vars(owner)[attr] is entry for (owner, attr), entry in zip(patched, entries))
        backend.uninstrument()
        assert _changed(before) == []
        assert backend.patcher.patched() == []

        # (c), (d) through each wrapper, around a stand-in original on the real class.
        stand_ins = {}
        for owner, attr in patched:
            stand_ins[(owner, attr)] = StandIn(inspect.iscoroutinefunction(before[owner][attr]))
            setattr(owner, attr, stand_ins[(owner, attr)].function)
        with_stand_ins = _snapshot(classes)
        assert backend.instrument() is True
        assert backend.patcher.patched() == patched
        counted = []
        for (owner, attr), stand_in in stand_ins.items():
            wrapper = vars(owner)[attr]
            assert is_ours(wrapper)
            errors = recording.wrapper_errors()
            answer = _outcome(wrapper.__get__(Poison(), owner)(*[Poison() for _ in range(6)]))
            assert answer is stand_in.sentinel, f"{owner.__qualname__}.{attr} changed the return value"
            stand_in.raising = True
            with pytest.raises(Boom) as raised:
                _outcome(wrapper.__get__(Poison(), owner)(*[Poison() for _ in range(6)]))
            assert raised.value is stand_in.error, f"{owner.__qualname__}.{attr} replaced the exception"
            frames = [frame.f_code for frame, _ in traceback.walk_tb(raised.value.__traceback__)]
            assert stand_in.code in frames  # the original's own frame is still in its traceback
            assert stand_in.calls == 2  # the original ran exactly once per call
            if recording.wrapper_errors() > errors:
                counted.append(f"{owner.__qualname__}.{attr}")
        # Every observer here read the unreadable arguments inside its guard; at least one of each backend's
        # observers ran (the others are gated on state a live engine would have, and called straight through).
        assert counted, f"no wrapper of {name} counted its own failure"
        backend.uninstrument()
        assert _changed(with_stand_ins) == []
    finally:
        backend.uninstrument()
        for klass, entries in before.items():  # the library's own originals back, exactly
            for attr, entry in entries.items():
                if vars(klass).get(attr) is not entry:
                    setattr(klass, attr, entry)
    assert _changed(before) == []


def test_mooncake_hot_path_builds_what_the_constructors_build(recording, monkeypatch):
    """The Mooncake sync wrapper writes its records out (calling `records.call` and `records.raw_call` would be
    more Python frames per transfer): inside a transfer scope and outside one, they must be what the constructors
    build from the same values, and what the general path (keyword arguments, through `_call`) builds; the engine
    gets each call as it was made."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")  # the transport of engines initialised before instrument()
    backend, (module,) = _load("otel_kvtransfer.engines.mooncake")
    engine_class = module.TransferEngine
    originals = {name: vars(engine_class)[name] for name in ("transfer_sync_write", "batch_transfer_sync_read")}
    engine = object()  # the stand-in originals never touch the engine (a real one needs a peer)
    received = []  # what each original was called with: the wrapper passes the call on as it came

    def original(self, *args, **kwargs):  # a completed transfer (rc 0)
        received.append((self, args, kwargs))
        return 0

    try:
        for name in originals:
            setattr(engine_class, name, original)
        assert backend.instrument() is True
        assert engine_class.transfer_sync_write(engine, "10.0.0.1:15001", 4096, 8192, 65536) == 0
        assert engine_class.transfer_sync_write(engine, target_hostname="10.0.0.1:15001", buffer=4096,
                                                peer_buffer_address=8192, length=65536) == 0
        lengths = [1024, 2048, 4096]
        assert engine_class.batch_transfer_sync_read(engine, "10.0.0.2:15002", [1, 2, 3], [4, 5, 6], lengths) == 0
        assert engine_class.transfer_sync_write(engine, "10.0.0.1:15001", 4096, 8192, length=65536) == 0
        with integration.transfer_scope(7):
            assert engine_class.transfer_sync_write(engine, "10.0.0.1:15001", 4096, 8192, 65536) == 0
        recording.wrapper_errors()
    finally:
        backend.uninstrument()
        for name, entry in originals.items():
            setattr(engine_class, name, entry)
    assert received == [
        (engine, ("10.0.0.1:15001", 4096, 8192, 65536), {}),
        (engine, (), {"target_hostname": "10.0.0.1:15001", "buffer": 4096, "peer_buffer_address": 8192,
                      "length": 65536}),
        (engine, ("10.0.0.2:15002", [1, 2, 3], [4, 5, 6], lengths), {}),
        (engine, ("10.0.0.1:15001", 4096, 8192), {"length": 65536}),
        (engine, ("10.0.0.1:15001", 4096, 8192, 65536), {})]
    assert len(recording.records) == 5
    hot, general, batch, mixed, scoped = recording.records

    def expected(record, nbytes, descriptors, op, peer):
        assert record[records.KIND] == records.RAW_CALL and len(record) == records.RAW_CONTEXT + 1
        call = record[records.RAW_CALL_FIELDS]
        return records.raw_call(records.call(call[records.CALL_START], call[records.CALL_END], nbytes, descriptors,
                                             op, peer, "tcp", 0, None, "mooncake"), record[records.RAW_CONTEXT])

    def expected_monotonic(record, nbytes, descriptors, op, peer):
        assert record[records.KIND] == records.RAW_MONOTONIC and len(record) == records.MONO_CONTEXT + 1
        return records.raw_monotonic(record[records.MONO_START], record[records.MONO_END], nbytes, descriptors, peer,
                                     0, records.call_form(op, "tcp", "mooncake", None, "transfer_failed"),
                                     record[records.MONO_CONTEXT])

    # The common call's records take the two clock readings as monotonic_ns() gave them (the builder adds BASE),
    # and what its engine's calls share as one form; the general path's are on the records' clock.
    assert hot == expected_monotonic(hot, 65536, 1, semconv.OP_WRITE, "10.0.0.1:15001")
    assert general == expected(general, 65536, 1, semconv.OP_WRITE, "10.0.0.1:15001")
    assert batch == expected_monotonic(batch, sum(lengths), 3, semconv.OP_READ, "10.0.0.2:15002")
    assert mixed == expected(mixed, 65536, 1, semconv.OP_WRITE, "10.0.0.1:15001")
    assert abs(hot[records.MONO_START] + clock.BASE - general[records.CALL_START + 1]) < 60 * 10**9
    assert scoped[records.KIND] == records.SEND
    (in_scope,) = scoped[records.SEND_CALLS]
    assert in_scope == records.call(in_scope[records.CALL_START], in_scope[records.CALL_END], 65536, 1,
                                    semconv.OP_WRITE, "10.0.0.1:15001", "tcp", 0, None, "mooncake")
    assert abs(in_scope[records.CALL_START] - general[records.CALL_START + 1]) < 60 * 10**9  # the records' clock
    # No span was current: the record holds no context, only plain values (a batch's lengths summed on the calling
    # thread) and its form, itself of plain values, so the GC stops tracking it at its first collection once its
    # form is untracked (the form an engine's calls share is, at the first collection after it was made), and a
    # queue of such records costs the later collections nothing. Here every call made its form afresh (the engine
    # is no weakly referable object): one that a collection reaches before the record's is untracked at the next.
    assert hot[records.MONO_CONTEXT] is None
    gc.collect()
    gc.collect()
    assert [gc.is_tracked(r) for r in (hot, hot[records.MONO_FORM], general, batch)] == [False] * 4


def test_observe_call_shows_the_call_and_never_changes_it(recording):
    """The helper every wrapper is built with: the observers see the call (the token passes from before to after,
    the exception too with on_raise); a failing observer is counted, never raised; when() off means not called."""
    error, seen, on = Boom("the call failed"), [], [True]

    class Target:
        def method(self, value):
            if value == "raise":
                raise error
            return [value]

    def before(instance, args, kwargs):
        seen.append(("before", args))
        if args[0] == "bad":
            raise Unreadable("before")
        return "token"

    def after(instance, args, kwargs, token, result, raised):
        seen.append(("after", token, result, raised))
        if args[0] == "bad":
            raise Unreadable("after")

    wrapt.wrap_function_wrapper(Target, "method", observe_call("observe", before, after, when=lambda: on[0],
                                                               on_raise=True))
    target = Target()
    assert target.method("ok") == ["ok"]
    assert seen == [("before", ("ok",)), ("after", "token", ["ok"], None)]
    seen.clear()
    with pytest.raises(Boom) as raised:
        target.method("raise")
    assert raised.value is error
    assert seen == [("before", ("raise",)), ("after", "token", None, error)]
    seen.clear()
    errors = recording.wrapper_errors()
    assert target.method("bad") == ["bad"]
    assert seen == [("before", ("bad",)), ("after", None, ["bad"], None)]
    assert recording.wrapper_errors() == errors + 2
    seen.clear()
    on[0] = False
    assert target.method("ok") == ["ok"]
    assert seen == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_declares_its_distributions_and_supported_range(name):
    """Its range is a PEP 440 specifier with a lower bound, and that bound is what the package's `instruments-any`
    list (wiring/package.py, the same as pyproject.toml's extra) asks of each of its distributions: the oldest
    release it works on is said in one way everywhere."""
    from packaging.specifiers import SpecifierSet

    from otel_kvtransfer.wiring.activation import bounds
    from otel_kvtransfer.wiring.package import _instruments_any

    backend = importlib.import_module(name)
    lower = [spec.version for spec in SpecifierSet(backend.SUPPORTED) if spec.operator == ">="]
    assert len(lower) == 1, backend.SUPPORTED
    assert backend.DISTRIBUTIONS and all(isinstance(d, str) and d for d in backend.DISTRIBUTIONS)
    for distribution in backend.DISTRIBUTIONS:
        assert f"{distribution} >= {lower[0]}" in _instruments_any, (distribution, _instruments_any)
    if backend.SPEC.version_gate:  # a framework: its gate enforces exactly the range it declares
        assert (backend.HOOKS.minimum, backend.HOOKS.below) == bounds(backend.SUPPORTED)
        assert backend.HOOKS.is_supported(lower[0])


def test_every_instruments_any_entry_belongs_to_a_backend():
    from otel_kvtransfer.wiring.package import _instruments_any

    declared = {distribution for name in BACKENDS for distribution in importlib.import_module(name).DISTRIBUTIONS}
    assert {entry.split(" ")[0] for entry in _instruments_any} == declared


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_is_one_spec_and_its_views(name):
    """One frozen spec per backend says what it is and what it patches; the module-level names the package, its
    tests and its docs use are views of it, and its one lazy patcher (`HOOKS`) is driven by it."""
    import dataclasses

    from otel_kvtransfer.wiring.activation import LazyPatcher

    backend = importlib.import_module(name)
    spec = backend.SPEC
    assert dataclasses.is_dataclass(spec) and type(spec).__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "renamed"
    assert isinstance(backend.HOOKS, LazyPatcher) and backend.HOOKS.spec is spec
    assert backend.HOOKS.patcher is backend.patcher
    assert (backend.instrument, backend.uninstrument, backend.modules) == (
        backend.HOOKS.instrument, backend.HOOKS.uninstrument, backend.HOOKS.modules)
    assert (backend.DISTRIBUTIONS, backend.SUPPORTED, backend.modules()) == (
        spec.distributions, spec.supported, spec.modules)
    assert spec.patches and all(callable(patch.apply) for patch in spec.patches)
    if name in registry.ENGINES:
        assert (backend.BACKEND, backend.SETUP_IN_FIRST_CALL) == (spec.name, spec.setup_in_first_call)
        assert backend.peer_attributes is spec.peer_attributes
        assert not spec.version_gate
    else:
        assert backend.FRAMEWORK == spec.name and spec.version_gate
        assert backend.is_supported == backend.HOOKS.is_supported
    hooked = [patch.module for patch in spec.patches]
    if name.endswith("engines.nixl"):  # `nixl` picks its build as it is imported: patched then, in `nixl._api`
        assert hooked == ["nixl"] and spec.modules == ("nixl._api",)
    else:
        assert spec.modules == tuple(dict.fromkeys(hooked))


def test_an_engine_spec_drives_the_same_lazy_patcher(tmp_path, monkeypatch, caplog):
    """What an engine's spec asks of the one lazy patcher, on a module of our own (named as such) imported for real:
    nothing before its module is imported, patched the moment it is, undone with the backend's own state on
    uninstrument; an absent library is not patched; a patch that raises is named once and leaves nothing patched."""
    import logging

    from otel_kvtransfer.recording.patching import EngineSpec, Patch, Patcher
    from otel_kvtransfer.wiring.activation import LazyPatcher

    (tmp_path / "kvt_standin_engine.py").write_text("class Engine:\n    def transfer(self):\n        return 'moved'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvt_standin_engine", raising=False)
    patcher, seen = Patcher("stand-in"), []

    def patch(module):
        patcher.wrap(module.Engine, "transfer", observe_call("time", when=None))

    def broken(module):
        raise Unreadable("a class the release renamed")

    def spec(apply, available=lambda: True):
        return EngineSpec("standin", ("kvt-standin",), ">=1.0", (Patch("kvt_standin_engine", apply),),
                          available=available, prepare=lambda: seen.append("prepare"),
                          forget=lambda: seen.append("forget"))

    assert LazyPatcher(spec(patch, available=lambda: False), patcher).instrument() is False
    hooks = LazyPatcher(spec(patch), patcher)
    try:
        assert hooks.instrument() is True and patcher.patched() == [] and seen == ["prepare"]
        module = importlib.import_module("kvt_standin_engine")
        assert patcher.patched() == [(module.Engine, "transfer")] and module.Engine().transfer() == "moved"
        hooks.uninstrument()
        assert patcher.patched() == [] and seen == ["prepare", "forget"]
        assert hooks.instrument() is True and patcher.patched() == [(module.Engine, "transfer")]  # imported: now
    finally:
        hooks.uninstrument()
    failing = LazyPatcher(spec(broken), patcher)
    with caplog.at_level(logging.WARNING, logger="otel_kvtransfer.wiring.activation"):
        assert failing.instrument() is False  # the module is imported: patched at once, and that failed
        assert failing.instrument() is False
    said = [r.getMessage() for r in caplog.records if "lacks what its instrumentation needs" in r.getMessage()]
    assert len(said) == 1 and "kvt_standin_engine: the patch failed" in said[0]
    assert patcher.patched() == [] and failing.blocked


def test_mooncake_hot_path_names_each_engines_own_transport_and_device(recording, monkeypatch):
    """The common call keeps the last engine's transport and device for the next call on the same engine: calls
    alternating between two engines, and an engine initialised again, must each carry their own engine's."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)  # either would name every engine's transport
    monkeypatch.delenv("MOONCAKE_PROTOCOL", raising=False)
    backend, (module,) = _load("otel_kvtransfer.engines.mooncake")
    engine_class = module.TransferEngine
    names = ("transfer_sync_write", "batch_transfer_sync_write", "initialize")
    originals = {name: vars(engine_class)[name] for name in names}

    class StandIn:  # the stand-in originals never touch the engine (a real one needs a peer); weakly referable
        pass

    first, second = StandIn(), StandIn()

    def original(self, *args, **kwargs):
        return 0

    try:
        for name in names:
            setattr(engine_class, name, original)
        assert backend.instrument() is True
        assert engine_class.initialize(first, "127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
        assert engine_class.initialize(second, "127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        for engine in (first, first, second, first, second, second, first):
            assert engine_class.transfer_sync_write(engine, "10.0.0.1:15001", 4096, 8192, 64) == 0
        assert engine_class.initialize(first, "127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_1") == 0
        assert engine_class.batch_transfer_sync_write(first, "10.0.0.1:15001", [1], [2], [64]) == 0
        assert engine_class.transfer_sync_write(second, "10.0.0.1:15001", 4096, 8192, 64) == 0
        recording.wrapper_errors()
    finally:
        backend.uninstrument()
        for name, entry in originals.items():
            setattr(engine_class, name, entry)
    calls = [records.monotonic_call(r, 0) for r in recording.records]
    seen = [(call[records.CALL_PROTOCOL], call[records.CALL_EXTRA]) for call in calls]
    rdma0, rdma1, tcp = ("rdma", {semconv.NIC: "mlx5_0"}), ("rdma", {semconv.NIC: "mlx5_1"}), ("tcp", None)
    assert seen == [rdma0, rdma0, tcp, rdma0, tcp, tcp, rdma0, rdma1, tcp]
    # Back to back on one engine, its writes share one form object: what pickle sends once a batch.
    forms = [r[records.MONO_FORM] for r in recording.records]
    assert forms[0] is forms[1] and forms[4] is forms[5] and forms[0] is not forms[2]


class _StandInEngine:
    """What the async wrappers are called with in place of a TransferEngine: any object a weak reference can name
    (the wrappers keep the last engine's forms by one), as a pybind engine is."""


_ASYNC_CALLS = ("batch_transfer_async_write", "get_batch_transfer_status", "transfer_check_status")
_COMPILED_TYPES = {"batch_transfer_async_write": "Submission", "get_batch_transfer_status": "BatchWait"}


def _prime(engine_class, engine, recording):
    """One send made and its record let go: the wrappers now know `engine` (they keep the last engine's forms,
    and take a call on another engine, as the first after instrument(), the Python way)."""
    from otel_kvtransfer.engines import mooncake

    primer = engine_class.batch_transfer_async_write(engine, "10.0.0.9:15001", [1], [2], [8])
    assert engine_class.get_batch_transfer_status(engine, [primer]) == 0
    assert mooncake._last_engine[0][0]() is engine
    recording.wrapper_errors()
    recording.records.clear()


def _assert_wrappers_of(engine_class, hot_path):
    """The async wrappers on the class are the ones `hot_path` makes (a test of one path never runs the other)."""
    for name, compiled_type in _COMPILED_TYPES.items():
        made = type(vars(engine_class)[name])
        assert (made.__name__ == compiled_type) is (hot_path == "compiled"), (name, made)


def test_mooncake_async_path_writes_what_the_constructors_build(hot_path, recording, monkeypatch):
    """The common async submission puts its pending entry in the table itself and its completion writes the
    record out (`records.raw_async`): what they hand over must be what the constructors build from the same
    values, on the compiled path and the Python one; a submission inside a transfer scope goes through
    `PendingTransfers.submit` and ends as that scope's send."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    backend, (module,) = _load("otel_kvtransfer.engines.mooncake")
    engine_class = module.TransferEngine
    originals = {name: vars(engine_class)[name] for name in _ASYNC_CALLS}
    engine, ids = _StandInEngine(), iter(range(101, 200))

    try:
        engine_class.batch_transfer_async_write = lambda self, *args: next(ids)
        engine_class.get_batch_transfer_status = lambda self, *args: 0
        engine_class.transfer_check_status = lambda self, *args: 0  # still running
        assert backend.instrument() is True
        _assert_wrappers_of(engine_class, hot_path)
        _prime(engine_class, engine, recording)
        before = clock.now_ns()
        raw = engine_class.batch_transfer_async_write(engine, "10.0.0.1:15001", [1, 2], [3, 4], [4096, 1024])
        with integration.transfer_scope(9, chunk_index=2):
            scoped = engine_class.batch_transfer_async_write(engine, "10.0.0.1:15001", [5], [6], [512])
        polled = clock.now_ns()
        assert engine_class.transfer_check_status(engine, scoped) == 0
        waited = clock.now_ns()
        assert engine_class.get_batch_transfer_status(engine, [raw, scoped]) == 0
        after = clock.now_ns()
        recording.wrapper_errors()
    finally:
        backend.uninstrument()
        for name, entry in originals.items():
            setattr(engine_class, name, entry)
    first, second = recording.records
    assert first[records.KIND] == records.RAW_ASYNC
    start, end, window, posted = records.async_times(first)
    # No poll saw it running: its window reaches back to its start.
    assert before <= start <= posted <= waited <= end <= after and window == start
    form = records.call_form(semconv.OP_WRITE, "tcp", "mooncake", None, "transfer_failed")
    assert first == records.raw_async(start, end - start, 5120, 2, "10.0.0.1:15001", 0, None, form, None, None,
                                      posted - start)
    assert second[records.KIND] == records.SEND
    (call,) = second[records.SEND_CALLS]
    assert second[records.SEND_INFO][records.INFO_CHUNK] == 2
    assert call[records.CALL_BYTES] == 512 and call[records.CALL_END] == end  # both seen ended by the one wait
    assert set(call[records.CALL_EXTRA]) == {semconv.END_UNCERTAINTY_S, semconv.POST_S}
    # A poll saw this one running: its window reaches back to that poll, not to its start.
    window = end - call[records.CALL_EXTRA][semconv.END_UNCERTAINTY_S] * 1e9
    assert polled - 1_000 <= window <= waited + 1_000


def test_mooncake_async_wrappers_take_every_other_case_alike_on_both_paths(hot_path, recording, monkeypatch):
    """What the common case does not cover goes the same way on both paths: a submission inside
    suppress_instrumentation() is the engine's alone; one past a full table is counted as dropped; a refused one
    (0) is a failed send at once; a raising one raises the engine's own exception and leaves nothing pending; one
    called with keywords or a numpy length is parsed as ever; a wait with ids in a tuple, or by keyword, ends
    them; ids nobody submitted are no sends; a length the wrapper cannot count is its own error, counted, the
    engine's answer returned; the recorder stopped, the engine is called straight through."""
    import numpy as np
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    from otel_kvtransfer.engines import mooncake

    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv(config.MAX_PENDING_ASYNC, "3")
    RECORDER.stop()
    recording = Recording()  # started again: the table's bound read from the variable above
    backend, (module,) = _load("otel_kvtransfer.engines.mooncake")
    engine_class = module.TransferEngine
    originals = {name: vars(engine_class)[name] for name in _ASYNC_CALLS}
    engine, ids, calls = _StandInEngine(), iter(range(501, 600)), []
    failure = RuntimeError("the engine's own")
    answers = {}  # a submission's peer -> what the stand-in answers instead of a new id

    def submit(self, peer, *args, **kwargs):
        calls.append(peer)
        answer = answers.get(peer)
        if isinstance(answer, BaseException):
            raise answer
        return next(ids) if answer is None else answer

    def write(peer, length=(4096,), **kwargs):
        return engine_class.batch_transfer_async_write(engine, peer, [1], [2], list(length), **kwargs)

    pending = mooncake._pending.entries
    try:
        engine_class.batch_transfer_async_write = submit
        engine_class.get_batch_transfer_status = lambda self, *args, **kwargs: 0
        engine_class.transfer_check_status = lambda self, *args: 1
        assert backend.instrument() is True
        _assert_wrappers_of(engine_class, hot_path)
        _prime(engine_class, engine, recording)
        with suppress_instrumentation():
            quiet = write("quiet:1")
        assert not pending
        answers["refused:1"] = 0
        assert write("refused:1") == 0
        answers["raising:1"] = failure
        with pytest.raises(RuntimeError) as raised:
            write("raising:1")
        assert raised.value is failure and not pending
        bad = write("bad:1", ("not a length",))  # the wrapper's own failure: counted, the id still returned
        assert bad > 0 and not pending and recording.wrapper_errors() == 1
        first = [write("common:1", (4096, 1024)),
                 engine_class.batch_transfer_async_write(engine, "keyword:1", [1], [2], lengths=[512]),
                 write("numpy:1", (np.int64(7), np.int64(8)))]
        full = write("full:1")  # the table holds 3
        assert len(pending) == 3 and full not in {key[1] for key in pending}
        assert engine_class.get_batch_transfer_status(engine, tuple(first[:2])) == 0
        assert engine_class.get_batch_transfer_status(engine, batch_id_list=[first[2], 999, full]) == 0
        assert not pending
        RECORDER.active = False  # as between stop() and start(): nothing recorded, the engine still called
        try:
            off = write("off:1")
            assert engine_class.get_batch_transfer_status(engine, [off]) == 0
        finally:
            RECORDER.active = True
        assert not pending
        assert recording.wrapper_errors() == 1
    finally:
        backend.uninstrument()
        for name, entry in originals.items():
            setattr(engine_class, name, entry)
    assert calls == ["10.0.0.9:15001", "quiet:1", "refused:1", "raising:1", "bad:1", "common:1", "keyword:1",
                     "numpy:1", "full:1", "off:1"]
    assert quiet > 0 and off > 0
    assert recording.drops == {"async_pending_full": 1, "wrapper_error": 1}
    sends = {}
    for record in recording.records:
        if record[records.KIND] == records.RAW_ASYNC:
            start, end, window, posted = records.async_times(record)
            assert start <= posted <= end and window == start
            sends[record[records.ASYNC_PEER]] = (record[records.ASYNC_BYTES], record[records.ASYNC_DESCRIPTORS],
                                                 record[records.ASYNC_ERROR])
        else:  # the refused submission's send, ended at once
            assert record[records.KIND] == records.RAW_CALL
            call = record[records.RAW_CALL_FIELDS]
            sends[call[records.CALL_PEER]] = (call[records.CALL_BYTES], call[records.CALL_DESCRIPTORS],
                                              call[records.CALL_ERROR])
    assert sends == {"refused:1": (4096, 1, "submit_failed"), "common:1": (5120, 2, None),
                     "keyword:1": (512, 1, None), "numpy:1": (15, 2, None)}
    assert all(type(nbytes) is int for nbytes, _, _ in sends.values())


def test_a_raw_call_stays_raw_while_another_thread_is_in_a_scope(recording, monkeypatch):
    """The common call reads its thread's transfer scope only while some thread is in one (a count the scopes
    keep): a call on a thread outside any scope is a raw send even while another thread's scope is open, a call
    inside one is that scope's, and the count is back where it was once every scope has been left."""
    import threading

    backend, (module,) = _load("otel_kvtransfer.engines.mooncake")
    engine_class = module.TransferEngine
    saved = vars(engine_class)["transfer_sync_write"]
    engine = object()
    entered, leave = threading.Event(), threading.Event()
    before = integration.ENTERED[0]

    def in_a_scope():
        with integration.transfer_scope(3):
            with integration.transfer_scope(4):
                entered.set()
                leave.wait(30)
                engine_class.transfer_sync_write(engine, "10.0.0.9:15009", 1, 2, 512)

    try:
        engine_class.transfer_sync_write = lambda self, *args, **kwargs: 0
        assert backend.instrument() is True
        other = threading.Thread(target=in_a_scope)
        other.start()
        assert entered.wait(30)
        assert integration.ENTERED[0] == before + 2
        assert engine_class.transfer_sync_write(engine, "10.0.0.1:15001", 1, 2, 256) == 0
        leave.set()
        other.join(30)
        assert not other.is_alive()
        recording.wrapper_errors()
    finally:
        leave.set()
        backend.uninstrument()
        engine_class.transfer_sync_write = saved
    assert integration.ENTERED[0] == before
    kinds = [(r[records.KIND], r[records.MONO_BYTES] if r[records.KIND] == records.RAW_MONOTONIC
              else [c[records.CALL_BYTES] for c in r[records.SEND_CALLS]])
             for r in recording.records]
    assert kinds == [(records.RAW_MONOTONIC, 256), (records.SEND, [512])]
