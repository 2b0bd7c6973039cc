"""A model participant in NeMo Gym's sense (the reference `fake_model`, kind `model`):
while a checkpoint is open a new generation call waits at the door (NeMo Gym 0.7.0's
agents call `raise_for_status()` on it and never repeat a 409), an admitted one finishes
and its answer waits until resume, none of them blocks the checkpoint, and the server's
other routes keep serving."""

from __future__ import annotations

import asyncio
import os

import orjson

from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN, Control, wait_until

FAKE_MODEL = "gym_proxy.worker.apps.fake_model:create_app"
ASK = {"input": "What is the weather in Oslo?"}


async def test_model_calls_across_a_checkpoint(start_proxy, http, tmp_path):
    hold = tmp_path / "hold"
    hold.write_text("hold")
    env = {"GYM_FAKE_MODEL_HOLD_FILE": str(hold), "GYM_FAKE_MODEL_HOLD_CALLS": "1"}
    proxy = start_proxy(workers=1, app=FAKE_MODEL, env=env, control_token=CONTROL_TOKEN)
    control = Control(http, proxy.url)

    async def call(key: str) -> tuple[int, dict]:
        url = f"{proxy.url}/ng-rollout/{key}/v1/responses"
        async with http.post(url, data=orjson.dumps(ASK)) as resp:
            return resp.status, await resp.json()

    async def held() -> int:
        async with http.get(f"{proxy.url}/held") as resp:
            assert resp.status == 200  # not a generation route: served while closed too
            return (await resp.json())["held"]

    async def one_held() -> bool:
        return await held() == 1

    admitted = asyncio.ensure_future(call("r1"))
    await wait_until(one_held, 10, "the call to be held at the model")
    reply = await control.ok("prepare", checkpoint_id="m1")
    assert reply["phase"] == "prepared"  # an admitted model call never blocks
    new_call = asyncio.ensure_future(call("r2"))

    async def new_call_at_door() -> bool:
        return (await control.ok("status"))["report"]["counts"].get("door") == 1

    await wait_until(new_call_at_door, 10, "the new call to wait at the door")
    assert await held() == 1
    os.unlink(hold)  # the admitted call finishes; its answer waits for resume

    async def answer_parked() -> bool:
        return (await control.ok("status"))["report"]["counts"].get("parked") == 1

    await wait_until(answer_parked, 10, "the finished answer to be held")
    reply = await control.ok("prepare", checkpoint_id="m1")
    assert reply["phase"] == "prepared"  # neither a door wait nor a held answer blocks
    assert not admitted.done() and not new_call.done()
    await control.ok("resume", checkpoint_id="m1")
    status, body = await asyncio.wait_for(admitted, 10)
    assert status == 200 and body["output"][0]["name"] == "get_weather"
    status, body = await asyncio.wait_for(new_call, 10)  # went on after resume
    assert status == 200 and body["output"][0]["type"] == "function_call"


@BOTH_APP_KINDS
async def test_model_kind_gates_generation_routes_only(start_proxy, http):
    """The same rules through either front door (aiohttp middleware, ASGI middleware)."""
    proxy = start_proxy(workers=1, env={"GYM_TEST_KIND": "model"}, control_token=CONTROL_TOKEN)
    control = Control(http, proxy.url)
    generate = f"{proxy.url}/ng-rollout/r1/v1/responses"

    async def call(url: str) -> tuple[int, dict]:
        async with http.post(url, json={}) as resp:
            return resp.status, await resp.json()

    admitted = asyncio.ensure_future(call(generate))

    async def in_app() -> bool:  # past the worker's door: routed is not enough
        async with http.get(f"{proxy.url}/generating") as resp:
            return (await resp.json())["waiting"] == 1

    await wait_until(in_app, 10, "the generation call to be in the app")
    assert (await control.ok("prepare", checkpoint_id="g1"))["phase"] == "prepared"
    waiting = asyncio.ensure_future(call(generate))

    async def at_door() -> bool:
        return (await control.ok("status"))["report"]["counts"].get("door") == 1

    await wait_until(at_door, 10, "the new generation call to wait at the door")
    status, _ = await call(f"{proxy.url}/whoami")
    assert status == 200  # not a generation route: served while closed
    status, _ = await call(f"{proxy.url}/release?name=generate")
    assert status == 200  # the admitted call finishes; its answer waits for resume

    async def answer_parked() -> bool:
        return (await control.ok("status"))["report"]["counts"].get("parked") == 1

    await wait_until(answer_parked, 10, "the finished answer to be held")
    assert not admitted.done()
    await control.ok("resume", checkpoint_id="g1")
    status, body = await asyncio.wait_for(admitted, 10)
    assert status == 200 and body["generated"] is True
    status, body = await asyncio.wait_for(waiting, 10)  # the gate stays released
    assert status == 200 and body["generated"] is True
