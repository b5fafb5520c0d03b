"""Client-framework tests (LLaMA-Factory, axolotl, Liger, foreign patchers): run by ``nox -s clients`` only.

They need their own venvs (the frameworks pin conflicting stacks) and minutes of CPU, so the default
suite (``nox -s tests``, plain ``pytest``) does not collect them: unless ``FTSHIMS_CLIENTS`` is set
(the ``clients`` session sets it to the clients each of its venvs must test), every module here is
ignored at collection. This file imports nothing heavy.
"""

import os
import sys
from pathlib import Path

if not os.environ.get("FTSHIMS_CLIENTS"):
    collect_ignore_glob = ["test_*.py", "*_scenario.py"]

sys.path.insert(0, str(Path(__file__).parent))
