"""The gateway in front of real worker processes: a real redis-server, two prefill workers and one decode worker
(each its own process loading the default model), real gRPC over sockets.

Outputs are compared with the offline engine (`engine.llm.LLM`, prefix caching off: always a cold run) with the
same thread count as the workers, so greedy tokens must be identical. Block accounting is checked through each
worker's Stats with a bounded wait, never with timing assertions. Test order matters only at the end: the last
test kills a prefill worker.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.server import start_server
from kvstore.embedded_redis import EmbeddedRedis
from kvstore.hashing import hash_prompt_blocks, root_hash
from protos.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.cluster import (BLOCK_SIZE, IDLE_TIMEOUT_S, MAX_MODEL_LEN, REPO, RPC_TIMEOUT_S,
                                       START_TIMEOUT_S, Reference, assert_idle, run_async, running_cluster)

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "In machine learning, overfitting means",
    "My favourite programming language is",
    "Translate to French: Good morning, how are you?",
]
LONG_PREFIX = ("You are a meticulous assistant. Answer with care, cite what you know, and say so when you do not "
               "know. The user works on distributed systems, likes short answers, and reads them on a phone. ") * 3


def greedy(max_tokens: int = 16, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    last: generation_pb2.GenerateResponse
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def prefill_workers(self) -> list[str]:
        value = self.metadata["pdserve-prefill-workers"]
        return value.split(",") if value else []


def collect(call) -> Result:
    return collect_rest(call)


def collect_rest(call, *received: generation_pb2.GenerateResponse) -> Result:
    """The call's Result, `received` being its messages already read."""
    chunks = [*received, *call]
    assert chunks and chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    return Result("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1],
                  {m.key: m.value for m in call.trailing_metadata()})


@pytest.fixture(scope="module")
def cluster(default_model_path):
    with running_cluster(default_model_path, [("prefill", "p0"), ("prefill", "p1"), ("decode", "d0")]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def reference(cluster) -> Reference:
    return cluster.reference


@pytest.fixture(scope="module")
def gateway(cluster):
    """Disaggregates every request while a prefill worker lives (local_prefill_threshold 0)."""
    return cluster.gateway()


@pytest.fixture(scope="module")
def stub(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def generate(stub, prompt, sampling=None, **fields) -> Result:
    request = generation_pb2.GenerateRequest(sampling=sampling or greedy(), **fields)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids[:] = prompt
    return collect(stub.Generate(request, timeout=RPC_TIMEOUT_S))


# ------------------------------------------------------------------------------------------------ basics
def test_health_and_list_models(gateway, stub, cluster):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10).models
    assert [(m.name, m.max_model_len) for m in models] == [(cluster.model[0].name, MAX_MODEL_LEN)]
    assert models[0].fingerprint == cluster.model[0].fingerprint


def test_greedy_output_equals_offline_engine_with_prefill_on_p_and_decode_on_d(stub, reference, cluster):
    for prompt in PROMPTS:
        result = generate(stub, prompt)
        text, token_ids = reference(prompt)
        assert (result.text, result.token_ids) == (text, token_ids), prompt
        usage, timings = result.last.usage, result.last.timings
        assert usage.prompt_tokens == len(cluster.model[1].encode(prompt))
        assert usage.completion_tokens == len(token_ids)
        assert timings.transport in ("shm", "grpc") and timings.transfer_bytes > 0
        assert result.metadata["pdserve-decode-worker"] == "d0"
        assert result.metadata["pdserve-local-prefill"] == ""
        assert len(result.prefill_workers) == 1 and result.prefill_workers[0] in ("p0", "p1")
        assert timings.ttft_ms > 0 and timings.prefill_ms > 0
    assert_idle(cluster.wait_idle())


def test_token_id_prompt_and_chat_equal_offline_engine(stub, reference):
    ids = reference.llm.tokenizer.encode(PROMPTS[2])
    assert generate(stub, ids).token_ids == reference(ids)[1]
    messages = [{"role": "user", "content": "Name two colors."}]
    chat = collect(stub.Chat(generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(**m) for m in messages], sampling=greedy(24)), timeout=RPC_TIMEOUT_S))
    expected = reference.llm.chat(messages, SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
    assert (chat.text, chat.token_ids) == (expected.text, expected.token_ids)


def test_stop_string_truncates_text_and_frees_the_decode_worker(stub, reference, cluster):
    text, token_ids = reference(PROMPTS[0], max_tokens=32, ignore_eos=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    result = generate(stub, PROMPTS[0], greedy(32, ignore_eos=True, stop=[stop]))
    assert result.text == text[:text.index(stop)]
    assert result.last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert result.token_ids == token_ids[:len(result.token_ids)] and len(result.token_ids) < 32
    assert_idle(cluster.wait_idle())


def test_local_prefill_when_the_missing_part_is_short(cluster, reference):
    local_gateway = cluster.gateway(local_prefill_threshold=10_000, idle_offload_min_tokens=0)
    with grpc.insecure_channel(f"127.0.0.1:{local_gateway.port}") as channel:
        result = generate(generation_pb2_grpc.GenerationStub(channel), PROMPTS[3])
    assert result.token_ids == reference(PROMPTS[3])[1]
    assert result.last.timings.transport == "local" and result.last.timings.transfer_bytes == 0
    assert result.metadata["pdserve-local-prefill"] == "short" and result.prefill_workers == []


def test_a_short_prompt_goes_to_an_idle_prefill_worker_while_the_decode_worker_is_busy(cluster, reference):
    offload = cluster.gateway(local_prefill_threshold=10_000, idle_offload_min_tokens=4)
    deadline = time.monotonic() + IDLE_TIMEOUT_S       # every worker's heartbeat says idle (none left by others)
    while any(w.running or w.waiting for w in cluster.index.list_workers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    with grpc.insecure_channel(f"127.0.0.1:{offload.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        busy = stub.Generate(generation_pb2.GenerateRequest(text=PROMPTS[4], sampling=greedy(64, ignore_eos=True)),
                             timeout=RPC_TIMEOUT_S)
        first = next(busy)                 # d0 decodes it now (prefilled there: d0 was idle)
        result = generate(stub, PROMPTS[5])
        busy_result = collect_rest(busy, first)
    assert busy_result.metadata["pdserve-local-prefill"] == "short" and busy_result.prefill_workers == []
    assert busy_result.token_ids == reference(PROMPTS[4], max_tokens=64, ignore_eos=True)[1]
    assert result.metadata["pdserve-local-prefill"] == "" and len(result.prefill_workers) == 1
    assert result.last.timings.transfer_bytes > 0
    assert result.token_ids == reference(PROMPTS[5])[1]
    assert_idle(cluster.wait_idle())


def test_a_prefill_longer_than_the_lease_keeps_its_reservation(cluster, reference):
    # A 256-token prompt takes far longer than 250 ms to prefill here: without renewals D would release the
    # reservation before the KV arrived, the push would be refused on both prefill workers, and d0 would end up
    # prefilling the prompt itself.
    prompt = long_prompts(1, 256, seed=11)[0]
    short_lease = cluster.gateway(lease_ms=250)
    with grpc.insecure_channel(f"127.0.0.1:{short_lease.port}") as channel:
        result = generate(generation_pb2_grpc.GenerationStub(channel), prompt, greedy(4))
    assert result.token_ids == reference(prompt, max_tokens=4)[1]
    assert result.metadata["pdserve-local-prefill"] == "" and len(result.prefill_workers) == 1, \
        (result.metadata, result.last.timings.prefill_ms)
    assert result.last.timings.transport in ("shm", "grpc") and result.last.timings.transfer_bytes > 0
    assert_idle(cluster.wait_idle())


# ------------------------------------------------------------------------------------------------ prefix caching
def prefill_directly(cluster, prefill_worker: str, token_ids: list[int]) -> None:
    """Prefill `token_ids` on one chosen prefill worker (Reserve on d0, Prefill, Abort), bypassing routing."""
    request = worker_pb2.WorkerRequest(request_id=f"warm-{prefill_worker}", prompt_token_ids=token_ids,
                                       sampling=greedy(1), seed=1)
    with grpc.insecure_channel(cluster.endpoint("d0")) as dc, \
            grpc.insecure_channel(cluster.endpoint(prefill_worker)) as pc:
        decode, prefill = worker_pb2_grpc.DecodeWorkerStub(dc), worker_pb2_grpc.PrefillWorkerStub(pc)
        target = decode.Reserve(worker_pb2.ReserveRequest(request=request, lease_ms=30_000), timeout=10).target
        prefill.Prefill(worker_pb2.PrefillRequest(request=request, target=target), timeout=RPC_TIMEOUT_S)
        decode.Abort(worker_pb2.AbortRequest(request_id=request.request_id), timeout=10)


def test_shared_prefix_is_routed_to_the_prefill_worker_holding_it(stub, reference, cluster):
    # Put the prefix on p1 only. With equal loads ties go to p0, so only the prefix hit can send the next
    # request to p1.
    tokenizer = cluster.model[1]
    prefill_directly(cluster, "p1", tokenizer.encode(LONG_PREFIX + "Question: what is a mutex?"))
    hashes = hash_prompt_blocks(tokenizer.encode(LONG_PREFIX), BLOCK_SIZE, root_hash(cluster.model[0].fingerprint))
    deadline = time.monotonic() + IDLE_TIMEOUT_S      # the worker publishes its blocks asynchronously
    while cluster.index.lookup(hashes, role="prefill")["p1"] < len(hashes) - 1:
        assert time.monotonic() < deadline, "the prefix never showed up in the index"
        time.sleep(0.1)
    assert cluster.index.lookup(hashes, role="prefill")["p0"] == 0

    prompt = LONG_PREFIX + "Question: what is a semaphore?"
    result = generate(stub, prompt)
    assert result.prefill_workers == ["p1"]
    assert result.last.usage.cached_tokens >= BLOCK_SIZE * (len(hashes) - 1)
    assert result.last.usage.cached_tokens % BLOCK_SIZE == 0
    assert result.token_ids == reference(prompt)[1]      # a cache hit gives the cold run's tokens
    assert_idle(cluster.wait_idle())


def test_same_new_prefix_in_flight_is_routed_to_the_same_prefill_worker(stub, reference, cluster):
    # Two requests with a prefix no worker holds, the second sent while the first is prefilling (or just after):
    # the index learns the prefix only once p computed it, so only the gateway's memory of where it sent the
    # first one keeps the second from going to the idle prefill worker and computing the prefix again.
    prefix = "Reference notes. " + LONG_PREFIX.replace("assistant", "reviewer") * 3
    prompts = [prefix + "Q: what is a lock?", prefix + "Q: what is a latch?"]
    # The prefix must outweigh one unit of load (the default prefill_load_penalty_tokens, 256).
    assert len(cluster.model[1].encode(prefix)) > 256 + BLOCK_SIZE
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(generate, stub, prompts[0])
        time.sleep(0.05)                                      # usually mid-prefill; any order must give one P
        second = pool.submit(generate, stub, prompts[1])
        results = [first.result(), second.result()]
    assert results[0].prefill_workers == results[1].prefill_workers
    assert [r.token_ids for r in results] == [reference(p)[1] for p in prompts]
    assert_idle(cluster.wait_idle())


def test_delta_transfer_sends_fewer_bytes_when_d_holds_the_prefix(stub, reference, cluster):
    prefix = "Context: " + LONG_PREFIX.replace("assistant", "helper")
    first = generate(stub, prefix + "Q: define latency.")
    cluster.wait_idle("d0")                          # its blocks are cached on D once it finished
    second_prompt = prefix + "Q: define bandwidth."
    second = generate(stub, second_prompt)
    assert second.last.usage.prompt_tokens >= first.last.usage.prompt_tokens - 2
    assert 0 < second.last.timings.transfer_bytes < first.last.timings.transfer_bytes / 3
    assert second.token_ids == reference(second_prompt)[1]


# ------------------------------------------------------------------------------------------------ concurrency
def test_32_concurrent_streams_complete_correctly(gateway, reference, cluster):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    expected = [reference(p)[1] for p in prompts]

    async def run_all():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            aio_stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(prompt):
                chunks = [c async for c in aio_stub.Generate(
                    generation_pb2.GenerateRequest(text=prompt, sampling=greedy()), timeout=RPC_TIMEOUT_S)]
                return [t for c in chunks for t in c.token_ids], chunks[-1]

            return await asyncio.gather(*(one(p) for p in prompts))

    results = run_async(run_all())
    assert [tokens for tokens, _ in results] == expected
    assert all(last.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED for _, last in results)
    assert_idle(cluster.wait_idle())


# ------------------------------------------------------------------------------------------------ cancel / deadline
def test_client_cancel_mid_stream_returns_both_workers_to_idle(stub, cluster):
    call = stub.Generate(generation_pb2.GenerateRequest(text=PROMPTS[5], sampling=greedy(400, ignore_eos=True)),
                         timeout=RPC_TIMEOUT_S)
    for _ in range(3):
        next(call)
    assert cluster.stats("d0").running == 1
    call.cancel()
    assert_idle(cluster.wait_idle())


def test_deadline_on_a_long_generation_returns_both_workers_to_idle(stub, cluster):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generation_pb2.GenerateRequest(text=PROMPTS[6], sampling=greedy(2000, ignore_eos=True)),
                           timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(cluster.wait_idle())


def test_no_leak_after_100_random_cancels(gateway, cluster):
    rng = random.Random(2024)

    async def run_all():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            aio_stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(i):
                prompt = (LONG_PREFIX if i % 5 == 0 else "") + PROMPTS[i % len(PROMPTS)] + f" ({i})"
                call = aio_stub.Generate(generation_pb2.GenerateRequest(
                    text=prompt, sampling=greedy(64, ignore_eos=True)), timeout=RPC_TIMEOUT_S)
                if rng.random() < 0.4:       # cancel before the first token: during Reserve or Prefill
                    await asyncio.sleep(rng.uniform(0.0, 0.3))
                else:                        # cancel mid-stream
                    num_chunks = rng.randint(1, 10)
                    async for _ in call:
                        num_chunks -= 1
                        if num_chunks == 0:
                            break
                call.cancel()

            for wave in range(4):
                await asyncio.gather(*(one(wave * 25 + i) for i in range(25)))

    run_async(run_all())
    assert_idle(cluster.wait_idle())


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("fields, field_name", [
    (dict(text=""), "prompt"),
    (dict(token_ids=generation_pb2.TokenIds(ids=[1] * MAX_MODEL_LEN)), "prompt"),
    (dict(text="hello", sampling=common_pb2.SamplingParams(top_p=1.5)), "sampling.top_p"),
    (dict(text="hello", sampling=common_pb2.SamplingParams(temperature=-1.0)), "sampling.temperature"),
    (dict(token_ids=generation_pb2.TokenIds(ids=[1, 49152])), "token_ids"),
    (dict(text="hello", sampling=common_pb2.SamplingParams(stop=[""])), "sampling.stop[0]"),
])
def test_bad_input_is_invalid_argument_and_never_reaches_a_worker(stub, cluster, fields, field_name):
    before = cluster.wait_idle()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field_name + ": ")
    assert cluster.wait_idle() == before


def test_over_max_inflight_is_resource_exhausted_with_a_retry_hint(cluster):
    small = cluster.gateway(max_inflight=1)
    with grpc.insecure_channel(f"127.0.0.1:{small.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        running = stub.Generate(generation_pb2.GenerateRequest(text=PROMPTS[0], sampling=greedy(200, ignore_eos=True)),
                                timeout=RPC_TIMEOUT_S)
        next(running)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generation_pb2.GenerateRequest(text=PROMPTS[1]), timeout=RPC_TIMEOUT_S))
        running.cancel()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in info.value.details()
    assert int(dict(info.value.trailing_metadata())["retry-after-ms"]) > 0
    assert_idle(cluster.wait_idle())


def test_no_decode_worker_is_unavailable(cluster):
    with EmbeddedRedis() as empty:
        config = GatewayConfig(model=str(cluster.model_path), redis_url=empty.url, port=0, http_port=-1)
        handle = start_server(config, cluster.model)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                with pytest.raises(grpc.RpcError) as info:
                    list(generation_pb2_grpc.GenerationStub(channel).Generate(
                        generation_pb2.GenerateRequest(text=PROMPTS[0]), timeout=RPC_TIMEOUT_S))
        finally:
            handle.stop(0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "decode worker" in info.value.details()


def raw_generate(gateway, payload: bytes, method: str = "Generate"):
    """Send `payload` as the request message's bytes, unparsed (what a buggy or hostile client can send)."""
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        call = channel.unary_stream(f"/pdserve.v1.Generation/{method}", request_serializer=lambda b: b,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
        return list(call(payload, timeout=RPC_TIMEOUT_S))


@pytest.mark.parametrize("method, payload, message", [
    ("Generate", b"\x12\x02\xff\xfe", "GenerateRequest"),                 # text = invalid UTF-8
    ("Generate", b"\x12\x05ab", "GenerateRequest"),                       # truncated string
    ("Chat", b"\x12\x04\x0a\x02\xc3\x28", "ChatRequest"),                 # messages[0].role = invalid UTF-8
    ("Generate", b"\x22\x03\x08\x80\x80", "GenerateRequest"),             # sampling: truncated varint
])
def test_unparsable_messages_are_invalid_argument_naming_the_message(gateway, cluster, method, payload, message):
    before = cluster.wait_idle()
    with pytest.raises(grpc.RpcError) as info:
        raw_generate(gateway, payload, method)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{message}: ")
    assert cluster.wait_idle() == before


def test_a_message_past_max_request_bytes_is_refused_by_grpc(cluster):
    small = cluster.gateway(max_request_bytes=64 << 10)
    with grpc.insecure_channel(f"127.0.0.1:{small.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(text="a" * (100 << 10)), timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_huge_prompt_is_refused_while_list_models_is_answered_beside_it(gateway, cluster):
    huge = "lorem ipsum dolor sit amet " * ((3 << 20) // 27)    # ~3 MB: cannot fit, refused before tokenizing

    async def scenario():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}",
                                             options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
            aio_stub = generation_pb2_grpc.GenerationStub(channel)
            big = aio_stub.Generate(generation_pb2.GenerateRequest(text=huge), timeout=RPC_TIMEOUT_S)
            big_task = asyncio.ensure_future(big.read())
            models = await aio_stub.ListModels(generation_pb2.ListModelsRequest(), timeout=RPC_TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await big_task
            return models, info.value

    models, error = run_async(scenario())
    assert [m.name for m in models.models] == [cluster.model[0].name]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("prompt: ")
    assert "bytes" in error.details()


def test_a_temperature_that_underflows_is_greedy(stub, reference):
    result = generate(stub, PROMPTS[0], common_pb2.SamplingParams(max_tokens=8, temperature=1e-45))
    assert result.token_ids == reference(PROMPTS[0], 8)[1]


@pytest.mark.parametrize("penalty", [dict(presence_penalty=1.5), dict(frequency_penalty=1.0),
                                     dict(repetition_penalty=1.3)])
def test_penalties_through_the_cluster_succeed_and_change_nothing_else(stub, cluster, penalty):
    sampling = common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **penalty)
    results = [generate(stub, PROMPTS[3], sampling) for _ in range(2)]
    assert all(len(r.token_ids) == 12 for r in results)
    assert results[0].token_ids == results[1].token_ids              # greedy with penalties is deterministic
    assert_idle(cluster.wait_idle())


def long_prompts(n: int, num_tokens: int, seed: int) -> list[list[int]]:
    """Distinct token-id prompts (no shared prefix blocks)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(num_tokens)] for _ in range(n)]


def run_concurrently(gateway, prompts, max_tokens: int) -> list:
    """Each prompt's (status code, trailing metadata, number of tokens), all sent at once."""
    async def run_all():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            aio_stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(prompt):
                call = aio_stub.Generate(generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=prompt), sampling=greedy(max_tokens, ignore_eos=True)),
                    timeout=RPC_TIMEOUT_S * 3)
                num_tokens = 0
                try:
                    async for chunk in call:
                        num_tokens += len(chunk.token_ids)
                except grpc.aio.AioRpcError as err:
                    return err.code(), dict(err.trailing_metadata() or ()), num_tokens
                return grpc.StatusCode.OK, {}, num_tokens

            return await asyncio.gather(*(one(p) for p in prompts))

    return run_async(run_all())


def test_a_full_decode_pool_is_resource_exhausted_with_a_retry_hint_never_unavailable(cluster):
    # d0's pool holds ~180 blocks of 16; each prompt needs 94: one fits at a time.
    capacity = cluster.stats("d0").num_blocks
    num_tokens = BLOCK_SIZE * (capacity // 2 + 4)
    shedding = cluster.gateway(max_queued=0)
    results = run_concurrently(shedding, long_prompts(3, num_tokens, seed=7), max_tokens=32)
    codes = [code for code, _, _ in results]
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    for code, metadata, _ in results:
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert int(metadata["retry-after-ms"]) > 0
    assert_idle(cluster.wait_idle())


def test_the_gateway_queues_work_a_full_decode_pool_cannot_take_yet(cluster):
    capacity = cluster.stats("d0").num_blocks
    num_tokens = BLOCK_SIZE * (capacity // 2 + 4)
    queueing = cluster.gateway(queue_timeout_s=RPC_TIMEOUT_S * 3)
    results = run_concurrently(queueing, long_prompts(3, num_tokens, seed=8), max_tokens=32)
    assert [(code, n) for code, _, n in results] == [(grpc.StatusCode.OK, 32)] * 3
    assert_idle(cluster.wait_idle())


# ------------------------------------------------------------------------------------------------ drain
GATEWAY_MAIN = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
from gateway.config import GatewayConfig
from gateway.server import serve
serve(GatewayConfig(**json.loads(sys.argv[1])))
"""


def test_sigterm_drains_in_flight_streams_then_exits(cluster, reference):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = dict(model=str(cluster.model_path), redis_url=cluster.redis.url, port=port, block_size=BLOCK_SIZE,
                  max_model_len=MAX_MODEL_LEN, local_prefill_threshold=0, drain_timeout_s=60.0, http_port=0)
    proc = subprocess.Popen([sys.executable, "-c", GATEWAY_MAIN, json.dumps(config)], cwd=REPO)
    try:
        fast_retry = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=fast_retry) as channel:
            grpc.channel_ready_future(channel).result(timeout=START_TIMEOUT_S)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=RPC_TIMEOUT_S)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            call = generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
                text=PROMPTS[1], sampling=greedy(40, ignore_eos=True)), timeout=RPC_TIMEOUT_S)
            first = next(call)
            proc.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            rest = list(call)
            assert [*first.token_ids, *(t for c in rest for t in c.token_ids)] == \
                reference(PROMPTS[1], max_tokens=40, ignore_eos=True)[1]
            assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert proc.wait(RPC_TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_idle(cluster.wait_idle())


# ------------------------------------------------------------------------------------------------ failures
def test_redis_stalled_routes_by_load_with_the_last_known_workers(stub, reference, cluster):
    generate(stub, PROMPTS[4])                      # the gateway knows the workers
    cluster.redis.pause()
    try:
        result = generate(stub, PROMPTS[7])
    finally:
        cluster.redis.resume()
    assert result.token_ids == reference(PROMPTS[7])[1]
    assert result.last.timings.transport in ("shm", "grpc")


def test_corrupted_transfer_is_rejected_counted_and_recomputed(cluster, stub, reference):
    # Every transfer of p-bad is corrupted after its digests were computed. With equal (zero) prefix hits and
    # loads the tie goes to the lowest worker id, and "p-bad" sorts before "p0".
    cluster.start_worker("prefill", "p-bad", fault_corrupt_transfers=1000)
    cluster.wait_registered("p-bad")
    try:
        errors_before = cluster.stats("d0").transfer_errors
        prompt = "A corrupted chunk must never be decoded: " + PROMPTS[8]
        result = generate(stub, prompt)
        assert result.prefill_workers[0] == "p-bad" and result.prefill_workers[1] in ("p0", "p1")
        assert result.token_ids == reference(prompt)[1]
        assert cluster.stats("d0").transfer_errors == errors_before + 1

        once = cluster.gateway(prefill_attempts=1)   # no second prefill worker: D recomputes the prompt itself
        with grpc.insecure_channel(f"127.0.0.1:{once.port}") as channel:
            prompt = "Recompute locally after a bad transfer: " + PROMPTS[9]
            local = generate(generation_pb2_grpc.GenerationStub(channel), prompt)
        assert local.prefill_workers == ["p-bad"] and local.metadata["pdserve-local-prefill"] == "prefill_failed"
        assert local.last.timings.transport == "local"
        assert local.token_ids == reference(prompt)[1]
        assert cluster.stats("d0").transfer_errors == errors_before + 2
        assert cluster.stats("p-bad").transfer_errors == 2
        assert_idle(cluster.wait_idle())
    finally:
        cluster.stop_worker("p-bad")


def test_killing_a_prefill_worker_mid_run_later_requests_still_succeed(gateway, reference, cluster):
    # Cold prompts (no cached prefix anywhere): the gateway alternates them over p0 and p1 by its own counts.
    prompts = [f"Item {i}: " + LONG_PREFIX + PROMPTS[i % len(PROMPTS)] for i in range(6)]
    expected = [reference(p, max_tokens=8)[1] for p in prompts]

    async def run_all():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            aio_stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(prompt):
                call = aio_stub.Generate(generation_pb2.GenerateRequest(text=prompt, sampling=greedy(8)),
                                         timeout=RPC_TIMEOUT_S)
                chunks = [c async for c in call]
                metadata = dict(await call.trailing_metadata())
                return [t for c in chunks for t in c.token_ids], metadata["pdserve-prefill-workers"]

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            deadline = time.monotonic() + IDLE_TIMEOUT_S
            while gateway.get_inflight("p1") == 0:       # kill p1 while Prefill RPCs of ours are on it
                assert time.monotonic() < deadline, "no prefill went to p1"
                await asyncio.sleep(0.005)
            cluster.stop_worker("p1", kill=True)
            return await asyncio.gather(*tasks)

    results = run_async(run_all())
    assert [tokens for tokens, _ in results] == expected
    assert "p1,p0" in [tried for _, tried in results]        # prefills moved off the dead worker
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        later = [generate(generation_pb2_grpc.GenerationStub(channel), p) for p in PROMPTS[:4]]
    assert [r.token_ids for r in later] == [reference(p)[1] for p in PROMPTS[:4]]
    assert all(r.prefill_workers[-1] == "p0" for r in later)
    assert_idle(cluster.wait_idle("p0", "d0"))
