"""`--session-state ATTR` for a NeMo Gym server class, checked in the proxy before any
worker starts (`worker.nemo_gym_server.check_session_state`), on a pydantic model like
NeMo Gym's servers (the NeMo Gym tier runs the real class: tests/test_nemo_gym_servers.py)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field, PrivateAttr

from gym_proxy.worker.nemo_gym_server import NemoGymConfigError, check_session_state

pytestmark = pytest.mark.fast


class CounterServer(BaseModel):
    config: str = ""
    session_id_to_counter: dict[str, int] = Field(default_factory=dict)
    session_id_to_tags: dict[str, list[str]] = Field(default_factory=dict)
    _cache: dict[str, int] = PrivateAttr(default_factory=dict)

    def seed_session(self) -> None:
        pass


@pytest.mark.parametrize("name", ["session_id_to_counter", "config", "_cache", "seed_session"])
def test_an_attribute_the_class_has_passes(name):
    check_session_state(CounterServer, name)  # a non-dict is the worker's to refuse


def test_a_mistyped_attribute_is_one_line_naming_the_dict_fields():
    with pytest.raises(NemoGymConfigError) as caught:
        check_session_state(CounterServer, "session_id_to_countr")
    assert str(caught.value) == (
        "--session-state session_id_to_countr: CounterServer has no attribute "
        "'session_id_to_countr' (its dict fields: session_id_to_counter, session_id_to_tags)"
    )
