"""The weather episode both `/run`s play (single_turn's, and simple_agent's legacy one).

Steps, with a boundary after each (its state is the episode's record at a checkpoint):
seed a weather session; open an agent session (with the weather token, so the agent's
tool calls carry it); one agent turn, a `replay` step (sent again after a restore, the
agent continues the turn from its session); then verify and close, which end the
episode. A restored attempt N+1 starts from its record and skips the steps done.
"""

from __future__ import annotations

from typing import Any

from gym_proxy.worker.apps.calls import call, server_url
from gym_proxy.worker.episodes import Episode

__all__ = ["turn_input", "weather_episode"]


def turn_input(task: dict[str, Any]) -> str | list[dict[str, Any]]:
    """The agent turn's input for a task `{city, instructions?}`: the question, after
    the task's system prompt when it has one (the scale run gives tasks realistic ones)."""
    question = f"What is the weather in {task.get('city', '')}?"
    instructions = task.get("instructions")
    if not isinstance(instructions, str) or not instructions:
        return question
    return [{"role": "system", "content": instructions}, {"role": "user", "content": question}]


async def weather_episode(
    ep: Episode, task: dict[str, Any], agent: str, owner: str | None = None
) -> dict[str, Any]:
    """Run (or continue) the episode of `task` (`{city, instructions?}`); `agent` names the
    agent server, `owner` pins its session to one worker (an agent calling itself)."""
    city = str(task.get("city", ""))
    state = dict(ep.restored_state or {})
    prefix = f"/ng-rollout/{ep.key}"
    weather, agent_url = server_url("weather"), server_url(agent)
    if "weather_token" not in state:
        state["weather_token"] = (await call(f"{weather}{prefix}/seed_session")).token
        await ep.boundary(state)
    if "agent_token" not in state:
        seeded = await call(
            f"{agent_url}{prefix}/seed_session", {"weather_token": state["weather_token"]},
            owner=owner,
        )  # fmt: skip
        state["agent_token"] = seeded.token
        await ep.boundary(state)
    if "answer" not in state:
        turn = call(
            f"{agent_url}{prefix}/v1/responses",
            {"input": turn_input(task), "turn_id": "t1"},
            token=state["agent_token"],
        )
        state["answer"] = (await ep.replay(turn)).body
        await ep.boundary(state)
    answer = state["answer"]
    verdict = await call(
        f"{weather}{prefix}/verify",
        {"city": city, "answer": answer["output_text"]},
        token=state["weather_token"],
    )
    await call(f"{agent_url}{prefix}/close_session", token=state["agent_token"])
    return {"reward": verdict.body["reward"], "answer": answer["output_text"],
            "model_calls": answer["usage"]["model_calls"],
            "tool_calls": answer["usage"]["tool_calls"],
            "weather_tool_calls": verdict.body["tool_calls"]}  # fmt: skip
