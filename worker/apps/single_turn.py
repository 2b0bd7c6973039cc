"""`single_turn`: an environment server (FastAPI) with one weather episode per `/run`.

    gym-proxy gym_proxy.worker.apps.single_turn:create_app --workers 2

`POST /run {city, instructions?, _ng_rollout_id, _ng_attempt_index}`: seed a weather
session, run one agent turn through a native agent session, verify; boundaries between the steps
(`gym_proxy.worker.apps.episode_steps`). Answers `{reward, answer, model_calls, tool_calls,
weather_tool_calls}`. Other servers: `GYM_REF_WEATHER_URL`, `GYM_REF_AGENT_URL`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from gym_proxy.worker.apps.episode_steps import weather_episode
from gym_proxy.worker.apps.rollout_prefix import RolloutPrefix
from gym_proxy.worker.participant import Participation, declare, episode

__all__ = ["create_app"]


def create_app() -> Any:
    app = FastAPI(title="single_turn")

    @app.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        body = await request.json()
        return await weather_episode(episode(request), body, "agent")

    return declare(RolloutPrefix(app), Participation(kind="environment"))
