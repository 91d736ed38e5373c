"""Text from outside made safe to print: request keys (a client may choose them), peer names (a peer's own
metadata), values of a span file. What the log lines and the offline tools print of them is one line with every
character that is not printable (control and format characters: ESC, BEL, CR, LF, U+2028/2029, bidi controls,
zero-width and other Cc/Cf characters; separators other than the space) escaped as `\\xNN`, `\\uNNNN` or
`\\UNNNNNNNN`, so a value can neither forge a line of its own nor drive the terminal that shows it.

Here, below tools/, because the builder's WARNING lines need it too; tools/text.py builds on it.
"""

from typing import Any


def printable(text: str) -> str:
    """`text` with every non-printable character escaped (one line, no terminal control)."""
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(char if char.isprintable() else _escaped(ord(char)) for char in text)


def _escaped(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def as_text(value: Any) -> str:
    """`str(value)`, never raising (an engine's object whose `__str__` fails is named by its type)."""
    if type(value) is str:
        return value
    try:
        return str(value)
    except Exception:  # noqa: BLE001  whatever a foreign __str__ raises, a log line must still be written
        return f"<{type(value).__name__}>"


def one_line(value: Any, limit: int = 120) -> str:
    """`value` for a log line: printable, at most `limit` characters of it, and how long it was when cut."""
    text = as_text(value)
    shown = printable(text[:limit])
    cut = len(text) > limit
    if len(shown) > limit:  # escapes made it longer
        shown, cut = shown[:limit], True
    return f"{shown}... ({len(text)} characters)" if cut else shown


__all__ = ["as_text", "one_line", "printable"]
