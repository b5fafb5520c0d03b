"""The zoo gate is a tool run by ``nox -s zoo`` / ``python tests/zoo/gate.py``, not part of the pytest suite."""

collect_ignore_glob = ["*.py"]
