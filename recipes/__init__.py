"""Coordination recipes built on the public ``queen_sync`` API, one module per pattern.

* :mod:`recipes.leader_election` -- one leader at a time, fenced by its token.
* :mod:`recipes.fenced_export` -- export partitions so a replaced holder cannot
  overwrite a newer holder's output, resuming where the last holder stopped.
* :mod:`recipes.run_queue` -- claimed run queues: submit runs, claim one with a
  lease, fenced checkpoints, retaken after a dead worker's claim expires.

Each module is usable alone and small enough to copy into a pipeline.
"""
