"""``worker.py`` is a program started by ``launch.py`` (it joins ``jax.distributed``
when imported): not a module for pytest to import."""

collect_ignore = ["worker.py"]
