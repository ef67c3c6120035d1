"""The session store: leases, queued work, turn inputs, turn commits, maintenance.

One module per part (``leases``, ``queue``, ``turn_inputs``, ``commits``,
``checkpoints``, ``maintenance``), their tables in ``models``, values in
``domain`` and ``records``, one-call forms in ``facade``. See
docs/sessions.md#the-session-store.
"""
