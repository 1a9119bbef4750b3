"""The python tool calls' host uids (rollout.tools.identity), one module, real processes."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from rollout.tools.identity import CallUsers, IdentityUnavailable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="leasing uids is what a root tool worker does")

BASE = 210_000  # beside, not inside, the default range a test platform's workers lease


def test_live_workers_never_share_a_uid_and_a_lease_ends_with_its_holder(tmp_path):
    leases = tmp_path / "leases"
    a = CallUsers.lease(BASE, 2, str(leases))
    b = CallUsers.lease(BASE, 2, str(leases))
    assert {a.user.uid, b.user.uid} == {BASE, BASE + 1} and a.user.leased and b.user.leased
    with pytest.raises(IdentityUnavailable, match=r"all 2 uids from tools.python.uid_base=210000 are leased.*uid_count"):
        CallUsers.lease(BASE, 2, str(leases))
    freed = a.user.uid
    a.close()
    assert CallUsers.lease(BASE, 2, str(leases)).user.uid == freed


def test_a_lease_kills_what_an_earlier_holder_of_its_uid_left(tmp_path):
    left = subprocess.Popen(["sleep", "300"], user=BASE + 5, group=BASE + 5, extra_groups=[])
    try:
        users = CallUsers.lease(BASE + 5, 1, str(tmp_path / "leases"))
        assert users.user.uid == BASE + 5
        deadline = time.monotonic() + 5
        while left.poll() is None:
            assert time.monotonic() < deadline, "the earlier holder's process survived the lease"
            time.sleep(0.02)
        assert left.returncode == -9
    finally:
        left.kill()


def test_the_prefix_drops_every_privilege(tmp_path):
    users = CallUsers.lease(BASE + 7, 1, str(tmp_path / "leases"))
    out = subprocess.run([*users.command_prefix(), "sh", "-c", "id -u; id -G; grep -E 'CapEff|CapBnd|NoNewPrivs' /proc/self/status"], capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    assert lines[0] == str(BASE + 7) and lines[1] == str(BASE + 7), out.stdout
    assert "CapEff:\t0000000000000000" in out.stdout and "CapBnd:\t0000000000000000" in out.stdout and "NoNewPrivs:\t1" in out.stdout, out.stdout


def test_the_lease_directory_must_be_roots_alone(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(IdentityUnavailable, match="owned by root and writable by root only"):
        CallUsers.lease(BASE, 1, str(shared))


def test_a_root_worker_cannot_run_calls_as_itself():
    with pytest.raises(IdentityUnavailable, match="must lease a uid of its own"):
        CallUsers.own()
