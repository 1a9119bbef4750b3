"""The python tool's sandbox attacked as a policy would: through the public episode API.

Each test forces the model to call ``python`` with an attack (the tools e2e's way: a
turn whose structured output is exactly the call), so the code goes the whole way
— vLLM's parser, the replica, a Ray tool worker, bubblewrap — and then checks from the
host that nothing escaped: no canary secret in any output or trajectory, no file
outside, no connection to a listener on loopback, no process left behind, the tool
workers alive, and the replica serving the next request. One class of escape a test
(the classes the audit-hook sandbox fell to)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import uuid

import psutil
import pytest

from rollout.api import RolloutRequest, SamplingConfig, StructuredOutputs
from tests.conftest import API_KEY, METRICS_PORT, SYNC_TOKEN, wait_until
from tests.test_tools_e2e import OPENING

pytestmark = pytest.mark.e2e

CANARIES = (API_KEY, SYNC_TOKEN)


def forced(code: str) -> SamplingConfig:
    text = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
    return SamplingConfig(max_tokens=440, structured_outputs=StructuredOutputs(choice=[text]), seed=1)


async def run_python(client, code: str):
    """The tool call's result, after checking no canary is in it or in the trajectory."""
    episode = await client.start_episode(OPENING, tools=["python"])
    turn = await episode.turn(sampling=forced(code))
    traj = await episode.end()
    (result,) = turn.tool_calls
    assert result.name == "python" and json.loads(result.arguments) == {"code": code}, "the call ran as forced"
    seen = result.output + traj.model_dump_json()
    for canary in CANARIES:
        assert canary not in seen, f"a secret reached the model: {result.output[:500]}"
    return result


def stdout(result) -> str:
    """What the code printed, from the tool's JSON (whose status the code cannot write)."""
    said = json.loads(result.output)
    assert set(said) <= {"status", "stdout", "stderr", "truncated"}, said
    return said["stdout"]


def tool_workers() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.process_iter(["cmdline"]) if "ToolWorker" in " ".join(p.info["cmdline"] or [])}


async def assert_the_platform_serves_on(client):
    (r,) = await client.generate([RolloutRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingConfig(max_tokens=8, ignore_eos=True))])
    assert len(r.samples[0].token_ids) == 8, "the replica serves on"
    ok = await run_python(client, "print(6*7)")
    assert json.loads(ok.output) == {"status": "ok", "stdout": "42\n"}, ok.output


async def test_the_replica_reports_its_tools_isolation_in_metrics_and_status(handle_client, platform):
    from rollout.status import sandboxes, scrape

    await run_python(handle_client, "print(1)")
    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    labels = await wait_until(lambda: _async(lambda: set(sandboxes(scrape(url)).values())), timeout_s=60)
    (label,) = labels
    assert label.startswith("bubblewrap+seccomp+cgroup-"), label


async def _async(fn):
    return await asyncio.to_thread(fn)


async def test_the_tool_workers_hold_no_secret_and_the_sandbox_gets_an_empty_environment(handle_client):
    result = await run_python(
        handle_client,
        # (printed compactly: the test platform clips tool output to 300 characters)
        "import os,glob\nn=0\nfor p in glob.glob('/proc/*/environ')+glob.glob('/proc/*/cmdline'):\n try:d=open(p,'rb').read();n+=1;'ROLLOUT' in str(d) and print('FOUND',p)\n"
        " except OSError:pass\nprint(n,sorted(os.environ))",
    )
    out = stdout(result)
    assert "FOUND" not in out and "ROLLOUT" not in out and "'PATH'" in out, result.output
    assert int(out.split()[0]) >= 1, "the environments of the sandbox's own processes were read"
    workers = tool_workers()
    assert workers, "the tool workers run on this host"
    for pid in workers:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
        assert SYNC_TOKEN.encode() not in environ and API_KEY.encode() not in environ, f"tool worker {pid} holds a secret in its environment"


async def test_no_connection_reaches_a_listener_on_loopback(handle_client, base_url):
    import ray

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    gcs_port = int(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])
    ports = [listener.getsockname()[1], int(base_url.rsplit(":", 1)[1]), METRICS_PORT, gcs_port]
    try:
        result = await run_python(handle_client, f"import socket\nfor p in {ports}:\n try:socket.create_connection(('127.0.0.1',p),timeout=1);print(p,'open')\n except OSError as e:print(p,e.errno)")
        # Every port refused (ECONNREFUSED, 111): a loopback of its own. Line by line: a port's
        # number may hold "111" itself (49111 did), so the output is not counted as text.
        assert [line.split() for line in stdout(result).splitlines()] == [[str(p), "111"] for p in ports], result.output
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


async def test_native_code_runs_inside_and_leaves_no_process_behind(handle_client, tmp_path):
    mark = f"orphan-{uuid.uuid4().hex[:8]}"
    result = await run_python(
        handle_client,
        "import cffi,os\nf=cffi.FFI();f.cdef('int system(const char*);')\nC=f.dlopen(None)\n"
        f"C.system(b'id -u;hostname;touch {tmp_path}/x 2>&1')\n"
        f"if os.fork()==0:\n os.setsid()\n if os.fork()==0:os.execv('/bin/sleep',['{mark}','300'])\nprint('forked')",
    )
    assert stdout(result).startswith("65534\nsandbox\n") and "forked" in stdout(result), result.output
    assert not (tmp_path / "x").exists()
    await asyncio.sleep(0.5)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if mark in " ".join(p.info["cmdline"] or [])]
    assert left == [], "a process the call started outlived it"


async def test_writes_through_relative_forms_reach_nothing_outside(handle_client):
    rel = f"escape-{uuid.uuid4().hex[:8]}"  # at the root of the host, where an escape would land
    try:
        result = await run_python(
            handle_client,
            f"import os\nd=os.open('/',os.O_RDONLY);T={rel!r}\n"
            "for f in (lambda:os.mkdir(T,dir_fd=d),lambda:os.open(T,os.O_CREAT|os.O_WRONLY,dir_fd=d),lambda:os.symlink('/tmp',T,dir_fd=d),"
            "lambda:os.mkfifo(T,dir_fd=d),lambda:os.link('/sandbox/main.py',T,dst_dir_fd=d),lambda:os.rename('/sandbox/main.py',T,dst_dir_fd=d)):\n"
            " try:f();print('did')\n except OSError as e:print(e.errno)",
        )
        assert "did" not in stdout(result) and stdout(result).count("30") >= 5, result.output  # EROFS
        assert not os.path.lexists("/" + rel)
    finally:
        if os.path.lexists("/" + rel):
            os.system(f"rm -rf /{rel}")


async def test_the_output_is_never_read_back_from_files_the_code_controls(handle_client):
    result = await run_python(handle_client, "import os\nos.symlink('/proc/1/environ','.stdout')\nos.symlink('/proc/1/environ','.isolation')\nos.mkfifo('.stderr')\nprint('ok')")
    assert stdout(result) == "ok\n", result.output


async def test_harm_to_the_host_stays_inside(handle_client, platform):
    before = set(tool_workers())
    result = await run_python(
        handle_client,
        "import os\nfor p in range(2,5000):\n try:p!=os.getpid()and os.kill(p,9)\n except OSError:0\n"
        "for _ in range(1500):os.mkdir('d');os.chdir('d')\n"  # once crashed the cleanup and leaked the directory
        "for f in(lambda:os.memfd_create('m'),lambda:open('/etc/shadow')):\n try:f()\n except OSError as e:print(e.errno)",
    )
    assert stdout(result) == "1\n2\n", result.output  # EPERM (seccomp), ENOENT (not in its root)
    result = await run_python(handle_client, "i=0\ntry:\n while 1:open(f'f{i}','wb').write(b'x'*(1<<20));i+=1\nexcept OSError as e:print(i,e.errno)")
    filled, errno = map(int, stdout(result).split())
    assert errno == 28 and filled <= platform.tools.python.disk_mb, result.output  # ENOSPC at the tmpfs's size
    assert before <= set(tool_workers()), "a tool worker was killed"
    await assert_the_platform_serves_on(handle_client)


async def test_one_episode_cannot_change_another_episodes_tool_output(handle_client):
    victim = run_python(handle_client, "import time\ntime.sleep(3)\nprint('A-ok')")
    attacker = run_python(
        handle_client,
        "import glob,time\ntime.sleep(1)\nfor p in glob.glob('/tmp/**',recursive=True)+glob.glob('/proc/*/cwd/*')+glob.glob('/proc/*/root/tmp/*')+glob.glob('/proc/*/fd/*'):\n"
        " try:open(p,'w').write('forged');print('w',p)\n except OSError as e:print(p,e.errno)",
    )
    a, _ = await asyncio.gather(victim, attacker)
    assert stdout(a) == "A-ok\n", a.output


async def test_the_second_red_teams_classes_hold_through_the_episode_api(handle_client, platform):
    """The classes of the second red team (tests/test_sandbox_attacks.py has each on its own,
    in every worker mode) through vLLM's parser, the replica and a Ray tool worker: the host
    kernel's knobs, host-kernel information, socket families outside the network namespace,
    shared kernel pools, pdeathsig, and a forged status."""
    knob = open("/proc/sys/kernel/pid_max").read()
    # (two calls: a forced call's text must fit the test's max_tokens)
    result = await run_python(
        handle_client,
        "import os,socket as S\no=[]\nfor f in(lambda:open('/proc/sys/kernel/pid_max','w').write(open('/proc/sys/kernel/pid_max').read()),"
        "lambda:open('/proc/kcore','rb').read(1),lambda:S.socket(40,1),lambda:S.socket(16,3),os.openpty):\n try:f();o.append(0)\n except OSError as e:o.append(e.errno)\nprint(*o)",
    )
    said = json.loads(result.output)
    errnos = said["stdout"].split()
    # EROFS; EACCES (masked) or ENOENT (a kernel without it); EAFNOSUPPORT twice; ENOENT (no /dev/ptmx)
    assert said["status"] == "ok" and errnos[0] == "30" and errnos[1] in ("2", "13") and errnos[2:] == ["97", "97", "2"], result.output
    assert open("/proc/sys/kernel/pid_max").read() == knob
    result = await run_python(
        handle_client,
        "import ctypes,os\nL=ctypes.CDLL(None)\nprint(L.inotify_init1(0),L.msgget(0,0o1600),L.prctl(1,0,0,0,0),os.getuid())\nprint('[exit code 0]')\nraise SystemExit(4)",
    )
    said = json.loads(result.output)
    assert said == {"status": "exit code 4", "stdout": "-1 -1 -1 65534\n[exit code 0]\n"}, result.output
    await assert_the_platform_serves_on(handle_client)


async def test_tool_workers_in_a_namespace_without_user_namespaces_refuse_to_start_with_the_reason(ray_cluster, tmp_path):
    """The kernel refusal, through real tool workers: their bubblewrap runs in a user
    namespace whose limit on further user namespaces is 0. The pool (which a replica starts
    before it serves) fails with the reason and the setting to change; no call runs."""
    from rollout.config import ToolsConfig
    from rollout.tools.pool import ToolPool
    from rollout.tools.sandbox import SandboxUnavailable

    tmp_path.chmod(0o755)  # a root worker runs bubblewrap as the call's unprivileged uid
    for parent in tmp_path.parents:
        if parent.stat().st_mode & 0o001 == 0 and str(parent).startswith(tempfile.gettempdir() + "/"):
            parent.chmod(parent.stat().st_mode | 0o001)
    wrapper = tmp_path / "bwrap-without-userns"
    wrapper.write_text("#!/bin/sh\nexec unshare --user --map-root-user sh -c 'echo 0 > /proc/sys/user/max_user_namespaces && exec bwrap \"$@\"' sh \"$@\"\n")
    wrapper.chmod(0o755)
    pool = ToolPool.from_config(ToolsConfig(python={"bwrap": str(wrapper)}))
    try:
        with pytest.raises(SandboxUnavailable) as e:
            await pool.start()
        assert "the python tool cannot start" in str(e.value) and "user.max_user_namespaces" in str(e.value) and "tools.python.enabled=false" in str(e.value), e.value
        outcome = await pool.run("rollout.tools.builtins:python", json.dumps({"code": "print(1)"}))
        assert outcome.error and "SandboxUnavailable" in outcome.output, "a worker without its sandbox runs no code"
    finally:
        pool.close()
