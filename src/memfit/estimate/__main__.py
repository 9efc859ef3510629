"""`python -m memfit.estimate` = `memfit estimate`."""

import sys

from memfit.estimate.cli import main

sys.exit(main())
