"""Unit tests of the session token codec."""

from __future__ import annotations

import pytest

from proxy.session_tokens import SessionIdentity, TokenCodec, TokenError, new_session_id

codec = TokenCodec(b"secret-a")


def test_round_trip_with_and_without_owner():
    sid = new_session_id()
    assert codec.verify(codec.sign(sid, "owner1")) == SessionIdentity(sid, "owner1")
    assert codec.verify(codec.sign(sid, None)) == SessionIdentity(sid, None)
    assert codec.sign(sid, None).split(".")[2] == "-"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t[:-1],  # truncated MAC
        lambda t: t[: t.rindex(".")],  # MAC missing
        lambda t: "v2" + t[2:],  # unknown version
        lambda t: t.replace(".", "..", 1),  # empty session ID
        lambda t: t + ".extra",
        lambda t: "",
        lambda t: "v1.a b.c." + "x" * 43,  # bad characters
    ],
)
def test_malformed_tokens_refused(mutate):
    with pytest.raises(TokenError):
        codec.verify(mutate(codec.sign("sess", "own")))


def test_forged_owner_refused():
    token = codec.sign("sess", "own")
    _, sid, _, mac = token.split(".")
    with pytest.raises(TokenError):
        codec.verify(f"v1.{sid}.other.{mac}")


def test_token_signed_with_another_secret_refused():
    with pytest.raises(TokenError):
        codec.verify(TokenCodec(b"secret-b").sign("sess", "own"))


def test_flipped_mac_character_refused():
    token = codec.sign("sess", "own")
    flipped = token[:-1] + ("A" if token[-1] != "A" else "B")
    with pytest.raises(TokenError):
        codec.verify(flipped)


def test_cache_does_not_accept_what_it_did_not_verify():
    small = TokenCodec(b"k", cache_size=2)
    tokens = [small.sign(f"s{i}", "o") for i in range(5)]
    for token in tokens:
        assert small.verify(token).session_id.startswith("s")
    with pytest.raises(TokenError):
        small.verify(tokens[0][:-2] + "zz")


def test_empty_secret_rejected():
    with pytest.raises(ValueError):
        TokenCodec(b"")
