"""The embedded NATS password travels to nats-server as an environment-variable reference, which the server
parses as a config token: a generated password that started with a digit was read as a number and the
server refused to start (a 1-in-6 flake of every ``talaria up``). Generated passwords always have the safe
shape; an unsafe one is refused up front with a clear error instead of a server that does not start."""

from __future__ import annotations

import pytest

from talaria.natsutil import EmbeddedNats, connect, generate_password


def test_generated_passwords_have_the_shape_the_server_reads_back():
    for _ in range(500):
        EmbeddedNats(user="talaria", password=generate_password())  # raises on an unsafe shape


@pytest.mark.parametrize("bad", ["12Bxyz-abcdef", "1234567890", "ab-cd-ef-gh", "short"])
def test_an_unsafe_password_is_refused_with_a_clear_error(bad):
    with pytest.raises(ValueError, match="password"):
        EmbeddedNats(user="talaria", password=bad)


async def test_a_server_with_a_digit_leading_hex_password_starts_and_authenticates():
    pw = "p" + "9" * 8 + "e1"  # digits right after the letter: still a string token
    with EmbeddedNats(user="talaria", password=pw) as n:
        from talaria.natsutil import auth_url

        nc = await connect(auth_url(n.url, "talaria", pw), "pw-test")
        assert nc.is_connected
        await nc.close()
