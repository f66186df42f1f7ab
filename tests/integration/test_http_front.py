"""The gateway's OpenAI-compatible HTTP API in front of real worker processes: a real redis-server, one prefill
and one decode worker (each its own process loading the default model, one thread), HTTP over real sockets.

Greedy outputs are compared with the offline engine (as in test_gateway_cluster) and with the gRPC API; block
accounting is checked through each worker's Stats with bounded polling, never with timing assertions.
"""
from __future__ import annotations

import asyncio
import http.client
import importlib.metadata
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import grpc
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputSpec
from gateway.openai_protocol import parse_messages
from gateway.tools import parse_tools
from gateway.validation import render_chat
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.cluster import IDLE_TIMEOUT_S, RPC_TIMEOUT_S, Reference, assert_idle, running_cluster

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
LONG_PROMPT = ("You are a careful assistant. Answer briefly and say so when you do not know. The user reads on a "
               "phone and likes lists. Question: what is a mutex?")


@pytest.fixture(scope="module")
def cluster(default_model_path):
    with running_cluster(default_model_path, [("prefill", "p0"), ("decode", "d0")]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(cluster) -> Reference:
    return cluster.reference


@pytest.fixture(scope="module")
def gateway(cluster):
    """Disaggregates every request (local_prefill_threshold 0); HTTP on a free port."""
    return cluster.gateway()


def url(gateway, path: str) -> str:
    return f"http://127.0.0.1:{gateway.http_port}{path}"


def request(gateway, method: str, path: str, body=None, raw: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], dict | str]:
    """(status, headers, decoded JSON body or text) of one HTTP request."""
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url(gateway, path), data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=RPC_TIMEOUT_S) as response:
            status, response_headers, text = response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as err:
        status, response_headers, text = err.code, dict(err.headers), err.read().decode()
    is_json = response_headers.get("Content-Type", "").startswith("application/json")
    return status, response_headers, json.loads(text) if is_json else text


def post(gateway, path: str, body: dict) -> dict:
    status, _, answer = request(gateway, "POST", path, body)
    assert status == 200, answer
    return answer


def stream(gateway, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed response, in order ([DONE] included)."""
    req = urllib.request.Request(url(gateway, path), data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=RPC_TIMEOUT_S) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        lines = response.read().decode().split("\n\n")
    assert lines[-1] == ""
    assert all(line.startswith("data: ") for line in lines[:-1]), lines
    return [line.removeprefix("data: ") for line in lines[:-1]]


def greedy(prompt, max_tokens: int = 16, **fields) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}


def grpc_text(gateway, prompt: str, max_tokens: int = 16) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        chunks = list(generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            text=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)),
            timeout=RPC_TIMEOUT_S))
    return "".join(c.text for c in chunks)


def metric(gateway, name: str, **labels) -> float:
    """One sample of GET /metrics (0 when absent)."""
    status, _, text = request(gateway, "GET", "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


# ------------------------------------------------------------------------------------------------ endpoints
def test_health_and_models(gateway, cluster):
    status, _, body = request(gateway, "GET", "/health")
    assert (status, body) == (200, {"status": "ok", "decode_workers": 1, "prefill_workers": 1})
    status, _, body = request(gateway, "GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [(cluster.model[0].name, "model",
                                                                                   2048)]


def test_greedy_completion_equals_offline_engine_and_grpc(gateway, reference, cluster):
    for prompt in PROMPTS:
        answer = post(gateway, "/v1/completions", greedy(prompt, model=cluster.model[0].name))
        text, token_ids = reference(prompt)
        assert answer["object"] == "text_completion" and answer["model"] == cluster.model[0].name
        [choice] = answer["choices"]
        assert choice["text"] == text == grpc_text(gateway, prompt), prompt
        assert choice["finish_reason"] == ("length" if len(token_ids) == 16 else "stop")
        usage = answer["usage"]
        assert usage["prompt_tokens"] == len(cluster.model[1].encode(prompt))
        assert usage["completion_tokens"] == len(token_ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    ids = reference.llm.tokenizer.encode(PROMPTS[1])
    assert post(gateway, "/v1/completions", greedy(ids))["choices"][0]["text"] == reference(ids)[0]
    assert_idle(cluster.wait_idle())


def test_chat_completion_through_the_chat_template(gateway, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = post(gateway, "/v1/chat/completions", {"messages": messages, "max_tokens": 32, "temperature": 0})
    [choice] = answer["choices"]
    assert answer["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    expected = reference.llm.chat(messages, SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0]
    assert choice["message"]["content"] == expected.text
    assert answer["usage"]["completion_tokens"] == len(expected.token_ids)


def test_openai_client_retrieves_the_model_and_uses_developer_and_max_completion_tokens(gateway, reference, cluster):
    client = openai.OpenAI(base_url=url(gateway, "/v1"), api_key="unused", max_retries=0, timeout=RPC_TIMEOUT_S)
    name = cluster.model[0].name
    model = client.models.retrieve(name)
    assert (model.id, model.object) == (name, "model")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found"

    def messages(role: str) -> list[dict]:
        return [{"role": role, "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}]

    answer = client.chat.completions.create(model=name, messages=messages("developer"), temperature=0,
                                            max_completion_tokens=8)
    expected = reference.llm.chat(messages("system"), SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.completion_tokens == len(expected.token_ids) <= 8
    as_system = client.chat.completions.create(model=name, messages=messages("system"), temperature=0, max_tokens=8)
    assert (as_system.choices[0].message.content, as_system.usage.prompt_tokens) == \
        (answer.choices[0].message.content, answer.usage.prompt_tokens)


@pytest.mark.parametrize("endpoint, extra, param", [
    ("chat", {"extra_body": {"guided_decoding_backend": "outlines"}}, "guided_decoding_backend"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ("chat", {"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ("chat", {"n": 17}, "n"),
    ("chat", {"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ("chat", {"extra_body": {"echo": True}}, "echo"),
    ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ("completions", {"extra_body": {"priority": 1}}, "priority"),
    ("completions", {"logit_bias": {"49152": 1}}, "logit_bias"),
    ("completions", {"extra_body": {"min_tokens": 5}}, "min_tokens"),
])
def test_openai_client_gets_bad_request_naming_a_field_pdserve_does_not_implement(gateway, cluster, endpoint, extra,
                                                                                  param):
    client = openai.OpenAI(base_url=url(gateway, "/v1"), api_key="unused", max_retries=0, timeout=RPC_TIMEOUT_S)
    before = cluster.wait_idle()
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=cluster.model[0].name, messages=[{"role": "user", "content": "hi"}],
                                           **extra)
        else:
            client.completions.create(model=cluster.model[0].name, prompt="hello", max_tokens=4, **extra)
    assert info.value.param == param
    assert cluster.wait_idle() == before


def test_include_stop_str_in_output_keeps_the_stop_string(gateway, reference):
    text, _ = reference(PROMPTS[0])
    stop = text[3:6]
    cut = text.find(stop)
    dropped = post(gateway, "/v1/completions", greedy(PROMPTS[0], stop=stop))["choices"][0]
    kept = post(gateway, "/v1/completions", greedy(PROMPTS[0], stop=stop, include_stop_str_in_output=True))
    assert (dropped["text"], dropped["finish_reason"]) == (text[:cut], "stop")
    assert (kept["choices"][0]["text"], kept["choices"][0]["finish_reason"]) == (text[:cut + len(stop)], "stop")
    events = stream(gateway, "/v1/completions", greedy(PROMPTS[0], stop=stop, include_stop_str_in_output=True))
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == text[:cut + len(stop)]


def test_tokenize_detokenize_and_version(gateway, cluster):
    tokenizer = cluster.model[1]
    status, _, body = request(gateway, "POST", "/tokenize", {"prompt": PROMPTS[0]})
    assert status == 200
    assert body == {"tokens": tokenizer.encode(PROMPTS[0]), "count": len(tokenizer.encode(PROMPTS[0])),
                    "max_model_len": 2048}
    assert body["count"] == post(gateway, "/v1/completions", greedy(PROMPTS[0], max_tokens=1))["usage"]["prompt_tokens"]
    messages = [{"role": "user", "content": "Name two colors."}]
    status, _, chat_body = request(gateway, "POST", "/tokenize", {"messages": messages})
    assert status == 200 and chat_body["count"] == post(gateway, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 1})["usage"]["prompt_tokens"]
    status, _, text = request(gateway, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert (status, text) == (200, {"prompt": PROMPTS[0]})
    status, _, error = request(gateway, "POST", "/detokenize", {"tokens": [0, 10**9]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, _, error = request(gateway, "POST", "/tokenize", {"prompt": "a", "model": "gpt-4"})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    status, _, version = request(gateway, "GET", "/version")
    assert (status, version) == (200, {"version": importlib.metadata.version("pdserve")})


def test_streams_concatenate_to_the_non_streamed_text_and_end_with_done(gateway):
    body = greedy(LONG_PROMPT, 24)
    whole = post(gateway, "/v1/completions", body)
    events = stream(gateway, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *text_chunks, usage_chunk = chunks
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in text_chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["id"] == text_chunks[0]["id"]
    usage = usage_chunk["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (whole["usage"]["prompt_tokens"],
                                                                    whole["usage"]["completion_tokens"])
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16  # the same prompt again: a prefix-cache hit

    chat = {"messages": [{"role": "user", "content": "Name two colors."}], "max_tokens": 16, "temperature": 0}
    whole = post(gateway, "/v1/chat/completions", chat)
    events = stream(gateway, "/v1/chat/completions", chat)
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert events[-1] == "[DONE]" and deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", greedy("hello", temperature=-1), 400, "temperature"),
    ("/v1/completions", greedy("hello", max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", greedy("hello", n=17), 400, "n"),
    ("/v1/completions", greedy(["hello", ""], n=2), 400, "prompt[1]"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", greedy("hello", model="gpt-4"), 404, "model"),
    ("/v1/completions", b'{"prompt": "hello", ', 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
])
def test_bad_input_is_an_openai_error_naming_the_field_and_never_reaches_a_worker(gateway, cluster, path, body,
                                                                                  status, param):
    before = cluster.wait_idle()
    raw = body if isinstance(body, bytes) else None
    got, _, answer = request(gateway, "POST", path, None if raw else body, raw=raw)
    assert got == status
    error = answer["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert cluster.wait_idle() == before


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b'{"prompt": "hello", "max_tokens": 4294967296}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hello", "max_tokens": 18446744073709551616}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hello", "top_k": 5000000000}', "top_k"),
    ("/v1/completions", b'{"prompt": "hello", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", b'{"prompt": "hello", "max_tokens": true}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hello", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "hello", "top_p": Infinity}', "top_p"),
    ("/v1/completions", b'{"prompt": "hello", "temperature": 1e39}', "temperature"),
    ("/v1/completions", b'{"prompt": "hello \\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": "hello", "stop": ["\\udfff"]}', "stop"),
    ("/v1/completions", b'{"prompt": "hello", "model": 5}', "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4294967296}',
     "max_tokens"),
])
def test_out_of_range_and_ill_typed_values_are_400_naming_the_field(gateway, cluster, path, raw, param):
    before = cluster.wait_idle()
    status, _, answer = request(gateway, "POST", path, raw=raw)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert cluster.wait_idle() == before


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_declared_json_is_415(gateway, content_type):
    connection = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=RPC_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps(greedy("hello")).encode(),
                           headers={"Content-Type": content_type} if content_type else {})
        response = connection.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert status == 415 and answer["error"]["code"] == "unsupported_media_type"


def test_a_body_past_max_request_bytes_is_413(cluster):
    small = cluster.gateway(max_request_bytes=64 << 10)
    status, _, answer = request(small, "POST", "/v1/completions", greedy("a" * (100 << 10)))
    assert status == 413 and answer["error"]["code"] == "request_entity_too_large"
    assert request(small, "POST", "/v1/completions", greedy("Hello", 2))[0] == 200


def test_a_huge_prompt_is_400_while_models_is_answered_beside_it(gateway, cluster):
    huge = greedy("lorem ipsum dolor sit amet " * ((3 << 20) // 27))    # ~3 MB: refused before tokenizing

    async def scenario():
        async with aiohttp.ClientSession() as session:
            big = asyncio.ensure_future(session.post(url(gateway, "/v1/completions"), json=huge))
            async with session.get(url(gateway, "/v1/models")) as models:
                models_answer = (models.status, await models.json())
            async with await big as refused:
                return models_answer, (refused.status, await refused.json())

    (models_status, models), (status, answer) = asyncio.run(scenario())
    assert models_status == 200 and models["data"][0]["id"] == cluster.model[0].name
    assert status == 400 and answer["error"]["param"] == "prompt" and "bytes" in answer["error"]["message"]


def test_a_temperature_that_underflows_is_greedy(gateway, reference):
    answer = post(gateway, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1e-45})
    assert answer["choices"][0]["text"] == reference(PROMPTS[0], 8)[0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0},
                                     {"repetition_penalty": 1.3}])
def test_penalties_succeed_over_http(gateway, cluster, path, penalty):
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, **penalty}
    body |= {"prompt": PROMPTS[0]} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "Name three colors."}]}
    answers = [post(gateway, path, body) for _ in range(2)]
    assert all(a["usage"]["completion_tokens"] == 12 for a in answers)
    assert answers[0]["choices"] == answers[1]["choices"]
    assert_idle(cluster.wait_idle())


def test_over_max_inflight_is_429_with_retry_after(cluster):
    small = cluster.gateway(max_inflight=1)

    async def scenario():
        async with aiohttp.ClientSession() as session:
            running = await session.post(url(small, "/v1/completions"),
                                         json=greedy(PROMPTS[0], 200, ignore_eos=True, stream=True))
            await running.content.readline()                 # the first event: the request is admitted
            async with session.post(url(small, "/v1/completions"), json=greedy(PROMPTS[1])) as refused:
                answer = (refused.status, refused.headers.get("Retry-After"), await refused.json())
            running.close()
            return answer

    status, retry_after, body = asyncio.run(scenario())
    assert status == 429 and int(retry_after) >= 1 and body["error"]["type"] == "rate_limit_error"
    assert_idle(cluster.wait_idle())


def test_deadline_header_on_a_long_generation_is_504_and_frees_the_workers(gateway, cluster):
    status, _, answer = request(gateway, "POST", "/v1/completions", greedy(PROMPTS[2], 2000, ignore_eos=True),
                                headers={"X-Request-Timeout": "1"})
    assert status == 504 and answer["error"]["code"] == "deadline_exceeded"
    assert_idle(cluster.wait_idle())


def test_client_disconnect_mid_stream_returns_both_workers_to_idle(gateway, cluster):
    cancelled_before = metric(gateway, "pdserve_requests_total", api="http", code="CANCELLED", endpoint="completions")

    async def scenario():
        async with aiohttp.ClientSession() as session:
            response = await session.post(url(gateway, "/v1/completions"),
                                          json=greedy(PROMPTS[0], 400, ignore_eos=True, stream=True))
            for _ in range(3):
                assert (await response.content.readline()).startswith(b"data: ")
                await response.content.readline()            # the blank line ending the event
            running = (await asyncio.to_thread(cluster.stats, "d0")).running
            response.close()                                 # drops the connection mid-stream
            return running

    assert asyncio.run(scenario()) == 1
    assert_idle(cluster.wait_idle())
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while metric(gateway, "pdserve_requests_total", api="http", code="CANCELLED", endpoint="completions") \
            == cancelled_before:
        assert time.monotonic() < deadline, "the disconnected request was never recorded as CANCELLED"
        time.sleep(0.1)


def test_client_disconnect_while_waiting_for_a_whole_completion_frees_the_workers(gateway, cluster):
    # Nothing is written before the end, so only the handler's cancellation can notice the client left; the
    # generation would outlast wait_idle's bound.
    async def scenario():
        async with aiohttp.ClientSession() as session:
            call = asyncio.create_task(session.post(url(gateway, "/v1/completions"),
                                                    json=greedy(PROMPTS[0], 2000, ignore_eos=True)))
            deadline = time.monotonic() + IDLE_TIMEOUT_S
            while (await asyncio.to_thread(cluster.stats, "d0")).running == 0:
                assert time.monotonic() < deadline, "the request never reached the decode worker"
            call.cancel()                                    # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(scenario())
    assert_idle(cluster.wait_idle())


def test_metrics_count_both_apis(gateway):
    assert metric(gateway, "pdserve_requests_total", api="http", code="OK", endpoint="completions") >= 4
    assert metric(gateway, "pdserve_requests_total", api="http", code="INVALID_ARGUMENT", endpoint="completions") >= 5
    assert metric(gateway, "pdserve_requests_total", api="grpc", code="OK", endpoint="generate") >= 3
    for api in ("http", "grpc"):
        assert metric(gateway, "pdserve_time_to_first_token_seconds_count", api=api) > 0
        assert metric(gateway, "pdserve_e2e_request_latency_seconds_count", api=api) > 0
    assert metric(gateway, "pdserve_generation_tokens_total") > 0
    assert metric(gateway, "pdserve_prefix_cache_hit_tokens_total") >= 16
    assert metric(gateway, "pdserve_kv_transfer_bytes_total", transport="shm") + \
        metric(gateway, "pdserve_kv_transfer_bytes_total", transport="grpc") > 0
    assert metric(gateway, "pdserve_worker_kv_blocks_free", role="decode", worker="d0") > 0


# ------------------------------------------------------------------------------------------------ drain
def test_drain_finishes_http_streams_and_reports_draining(cluster, reference):
    draining = cluster.gateway(drain_timeout_s=60.0)
    expected = reference(PROMPTS[1], max_tokens=64, ignore_eos=True)[0]

    async def scenario():
        async with aiohttp.ClientSession() as probe, aiohttp.ClientSession() as client:
            async with probe.get(url(draining, "/health")) as health:     # its connection stays open (keep-alive)
                assert health.status == 200
            response = await client.post(url(draining, "/v1/completions"),
                                         json=greedy(PROMPTS[1], 64, ignore_eos=True, stream=True))
            first = await response.content.readline()
            stopping = asyncio.get_running_loop().run_in_executor(None, draining.stop, 60.0)
            deadline = time.monotonic() + IDLE_TIMEOUT_S
            while True:                                      # new requests on open connections: 503 draining
                async with probe.get(url(draining, "/health")) as health:
                    if health.status == 503:
                        assert await health.json() == {"status": "draining"}
                        break
                assert time.monotonic() < deadline, "the gateway never reported draining"
                await asyncio.sleep(0.05)
            rest = await response.read()
            await stopping
            with pytest.raises(aiohttp.ClientConnectionError):  # the listening socket is closed
                await client.get(url(draining, "/health"))
            return [e.removeprefix(b"data: ") for e in (first + rest).split(b"\n\n") if e.strip()]

    events = asyncio.run(scenario())
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == expected
    assert chunks[-1]["finish_reason"] == "length"
    assert_idle(cluster.wait_idle())


# ------------------------------------------------------------------------------------------------ structured output
PERSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                 "properties": {"name": {"type": "string", "maxLength": 12},
                                "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
ASK_PERSON = [{"role": "user", "content": "Describe a fictional person as JSON with a name and an age."}]


def openai_client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=url(gateway, "/v1"), api_key="unused", max_retries=0, timeout=RPC_TIMEOUT_S)


def test_openai_parse_with_a_pydantic_model_returns_a_valid_object(gateway, cluster):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=150)

    completion = openai_client(gateway).chat.completions.parse(
        model=cluster.model[0].name, messages=ASK_PERSON, response_format=Person, temperature=0, max_tokens=48)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    jsonschema.validate(json.loads(message.content), Person.model_json_schema())
    assert_idle(cluster.wait_idle())


def test_json_schema_and_json_object_outputs_parse_and_validate(gateway, cluster, reference):
    client = openai_client(gateway)
    name = cluster.model[0].name
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    answer = client.chat.completions.create(model=name, messages=ASK_PERSON, temperature=0, max_tokens=48,
                                            response_format=schema_format)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON_SCHEMA)
    # disaggregated (first token on p0 under the mask, the rest on d0 continuing its matcher) = the offline engine
    offline = reference.llm.chat(ASK_PERSON, SamplingParams(max_tokens=48, temperature=0.0, structured_output=
                                 StructuredOutputSpec.json_schema(PERSON_SCHEMA)))[0].outputs[0]
    assert answer.choices[0].message.content == offline.text
    streamed = client.chat.completions.create(model=name, messages=ASK_PERSON, temperature=0.7, seed=3,
                                              max_tokens=48, response_format={"type": "json_object"}, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert isinstance(json.loads(text), dict)
    assert_idle(cluster.wait_idle())


def test_guided_choice_and_regex_constrain_the_text(gateway, cluster):
    client = openai_client(gateway)
    name = cluster.model[0].name
    question = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    answer = client.chat.completions.create(model=name, messages=question, temperature=1.0, seed=1, n=3,
                                            extra_body={"guided_choice": ["yes", "no", "maybe not"]})
    assert len(answer.choices) == 3                    # forked choices each continue a matcher of their own
    assert all(c.message.content in ("yes", "no", "maybe not") and c.finish_reason == "stop" for c in answer.choices)
    phone = client.completions.create(model=name, prompt="Call me at", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}})
    assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text) and phone.choices[0].finish_reason == "stop"
    cut = client.completions.create(model=name, prompt="Call me at", max_tokens=3, temperature=0,
                                    extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    assert re.fullmatch(r" \d{0,3}-?\d{0,4}", cut.choices[0].text)
    assert_idle(cluster.wait_idle())


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}},
     "response_format.json_schema.schema"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),   # the second in FIELDS order
])
def test_a_constraint_that_does_not_compile_or_a_second_one_is_a_400_naming_it(gateway, cluster, extra, param):
    before = cluster.wait_idle()
    status, _, body = request(gateway, "POST", "/v1/chat/completions",
                              {"model": cluster.model[0].name, "messages": USER_HI, **extra})
    assert status == 400 and body["error"]["param"] == param
    assert cluster.wait_idle() == before


USER_HI = [{"role": "user", "content": "hi"}]


def test_grpc_structured_output_with_local_prefill_on_the_decode_worker(cluster, reference):
    local_gateway = cluster.gateway(local_prefill_threshold=10_000, idle_offload_min_tokens=0)
    spec = common_pb2.StructuredOutput(choice=common_pb2.Choices(options=["red", "green", "blue"]))
    request_pb = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(role="user", content="Name a color.")],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, structured_output=spec))
    with grpc.insecure_channel(f"127.0.0.1:{local_gateway.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Chat(request_pb, timeout=RPC_TIMEOUT_S)
        text = "".join(r.text for r in call)
        assert dict(call.trailing_metadata())["pdserve-local-prefill"] == "short"
        bad = generation_pb2.ChatRequest(messages=request_pb.messages, sampling=common_pb2.SamplingParams(
            structured_output=common_pb2.StructuredOutput(regex="(")))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Chat(bad, timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.structured_output.regex:")
    offline = reference.llm.chat([{"role": "user", "content": "Name a color."}], SamplingParams(
        max_tokens=8, temperature=0.0, structured_output=StructuredOutputSpec.choice(["red", "green", "blue"])))
    assert text == offline[0].outputs[0].text and text in ("red", "green", "blue")
    assert_idle(cluster.wait_idle())


def test_offline_batch_mixing_constrained_and_free_requests_keeps_the_free_ones_greedy_tokens(reference):
    llm = reference.llm
    free = SamplingParams(max_tokens=12, temperature=0.0)
    outs = llm.generate(PROMPTS, [free, SamplingParams(max_tokens=12, temperature=0.0, structured_output=
                                                       StructuredOutputSpec.regex(r"[A-Z][a-z]+\.")),
                                  SamplingParams(max_tokens=12, temperature=0.0, structured_output=
                                                 StructuredOutputSpec.choice(["100 degrees", "212 F"]))])
    assert outs[0].outputs[0].token_ids == reference(PROMPTS[0], max_tokens=12)[1]
    assert re.fullmatch(r"[A-Z][a-z]+\.", outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in ("100 degrees", "212 F") and outs[2].outputs[0].finish_reason == "stop"
    broken = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, structured_output=StructuredOutputSpec.regex("[a-z")))
    assert broken[0].outputs[0].finish_reason == "error" and "structured_output.regex" in broken[0].outputs[0].error
    assert llm.engine.kv.pool.get_num_used_blocks() == 0


# ------------------------------------------------------------------------------------------------ tool calling
WEATHER_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city"],
                      "properties": {"city": {"type": "string", "maxLength": 16},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "additionalProperties": False,
                                                          "properties": {"city": {"type": "string",
                                                                                  "maxLength": 16}}}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def reassembled(stream) -> tuple[str, list[tuple[str, str]], str, list[dict]]:
    """(content, [(name, arguments)], finish_reason, tool call deltas) of a streamed chat completion."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            deltas.append(delta.model_dump(exclude_none=True))
            if delta.id is not None:
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, deltas


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_client_gets_forced_tool_calls_whole_and_streamed_alike(gateway, cluster, tool_choice):
    client = openai_client(gateway)
    kwargs = {"model": cluster.model[0].name, "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": tool_choice,
              "parallel_tool_calls": False, "temperature": 0, "max_tokens": 48}
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls                     # parallel_tool_calls false: one call
    assert call.type == "function" and call.id.startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if tool_choice != "required":
        assert call.function.name == "get_weather"

    content, streamed_calls, finish, deltas = reassembled(client.chat.completions.create(**kwargs, stream=True))
    assert (content, streamed_calls, finish) == ("", [(call.function.name, call.function.arguments)], "tool_calls")
    first = deltas[0]                                # OpenAI's shape: the call's id, type and name come first
    assert set(first) == {"index", "id", "type", "function"} and first["function"]["arguments"] == ""
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])
    if tool_choice != "required":                 # the gRPC Chat gives the same call, arguments not as text
        assert grpc_tool_calls(gateway, generation_pb2.ToolChoice(function_name="get_weather", single_call=True)) \
            == ("", [(call.function.name, call.function.arguments)])
    assert_idle(cluster.wait_idle())


def test_every_choice_of_an_n_2_request_is_a_forced_tool_call(gateway, cluster):
    # choice 1 forks on the decode worker: its own grammar matcher constrains it as choice 0's does
    answer = openai_client(gateway).chat.completions.create(
        model=cluster.model[0].name, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", n=2, seed=7,
        parallel_tool_calls=False, temperature=0.8, max_tokens=48)
    assert [c.index for c in answer.choices] == [0, 1]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert_idle(cluster.wait_idle())


def grpc_tool_calls(gateway, tool_choice: generation_pb2.ToolChoice) -> tuple[str, list[tuple[str, str]]]:
    """(text, [(name, arguments)]) of a greedy gRPC Chat of ASK_WEATHER with TOOLS; calls come on the last message."""
    request_pb = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(role="user", content=ASK_WEATHER[0]["content"])],
        tools=[generation_pb2.Tool(name=t["function"]["name"], description=t["function"]["description"],
                                   parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS],
        tool_choice=tool_choice, sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=48))
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Chat(request_pb, timeout=RPC_TIMEOUT_S))
    assert all(not r.tool_calls for r in responses[:-1])
    return "".join(r.text for r in responses), [(c.name, c.arguments_json) for c in responses[-1].tool_calls]


def test_a_tool_result_in_the_history_is_rendered_and_answered(gateway, cluster, reference):
    history = [*ASK_WEATHER,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'}]
    reply = openai_client(gateway).chat.completions.create(model=cluster.model[0].name, messages=history,
                                                           tools=TOOLS, temperature=0, max_tokens=8)
    # the gateway's rendering (default tool prompt, <tool_call> / <tool_response> blocks), done here
    prompt = render_chat(parse_messages(history), reference.llm.tokenizer, None, parse_tools(TOOLS))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"temperature_c": 21}\n</tool_response>' in prompt
    assert reply.usage.prompt_tokens == len(reference.llm.tokenizer.encode(prompt))
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls") and reply.usage.completion_tokens > 0
    assert_idle(cluster.wait_idle())


def test_langchain_bind_tools_and_with_structured_output(gateway, cluster):
    langchain_openai = pytest.importorskip("langchain_openai")

    class Weather(pydantic.BaseModel):
        """Current weather of a city."""

        city: str = pydantic.Field(max_length=16)
        unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")

    llm = langchain_openai.ChatOpenAI(base_url=url(gateway, "/v1"), api_key="unused", model=cluster.model[0].name,
                                      temperature=0, max_tokens=48, max_retries=0, timeout=RPC_TIMEOUT_S)
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke(ASK_WEATHER[0]["content"])
    [call] = message.tool_calls
    assert call["name"] == "Weather" and Weather(**call["args"])
    for method in ("function_calling", "json_schema"):
        weather = llm.with_structured_output(Weather, method=method).invoke(ASK_WEATHER[0]["content"])
        assert isinstance(weather, Weather) and weather.unit in ("celsius", "fahrenheit")


# ------------------------------------------------------------------------------------------------ n > 1, batches
SEEDED = {"temperature": 1.0, "seed": 7, "max_tokens": 8}


def offline_choices(reference, prompt, n: int, **fields) -> list[str]:
    params = SamplingParams(n=n, **{**SEEDED, **fields})
    return [o.text for o in reference.llm.generate(prompt, params)[0].outputs]


def streamed_choices(events) -> tuple[dict[int, str], dict[int, str], object]:
    """(text per index, finish_reason per index, usage) of an openai client stream."""
    texts, finishes, usage = {}, {}, None
    for event in events:
        usage = event.usage or usage
        for c in event.choices:
            part = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + part
            if c.finish_reason is not None:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
    return texts, finishes, usage


def test_openai_client_n3_is_one_prefill_with_seeded_reproducible_choices(gateway, reference, cluster):
    client = openai.OpenAI(base_url=url(gateway, "/v1"), api_key="unused", max_retries=0, timeout=RPC_TIMEOUT_S)
    name = cluster.model[0].name
    free_before = cluster.wait_idle()["d0"].free_blocks
    expected = offline_choices(reference, PROMPTS[0], 3, ignore_eos=True)
    assert len(set(expected)) == 3
    answer = client.completions.create(model=name, prompt=PROMPTS[0], n=3, extra_body={"ignore_eos": True}, **SEEDED)
    assert [(c.index, c.text, c.finish_reason) for c in answer.choices] == \
        [(i, t, "length") for i, t in enumerate(expected)]
    assert answer.usage.prompt_tokens == len(cluster.model[1].encode(PROMPTS[0]))
    assert answer.usage.completion_tokens == 3 * 8                    # summed over the choices, as OpenAI
    events = client.completions.create(model=name, prompt=PROMPTS[0], n=3, extra_body={"ignore_eos": True},
                                       stream=True, stream_options={"include_usage": True}, **SEEDED)
    texts, finishes, usage = streamed_choices(events)
    assert texts == dict(enumerate(expected)) and finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 24
    # choice 0 is the n=1 completion with the request's seed
    one = client.completions.create(model=name, prompt=PROMPTS[0], extra_body={"ignore_eos": True}, **SEEDED)
    assert one.choices[0].text == expected[0]

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=name, messages=messages, n=3, **SEEDED)
    again = client.chat.completions.create(model=name, messages=messages, n=3, stream=True, **SEEDED)
    texts, finishes, _ = streamed_choices(again)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len(finishes) == 3
    assert texts == {c.index: c.message.content for c in chat.choices}
    assert finishes == {c.index: c.finish_reason for c in chat.choices}
    greedy_n = client.chat.completions.create(model=name, messages=messages, n=2, temperature=0, max_tokens=6)
    assert greedy_n.choices[0].message.content == greedy_n.choices[1].message.content
    stats = cluster.wait_idle()
    assert_idle(stats)
    assert stats["d0"].free_blocks == free_before


def test_batched_prompts_are_indexed_prompt_major(gateway, reference, cluster):
    ids = reference.llm.tokenizer.encode(PROMPTS[2])
    answer = post(gateway, "/v1/completions", greedy([PROMPTS[1], ids], 6, n=2))
    texts = [reference(PROMPTS[1], 6)[0], reference(ids, 6)[0]]
    assert [(c["index"], c["text"]) for c in answer["choices"]] == \
        [(0, texts[0]), (1, texts[0]), (2, texts[1]), (3, texts[1])]
    assert answer["usage"]["prompt_tokens"] == len(cluster.model[1].encode(PROMPTS[1])) + len(ids)
    events = [json.loads(e) for e in stream(gateway, "/v1/completions", greedy([PROMPTS[1], ids], 6, n=2))[:-1]]
    streamed = {}
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == {i: texts[i // 2] for i in range(4)}
    one_token = post(gateway, "/v1/completions", {"prompt": PROMPTS[1], "n": 3, **SEEDED, "max_tokens": 1})
    assert [c["finish_reason"] for c in one_token["choices"]] == ["length"] * 3     # ended as the choices forked
    assert one_token["usage"]["completion_tokens"] == 3
    best = post(gateway, "/v1/completions", {"prompt": PROMPTS[1], "n": 1, "best_of": 3, **SEEDED})
    assert len(best["choices"]) == 1 and best["choices"][0]["text"] in offline_choices(reference, PROMPTS[1], 3)
    assert_idle(cluster.wait_idle())


def test_local_prefill_forks_the_same_choices(cluster, reference):
    local = cluster.gateway(local_prefill_threshold=10_000, idle_offload_min_tokens=0)
    answer = post(local, "/v1/completions", {"prompt": PROMPTS[0], "n": 3, "ignore_eos": True, **SEEDED})
    assert [c["text"] for c in answer["choices"]] == offline_choices(reference, PROMPTS[0], 3, ignore_eos=True)
    assert_idle(cluster.wait_idle())


def test_cancel_of_an_n3_stream_returns_the_decode_workers_blocks(gateway, cluster):
    free_before = cluster.wait_idle()["d0"].free_blocks

    async def scenario():
        async with aiohttp.ClientSession() as session:
            response = await session.post(url(gateway, "/v1/completions"),
                                          json=greedy(PROMPTS[0], 400, ignore_eos=True, stream=True, n=3))
            for _ in range(6):
                assert (await response.content.readline()).startswith(b"data: ")
                await response.content.readline()
            running = (await asyncio.to_thread(cluster.stats, "d0")).running
            response.close()
            return running

    assert asyncio.run(scenario()) == 3
    stats = cluster.wait_idle()
    assert_idle(stats)
    assert stats["d0"].free_blocks == free_before


def test_grpc_generate_streams_each_choice_with_its_index(gateway, cluster):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        chunks = list(generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            text=PROMPTS[2], sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, n=2,
                                                                ignore_eos=True)), timeout=RPC_TIMEOUT_S))
    by_choice = {i: [c for c in chunks if c.choice_index == i] for i in (0, 1)}
    assert {c.choice_index for c in chunks} == {0, 1}
    assert [sum(len(c.token_ids) for c in cs) for cs in by_choice.values()] == [4, 4]
    assert [sum(c.finish_reason != 0 for c in cs) for cs in by_choice.values()] == [1, 1]
    assert chunks[-1].usage.completion_tokens == 8 and sum(c.HasField("usage") for c in chunks) == 1
    assert_idle(cluster.wait_idle())


# ------------------------------------------------------------------------------------------------ prompt logprobs
SCORED = ("The quick brown fox jumps over the lazy dog, and then it runs into the forest where the old owl lives. "
          "The owl asks the fox where it is going, and the fox says")            # 3 full blocks of 16 tokens


def offline_prompt_logprobs(reference, token_ids: list[int]) -> list[float | None]:
    """The offline engine's prompt logprobs (tests/e2e checks them against transformers), first entry None."""
    out = reference.llm.generate([token_ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    return [None] + [lp.logprob for lp in out.prompt_logprobs[1:]]


def test_openai_echo_logprobs_score_the_prompt_also_when_its_prefix_is_cached(gateway, reference, cluster):
    client, name = openai_client(gateway), cluster.model[0].name
    token_ids = reference.llm.tokenizer.encode(SCORED)
    expected = offline_prompt_logprobs(reference, token_ids)
    client.completions.create(model=name, prompt=SCORED, max_tokens=1, temperature=0)
    again = client.completions.create(model=name, prompt=SCORED, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0          # the prompt's prefix is cached now
    generated = reference(SCORED, max_tokens=3, ignore_eos=True)[0]
    for max_tokens in (0, 3):
        answer = client.completions.create(model=name, prompt=SCORED, echo=True, logprobs=1, max_tokens=max_tokens,
                                           temperature=0, extra_body={"ignore_eos": True})
        [choice], lp = answer.choices, answer.choices[0].logprobs
        assert choice.text == SCORED + (generated if max_tokens else "")
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(token_ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(token_ids)] == pytest.approx(expected[1:], abs=2e-3)
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(token_ids), max_tokens)
        assert answer.usage.prompt_tokens_details.cached_tokens == 0    # recomputed, not read from the cache
    pieces = list(client.completions.create(model=name, prompt=SCORED, echo=True, logprobs=1, max_tokens=0,
                                            temperature=0, stream=True))
    assert "".join(piece.choices[0].text for piece in pieces) == SCORED
    streamed = [lp for piece in pieces for lp in piece.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(expected[1:], abs=2e-3)
    assert pieces[-1].choices[0].finish_reason == "length"
    assert_idle(cluster.wait_idle())


def test_vllm_prompt_logprobs_on_both_endpoints_disaggregated_and_local(gateway, reference, cluster):
    token_ids = reference.llm.tokenizer.encode(SCORED)
    expected = offline_prompt_logprobs(reference, token_ids)
    local = cluster.gateway(local_prefill_threshold=10_000, idle_offload_min_tokens=0)
    for front in (gateway, local):
        answer = post(front, "/v1/completions", greedy(SCORED, 2, prompt_logprobs=2))
        positions = answer["choices"][0]["prompt_logprobs"]
        assert positions[0] is None and len(positions) == len(token_ids)
        for p, entry in enumerate(positions[1:], start=1):
            mine = entry[str(token_ids[p])]
            assert mine["logprob"] == pytest.approx(expected[p], abs=2e-3)
            assert 1 <= mine["rank"] and mine["decoded_token"] == reference.llm.tokenizer.decode([token_ids[p]])
            assert 1 <= len(entry) <= 3
        assert answer["choices"][0]["text"] == reference(SCORED, max_tokens=2)[0]
    chat = post(local, "/v1/chat/completions", {"messages": [{"role": "user", "content": SCORED}], "max_tokens": 1,
                                                "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert_idle(cluster.wait_idle())


def test_grpc_prompt_logprobs_come_with_the_first_message(gateway, reference):
    token_ids = reference.llm.tokenizer.encode(SCORED)
    expected = offline_prompt_logprobs(reference, token_ids)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        messages = list(generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=token_ids),
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)),
            timeout=RPC_TIMEOUT_S))
    first = messages[0].prompt_logprobs
    assert [p.logprob.token_id for p in first] == token_ids[1:]
    assert [p.logprob.logprob for p in first] == pytest.approx(expected[1:], abs=2e-3)
    assert all(len(p.logprob.top) == 1 and p.rank >= 1 for p in first)
    assert all(not m.prompt_logprobs for m in messages[1:])


def test_logit_bias_and_min_tokens_end_to_end(gateway, reference, cluster):
    client, name = openai_client(gateway), cluster.model[0].name
    eos = reference.llm.engine.model_config.eos_token_ids[0]
    forced = reference.llm.tokenizer.encode(" banana")[0]
    biased = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={str(forced): 100})
    assert biased.choices[0].text == reference.llm.tokenizer.decode([forced] * 4)
    ends = {str(eos): 100}                                   # EOS certain: only min_tokens keeps it away
    short = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0, logit_bias=ends)
    held = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0, logit_bias=ends,
                                     extra_body={"min_tokens": 4})
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (1, "stop")
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (5, "stop")
    assert_idle(cluster.wait_idle())


def test_lm_eval_loglikelihood_task_through_local_completions(gateway, reference, cluster, tmp_path, monkeypatch):
    """lm-eval-harness's local-completions model (echo + logprobs, max_tokens 1, token ids) on a task read from
    tests/data/lm_eval; its log-likelihoods are the engine's prompt logprobs summed over each continuation."""
    lm_eval = pytest.importorskip("lm_eval", reason="the dev extra provides lm-eval")
    from lm_eval.tasks import TaskManager
    data = Path(__file__).parent.parent / "data" / "lm_eval"
    tokenizer_dir = tmp_path / "tokenizer"                  # the served model's tokenizer, for lm-eval's HF backend
    tokenizer_dir.mkdir()
    reference.llm.tokenizer.backend.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": reference.llm.tokenizer.decode(
            list(reference.llm.engine.model_config.eos_token_ids), skip_special_tokens=False)}))
    monkeypatch.chdir(data)                                  # the task's data_files are relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": cluster.model[0].name, "base_url": url(gateway, "/v1/completions"),
                    "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir), "tokenized_requests": True,
                    "num_concurrent": 1, "max_retries": 1},
        tasks=["pdserve_capitals"], task_manager=TaskManager(include_path=str(data), include_defaults=False),
        log_samples=True, apply_chat_template=False)
    samples = results["samples"]["pdserve_capitals"]
    assert len(samples) == 4
    tok = reference.llm.tokenizer
    for sample in samples:
        context, continuation = sample["doc"]["context"], sample["doc"]["continuation"]
        context_ids, continuation_ids = tok.encode(context), tok.encode(continuation)
        logprobs = offline_prompt_logprobs(reference, context_ids + continuation_ids)
        expected = sum(logprobs[len(context_ids):])
        [[(loglikelihood, _)]] = sample["resps"]
        assert float(loglikelihood) == pytest.approx(expected, abs=5e-3)
    assert "perplexity,none" in results["results"]["pdserve_capitals"]
