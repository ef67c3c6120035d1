"""agentkeep: durable state for agent runtimes."""
