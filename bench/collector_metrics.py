"""The Collectors' own metrics (Prometheus text exposition), read defensively: every byte of it is untrusted.

`parse` turns an exposition into samples `(name, labels, value)`; anything that is not the text format (a bad
name, an unterminated label, a value that is not a number, too many lines, too long a line) raises
`BadExposition` with one line that says where and what. `fetch` reads one endpoint on 127.0.0.1, bounded in
size and time. `total` adds up the series of one counter, with or without the `_total` suffix the exporter adds.
"""

import math
import re
import urllib.error
import urllib.request
from typing import Dict, List, Tuple

MAX_BYTES = 8 << 20  # one exposition; a Collector's own is a few hundred KiB
MAX_LINES = 200_000
MAX_LINE = 16_384
MAX_LABELS = 64
SHOWN = 60  # characters of a bad line quoted in the error

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*')
ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Sample = Tuple[str, Dict[str, str], float]


class BadExposition(ValueError):
    """What was read is not a Prometheus text exposition; the message is one line."""


def _shown(line: str) -> str:
    return repr(line[:SHOWN]) + ("..." if len(line) > SHOWN else "")


def _unescape(value: str) -> str:
    return re.sub(r"\\.", lambda m: ESCAPES.get(m.group(0), m.group(0)), value)


def _labels(text: str, number: int, line: str) -> Tuple[Dict[str, str], str]:
    """The label set that `text` starts with (just after '{'), and what follows its closing '}'."""
    labels: Dict[str, str] = {}
    position = 0
    while True:
        rest = text[position:].lstrip()
        if rest.startswith("}"):
            return labels, rest[1:]
        match = LABEL.match(text, position)
        if match is None:
            raise BadExposition(f"line {number}: bad label set: {_shown(line)}")
        if len(labels) >= MAX_LABELS:
            raise BadExposition(f"line {number}: more than {MAX_LABELS} labels")
        labels[match.group(1)] = _unescape(match.group(2))
        position = match.end()
        if text[position:position + 1] == ",":
            position += 1
        elif text[position:position + 1] != "}":
            raise BadExposition(f"line {number}: bad label set: {_shown(line)}")


def _value(text: str, number: int, line: str) -> float:
    fields = text.split()
    if not 1 <= len(fields) <= 2:  # the value, and an optional timestamp
        raise BadExposition(f"line {number}: expected a value (and a timestamp): {_shown(line)}")
    try:
        value = float(fields[0])
        if len(fields) == 2:
            int(fields[1])
    except ValueError:
        raise BadExposition(f"line {number}: not a number: {_shown(line)}") from None
    return value


def parse(text: str) -> List[Sample]:
    """Every sample of an exposition; comments (# HELP, # TYPE) and blank lines are skipped."""
    if len(text) > MAX_BYTES:
        raise BadExposition(f"exposition larger than {MAX_BYTES} bytes")
    lines = text.split("\n")
    if len(lines) > MAX_LINES:
        raise BadExposition(f"more than {MAX_LINES} lines")
    samples: List[Sample] = []
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\r")
        if len(line) > MAX_LINE:
            raise BadExposition(f"line {number}: longer than {MAX_LINE} characters")
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = NAME.match(stripped)
        if match is None:
            raise BadExposition(f"line {number}: no metric name: {_shown(line)}")
        name, rest = match.group(0), stripped[match.end():]
        labels: Dict[str, str] = {}
        if rest.startswith("{"):
            labels, rest = _labels(rest[1:], number, line)
        elif rest and not rest[0].isspace():
            raise BadExposition(f"line {number}: bad metric name: {_shown(line)}")
        samples.append((name, labels, _value(rest, number, line)))
    return samples


def total(samples: List[Sample], name: str, **labels: str) -> float:
    """The sum of every series of counter `name` (or `name_total`) whose labels include `labels`; NaN counts 0."""
    found = 0.0
    for sample_name, sample_labels, value in samples:
        if sample_name in (name, name + "_total") and all(sample_labels.get(k) == v for k, v in labels.items()):
            found += 0.0 if math.isnan(value) else value
    return found


def label_values(samples: List[Sample], name: str, label: str) -> List[str]:
    """The distinct values of `label` among the series of counter `name` (or `name_total`), sorted."""
    return sorted({labels[label] for sample_name, labels, _ in samples
                   if sample_name in (name, name + "_total") and label in labels})


def fetch(port: int, timeout_s: float = 5.0) -> List[Sample]:
    """The samples served at http://127.0.0.1:<port>/metrics (the Collector's own telemetry)."""
    url = f"http://127.0.0.1:{int(port)}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(MAX_BYTES + 1)
    except (OSError, urllib.error.URLError) as exc:
        raise BadExposition(f"{url}: no answer ({type(exc).__name__})") from None
    if len(body) > MAX_BYTES:
        raise BadExposition(f"{url}: exposition larger than {MAX_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadExposition(f"{url}: not UTF-8") from None
    try:
        return parse(text)
    except BadExposition as exc:
        raise BadExposition(f"{url}: {exc}") from None
