"""What each engine's sends carry besides the call: its transport and device, kept per engine as initialize()
named them, and the forms of its calls (`records.call_form`), kept for the last engine a common call was made on.
"""

import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from otel_kvtransfer import semconv
from otel_kvtransfer.engines.mooncake.methods import BACKEND, READ, WRITE
from otel_kvtransfer.recording import records
from otel_kvtransfer.recording.patching import safely

# What a send of an engine carries besides its call: (transport, the extra naming its one device, or None)
Transport = Tuple[Optional[str], Optional[Dict[str, str]]]

# id(engine) -> (protocol given to initialize(), the call extra naming its one device, or None): one lookup per call
engines: Dict[int, Transport] = {}
# read on the hot path: (transport, extra) of engines initialised before us
state: Dict[str, Transport] = {"fallback": (None, None)}
devices: List[str] = []  # every device given to initialize() in this process, in order (configured_devices())
hinted: Dict[str, Dict[str, str]] = {}  # nic_hint's name -> its call extra, one constant dict per device named
MAX_DEVICES = 64


def transport_of(engine: Any) -> Transport:
    return engines.get(id(engine), state["fallback"])


def hint_extra(hint: Any) -> Dict[str, str]:
    """The call extra of a send whose caller named its device: one constant dict per name (the builder shares a
    shape's attributes between the sends that carry the same dict's items), kept by the name as it is shown, cut:
    never by the caller's object (a hint of a megabyte, or one whose hashing runs code of its own)."""
    name = str(hint)[:64]
    extra = hinted.get(name)
    if extra is None:
        if len(hinted) >= 256:  # a host has a few NICs; a caller inventing names costs a new dict each, no more
            hinted.clear()
        extra = hinted[name] = {semconv.NIC: name}
    return extra


def no_engine() -> None:
    return None


# The last engine a common call was made on and the forms of its calls (`records.call_form`: op, transport,
# backend, the extra naming its one device, the error of a failed call), as one tuple (a reader never sees one
# engine with another's forms): (weak reference to it, its writes' form, its reads' form). Most processes have one
# engine, and a weak reference's call and an identity test cost a call a tenth of what `engines.get(id(engine),
# ...)` does; the same form object in every record lets pickle send it once a batch. Set afresh whenever what an
# engine's sends carry may change (initialize(), instrument(), uninstrument()). The compiled submission reads it
# too (`compiled.py`): its positions are FORMS_ENGINE and FORM_AT's.
Forms = Tuple[Any, ...]  # (the weak reference, its writes' form, its reads' form): read by a position the op picks
FORMS_ENGINE = 0  # the weak reference (or no_engine)
FORM_AT = {WRITE: 1, READ: 2}  # op -> where a Forms tuple holds that op's form
NO_FORM = records.call_form(WRITE, None, BACKEND, None, "transfer_failed")
NO_ENGINE: Forms = (no_engine, NO_FORM, NO_FORM)
last_engine: List[Forms] = [NO_ENGINE]


def forms_of(engine: Any) -> Forms:
    """The forms of `engine`'s writes and reads; the answer kept for the next call (`last_engine`)."""
    transport, extra = transport_of(engine)
    write = records.call_form(WRITE, transport, BACKEND, extra, "transfer_failed")
    read = records.call_form(READ, transport, BACKEND, extra, "transfer_failed")
    try:
        forms: Forms = (weakref.ref(engine), write, read)
    except TypeError:  # an engine no weak reference can name (a test's stand-in): looked up every call
        return (no_engine, write, read)
    last_engine[0] = forms
    return forms


def forced_transport() -> Optional[str]:
    if os.environ.get("MC_FORCE_TCP", "").strip().lower() in ("1", "true", "yes", "on"):
        return "tcp"
    return (os.environ.get("MOONCAKE_PROTOCOL") or "")[:32] or None


def remember_engine(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """What initialize() (and initialize_ext()) said of the engine: its protocol, and its devices (the 4th
    argument, a comma-separated list; empty: the engine finds its own): with exactly one, every send of this
    engine carries it as kv_transfer.nic unless the call names another."""
    protocol = forced_transport() or (args[2] if len(args) > 2 else kwargs.get("protocol"))
    named = args[3] if len(args) > 3 else kwargs.get("device_name")
    found = [d.strip()[:64] for d in named.split(",") if d.strip()] if isinstance(named, str) else []
    for device in found:
        if device not in devices and len(devices) < MAX_DEVICES:
            devices.append(device)
    transport = str(protocol)[:32] if protocol else state["fallback"][0]
    engines[id(engine)] = (transport, {semconv.NIC: found[0]} if len(found) == 1 else None)
    last_engine[0] = NO_ENGINE


def configured_devices() -> Tuple[str, ...]:
    """The device names given to TransferEngine.initialize() / initialize_ext() in this process while instrumented
    (each once, in the order given; at most MAX_DEVICES), for the start-up line: empty before any engine is
    initialised, and where engines find their devices themselves."""
    return tuple(devices)


def initialize_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    # Once per engine: its guard is the shared helper's.
    def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        rc = original(self, *args, **kwargs)
        safely("read the transport and devices of initialize()", remember_engine, self, args, kwargs)
        return rc

    return initialize


def prepare() -> None:
    state["fallback"] = (forced_transport(), None)  # for engines initialised before instrument()
    last_engine[0] = NO_ENGINE


def forget() -> None:
    engines.clear()
    last_engine[0] = NO_ENGINE
    devices.clear()
