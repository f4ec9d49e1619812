"""`python -m hybridkv.integration.router`: the router without the `hybridkv` script."""

import sys

from hybridkv.integration.router import main

sys.exit(main())
