"""`make image-test`'s check, run by the image's own Python inside the image, as the chart runs
it (tests/image/run.sh: uid 1000, the root filesystem read-only, tmpfs at /tmp and /dev/shm,
the image's environment, no network but loopback). Each step prints `image-test: ...` and its
wall time; any failure raises.

1. who it runs as, and that the root filesystem refuses writes;
2. `rollout build-model /tmp/model` (the demo model, built in code);
3. `rollout serve` with the README's smallest config (the model's path and the port);
4. one rollout over HTTP (`/v1/rollouts`, the project's client), one OpenAI completion
   (`/v1/completions`, the OpenAI SDK vLLM brings);
5. SIGTERM: `rollout serve` stops and exits 0; what it wrote lies under the chart's
   writable mounts (any other write would have failed: the root is read-only).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PORT = 8000  # the chart's serve port (values: http.port) and the image's EXPOSE
START_TIMEOUT_S = float(os.environ.get("IMAGE_TEST_START_TIMEOUT_S", "600"))
T0 = time.monotonic()


def say(text: str) -> None:
    print(f"image-test: [{time.monotonic() - T0:6.1f} s] {text}", flush=True)


def who_and_where() -> None:
    uid, gid = os.getuid(), os.getgid()
    assert (uid, gid) == (1000, 1000), f"runs as uid {uid} gid {gid}, not the chart's 1000:1000"
    for path in ("/opt/venv/probe", "/etc/probe", "/probe"):
        try:
            Path(path).write_text("x")
        except OSError as exc:
            assert exc.errno in (errno.EROFS, errno.EACCES), (path, exc)
        else:
            raise AssertionError(f"{path}: the root filesystem took a write")
    home, cache = os.environ["HOME"], os.environ["XDG_CACHE_HOME"]
    for d in (home, cache):
        Path(d).mkdir(parents=True, exist_ok=True)  # the chart's emptyDir starts empty
    say(f"uid {uid} gid {gid}, root read-only; HOME={home} XDG_CACHE_HOME={cache}")


def build_model() -> Path:
    model = Path("/tmp/model")
    subprocess.run(["rollout", "build-model", str(model)], check=True, stdout=subprocess.DEVNULL)
    say(f"built the demo model in {model}")
    return model


class Serve:
    def __init__(self, model: Path):
        config = Path("/tmp/platform.yaml")
        # The README's smallest config: the model's path (and the port, optional).
        config.write_text(f"model: {{path: {model}}}\nhttp: {{port: {PORT}}}\n")
        self.lines: list[str] = []
        self.proc = subprocess.Popen(["rollout", "serve", "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            print(f"  serve| {line.rstrip()}", flush=True)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                time.sleep(1)
                if any(text in line for line in self.lines):
                    return
                raise AssertionError(f"rollout serve exited {self.proc.returncode} before {text!r}")
            time.sleep(0.5)
        raise AssertionError(f"no {text!r} from rollout serve in {timeout_s:.0f} s")


def rollout_over_http() -> None:
    from rollout import RolloutRequest, SamplingConfig
    from rollout.client import RolloutClient

    client = RolloutClient.http(f"http://127.0.0.1:{PORT}")
    try:
        (result,) = client.generate_sync([RolloutRequest(prompt_token_ids=[5, 6, 7], n=2, sampling=SamplingConfig(max_tokens=4, ignore_eos=True))])
    finally:
        client.close()
    assert len(result.samples) == 2 and all(len(s.token_ids) == 4 and len(s.logprobs) == 4 for s in result.samples), result
    say(f"/v1/rollouts: 2 samples of 4 tokens, versions {[s.weight_versions for s in result.samples]}")


def openai_completion() -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    out = client.completions.create(model=model, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length", out
    say(f"/v1/completions (OpenAI SDK): model {model!r}, {out.usage.completion_tokens} tokens: {out.choices[0].text!r}")


def written() -> str:
    """What the run wrote: the writable mounts' top entries and sizes (everything else is read-only)."""
    out = subprocess.run(["du", "-sh", *sorted(str(p) for p in Path("/tmp").iterdir()), "/dev/shm"], capture_output=True, text=True)
    return " | ".join(" ".join(line.split()) for line in out.stdout.splitlines())


def main() -> int:
    who_and_where()
    model = build_model()
    serve = Serve(model)
    try:
        serve.wait_for("serving ", START_TIMEOUT_S)
        say("rollout serve: serving")
        rollout_over_http()
        openai_completion()
    finally:
        if serve.proc.poll() is None:
            serve.proc.send_signal(signal.SIGTERM)
            try:
                serve.proc.wait(180)
            except subprocess.TimeoutExpired:
                serve.proc.kill()
                raise AssertionError("rollout serve did not stop within 180 s of SIGTERM")
    assert serve.proc.returncode == 0, f"rollout serve exited {serve.proc.returncode}"
    assert Path(os.environ["XDG_CACHE_HOME"], "vllm").is_dir(), "no vLLM cache under XDG_CACHE_HOME"
    say(f"rollout serve stopped, exit 0; written: {written()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
