"""NCCL's socket interface follows the advertised address (rollout.contracts.net.pin_nccl_interface).

NCCL chooses its bootstrap interface itself (InfiniBand first, then any but loopback and
docker), so a trainer whose first interface leads elsewhere would announce an address the
replicas cannot reach. The check runs in a network namespace of its own with two
interfaces, the advertised address on the second; NCCL itself needs a GPU (tests/gpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import json, os, sys
from rollout.contracts import net
out = {}
os.environ.pop(net.NCCL_IFNAME_ENV, None)
out["second"] = net.pin_nccl_interface(net.Choice("10.231.9.1", "test"))
out["kept"] = net.pin_nccl_interface(net.Choice("10.231.8.1", "test"))  # already set: kept
os.environ.pop(net.NCCL_IFNAME_ENV, None)
out["loopback"] = net.pin_nccl_interface(net.Choice("127.0.0.1", "test"))
try:
    net.pin_nccl_interface(net.Choice("10.231.7.7", "set by ROLLOUT_PUBLISHER_ADDRESS"))
except RuntimeError as e:
    out["foreign"] = str(e)
print(json.dumps(out))
"""


@pytest.fixture
def two_interfaces():
    if os.geteuid() != 0:
        pytest.skip("making a network namespace needs root")
    ns = f"rolloutnccl{uuid.uuid4().hex[:8]}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        pytest.skip("cannot make network namespaces here")
    try:
        for dev, address in (("first0", "10.231.8.1/24"), ("second0", "10.231.9.1/24")):
            # A veth pair with both ends here (this kernel has no dummy interfaces).
            subprocess.run(["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", dev[:-1] + "1"], check=True)
            subprocess.run(["ip", "-n", ns, "addr", "add", address, "dev", dev], check=True)
            subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_nccl_is_pointed_at_the_interface_holding_the_advertised_address_never_over_the_operators_choice(two_interfaces):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env["PYTHONPATH"] = os.path.join(ROOT, "platform")
    done = subprocess.run(["ip", "netns", "exec", two_interfaces, sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # "=" makes NCCL match the name exactly; the first interface (first0) is not chosen.
    assert out["second"] == "=second0"
    assert out["kept"] is None, "an NCCL_SOCKET_IFNAME already set is the operator's (or an earlier round's): kept"
    assert out["loopback"] is None
    assert "10.231.7.7" in out["foreign"] and "ROLLOUT_PUBLISHER_ADDRESS" in out["foreign"]
