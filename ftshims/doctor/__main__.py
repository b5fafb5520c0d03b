"""``python -m ftshims.doctor``; see :mod:`ftshims.doctor.cli`."""

import logging
import os
import sys

from .cli import main

code = main()
# Tearing down the interpreter after torch and transformers were imported takes
# seconds; the report is written, so flush and leave without it.
logging.shutdown()
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except (OSError, ValueError):
        pass
os._exit(code)
