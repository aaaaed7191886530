"""Activation datasets: prompts in, Parquet shards and a manifest out, read back by any Parquet tool.

Everything here runs in the process that builds or reads a dataset (the driver, or a Ray replica
writing its shards); nothing imports a backend. ``build.py`` is the entry point
(:func:`~.build.build_dataset`); ``shard.py`` / ``writer.py`` compute and write one shard;
``manifest.py``, ``lease.py``, ``integrity.py`` and ``schema.py`` keep a build resumable and its
folder trustworthy; ``store.py`` / ``uri.py`` reach local folders and object stores;
``result.py``, ``loader.py``, ``columns.py``, ``export.py`` and ``ray_data.py`` read it back.
"""
