"""An agent-environment library from PyPI, unchanged, against the platform: TextArena's
multi-turn game environments played by its own ``OpenAIAgent`` (the OpenAI SDK inside),
two replicas. Each agent sends the session header agent frameworks use, through the
library's own passthrough of OpenAI call options, and its turns stay on one replica.

The calls go through a recording proxy, which notes the replica that answered each
(``x-rollout-replica``) without the library knowing. The random model's moves are kept
legal with vLLM's structured outputs (also through the passthrough), so every game runs
all its rounds."""

from __future__ import annotations

import asyncio
import collections
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from rollout.http.ingress import SESSION_HEADER
from tests.conftest import API_KEY

pytestmark = pytest.mark.e2e

GAMES = 6  # 12 players: that every session lands on one of two replicas by chance is 2**-11
ROUNDS = 3  # the observation holds the whole game: three rounds fit the tests' context
MOVES = ["[rock]", "[paper]", "[scissors]"]
HOP_BY_HOP = {"connection", "transfer-encoding", "content-length", "content-encoding", "keep-alive"}


class RecordingProxy:
    """Forwards HTTP to the platform; records (session, replica) of every answer."""

    def __init__(self, target: str):
        self.calls: list[tuple[str, str]] = []
        proxy = self
        upstream = httpx.Client(base_url=target, timeout=120)

        class Handler(BaseHTTPRequestHandler):
            def _forward(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
                r = upstream.request(self.command, self.path, headers=headers, content=body)
                proxy.calls.append((self.headers.get(SESSION_HEADER, ""), r.headers.get("x-rollout-replica", "")))
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("content-length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = _forward

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def two_replicas(platform):
    from rollout.app import deploy

    deploy(platform.model_copy(update={"deployment": platform.deployment.model_copy(update={"replicas": 2})}))
    return platform


@pytest.fixture
def proxy(base_url):
    p = RecordingProxy(base_url)
    yield p
    p.close()


def play(game: int, proxy_url: str, model: str) -> dict:
    import textarena as ta

    env = ta.make("IteratedRockPaperScissors-v0", num_rounds=ROUNDS)
    agents = {
        player: ta.agents.OpenAIAgent(
            model_name=model,
            base_url=f"{proxy_url}/v1",
            api_key=API_KEY,
            max_tokens=16,  # enough for the longest move, however the model splits it into tokens
            extra_headers={SESSION_HEADER: f"game{game}-player{player}"},
            extra_body={"structured_outputs": {"choice": MOVES}},
        )
        for player in (0, 1)
    }
    env.reset(num_players=2, seed=game)
    done = False
    while not done:
        player, observation = env.get_observation()
        done, _ = env.step(action=agents[player](observation))
    _, info = env.close()
    return info


async def test_textarena_plays_multi_turn_games_against_the_platform_each_agent_on_one_replica(two_replicas, proxy):
    infos = await asyncio.gather(*(asyncio.to_thread(play, g, proxy.url, two_replicas.model.name) for g in range(GAMES)))
    for info in infos:
        assert all(not p["invalid_move"] and p["turn_count"] == ROUNDS for p in info.values()), info
    by_session = collections.defaultdict(list)
    for session, replica in proxy.calls:
        by_session[session].append(replica)
    assert len(by_session) == 2 * GAMES and all(len(replicas) == ROUNDS for replicas in by_session.values()), dict(by_session)
    assert all(len(set(replicas)) == 1 and replicas[0] for replicas in by_session.values()), dict(by_session)
    assert len({replicas[0] for replicas in by_session.values()}) == 2, "the agents' sessions spread over both replicas"
