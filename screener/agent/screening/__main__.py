"""`python -m screener.agent.screening worker RESULT.json MODE`: the screen worker's process.

The worker's command line has always named this package (ps, the tests, reap_stale_screens); its
code is screener.agent.screening.worker."""

import sys

from screener.agent.screening.worker import main

sys.exit(main())
