"""A NeMo Gym resources server written for the tier's own tests, on NeMo Gym's real base
classes (`SimpleResourcesServer`, its session middleware and config): a server whose
per-session state can be made something that is not JSON, which none of NeMo Gym's own
servers keeps. Its dict is declared with `--session-state session_id_to_tags`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY
from pydantic import BaseModel, Field


class TaggedConfig(BaseResourcesServerConfig):
    pass


class TagRequest(BaseModel):
    tag: str
    as_set: bool = False  # keep the tags as a set: not JSON


class TaggedResourcesServer(SimpleResourcesServer):
    ray_enabled = False
    config: TaggedConfig
    session_id_to_tags: dict[str, Any] = Field(default_factory=dict)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/tag")(self.tag)
        return app

    async def seed_session(
        self, request: Request, body: BaseSeedSessionRequest
    ) -> BaseSeedSessionResponse:
        self.session_id_to_tags.setdefault(request.session[SESSION_ID_KEY], [])
        return BaseSeedSessionResponse()

    async def tag(self, request: Request, body: TagRequest) -> dict[str, Any]:
        session_id = request.session[SESSION_ID_KEY]
        tags = sorted({*self.session_id_to_tags.get(session_id, ()), body.tag})
        self.session_id_to_tags[session_id] = set(tags) if body.as_set else tags
        return {"tags": tags, "session_id": session_id}

    async def verify(self, request: Request, body: BaseVerifyRequest) -> BaseVerifyResponse:
        return BaseVerifyResponse(**body.model_dump(), reward=1.0)
