"""The package's own WARNING lines, captured in-process while a block runs."""

import contextlib
import logging


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def warnings_logged(logger: str = "otel_kvtransfer"):
    """The messages `logger` logs at WARNING or above inside the block, as a list that grows while it runs."""
    handler = _Lines()
    logging.getLogger(logger).addHandler(handler)
    try:
        yield handler.lines
    finally:
        logging.getLogger(logger).removeHandler(handler)
