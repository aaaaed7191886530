"""Ray job entrypoints (installed as ``interp_engine.jobs``): ``build_dataset.py`` and its config."""
