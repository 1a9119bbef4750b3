"""Addresses for a transfer group's rendezvous, where this process listens."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def own_address() -> str:
    """The address other nodes reach this process at: ``ROLLOUT_PUBLISHER_ADDRESS`` when
    set (a hostname that does not resolve to a reachable address), else Ray's node address
    inside a Ray cluster, else the hostname's."""
    explicit = os.environ.get("ROLLOUT_PUBLISHER_ADDRESS")
    if explicit:
        return explicit
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())
