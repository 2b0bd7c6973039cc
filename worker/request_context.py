"""One request as the participant runtime shows it to the app (both front doors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.worker.episodes import Episode
from gym_proxy.worker.flights import InFlight
from gym_proxy.worker.identity import WorkerInfo
from gym_proxy.worker.runtime import ParticipantRuntime
from gym_proxy.worker.sessions import SessionStore

__all__ = ["RequestContext", "RequestSession"]


class RequestSession:
    """The session of one request: its ID and its value in the session store."""

    __slots__ = ("id", "_store", "_episode")

    def __init__(self, store: SessionStore, session_id: str, episode_key: str | None) -> None:
        self.id = session_id
        self._store = store
        self._episode = episode_key

    def get(self, default: Any = None) -> Any:
        return self._store.get(self.id, default)

    def set(self, value: Any) -> None:
        self._store.put(self.id, value, self._episode)

    def delete(self) -> None:
        self._store.delete(self.id)


@dataclass(slots=True)
class RequestContext:
    """One request as the participant runtime sees it."""

    runtime: ParticipantRuntime
    flight: InFlight

    @property
    def kind(self) -> str:
        return self.runtime.kind

    @property
    def worker(self) -> WorkerInfo:
        return self.runtime.info

    @property
    def session(self) -> RequestSession:
        if self.runtime.app_keyed:
            # One namespace per store: this app's sessions are its own (ParticipantRuntime).
            raise GymError(
                "invalid_request",
                "this app keeps its own sessions (a Starlette session cookie), so the "
                "runtime's session store holds those; declare them with "
                "Participation(session_state=...) or hooks instead of current_session",
            )
        session_id = self.flight.session_id
        if session_id is None:
            if self.flight.app_token:
                # The proxy passes an app's own token on, and routes it by the session it
                # names; one naming no session a worker holds gets no gym-proxy session.
                raise GymError(
                    "unknown_session",
                    "the X-NeMo-Gym-Session-Token is not a gym-proxy token and names no "
                    "session a worker of this server holds (it ended, or another server "
                    "issued it), so this request has no session",
                )
            raise GymError(
                "invalid_request",
                "the request has no gym-proxy session: it reached the worker without "
                "passing gym-proxy's public port",
            )
        key = self.flight.identity.key if self.flight.identity is not None else None
        return RequestSession(self.runtime.store, session_id, key)

    @property
    def episode(self) -> Episode:
        if self.flight.episode is None:
            detail = "this request carries no rollout identity (_ng_rollout_id)"
            raise GymError("invalid_request", detail)
        return self.flight.episode
