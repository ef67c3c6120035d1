"""The fault campaign: SIGKILLed workers and terminated backends, checked against what was acked.

* :mod:`tests.faults.journal`: each worker incarnation's append-only journal
  of acknowledged results (one fsync'd JSON line per ack).
* :mod:`tests.faults.worker`: the worker, a mixed workload over every store
  through one-call operations (``python -m tests.faults.worker`` runs one).
* :mod:`tests.faults.campaign`: the driver: seeds the database, keeps K
  workers running, SIGKILLs them at random moments and restarts them; on
  Postgres it also terminates random worker backends.
* :mod:`tests.faults.checker`: the invariants over the final database and
  the journals (nothing acknowledged lost, nothing doubled, head revisions
  gap-free, fencing tokens and generations increasing).
* ``test_campaign.py``: the campaign on both backends (``AGENTKEEP_FAULT_SECONDS``
  per backend, default 25); ``test_checker.py``: the checker catches what it
  must; ``test_full_disk.py``: a full disk gives a typed error and loses nothing.
"""
