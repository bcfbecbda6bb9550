"""Coordination recipes built on the public ``queen_sync`` API, one module per pattern.

* :mod:`queen_sync.recipes.leader_election` -- one leader at a time, fenced by its token.
* :mod:`queen_sync.recipes.fenced_export` -- export partitions so a replaced holder cannot
  overwrite a newer holder's output, resuming where the last holder stopped.
* :mod:`queen_sync.recipes.run_queue` -- claimed run queues: submit runs, claim one with a
  lease, fenced checkpoints, retaken after a dead worker's claim expires, dead-lettered
  after ``max_attempts``; a claim's cost does not grow with the queue's history.

Each module is usable alone and small enough to copy into a pipeline, and takes the
client as its first argument (``client=`` by keyword). The repository keeps them in its
top-level ``recipes/`` folder; they install as ``queen_sync.recipes``.
"""
