"""`python -m hybridkv.integration.cli`: the `hybridkv` command without its script."""

import sys

from hybridkv.integration.cli import main

sys.exit(main())
