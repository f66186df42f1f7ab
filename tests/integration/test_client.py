"""pdserve.client (sync and asyncio), pdserve.health and the client commands of the CLI against a Generation
servicer defined here, served by a real gRPC server on a localhost socket."""

from __future__ import annotations

import asyncio
import collections
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve import cli, health as pd_health
from pdserve.client import (AsyncClient, Chunk, Client, Completion, ModelInfo, PdserveError, Timings, TokenLogprob,
                            ToolCall, Usage)
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.integration.cluster import run_async

SERVICE = "pdserve.v1.Generation"


class EchoGeneration(generation_pb2_grpc.GenerationServicer):
    """Streams the prompt back one word per message. Special prompts: "invalid" (INVALID_ARGUMENT up front),
    "overload midway" (one message, then RESOURCE_EXHAUSTED), "slow" (sleeps 2 s), "forever" (streams until
    cancelled; the cancellation is recorded per request_id)."""

    def __init__(self) -> None:
        self.requests: dict[str, object] = {}
        self.cancelled: dict[str, threading.Event] = collections.defaultdict(threading.Event)

    def Generate(self, request, context):
        self.requests[request.request_id] = request
        if request.WhichOneof("prompt") == "token_ids":
            words = [str(i) for i in request.token_ids.ids]
        else:
            words = request.text.split()
        yield from self._stream(request.request_id, words, request.sampling, context)

    def Chat(self, request, context):
        self.requests[request.request_id] = request
        words = [f"{m.role}:{m.content}" for m in request.messages]
        calls = [generation_pb2.ToolCall(id=f"call_{i}", name=t.name, arguments_json=t.parameters_json)
                 for i, t in enumerate(request.tools)]         # "calls" each tool with its schema as arguments
        yield from self._stream(request.request_id, words, request.sampling, context, calls)

    def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(models=[
            generation_pb2.ModelInfo(name="smol", max_model_len=2048, fingerprint="f1"),
            generation_pb2.ModelInfo(name="other", max_model_len=512, fingerprint="f2")])

    def _stream(self, request_id, words, sampling, context, tool_calls=()):
        if words == ["invalid"]:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p must be in (0, 1], got 2")
        if words == ["slow"]:
            time.sleep(2.0)
        if words == ["forever"]:
            context.add_callback(self.cancelled[request_id].set)
            i = 0
            while context.is_active():
                yield generation_pb2.GenerateResponse(request_id=request_id, text=".", token_ids=[i])
                i += 1
                time.sleep(0.01)
            return
        for i, word in enumerate(words):
            logprobs = []
            if sampling.HasField("logprobs"):
                logprobs = [common_pb2.TokenLogprob(token_id=i, logprob=-0.5,
                                                    top=[common_pb2.TopLogprob(token_id=9, logprob=-1.5)])]
            yield generation_pb2.GenerateResponse(request_id=request_id, text=word + " ", token_ids=[i],
                                                  logprobs=logprobs)
            if words[:2] == ["overload", "midway"]:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests; retry in 1 s")
        yield generation_pb2.GenerateResponse(
            request_id=request_id, finish_reason=common_pb2.FINISH_REASON_STOP, tool_calls=tool_calls,
            usage=generation_pb2.Usage(prompt_tokens=len(words), completion_tokens=len(words), cached_tokens=1),
            timings=generation_pb2.Timings(queue_ms=1.0, prefill_ms=2.0, transfer_ms=0.5, ttft_ms=4.0,
                                           transport="shm", transfer_bytes=4096, kv_reshard_bytes=6144,
                                           kv_reshard_slices=3))


@pytest.fixture(scope="module")
def servicer():
    return EchoGeneration()


@pytest.fixture(scope="module")
def target(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("draining", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


@pytest.fixture
def closed_port_target():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed when returned: nothing listens there


FINAL = Chunk(request_id="r1", text="", token_ids=(), finish_reason="stop", usage=Usage(3, 3, 1),
              timings=Timings(1.0, 2.0, 0.5, 4.0, "shm", 4096, 6144, 3))


# ------------------------------------------------------------------------------------------------ sync client
def test_generate_streams_chunks_and_sends_only_the_given_options(target, servicer):
    with Client(target) as client:
        chunks = list(client.generate("a b c", max_tokens=5, temperature=0.0, seed=3, stop="END",
                                      stop_token_ids=[2], cache_salt="tenant", request_id="r1", model="smol"))
    assert chunks == [Chunk("r1", "a ", (0,)), Chunk("r1", "b ", (1,)), Chunk("r1", "c ", (2,)), FINAL]
    request = servicer.requests["r1"]
    assert (request.text, request.cache_salt, request.model) == ("a b c", "tenant", "smol")
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.seed) == (5, 0.0, 3)
    assert sampling.HasField("temperature")  # 0 is sent, not mistaken for "unset"
    assert (list(sampling.stop), list(sampling.stop_token_ids)) == (["END"], [2])
    assert not sampling.HasField("top_p") and not sampling.HasField("logprobs")


def test_token_id_prompt_and_logprobs(target, servicer):
    with Client(target) as client:
        completion = client.complete([7, 8], request_id="r2", logprobs=1)
    assert list(servicer.requests["r2"].token_ids.ids) == [7, 8]
    assert completion.text == "7 8 "
    assert completion.logprobs == (TokenLogprob(0, -0.5, ((9, -1.5),)), TokenLogprob(1, -0.5, ((9, -1.5),)))


def test_complete_and_chat(target, servicer):
    with Client(target) as client:
        completion = client.complete("a b c", request_id="r1")
        chat = client.complete_chat([{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}],
                                    request_id="r3")
        models = client.list_models()
    assert completion == Completion("r1", "a b c ", (0, 1, 2), "stop", FINAL.usage, FINAL.timings)
    assert chat.text == "system:terse user:hi "
    assert [(m.role, m.content) for m in servicer.requests["r3"].messages] == [("system", "terse"), ("user", "hi")]
    assert models == [ModelInfo("smol", 2048, "f1"), ModelInfo("other", 512, "f2")]


def test_chat_with_tools_sends_them_with_the_history_and_returns_the_calls(target, servicer):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with Client(target) as client:
        done = client.complete_chat(history, tools=tools, tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, parallel_tool_calls=False, request_id="t1", temperature=0)
        with pytest.raises(TypeError):
            client.complete("a", tools=tools)                          # tools are for chat only
    sent = servicer.requests["t1"]
    assert [(m.role, m.content, m.tool_call_id) for m in sent.messages] == \
        [("user", "hi", ""), ("assistant", "", ""), ("tool", "sunny", "c1")]
    assert [(c.id, c.name, c.arguments_json) for c in sent.messages[1].tool_calls] == [("c1", "get_weather", "{}")]
    assert [(t.name, t.description, t.parameters_json) for t in sent.tools] == \
        [("get_weather", "Weather of a city", '{"type": "object"}')]
    assert (sent.tool_choice.function_name, sent.tool_choice.single_call) == ("get_weather", True)
    assert sent.sampling.temperature == 0.0
    assert done.tool_calls == (ToolCall("call_0", "get_weather", '{"type": "object"}'),)


def test_server_errors_surface_as_pdserve_error_with_their_code(target, closed_port_target):
    with Client(target) as client:
        with pytest.raises(PdserveError) as invalid:
            list(client.generate("invalid"))
        stream = client.generate("overload midway")
        assert next(stream).text == "overload "
        with pytest.raises(PdserveError) as overloaded:
            next(stream)
        with pytest.raises(PdserveError) as late:
            client.complete("slow", timeout=0.2)
    assert (invalid.value.code, invalid.value.message) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                           "sampling.top_p must be in (0, 1], got 2")
    assert not invalid.value.retryable
    assert overloaded.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and overloaded.value.retryable
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with Client(closed_port_target, timeout=5) as client, pytest.raises(PdserveError) as unreachable:
        client.list_models()
    assert unreachable.value.code == grpc.StatusCode.UNAVAILABLE


def test_bad_options_fail_before_sending(target):
    with Client(target) as client:
        with pytest.raises(PdserveError) as negative:
            client.generate("a", max_tokens=-1)
        with pytest.raises(PdserveError) as bad_message:
            client.chat([{"role": "user"}])
        with pytest.raises(TypeError, match="max_token"):
            client.generate("a", max_token=3)
    assert negative.value.code == grpc.StatusCode.INVALID_ARGUMENT and negative.value.message.startswith("max_tokens")
    assert bad_message.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_closing_the_stream_cancels_the_call_on_the_server(target, servicer):
    with Client(target) as client:
        stream = client.generate("forever", request_id="cancel-sync")
        assert [next(stream).text for _ in range(3)] == [".", ".", "."]
        assert not servicer.cancelled["cancel-sync"].is_set()
        stream.close()
        assert servicer.cancelled["cancel-sync"].wait(5.0)
        assert list(stream) == []

        with client.generate("forever", request_id="cancel-with") as stream:
            next(stream)
        assert servicer.cancelled["cancel-with"].wait(5.0)


# ------------------------------------------------------------------------------------------------ async client
def test_async_client_streams_collects_maps_errors_and_cancels(target, servicer):
    async def scenario():
        async with AsyncClient(target) as client:
            chunks = [chunk async for chunk in client.generate("a b c", request_id="r1", max_tokens=5)]
            chat = await client.complete_chat([{"role": "user", "content": "hi"}], request_id="r4")
            models = await client.list_models()
            with pytest.raises(PdserveError) as invalid:
                await client.complete("invalid")
            with pytest.raises(PdserveError) as late:
                await client.complete("slow", timeout=0.2)
            stream = client.generate("forever", request_id="cancel-async")
            first = await stream.__anext__()
            await stream.aclose()
            cancelled = await asyncio.to_thread(servicer.cancelled["cancel-async"].wait, 5.0)
            rest = [chunk async for chunk in stream]
        return chunks, chat, models, invalid.value, late.value, first, cancelled, rest

    chunks, chat, models, invalid, late, first, cancelled, rest = run_async(scenario())
    assert chunks == [Chunk("r1", "a ", (0,)), Chunk("r1", "b ", (1,)), Chunk("r1", "c ", (2,)), FINAL]
    assert servicer.requests["r1"].sampling.max_tokens == 5
    assert chat.text == "user:hi " and chat.finish_reason == "stop"
    assert models[0] == ModelInfo("smol", 2048, "f1")
    assert invalid.code == grpc.StatusCode.INVALID_ARGUMENT
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert first.text == "." and cancelled and rest == []


# ------------------------------------------------------------------------------------------------ health
def test_health_check(target, closed_port_target):
    assert pd_health.check(target)
    assert pd_health.check(target, SERVICE)
    assert pd_health.status(target, "draining") == "NOT_SERVING"
    assert pd_health.status(target, "nope") == "SERVICE_UNKNOWN"
    assert not pd_health.check(closed_port_target, timeout=1.0)
    assert pd_health.status(closed_port_target, timeout=1.0) == "UNAVAILABLE"


def test_health_command_exit_codes(target, closed_port_target, capsys):
    assert cli.main(["health", target]) == 0
    assert cli.main(["health", target, "--service", "draining"]) == 1
    assert cli.main(["health", closed_port_target, "--timeout", "1"]) == 1
    assert capsys.readouterr().out.split() == ["SERVING", "NOT_SERVING", "UNAVAILABLE"]


# ------------------------------------------------------------------------------------------------ CLI clients
def test_generate_and_chat_commands_stream_through_the_gateway(target, servicer, capsys):
    assert cli.main(["generate", "a b", "--target", target, "--stop", "x", "--top-k", "4", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out == "a b \n"
    assert "finish=stop" in err and "cached=1" in err and "shm" in err
    assert cli.main(["chat", "hello", "--target", target, "--system", "be brief"]) == 0
    assert capsys.readouterr().out == "system:be brief user:hello \n"


def test_client_commands_report_errors_in_one_line_with_exit_2(target, closed_port_target, capsys):
    assert cli.main(["generate", "invalid", "--target", target]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pdserve: error: INVALID_ARGUMENT: sampling.top_p must be in (0, 1], got 2"
    assert cli.main(["chat", "hi", "--target", closed_port_target, "--timeout", "5"]) == 2
    assert capsys.readouterr().err.startswith("pdserve: error: UNAVAILABLE: ")
