"""The start-up line: one INFO line per instrumented process (logger `otel_kvtransfer`), so an operator can grep a
server's log and see that the instrumentation is on, in which role and rank, and where its spans and metrics go.

    otel_kvtransfer: on (otel_kvtransfer 0.1.0); patched: sglang 0.5.23; engines: mooncake 0.3.13, nixl absent;
    role prefill, kv_transfer.tp_rank 0; builder: process; spans: otlp (OTLPSpanExporter); metrics: otlp (...)

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
from typing import Optional

from opentelemetry import metrics, trace

from otel_kvtransfer import sdk_internals

LOGGER_NAME = "otel_kvtransfer"
# How long a process with a framework waits for its role before printing without one: an engine process builds
# its KV manager only after loading the model (minutes on a loaded CPU machine); the others never build one.
GRACE_S = 300.0

_logger = logging.getLogger(LOGGER_NAME)
_lock = threading.Lock()
_state = {"pending": None, "timer": None, "printed": False}


class Announcement:
    """What instrument() set up in this process; the line is made from it when it is printed."""

    def __init__(self, version: str, frameworks, engines, builder: str, tracer_provider=None, meter_provider=None):
        self.version = version
        self.frameworks = frameworks  # [(name, version or None, on)]
        self.engines = engines  # [(name, version or None, on)]
        self.builder = builder  # "process" | "thread"
        self.tracer_provider, self.meter_provider = tracer_provider, meter_provider


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


def role_known(framework: str, role: Optional[str], ranks: Optional[dict]) -> None:
    """A framework learnt this process's role and rank: the line goes out now (once per process)."""
    _print_pending(framework, role, ranks)


def _cancel_timer() -> None:
    timer = _state["timer"]
    if timer is not None:
        timer.cancel()
        _state["timer"] = None


def _print_pending(framework=None, role=None, ranks=None) -> None:
    try:
        with _lock:
            announcement = _state["pending"]
            if announcement is None or _state["printed"]:
                return  # nothing set up, or already said
            _state["printed"] = True
            _cancel_timer()
        emit(line(announcement, framework, role, ranks))
    except Exception:  # the line is a courtesy: it never disturbs the engine
        _logger.debug("otel_kvtransfer: the start-up line failed", exc_info=True)


def _parts(items) -> str:
    said = [f"{name} {version}" if on else f"{name} {version} (not patched)" if version else f"{name} absent"
            for name, version, on in items]
    return ", ".join(said) or "none"


def line(announcement: Announcement, framework=None, role=None, ranks=None) -> str:
    """The start-up line's text (pure apart from reading the providers and OTEL_* variables)."""
    frameworks = [item for item in announcement.frameworks if item[1]]  # installed ones only
    where = f"role {role}" if role else "no role in this process (no KV manager or connector worker seen)"
    if ranks:
        where += "".join(f", {name} {value}" for name, value in sorted(ranks.items()))
    if framework:
        where += f" ({framework})"
    return (f"otel_kvtransfer: on (otel_kvtransfer {announcement.version}); patched: {_parts(frameworks)}; "
            f"engines: {_parts(announcement.engines)}; {where}; builder: {announcement.builder}; "
            f"spans: {spans_destination(announcement.tracer_provider)}; "
            f"metrics: {metrics_destination(announcement.meter_provider)}")


def _variable(name: str) -> str:
    value = os.environ.get(name, "").strip()
    return value[:120] if value else "unset"


def spans_destination(provider=None) -> str:
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


def metrics_destination(provider=None) -> str:
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


def distribution_version(names) -> Optional[str]:
    """The installed version of the first of these distributions that is installed, else None."""
    for name in names:
        try:
            return metadata.version(name)
        except Exception:
            continue
    return None


def _has_handler(logger: logging.Logger) -> bool:
    current = logger
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
