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

# FTSHIMS_CLIENT_SEED=<int>: seed torch's default generator the moment torch is imported. torch seeds it from
# the OS at start-up, and a client may draw from it before seeding (axolotl 0.19 initialises the LoRA weights
# before its Trainer calls set_seed(cfg.seed)): without this, two identical runs start from different adapters.
if os.environ.get("FTSHIMS_CLIENT_SEED"):
    import wrapt

    _seed = int(os.environ["FTSHIMS_CLIENT_SEED"])
    wrapt.register_post_import_hook(lambda torch: torch.manual_seed(_seed), "torch")

# FTSHIMS_CLIENT_DS_CPU=1: the CPU catch of docs/deepspeed.md in each rank of a client's DeepSpeed run (a client we
# cannot edit): on CPU accelerate picks no backend for DeepSpeed and every rank would believe it is alone, so the
# rank's state is created first with gloo (the YAML passes accelerator_config.use_configured_state). Not in the
# client's launcher process (no WORLD_SIZE there).
if os.environ.get("FTSHIMS_CLIENT_DS_CPU") == "1" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    PartialState(backend="gloo")
