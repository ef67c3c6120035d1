"""Integrations of agentkeep with agent frameworks (each behind its own extra).

* :mod:`agentkeep.integrations.langgraph`: ``AgentkeepSaver``, a LangGraph
  checkpointer (extra ``agentkeep[langgraph]``; docs/langgraph.md).
"""
