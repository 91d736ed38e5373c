import sys

from otel_kvtransfer.cli import main

sys.exit(main())
