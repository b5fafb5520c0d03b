"""``python -m ftshims.monitor report run.jsonl [--html out.html]`` (see :mod:`ftshims.monitor.report`)."""

import sys

from .report import main

sys.exit(main())
