"""``python -m pd_cache.app.bench``: the same as ``pd-cache bench``."""

import sys

from pd_cache.app.bench.cli import main

sys.exit(main())
