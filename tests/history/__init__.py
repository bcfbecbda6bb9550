"""Jepsen-style histories: real worker processes in every topology of ordinary use, under faults.

``workers.py`` runs the topologies and records each critical section and each fenced
write; ``driver.py`` runs a history against a real engine while injecting faults;
``checker.py`` judges the recorded history (pure functions, unit-tested on small
hand-made histories in ``test_histories.py``).
"""
