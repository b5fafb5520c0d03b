"""Start-up file of the client tests' training subprocesses (tests/clients/clientlib.py puts this
directory first on their PYTHONPATH).

Python imports ``sitecustomize`` after the ``.pth`` files of site-packages have run, so when
``FTSHIMS_AUTO`` is set ftshims has already been applied by ``ftshims-auto.pth`` here. With
``FTSHIMS_CLIENT_PROBE`` naming a JSON file, the observer in ``ftshims_client_probe`` is armed;
without it this file does nothing.
"""

import os

if os.environ.get("FTSHIMS_CLIENT_PROBE"):
    import ftshims_client_probe  # noqa: F401
