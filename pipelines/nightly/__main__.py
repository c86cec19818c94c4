"""``python -m pipelines.nightly``: the nightly job's command line (:mod:`pipelines.nightly.cli`)."""

import sys

from pipelines.nightly.cli import main

sys.exit(main())
