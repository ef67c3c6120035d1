"""A small real LangGraph graph for the saver tests: three nodes over a messages state."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages


class State(TypedDict):
    messages: Annotated[list[Any], add_messages]


def _plan(state: State) -> dict[str, Any]:
    return {"messages": [("ai", f"plan {len(state['messages'])}")]}


def _review(state: State) -> dict[str, Any]:
    return {"messages": [("ai", "review")]}


def _compile(checkpointer: Any, act: Callable[[State], Any]) -> Any:
    graph = StateGraph(State)
    graph.add_node("plan", _plan)
    graph.add_node("act", act)
    graph.add_node("review", _review)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "act")
    graph.add_edge("act", "review")
    graph.add_edge("review", END)
    return graph.compile(checkpointer=checkpointer)


def build_graph(checkpointer: Any, hook: Callable[[], object] | None = None) -> Any:
    """plan -> act -> review; ``hook`` runs inside ``act`` (a race's rendezvous)."""

    def act(state: State) -> dict[str, Any]:
        if hook is not None:
            hook()
        return {"messages": [("ai", "act")]}

    return _compile(checkpointer, act)


def build_async_graph(checkpointer: Any, hook: Callable[[], Awaitable[None]]) -> Any:
    """The same graph with an async ``act`` node that awaits ``hook`` (for ``ainvoke``)."""

    async def act(state: State) -> dict[str, Any]:
        await hook()
        return {"messages": [("ai", "act")]}

    return _compile(checkpointer, act)


def config(thread_id: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id}}


def chain_shape(saver: Any, thread_id: str) -> tuple[int, int]:
    """``(roots, forks)`` of a thread's root-namespace history: one chain is ``(1, 0)``.

    A fork is a checkpoint with more than one child.
    """
    parents: list[str | None] = []
    for tup in saver.list(config(thread_id)):
        if tup.config["configurable"]["checkpoint_ns"] != "":
            continue
        parent = tup.parent_config
        parents.append(None if parent is None else parent["configurable"]["checkpoint_id"])
    roots = parents.count(None)
    children = [p for p in parents if p is not None]
    return roots, len(children) - len(set(children))
