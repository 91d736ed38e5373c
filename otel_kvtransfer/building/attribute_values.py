"""Attribute values as they may leave the process: every string one UTF-8 can carry, and the provider's span limits
applied as the SDK applies them.

A Python str may hold a lone surrogate (a client's JSON `"\\ud800"` decodes to one, and frameworks keep it); no
UTF-8 encoder takes it: the SDK's OTLP encoder drops such an attribute and fails the whole batch on such a status
description, a JSON writer fails the line. Both span pipelines repair such a string where it enters a span, the
same way (`repaired_text`: each lone surrogate becomes U+FFFD, a valid pair its character, as a JSON decoder
would have made it), so what they send is identical and valid.

Limits: the SDK keeps a span's attributes in a `BoundedAttributes` (the provider's `SpanLimits`: count, then
oldest dropped; strings truncated; empty keys dropped; odd types cleaned). The direct pipeline hands a span's
attributes on as they are when that would change nothing (`clean_enough`: a few type checks), and otherwise
through the SDK's own `BoundedAttributes` (`bounded`), so the result is the SDK's by construction.
"""

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Sequence, Tuple, TypeVar, Union

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, SpanLimits, Tracer
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Status

from otel_kvtransfer import sdk_internals

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

_SCALARS = (bool, int, float)


def repaired_text(text: str) -> str:
    """`text` itself when UTF-8 can carry it, else a copy with each lone surrogate replaced by U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _needs_repair(value: Any) -> bool:
    kind = type(value)
    if kind is str:
        return not value.isascii() and repaired_text(value) is not value
    if kind in _SCALARS or value is None:
        return False
    if isinstance(value, str):
        return repaired_text(value) is not value
    if isinstance(value, (list, tuple)):
        return any(_needs_repair(item) for item in value)
    if isinstance(value, Mapping):
        return any(_needs_repair(k) or _needs_repair(v) for k, v in value.items())
    return False


def repaired_value(value: Any) -> Any:
    """`value` itself unless it holds a string UTF-8 cannot carry; else repaired (sequences and mappings too)."""
    if not _needs_repair(value):
        return value
    if isinstance(value, str):
        return repaired_text(value)
    if isinstance(value, (list, tuple)):
        items = [repaired_value(item) for item in value]
        return items if type(value) is list else tuple(items)
    return {repaired_value(k): repaired_value(v) for k, v in value.items()}


# What `repaired` takes and gives back: a dict (its copy is a dict too), any mapping, or None.
Attributes = TypeVar("Attributes", Dict[str, Any], Mapping[str, Any], None, Optional[Mapping[str, Any]])


def repaired(attributes: Attributes) -> Attributes:
    """`attributes` itself when every key and value is fine (the common case: one scan, no copy), else a repaired
    copy in the same order."""
    if not attributes:
        return attributes
    for key, value in attributes.items():
        kind = type(value)
        if type(key) is str and key.isascii() and (kind is str and value.isascii() or kind in _SCALARS):
            continue  # the common case, without a call
        if _needs_repair(key) or _needs_repair(value):
            break
    else:
        return attributes
    return {repaired_value(key): repaired_value(value) for key, value in attributes.items()}


def repaired_status(status: Status) -> Status:
    description = status.description
    if type(description) is str and not description.isascii():
        fixed = repaired_text(description)
        if fixed is not description:
            return Status(status.status_code, fixed)
    return status


def clean_enough(items: Iterable[Tuple[Any, Any]], max_length: Optional[int]) -> bool:
    """True when the SDK's BoundedAttributes would keep these (key, value) items exactly as they are (the count
    limit is the caller's): non-empty str keys, plain str / bool / int / float values, strings within
    `max_length` and valid UTF-8."""
    for key, value in items:
        if type(key) is not str or not key:
            return False
        kind = type(value)
        if kind is str:
            if (max_length is not None and len(value) > max_length) or (
                    not value.isascii() and repaired_text(value) is not value):
                return False
        elif kind is not int and kind is not float and kind is not bool:
            return False
    return True


def bounded(attributes: Mapping[str, Any], max_count: Optional[int],
            max_length: Optional[int]) -> "Union[Mapping[str, AttributeValue], BoundedAttributes]":
    """The span attributes the SDK would keep of `attributes` (repaired first): a plain dict when nothing is cut
    or cleaned, else the SDK's own BoundedAttributes (its `dropped` is the span's dropped_attributes)."""
    fixed: "Mapping[str, AttributeValue]" = repaired(attributes)  # typed: the SDK's constructor is overloaded
    if (max_count is None or len(fixed) <= max_count) and clean_enough(fixed.items(), max_length):
        return fixed
    return BoundedAttributes(max_count, fixed, immutable=True, max_value_len=max_length)


def bounded_events(events: Sequence[Event], limits: SpanLimits) -> "BoundedList[Event]":
    """A span's events as the SDK's Span.add_event keeps them: at most max_events (the oldest dropped), each
    one's attributes bounded by the event limits."""
    kept: "BoundedList[Event]" = BoundedList(limits.max_events)
    for event in events:
        attributes = BoundedAttributes(limits.max_event_attributes, repaired(event.attributes),
                                       immutable=True, max_value_len=limits.max_attribute_length)
        kept.append(Event(event.name, attributes, event.timestamp))
    return kept


def limits_of(tracer: Tracer) -> SpanLimits:
    """The span limits an SDK tracer applies: its provider's, resolved from OTEL_* when the provider was made
    (a private attribute: sdk_internals); a fresh SpanLimits() (the environment now) else."""
    limits = sdk_internals.span_limits(tracer)
    return limits if isinstance(limits, SpanLimits) else SpanLimits()
