"""The start-up line: one INFO line per instrumented process (logger `otel_kvtransfer`), so an operator can grep a
server's log and see that the instrumentation is on, in which role and rank, and where its spans and metrics go.

    otel_kvtransfer: on (otel_kvtransfer 0.1.0); patched: sglang 0.5.23; engines: mooncake 0.3.14
    (mooncake-transfer-engine-cuda13), nixl absent; devices: mooncake mlx5_0, sglang --disaggregation-ib-device
    mlx5_0; untimed calls: none; role prefill, kv_transfer.tp_rank 0; builder: process; spans: otlp
    (OTLPSpanExporter); metrics: otlp (...)

Each engine is named with the build (the distribution: one of the engine's DISTRIBUTIONS) and version found; the
devices are those configured (each engine's own device list, the framework's device option, UCX_NET_DEVICES); the
untimed calls are the engine calls found that this package neither times nor knows to move no bytes
(recording/untimed.py). Values from the environment and the engine are escaped and bounded: the line stays one line.

instrument() hands over what it set up (`announce`). A process whose framework can name its role and rank (the
framework's KV manager or connector worker, built after the framework configured its logging) prints the line when
it does (`role_known`); one with no framework installed prints it at once; any other prints it after
`GRACE_S`, or at exit if that comes first, without a role. Written through the logging configuration the engine
set up (sglang configures the root logger, at its --log-level); where nobody configured any handler (vLLM
configures only its own `vllm` logger), straight to stderr, so the line is never lost to logging's last resort.
"""

import atexit
import logging
import os
import sys
import threading
from importlib import metadata
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from opentelemetry import metrics, trace

from otel_kvtransfer import sdk_internals
from otel_kvtransfer.building.printable import one_line

LOGGER_NAME = "otel_kvtransfer"
# How long a process with a framework waits for its role before printing without one: an engine process builds
# its KV manager only after loading the model (minutes on a loaded CPU machine); the others never build one.
GRACE_S = 300.0

_logger = logging.getLogger(LOGGER_NAME)
_lock = threading.Lock()
# pending: the Announcement not printed yet; timer: the threading.Timer that prints it after GRACE_S
_state: Dict[str, Any] = {"pending": None, "timer": None, "printed": False}

# What the line says of each framework: (name, version or None, on); of each engine: (name, version or None, on) or
# (name, version or None, on, build)
Backends = Sequence[Tuple[Any, ...]]
Devices = List[Tuple[str, List[str]]]  # [(engine, [device or call name, ...])]


class Announcement:
    """What instrument() set up in this process; the line is made from it when it is printed."""

    def __init__(self, version: str, frameworks: Backends, engines: Union[Backends, Callable[[], Backends]],
                 builder: str, tracer_provider: object = None, meter_provider: object = None) -> None:
        self.version = version
        self.frameworks = frameworks  # [(name, version or None, on)]
        # [(name, version or None, on)], or [(name, version or None, on, build)]; or a callable that answers such a
        # list when the line is printed (an engine module imported after instrument() is then known by its build)
        self.engines = engines
        self.builder = builder  # "process" | "thread"
        self.tracer_provider, self.meter_provider = tracer_provider, meter_provider
        # [(engine, [device, ...])]: the devices each engine was initialised with
        self.engine_devices: Callable[[], Devices] = lambda: []
        self.untimed: Callable[[], Devices] = lambda: []  # [(engine, [call name, ...])]: calls found that are not timed


def announce(announcement: Announcement, wait_for_role: bool) -> None:
    """instrument() is done: print now (no framework can tell a role), or when the role is known / GRACE_S."""
    with _lock:
        _cancel_timer()
        _state.update(pending=announcement, printed=False)
        if wait_for_role:
            timer = threading.Timer(GRACE_S, _print_pending)
            timer.daemon = True
            timer.name = "otel_kvtransfer-startup-line"
            _state["timer"] = timer
            timer.start()
    if not wait_for_role:
        _print_pending()


def withdraw() -> None:
    """uninstrument(): nothing is printed for an instrumentation that is gone."""
    with _lock:
        _cancel_timer()
        _state["pending"] = None


def role_known(framework: str, role: Optional[str], ranks: Optional[Dict[str, Any]],
               devices: Optional[Dict[str, Any]] = None) -> None:
    """A framework learnt this process's role and rank: the line goes out now (once per process). `devices`: the
    framework's device options and their values (e.g. {"--disaggregation-ib-device": "mlx5_0"}), when set."""
    _print_pending(framework, role, ranks, devices)


def _cancel_timer() -> None:
    timer = _state["timer"]
    if timer is not None:
        timer.cancel()
        _state["timer"] = None


def _print_pending(framework: Optional[str] = None, role: Optional[str] = None, ranks: Optional[Dict[str, Any]] = None,
                   devices: Optional[Dict[str, Any]] = None) -> None:
    try:
        with _lock:
            announcement = _state["pending"]
            if announcement is None or _state["printed"]:
                return  # nothing set up, or already said
            _state["printed"] = True
            _cancel_timer()
        emit(line(announcement, framework, role, ranks, devices))
    except Exception:  # the line is a courtesy: it never disturbs the engine
        _logger.debug("otel_kvtransfer: the start-up line failed", exc_info=True)
    finally:
        for listener in list(_printed_listeners):
            try:
                listener()
            except Exception:
                _logger.debug("otel_kvtransfer: a start-up line listener failed", exc_info=True)


# Called once the line went out (or could not): later finds get a line of their own.
_printed_listeners: List[Callable[[], None]] = []


def on_printed(listener: Callable[[], None]) -> None:
    if listener not in _printed_listeners:
        _printed_listeners.append(listener)


def shown(value: object) -> str:
    """A value from the environment or an engine, as one bounded line (building.printable: the rule every line
    of ours follows)."""
    return one_line(value)


def _parts(items: Backends) -> str:
    said = []
    for item in items:
        name, version, on = item[:3]
        build = item[3] if len(item) > 3 else None
        text = f"{name} {version}" if version else f"{name} absent"
        if version and build:
            text += f" ({build})"
        if version and not on:
            text += " (not patched)"
        said.append(text)
    return ", ".join(said) or "none"


def _named(pairs: Iterable[Tuple[Any, Sequence[Any]]]) -> str:
    """[(owner, [value, ...])] -> "owner a, b; owner2 c" (escaped, bounded)."""
    return ", ".join(f"{shown(owner)} {' '.join(shown(value) for value in values[:16])}"
                     for owner, values in pairs if values)


def devices_part(announcement: Announcement, framework: Optional[str] = None,
                 devices: Optional[Dict[str, Any]] = None) -> str:
    pairs: List[Tuple[str, List[Any]]] = list(announcement.engine_devices())
    if framework and devices:
        pairs.extend((f"{framework} {option}", [value]) for option, value in sorted(devices.items()) if value)
    ucx = os.environ.get("UCX_NET_DEVICES", "").strip()
    if ucx:
        pairs.append(("UCX_NET_DEVICES", [ucx]))
    return _named(pairs) or "none named"


def line(announcement: Announcement, framework: Optional[str] = None, role: Optional[str] = None,
         ranks: Optional[Dict[str, Any]] = None, devices: Optional[Dict[str, Any]] = None) -> str:
    """The start-up line's text (pure apart from reading the providers, OTEL_* and UCX_NET_DEVICES)."""
    frameworks = [item for item in announcement.frameworks if item[1]]  # installed ones only
    engines = announcement.engines() if callable(announcement.engines) else announcement.engines
    where = f"role {role}" if role else "no role in this process (no KV manager or connector worker seen)"
    if ranks:
        where += "".join(f", {name} {value}" for name, value in sorted(ranks.items()))
    if framework:
        where += f" ({framework})"
    untimed = _named([(engine, [f"{name}()" for name in names]) for engine, names in announcement.untimed()])
    return (f"otel_kvtransfer: on (otel_kvtransfer {announcement.version}); patched: {_parts(frameworks)}; "
            f"engines: {_parts(engines)}; devices: {devices_part(announcement, framework, devices)}; "
            f"untimed calls: {untimed or 'none'}; {where}; builder: {announcement.builder}; "
            f"spans: {spans_destination(announcement.tracer_provider)}; "
            f"metrics: {metrics_destination(announcement.meter_provider)}")


def _variable(name: str) -> str:
    value = os.environ.get(name, "").strip()
    return value[:120] if value else "unset"


def spans_destination(provider: object = None) -> str:
    """OTEL_TRACES_EXPORTER and the exporters the provider's span processors hold (class names)."""
    if provider is None or isinstance(provider, trace.ProxyTracerProvider):  # an SDK may have come since
        provider = trace.get_tracer_provider()
    processors = sdk_internals.span_processors(provider)
    if processors is None:
        held = "no SDK tracer provider yet"
    else:
        names = [type(getattr(p, "span_exporter", None) or p).__name__ for p in processors
                 if not type(p).__module__.startswith("otel_kvtransfer.")]
        held = ", ".join(names) or "no span processor"
    return f"{_variable('OTEL_TRACES_EXPORTER')} ({held})"


def metrics_destination(provider: object = None) -> str:
    """OTEL_METRICS_EXPORTER and the provider's metric readers (their exporters' class names)."""
    readers = None
    for candidate in (provider, metrics.get_meter_provider()):  # the global one: an SDK may have come since
        readers = sdk_internals.metric_readers(candidate)
        if readers is not None:
            break
    if readers is None:
        held = "no SDK meter provider yet"
    else:
        names = [type(sdk_internals.reader_exporter(r) or r).__name__ for r in readers]
        held = ", ".join(names) or "no metric reader"
    return f"{_variable('OTEL_METRICS_EXPORTER')} ({held})"


def distribution_version(names: Iterable[str]) -> Optional[str]:
    """The installed version of the first of these distributions that is installed, else None."""
    for name in names:
        try:
            return metadata.version(name)
        except Exception:
            continue
    return None


def installed_build(names: Iterable[str], module_names: Sequence[str] = ()) -> Optional[Tuple[str, str]]:
    """(distribution, version) of the build of an engine found here, among its published builds `names`.

    Where several are installed (their files overwrite each other in one package folder), the one whose files are
    on disk: the build that owns a loaded module's file, else the build whose record of the engine's files matches
    their size on disk (read from each build's RECORD, nothing imported). None when none is installed.
    """
    found = []
    for name in names:
        try:
            found.append(metadata.distribution(name))
        except Exception:
            continue
    if len(found) <= 1:
        return (found[0].metadata["Name"], found[0].version) if found else None
    loaded = [path for path in (getattr(sys.modules.get(module), "__file__", None) for module in module_names) if path]
    for dist in found:
        if _owns(dist, loaded, module_names):
            return dist.metadata["Name"], dist.version
    return found[0].metadata["Name"], found[0].version


def _owns(dist: metadata.Distribution, loaded_files: List[str], module_names: Iterable[str]) -> bool:
    """Does `dist` own a loaded module's file, or (none loaded) is its copy of the module's file the one on disk?"""
    wanted = {tuple(module.split(".")) for module in module_names}
    for entry in dist.files or ():
        path = os.path.realpath(str(dist.locate_file(entry)))
        if loaded_files:
            if any(os.path.realpath(loaded) == path for loaded in loaded_files):
                return True
            continue
        stem = entry.parts[:-1] + (entry.name.split(".", 1)[0],)
        if stem in wanted and entry.size:
            try:
                return os.path.getsize(path) == entry.size
            except OSError:
                return False
    return False


def _has_handler(logger: logging.Logger) -> bool:
    current: Optional[logging.Logger] = logger
    while current is not None:
        if current.handlers:
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


_FORMAT = "%(asctime)s %(levelname)s %(message)s"  # the message names otel_kvtransfer itself


def emit(text: str) -> None:
    """Through the process's logging configuration when it has one (its level decides), else to stderr."""
    if _has_handler(_logger):
        _logger.info("%s", text)
        return
    if _logger.getEffectiveLevel() <= logging.WARNING:
        # Nobody configured logging (WARNING is logging's default): the line goes to stderr itself.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.handle(_logger.makeRecord(LOGGER_NAME, logging.INFO, __file__, 0, "%s", (text,), None))


def _at_exit() -> None:
    with _lock:
        pending = _state["pending"] is not None and not _state["printed"]
    if pending:
        _print_pending()


def _after_fork_in_child() -> None:
    """A forked child (vLLM's engine core may be one) inherits the instrumentation without instrument(): it is a
    process of its own, and says so when its framework names its role (its parent's timer did not come along)."""
    global _lock
    _lock = threading.Lock()
    _state.update(timer=None, printed=False)


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
