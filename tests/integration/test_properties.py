"""Property-based robustness of both public APIs against one live cluster (a real redis-server, one prefill and one
decode worker process, an in-process gateway): every field of GenerateRequest / ChatRequest and of the OpenAI
bodies, with values of every type (huge integers, NaN and infinities, unicode edge cases, lone surrogates, raw
bytes that protobuf or JSON cannot parse, wrong content types).

The property (DESIGN section 11): every answer is OK, INVALID_ARGUMENT / 400 naming the field (the gRPC details
start with "field: ", the OpenAI error has its `param`), or RESOURCE_EXHAUSTED / 413 / 415 / 429; never a 5xx,
UNKNOWN or INTERNAL, never a hang (every call has its own timeout; streams are read a few messages deep, then
cancelled, which also exercises cancels). Afterwards the cluster still answers "Paris" greedily and every worker's
KV blocks are all free again (Stats RPC).

Bounded for CI: MAX_EXAMPLES per test, no shrinking (each example is a real request), completions of at most a
few tokens.
"""
from __future__ import annotations

import http.client
import json
import math
import re

import grpc
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.cluster import assert_idle, running_cluster

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 60
CALL_TIMEOUT_S = 60.0
MAX_MESSAGES = 4
"""Stream messages (gRPC) or events (SSE) read before the call is cancelled."""
SMALL_MAX_TOKENS = 3
MAX_MODEL_LEN = 2048
SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck), print_blob=False)
FIELD_NAMED = re.compile(r"^[A-Za-z_][\w.\[\]]*: ")
"""INVALID_ARGUMENT details name the field first: "sampling.temperature: ...", "GenerateRequest: ..."."""
PARIS = "What is the capital of France?"

# ------------------------------------------------------------------------------------------------ values
EDGE_STRINGS = ["", " ", "\x00", "\ufeff", "\u202e", "\U0001F1EB\U0001F1F7", "e\u0301", "\uffff", "\U0010ffff",
                "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\r\n", "\\", '"', "x" * 3000, "Paris " * 200]
LONE_SURROGATES = ["\ud800", "\udfff", "a\udc80b", "\ud83d"]
EDGE_INTS = [0, 1, -1, 2, 49151, 49152, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1,
             2**64, -(2**63) - 1, 5 * 10**9, 10**30]
EDGE_FLOATS = [0.0, -0.0, 1e-45, 5e-324, 1e-7, 0.5, 1.0, 1.5, 2.0, 100.0, 1e38, 3.5e38, 1e308, -1.0,
               math.nan, math.inf, -math.inf]

safe_text = st.one_of(st.sampled_from(EDGE_STRINGS), st.text(max_size=20))       # what protobuf can encode
any_text = st.one_of(safe_text, st.sampled_from(LONE_SURROGATES),
                     st.text(st.characters(categories=["Cs", "Co", "Cn", "Cc", "Zs", "Lo", "Mn"]), max_size=8))
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-5, 60000), st.integers())
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(-3, 3), st.floats())
json_scalars = st.one_of(st.none(), st.booleans(), ints, floats, any_text)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly of its own type (so later fields get checked too), else anything JSON holds."""
    return st.one_of(plausible, plausible, json_values)


uint32 = st.one_of(st.sampled_from([0, 1, 2, 49151, 49152, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
uint64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
proto_floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(-3, 3), st.floats(width=32))
# Small enough to finish at once, or past any context (refused): never a long completion.
grpc_max_tokens = st.sampled_from([0, 1, SMALL_MAX_TOKENS, MAX_MODEL_LEN + 1, 2**31, 2**32 - 1])


# ------------------------------------------------------------------------------------------------ the cluster
@pytest.fixture(scope="module")
def cluster(default_model_path):
    with running_cluster(default_model_path, [("prefill", "p0"), ("decode", "d0")]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gateway(cluster):
    return cluster.gateway()


@pytest.fixture(scope="module")
def channel(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield channel


# ------------------------------------------------------------------------------------------------ gRPC
def grpc_answer(call) -> tuple[str, str]:
    """(status code name, details) of a response stream read MAX_MESSAGES deep, then cancelled (OK)."""
    try:
        for count, _ in enumerate(call, 1):
            if count >= MAX_MESSAGES:
                call.cancel()
                return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""
    return "OK", ""


def grpc_problem(code: str, details: str) -> str | None:
    if code in ("OK", "RESOURCE_EXHAUSTED"):
        return None
    if code == "INVALID_ARGUMENT" and FIELD_NAMED.match(details):
        return None
    return f"{code}: {details!r}"


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(max_tokens=draw(grpc_max_tokens))
    for name, values in (("temperature", proto_floats), ("top_k", uint32), ("top_p", proto_floats),
                         ("min_p", proto_floats), ("seed", uint64), ("repetition_penalty", proto_floats),
                         ("presence_penalty", proto_floats), ("frequency_penalty", proto_floats),
                         ("ignore_eos", st.booleans()), ("logprobs", uint32)):
        if draw(st.booleans()):
            setattr(params, name, draw(values))
    params.stop_token_ids.extend(draw(st.lists(uint32, max_size=3)))
    params.stop.extend(draw(st.lists(safe_text, max_size=3)))
    return params


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(request_id=draw(safe_text), cache_salt=draw(safe_text),
                                             model=draw(st.one_of(st.just(""), safe_text)))
    prompt = draw(st.sampled_from(["text", "token_ids", "none"]))
    if prompt == "text":
        request.text = draw(safe_text)
    elif prompt == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(uint32, max_size=8)))
    if draw(st.booleans()):   # without sampling the defaults apply (a long completion: the stream is cancelled)
        request.sampling.CopyFrom(draw(sampling_params()))
    return request


@st.composite
def chat_requests(draw) -> generation_pb2.ChatRequest:
    roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", ""]), safe_text)
    messages = [generation_pb2.ChatMessage(role=draw(roles), content=draw(safe_text))
                for _ in range(draw(st.integers(0, 3)))]
    return generation_pb2.ChatRequest(request_id=draw(safe_text), messages=messages, cache_salt=draw(safe_text),
                                      model=draw(st.one_of(st.just(""), safe_text)), sampling=draw(sampling_params()))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


BAD_UTF8 = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"ok\xe2\x82"] + \
           [s.encode("utf-8", "surrogatepass") for s in LONE_SURROGATES]


@st.composite
def raw_request_bytes(draw) -> tuple[str, bytes]:
    """(method, bytes): unparsable or odd encodings of GenerateRequest / ChatRequest."""
    method = draw(st.sampled_from(["Generate", "Chat"]))
    valid = (draw(generate_requests()) if method == "Generate" else draw(chat_requests())).SerializeToString()
    kind = draw(st.sampled_from(["random", "truncated", "bad_utf8", "unknown_field", "wrong_wire_type",
                                 "huge_varint", "bad_length"]))
    if kind == "random":
        data = draw(st.binary(max_size=64))
    elif kind == "truncated":
        data = valid[:draw(st.integers(0, max(0, len(valid) - 1)))] if valid else b"\x12"
    elif kind == "bad_utf8":
        bad = draw(st.sampled_from(BAD_UTF8))
        if method == "Generate":
            data = valid + _field_bytes(draw(st.sampled_from([1, 2, 5, 6])), bad)   # request_id, text, salt, model
        else:
            message = _field_bytes(draw(st.sampled_from([1, 2])), bad)             # ChatMessage role / content
            data = valid + _field_bytes(2, message)
    elif kind == "unknown_field":
        data = valid + _varint(99 << 3) + _varint(draw(st.integers(0, 2**64 - 1)))
    elif kind == "wrong_wire_type":
        data = valid + _varint(draw(st.sampled_from([2, 3, 4])) << 3) + _varint(1)   # a varint where a message is
    elif kind == "huge_varint":   # sampling.max_tokens (a uint32) as a 10-byte varint
        number = 4 if method == "Generate" else 3
        data = valid + _field_bytes(number, _varint(1 << 3) + _varint(draw(st.integers(2**32, 2**64 - 1))))
    else:
        data = valid + _varint(2 << 3 | 2) + _varint(2**31)                       # a length past the end
    return method, data


@SETTINGS
@given(request=generate_requests())
def test_grpc_generate_answers_ok_or_names_the_field(channel, request):
    call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=CALL_TIMEOUT_S)
    assert grpc_problem(*grpc_answer(call)) is None, request


@SETTINGS
@given(request=chat_requests())
def test_grpc_chat_answers_ok_or_names_the_field(channel, request):
    call = generation_pb2_grpc.GenerationStub(channel).Chat(request, timeout=CALL_TIMEOUT_S)
    assert grpc_problem(*grpc_answer(call)) is None, request


@SETTINGS
@given(method_and_bytes=raw_request_bytes())
@example(method_and_bytes=("Chat", b"\x1e\xed\x06"))                    # corrupt wire format
@example(method_and_bytes=("Generate", _field_bytes(2, "\ud800".encode("utf-8", "surrogatepass"))))
def test_grpc_raw_bytes_answer_ok_or_invalid_argument_naming_the_message(channel, method_and_bytes):
    method, data = method_and_bytes
    # Identity serializers: the bytes go on the wire as they are.
    call = channel.unary_stream(f"/pdserve.v1.Generation/{method}")(data, timeout=CALL_TIMEOUT_S)
    assert grpc_problem(*grpc_answer(call)) is None, (method, data)


# ------------------------------------------------------------------------------------------------ HTTP
def http_post(gateway, path: str, body: bytes, content_type: str | None = "application/json") -> tuple[int, list]:
    """(status, answer): the decoded JSON body, or, for an event stream, its first MAX_MESSAGES decoded events
    (fewer when `data: [DONE]` comes first: HTTP/1.1 keeps the connection open after it, as OpenAI clients expect)."""
    connection = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=CALL_TIMEOUT_S)
    try:
        headers = {"Content-Type": content_type} if content_type is not None else {}
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        if response.getheader("Content-Type", "").startswith("text/event-stream"):
            events = []
            while len(events) < MAX_MESSAGES:
                line = response.fp.readline()
                if not line or line.strip() == b"data: [DONE]":  # the stream's end: the connection stays open
                    break
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
            return response.status, events
        text = response.read()
        try:
            return response.status, [json.loads(text)]
        except ValueError:
            return response.status, [text.decode(errors="replace")]
    finally:
        connection.close()   # mid-stream: the client goes away, the gateway must abort the request


def http_problem(status: int, answer: list, body_is_object: bool) -> str | None:
    if status == 200:
        errors = [event["error"] for event in answer if isinstance(event, dict) and "error" in event]
        return f"200 with in-band errors {errors}" if errors else None
    if status >= 500 or status < 400:
        return f"{status}: {answer}"
    error = answer[0].get("error") if answer and isinstance(answer[0], dict) else None
    if not isinstance(error, dict) or not error.get("message"):
        return f"{status} without an OpenAI error object: {answer}"
    if status in (413, 415, 429):
        return None
    if status == 404 and error.get("param") == "model":
        return None
    if status == 400 and (error.get("param") or not body_is_object):
        return None
    return f"{status} naming no field: {error}"


def bounded(body: dict) -> dict:
    """The body, with any completion length that would be accepted and long replaced by a short one (a value past
    the context is accepted too: generation stops where the context ends, which is long for a short prompt)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and SMALL_MAX_TOKENS < value < 2**32:
            body[name] = SMALL_MAX_TOKENS
    body.setdefault("max_tokens", SMALL_MAX_TOKENS)
    return body


def encode(body, ascii_only: bool) -> bytes:
    """JSON as Python writes it (NaN, Infinity and lone surrogates included: escaped, or raw when not ascii_only)."""
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


SAMPLING_FIELDS = {
    "max_tokens": field(st.one_of(st.integers(0, SMALL_MAX_TOKENS), st.sampled_from(EDGE_INTS))),
    "temperature": field(floats), "top_p": field(floats), "min_p": field(floats), "top_k": field(ints),
    "seed": field(ints), "repetition_penalty": field(floats), "presence_penalty": field(floats),
    "frequency_penalty": field(floats), "stop_token_ids": field(st.lists(ints, max_size=3)),
    "stop": field(st.one_of(any_text, st.lists(any_text, max_size=3))), "ignore_eos": field(st.booleans()),
    "stream": field(st.booleans()), "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "model": field(st.one_of(st.just("default"), any_text)), "cache_salt": field(any_text),
    "n": field(st.sampled_from([1, 2])), "best_of": field(st.sampled_from([1, 2])),
    "response_format": field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "guided_regex": field(any_text), "guided_choice": field(st.lists(any_text, max_size=3)),
    "logit_bias": field(st.dictionaries(st.one_of(st.integers(0, 2**33).map(str), any_text), st.one_of(ints, floats),
                                        max_size=3)),
    "min_tokens": field(ints), "prompt_logprobs": field(ints),
    "echo": json_values, "suffix": json_values, "tools": json_values,
    "functions": json_values, "user": json_values, "unknown_field": json_values,
}
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "logprobs": field(ints)}
CHAT_FIELDS = {**SAMPLING_FIELDS, "logprobs": field(st.booleans()), "top_logprobs": field(ints),
               "max_completion_tokens": field(st.one_of(st.integers(0, SMALL_MAX_TOKENS), st.sampled_from(EDGE_INTS)))}
prompts = field(st.one_of(any_text, st.lists(ints, max_size=6)))
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "tool"])),
     "content": field(st.one_of(any_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": any_text}),
                                                   max_size=2)))},
    optional={"name": json_values})
messages = field(st.lists(message, max_size=3))


# Inputs answered with a 500 (or accepted) on fd09d1a, always tried first.
@SETTINGS
@given(body=st.fixed_dictionaries({"prompt": prompts}, optional=COMPLETION_FIELDS), ascii_only=st.booleans())
@example(body={"prompt": "\ud800"}, ascii_only=True)
@example(body={"prompt": "a", "max_tokens": 2**32}, ascii_only=True)
@example(body={"prompt": "a", "top_k": 5 * 10**9}, ascii_only=True)
@example(body={"prompt": "a", "model": 5}, ascii_only=True)
@example(body={"prompt": "a", "temperature": 1e-45}, ascii_only=True)
@example(body={"prompt": "/\xae\x99o\xbc", "stream": True}, ascii_only=False)  # 3 events, then [DONE]: a valid stream
def test_http_completions_answer_ok_or_a_4xx_naming_the_field(gateway, body, ascii_only):
    body = bounded(body)
    status, answer = http_post(gateway, "/v1/completions", encode(body, ascii_only))
    assert http_problem(status, answer, body_is_object=True) is None, body


@SETTINGS
@given(body=st.fixed_dictionaries({"messages": messages}, optional=CHAT_FIELDS), ascii_only=st.booleans())
@example(body={"messages": [{"role": "user", "content": "\udfff"}]}, ascii_only=False)
def test_http_chat_completions_answer_ok_or_a_4xx_naming_the_field(gateway, body, ascii_only):
    body = bounded(body)
    status, answer = http_post(gateway, "/v1/chat/completions", encode(body, ascii_only))
    assert http_problem(status, answer, body_is_object=True) is None, body


@SETTINGS
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.one_of(st.binary(max_size=64), json_values.map(lambda value: encode(value, False)),
                      st.sampled_from([b"", b"{", b'{"prompt": "a"', b"\xff\xfe{}", b"[]", b"null", b"1e999",
                                       b'{"prompt": "a", "prompt": 1}', b'{"max_tokens": 1' + b"0" * 5000 + b"}"])),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                     "multipart/form-data; boundary=x", "application/json; charset=latin-1", None]))
@example(path="/v1/completions", body=b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
         content_type="application/json")                                # past int()'s 4300-digit limit
@example(path="/v1/completions", body=b"[" * 200_000, content_type="application/json")  # too deep to parse
@example(path="/v1/chat/completions", body=b'{"prompt": "a"}', content_type="text/plain")
def test_http_raw_bodies_answer_a_4xx(gateway, path, body, content_type):
    try:
        parsed = json.loads(body)
        is_object = isinstance(parsed, dict) and content_type is not None and content_type.startswith("application/json")
    except (ValueError, RecursionError):
        is_object = False
    if is_object:   # a JSON object that happens to be a valid request: keep it short
        body = encode(bounded(parsed), True)
    status, answer = http_post(gateway, path, body, content_type)
    assert http_problem(status, answer, body_is_object=is_object) is None, (path, body[:200], content_type)


# ------------------------------------------------------------------------------------------------ afterwards
def test_afterwards_the_cluster_answers_paris_and_every_block_is_free(cluster, gateway, channel):
    request = generation_pb2.ChatRequest(messages=[generation_pb2.ChatMessage(role="user", content=PARIS)],
                                         sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.0))
    text = "".join(r.text for r in generation_pb2_grpc.GenerationStub(channel).Chat(request, timeout=CALL_TIMEOUT_S))
    assert "Paris" in text
    body = {"messages": [{"role": "user", "content": PARIS}], "max_tokens": 16, "temperature": 0}
    status, answer = http_post(gateway, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and "Paris" in answer[0]["choices"][0]["message"]["content"], answer
    stats = cluster.wait_idle()
    assert_idle(stats)
    for worker_id, s in stats.items():
        assert s.free_blocks == s.num_blocks, f"{worker_id}: {s.num_blocks - s.free_blocks} blocks not free: {s}"
