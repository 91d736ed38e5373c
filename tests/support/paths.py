"""Where the checkout and its tests are, found from this file: a test names them the same way from any folder, and
so does a script the tests run."""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: `support` is importable from here
ROOT = os.path.dirname(TESTS)  # the checkout: put first on a child's PYTHONPATH, it imports this package
APPS = os.path.join(TESTS, "apps")  # the apps the tests run under opentelemetry-instrument or as the builder
