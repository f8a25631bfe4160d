"""The agent clients themselves, from the npm registry at pinned versions,
run headless against a real model in this repository (slow: run with
``--run-slow``; skipped, saying why, where npm or its registry is missing;
an install that fails otherwise fails the test).

Codex CLI speaks the Responses API as a custom provider; Claude Code the
Anthropic Messages API through ``ANTHROPIC_BASE_URL``. Each completes a
turn with tools offered: exit status 0, the model's text in its output, and
every request the server saw answered 2xx. Qwen2.5-Coder-0.5B, whose
template has tool calling, with n-gram speculation on.

Codex runs with its default configuration (a 4,300-token prompt here).
Claude Code's default one is a 21,500-token prompt that this 2-core CPU
did not prefill within 20 minutes; it runs here in its minimal mode
(``--bare``, one tool), and its default request is checked without
generating in ``test_agent_apis.py`` (``count_tokens``) and timed turn by
turn with ``scripts/bench/bench_agent_turns.py`` where prefill is fast.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CODEX = "@openai/codex@0.169.0"
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.328"
PROMPT = "Reply with the single word: hello"


class Statuses:
    """ASGI middleware: the status of every response, with its path."""

    seen: list = []

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def record(message):
            if message["type"] == "http.response.start":
                Statuses.seen.append((scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, record if scope["type"] == "http" else send)


@pytest.fixture(scope="module")
def npm_bin(tmp_path_factory) -> Path:
    """Both clients installed into one folder; its ``node_modules/.bin``."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed here: the clients cannot be installed")
    folder = tmp_path_factory.mktemp("agent-clients")
    try:
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(folder),
                        CODEX, CLAUDE_CODE], check=True, capture_output=True, text=True,
                       timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.skip(f"npm did not install {CODEX} and {CLAUDE_CODE} in 600 s: {e}"[:500])
    except subprocess.CalledProcessError as e:
        if not registry_unreachable(e.stderr):
            pytest.fail(f"npm could not install {CODEX} and {CLAUDE_CODE}: {e.stderr[-1500:]}")
        pytest.skip(f"the npm registry is unreachable from here: {e.stderr}"[:500])
    return folder / "node_modules" / ".bin"


# npm's errors for a registry it cannot reach; any other failure (a pinned
# version that does not exist, a broken package) fails the test.
NETWORK_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT",
                  "ENETUNREACH", "EHOSTUNREACH", "network request")


def registry_unreachable(stderr: str) -> bool:
    return any(code in stderr for code in NETWORK_ERRORS)


@pytest.fixture(scope="module")
def server(qwen05_path):
    from conftest import LiveServer

    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    server = LiveServer(qwen05_path, wrap=Statuses,
                        spec=SpecDecodeConfig(mode="ngram", calibration_seconds=0))
    yield server
    server.close()


def _run(argv, env, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env={**os.environ, **env}, cwd=cwd, capture_output=True,
                          text=True, timeout=1800, stdin=subprocess.DEVNULL)


def _answered_2xx(since: int) -> list:
    seen = Statuses.seen[since:]
    assert seen, "the client sent the server nothing"
    assert all(200 <= status < 300 for _, status in seen), seen
    return seen


def test_codex_exec_completes_a_turn(npm_bin, server, tmp_path):
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{server.model}"\nmodel_provider = "local"\n\n'
        f'[model_providers.local]\nname = "local"\nbase_url = "{server.url}/v1"\n'
        'wire_api = "responses"\n')
    since = len(Statuses.seen)
    out = _run([str(npm_bin / "codex"), "exec", "--skip-git-repo-check", PROMPT],
               {"CODEX_HOME": str(home)}, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = _answered_2xx(since)
    assert ("/v1/responses", 200) in seen
    answer = out.stdout.strip().splitlines()
    assert answer and answer[-1].strip(), out.stdout  # the model's last message


def test_claude_code_print_completes_a_turn(npm_bin, server, tmp_path):
    """Minimal mode, Bash offered and allowed for ``ls``."""
    since = len(Statuses.seen)
    env = {"HOME": str(tmp_path), "ANTHROPIC_BASE_URL": server.url,
           "ANTHROPIC_API_KEY": "none", "ANTHROPIC_DEFAULT_HAIKU_MODEL": server.model,
           "ANTHROPIC_SMALL_FAST_MODEL": server.model, "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    out = _run([str(npm_bin / "claude"), "--bare", "-p", PROMPT, "--model", server.model,
                "--tools", "Bash", "--allowedTools", "Bash(ls:*)"], env, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    seen = _answered_2xx(since)
    assert any(path == "/v1/messages" for path, _ in seen)
    assert out.stdout.strip(), out.stderr[-3000:]
