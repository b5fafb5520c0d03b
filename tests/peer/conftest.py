# The vendored upstream trees are run by tests/peer/run.py (nox -s peer), in a working folder of their own, never
# collected by the default suite.
collect_ignore_glob = ["*"]
