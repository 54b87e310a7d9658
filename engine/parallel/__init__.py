"""Tensor parallelism inside one worker: which slice of the model each rank holds (``shard``), the
collectives that join the ranks (``group``), the per-step plan the driver sends (``step_plan``), and
the rank processes (``ranks`` on the driver, ``rank_main`` in each rank)."""
