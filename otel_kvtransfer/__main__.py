"""`python -m otel_kvtransfer`: the `otel-kvtransfer` command."""

import sys

from otel_kvtransfer.cli import main

sys.exit(main())
