"""Unit tests of the session token codec: instances, verification, foreign tokens."""

from __future__ import annotations

import pytest

from gym_proxy.proxy.data_path.session_tokens import (
    SessionIdentity,
    TokenCodec,
    TokenError,
    instance_tag,
    new_owner_id,
    new_session_id,
)
from tests.support import v1_token

pytestmark = pytest.mark.fast

codec = TokenCodec(b"secret-a", "counter")


def test_round_trip_with_and_without_owner():
    sid = new_session_id()
    assert codec.read(codec.sign(sid, "owner1")) == SessionIdentity(sid, "owner1")
    assert codec.read(codec.sign(sid, None)) == SessionIdentity(sid, None)
    version, tag, _, owner, _ = codec.sign(sid, None).split(".")
    assert (version, tag, owner) == ("v2", instance_tag(b"secret-a", "counter"), "-")


def test_instances_tell_their_tokens_apart_under_one_secret():
    agent = TokenCodec(b"secret-a", "agent")
    assert agent.tag != codec.tag and agent.prefix != codec.prefix
    token = agent.sign("sess", "own")
    assert codec.read(token) is None  # another instance's: not this one's business
    assert agent.read(token) == SessionIdentity("sess", "own")
    # the same name under another secret is another instance too
    assert TokenCodec(b"secret-b", "counter").read(codec.sign("sess", "own")) is None


@pytest.mark.parametrize(
    "token",
    ["", "abc", "v2.something-else", "eyJzaWQiOiAicyJ9.sig", "v3.a.b.c.d"],
)
def test_tokens_that_are_not_this_instances_read_as_none(token):
    assert codec.read(token) is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t[:-1],  # truncated MAC
        lambda t: t[: t.rindex(".")],  # MAC missing
        lambda t: t.replace(".sess.", ".."),  # empty session ID
        lambda t: t + ".extra",
        lambda t: t.rsplit(".", 3)[0] + ".a b.c." + "x" * 43,  # bad characters
    ],
)
def test_malformed_tokens_of_this_instance_refused(mutate):
    token = mutate(codec.sign("sess", "own"))
    assert token.startswith(codec.prefix)
    with pytest.raises(TokenError):
        codec.read(token)


def test_forged_owner_refused():
    token = codec.sign("sess", "own")
    version, tag, sid, _, mac = token.split(".")
    with pytest.raises(TokenError):
        codec.read(f"{version}.{tag}.{sid}.other.{mac}")


def test_flipped_mac_character_refused():
    token = codec.sign("sess", "own")
    flipped = token[:-1] + ("A" if token[-1] != "A" else "B")
    with pytest.raises(TokenError):
        codec.read(flipped)


def test_v1_tokens_are_not_this_instances_even_signed_with_its_secret():
    """The `v1.` shape named no instance; nothing mints it any more, so one is someone
    else's whatever its MAC: read as None (passed on), never verified, never refused."""
    for owner in ("own", None):
        assert codec.read(v1_token(b"secret-a", "sess", owner)) is None
    assert codec.read(v1_token(b"secret-b", "sess", "own")) is None
    assert codec.read(v1_token(b"secret-a", "sess", "own")[:-2] + "zz") is None
    assert codec.read_bytes(b"v1.\xe2\x98\x83.own.mac") is None


def test_cache_does_not_accept_what_it_did_not_verify():
    small = TokenCodec(b"k", "i", cache_size=2)
    tokens = [small.sign(f"s{i}", "o") for i in range(5)]
    for token in tokens:
        identity = small.read(token)
        assert identity is not None and identity.session_id.startswith("s")
    with pytest.raises(TokenError):
        small.read(tokens[0][:-2] + "zz")


def test_tokens_read_off_the_wire_are_remembered_only_once_verified():
    """read_bytes remembers by the bytes a request carried, bounded like read's cache:
    a damaged copy of a remembered token is still refused, and a foreign one still passes."""
    small = TokenCodec(b"k", "i", cache_size=2)
    tokens = [small.sign(f"s{i}", "o").encode() for i in range(5)]
    for _ in range(2):
        for i, token in enumerate(tokens):
            assert small.read_bytes(token) == SessionIdentity(f"s{i}", "o")
    with pytest.raises(TokenError):
        small.read_bytes(tokens[4][:-2] + b"zz")
    assert small.read_bytes(TokenCodec(b"other", "i").sign("s0", "o").encode()) is None


def test_empty_secret_rejected():
    with pytest.raises(ValueError):
        TokenCodec(b"")


def test_fresh_ids_never_begin_with_a_dash():
    """IDs go on command lines (`gym-proxy-ctl move --session ID`), where '-x' reads as an option;
    about one random ID in 64 would begin with '-'."""
    drawn = [new_session_id() for _ in range(3000)] + [new_owner_id() for _ in range(3000)]
    assert not [value for value in drawn if value.startswith("-")]
