"""`python -m otel_kvtransfer`: the `otel-kvtransfer` command."""

import sys

from otel_kvtransfer.tools.cli import main

sys.exit(main())
