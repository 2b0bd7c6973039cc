"""The data path's part of an episode hand-over, driven in process: a worker's answer
with the hand-over marker the mover expects sends the request on, unchanged, to the
target, and the client sees only the target's answer; any other marker is relayed."""

from __future__ import annotations

import asyncio

import pytest

from gym_proxy.proxy.data_path.routing import ExpectedHandover
from tests.data_path_rig import Rig

pytestmark = pytest.mark.fast

BODY = b'{"_ng_rollout_id": "r1", "steps": 3}'


def run_request(body: bytes = BODY) -> bytes:
    head = b"POST /run HTTP/1.1\r\nHost: t\r\ncontent-length: %d\r\n\r\n" % len(body)
    return head + body


def marker(handover_id: bytes, body: bytes = BODY) -> bytes:
    head = b"HTTP/1.1 503 Service Unavailable\r\nx-ng-handover: %s\r\ncontent-length: %d\r\n\r\n"
    return head % (handover_id, len(body)) + body


def expect(rig: Rig, handover_id: bytes, source: int = 0, target: int = 1) -> asyncio.Future:
    arrived = asyncio.get_running_loop().create_future()
    rig.router.handovers[handover_id] = ExpectedHandover(
        rig.worker(source), rig.worker(target), arrived
    )
    return arrived


async def first_request_on(rig: Rig, client_request: bytes) -> tuple:
    client = rig.client()
    client.send(client_request)
    source = await rig.upstream()
    return client, source, source.requests()[0]


async def test_the_marker_sends_the_request_on_to_the_target_unchanged():
    rig = Rig(workers=2)
    client, source, (method, path, headers, body) = await first_request_on(rig, run_request())
    arrived = expect(rig, b"h1", source=routed_slot(rig))
    source.send(marker(b"h1"))
    target = await rig.upstream()
    assert target is not source
    [(method2, path2, headers2, body2)] = target.requests()
    assert (method2, path2, headers2, body2) == (method, path, headers, body)
    assert arrived.done() and arrived.result() == ""
    assert client.responses() == []  # the marker never reaches the client
    assert rig.router.handovers == {}
    target.send(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone")
    [(status, _, answer)] = client.responses()
    assert (status, answer) == (200, b"done")
    assert rig.worker(0).in_flight == rig.worker(1).in_flight == 0


def routed_slot(rig: Rig) -> int:
    """The slot the one request in flight was routed to."""
    return 0 if rig.worker(0).in_flight else 1


async def test_a_marker_nobody_expects_is_relayed_as_the_503_it_is():
    rig = Rig(workers=2)
    client, source, _ = await first_request_on(rig, run_request())
    expect(rig, b"other")  # a hand-over is under way, of another request
    source.send(marker(b"forged", b"{}"))
    [(status, headers, body)] = client.responses()
    assert status == 503 and body == b"{}"
    assert len(rig.upstreams) == 1 and b"other" in rig.router.handovers


async def test_a_marker_from_another_worker_than_the_expected_source_is_relayed():
    rig = Rig(workers=2)
    client, source, _ = await first_request_on(rig, run_request())
    routed = routed_slot(rig)
    arrived = expect(rig, b"h2", source=1 - routed, target=1 - routed)
    source.send(marker(b"h2", b"{}"))
    [(status, _, _)] = client.responses()
    assert status == 503 and not arrived.done()


async def test_the_client_leaving_mid_hand_over_is_told_to_the_mover():
    rig = Rig(workers=2)
    client, source, _ = await first_request_on(rig, run_request())
    arrived = expect(rig, b"h3", source=routed_slot(rig))
    source.send(marker(b"h3")[:-5])  # the body is still coming
    client.hang_up()
    await rig.settle()
    assert arrived.done() and arrived.result() == "its client went away"
    assert len(rig.upstreams) == 1  # nothing was sent to the target


async def test_a_gone_target_answers_410_and_says_why():
    rig = Rig(workers=2)
    client, source, _ = await first_request_on(rig, run_request())
    routed = routed_slot(rig)
    arrived = expect(rig, b"h4", source=routed, target=1 - routed)
    rig.router.remove_worker(rig.worker(1 - routed).owner)
    source.send(marker(b"h4"))
    [(status, _, body)] = client.responses()
    assert status == 410 and b"session_owner_gone" in body
    assert arrived.result() == "the target worker is gone"
