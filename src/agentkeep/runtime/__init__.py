"""Runtime store: session snapshots, receipts, input-state CAS, lifecycle and ops epochs."""
