"""RolloutClient.close: a transport that fails to close is logged with its cause, and
the others still close (before, the failure vanished in a bare ``except: pass``)."""

from __future__ import annotations

import logging

from rollout.client import RolloutClient


class FailingClose:
    async def generate(self, requests):
        return []

    async def close(self):
        raise ConnectionResetError("peer went away")


def test_a_transport_that_fails_to_close_is_logged_with_its_cause(caplog):
    client = RolloutClient(FailingClose, "test client")
    assert client.generate_sync([{"prompt_token_ids": [1]}]) == []  # makes the transport of the client's own loop
    with caplog.at_level(logging.WARNING, logger="rollout.client.client"):
        client.close()
    assert "closing test client: FailingClose failed to close: ConnectionResetError: peer went away" in caplog.text
    assert client._sync is None, "the client's loop stopped all the same"
