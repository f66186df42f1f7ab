"""Conversions between pdserve.v1 messages and plain dataclasses (the protobuf edge), and the dataclasses of
the worker RPCs' boundary (`WorkerRequestData`, `TransferTargetData`, `WorkerStatsData`).

Services call these at their boundary; nothing inside the engine, kvstore or routing sees a protobuf type.
Imports stay light (no torch, no grpc): the gateway converts here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, PromptLogprob, TokenLogprob
from engine.structured import StructuredOutputSpec
from kvstore.transfer_manifest import KvLayoutSpec, TransferManifest
from protos.pdserve.v1 import common_pb2, kv_transfer_pb2, worker_pb2

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats, StepOutput

_FINISH_TO_PB = {None: common_pb2.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
                 FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH, FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults. Not validated here: call .validate()."""
    d = SamplingParams()
    return SamplingParams(
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else d.max_tokens,
        temperature=pb.temperature if pb.HasField("temperature") else d.temperature,
        top_k=pb.top_k,
        top_p=pb.top_p if pb.HasField("top_p") else d.top_p,
        min_p=pb.min_p,
        seed=pb.seed if pb.HasField("seed") else None,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else d.repetition_penalty,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        structured_output=structured_from_pb(pb.structured_output) if pb.HasField("structured_output") else None,
        n=pb.n if pb.HasField("n") else d.n,
        min_tokens=pb.min_tokens,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
    )


def structured_from_pb(pb: common_pb2.StructuredOutput) -> StructuredOutputSpec:
    """Raises InvalidRequestError naming the field when no kind is set, json_object is false or a schema is
    not JSON; the rest of the checks are StructuredOutputSpec.validate's and the grammar compiler's."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_output", "set one of json_schema, json_object, regex, choice, grammar")
    if kind == "json_schema":
        return StructuredOutputSpec.json_schema(pb.json_schema)
    if kind == "json_object":
        if not pb.json_object:
            raise InvalidRequestError("structured_output.json_object", "must be true when set")
        return StructuredOutputSpec.json_object()
    if kind == "regex":
        return StructuredOutputSpec.regex(pb.regex)
    if kind == "choice":
        return StructuredOutputSpec.choice(list(pb.choice.options))
    return StructuredOutputSpec.grammar(pb.grammar)


def structured_to_pb(spec: StructuredOutputSpec) -> common_pb2.StructuredOutput:
    if spec.kind == "json_schema":
        return common_pb2.StructuredOutput(json_schema=spec.schema)
    if spec.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if spec.kind == "regex":
        return common_pb2.StructuredOutput(regex=spec.pattern)
    if spec.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(options=list(spec.choices)))
    return common_pb2.StructuredOutput(grammar=spec.grammar_text)


def sampling_to_pb(p: SamplingParams, stop: tuple[str, ...] = ()) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, stop_token_ids=list(p.stop_token_ids), stop=list(stop),
        ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias))
    if p.seed is not None:
        pb.seed = p.seed
    if p.logprobs is not None:
        pb.logprobs = p.logprobs
    if p.structured_output is not None:
        pb.structured_output.CopyFrom(structured_to_pb(p.structured_output))
    if p.n != 1:
        pb.n = p.n
    if p.prompt_logprobs is not None:
        pb.prompt_logprobs = p.prompt_logprobs
    return pb


def logprob_to_pb(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                   top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_pb(pb: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(pb.token_id, pb.logprob, [(t.token_id, t.logprob) for t in pb.top])


def choice_tokens_to_pb(tokens: list[tuple[int, TokenLogprob | None]]) -> list[worker_pb2.ChoiceFirstToken]:
    """First tokens of choices 1..n-1 (PrefillResponse / DecodeRequest choice_first_tokens)."""
    return [worker_pb2.ChoiceFirstToken(token_id=t, logprob=logprob_to_pb(lp) if lp is not None else None)
            for t, lp in tokens]


def choice_tokens_from_pb(pbs) -> list[tuple[int, TokenLogprob | None]]:
    return [(pb.token_id, logprob_from_pb(pb.logprob) if pb.HasField("logprob") else None) for pb in pbs]
def prompt_logprob_to_pb(lp: PromptLogprob) -> common_pb2.PromptTokenLogprob:
    return common_pb2.PromptTokenLogprob(logprob=logprob_to_pb(lp), rank=lp.rank)


def prompt_logprob_from_pb(pb: common_pb2.PromptTokenLogprob) -> PromptLogprob:
    lp = pb.logprob
    return PromptLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top], pb.rank)


def finish_reason_to_pb(reason: FinishReason | None) -> int:
    return _FINISH_TO_PB[reason]


def finish_reason_from_pb(value: int) -> FinishReason | None:
    return _FINISH_FROM_PB[value]


# --------------------------------------------------------------------------------------------- worker RPCs
@dataclass(frozen=True)
class WorkerRequestData:
    """A tokenized, validated request as the gateway sends it to a worker (WorkerRequest in worker.proto)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    seed: int


def request_from_pb(pb: worker_pb2.WorkerRequest) -> WorkerRequestData:
    return WorkerRequestData(pb.request_id, list(pb.prompt_token_ids), sampling_from_pb(pb.sampling),
                             pb.cache_salt or None, pb.seed)


@dataclass(frozen=True)
class TransferTargetData:
    """Where a prefill worker pushes a request's KV (TransferTarget in worker.proto)."""

    endpoint: str
    handle: str
    num_cached_blocks: int
    block_ids: list[int]      # destination ids of the blocks the decode worker lacks, in prompt order
    host_id: str


def target_from_pb(pb: worker_pb2.TransferTarget) -> TransferTargetData:
    return TransferTargetData(pb.endpoint, pb.handle, pb.num_cached_blocks, list(pb.block_ids), pb.host_id)


def target_to_pb(t: TransferTargetData) -> worker_pb2.TransferTarget:
    return worker_pb2.TransferTarget(endpoint=t.endpoint, handle=t.handle, num_cached_blocks=t.num_cached_blocks,
                                     block_ids=t.block_ids, host_id=t.host_id)


def step_to_pb(out: StepOutput) -> worker_pb2.DecodeResponse:
    return worker_pb2.DecodeResponse(
        token_ids=out.new_token_ids, logprobs=[logprob_to_pb(lp) for lp in out.new_logprobs],
        finish_reason=finish_reason_to_pb(out.seq.finish_reason if out.finished else None),
        cached_tokens=out.seq.num_cached_tokens, choice_index=out.seq.choice_index,
        prompt_logprobs=[prompt_logprob_to_pb(lp) for lp in out.prompt_logprobs or ()])


@dataclass(frozen=True)
class WorkerStatsData:
    """A worker's Stats answer (WorkerStats in worker.proto)."""

    worker_id: str
    role: str
    epoch: int
    engine: EngineStats
    transfer_errors: int      # transfers rejected (receiver) or failed (sender) since start


def worker_stats_to_pb(s: WorkerStatsData) -> worker_pb2.WorkerStats:
    e = s.engine
    return worker_pb2.WorkerStats(
        worker_id=s.worker_id, role=s.role, epoch=s.epoch, num_blocks=e.num_blocks, free_blocks=e.free_blocks,
        used_blocks=e.used_blocks, running=e.running, waiting=e.waiting, reserved=e.reserved,
        transfer_errors=s.transfer_errors, preemptions=e.preemptions, tensor_parallel_size=e.tensor_parallel_size,
        kv_resharding_bytes=e.kv_resharding_bytes, decode_compile_seconds=e.decode_compile_seconds)


# --------------------------------------------------------------------------------------------- KV transfer
def layout_from_pb(pb: kv_transfer_pb2.KvLayout) -> KvLayoutSpec:
    return KvLayoutSpec(pb.num_layers, pb.num_kv_heads, pb.head_dim, pb.block_size, pb.dtype, pb.model_fingerprint)


def layout_to_pb(layout: KvLayoutSpec) -> kv_transfer_pb2.KvLayout:
    return kv_transfer_pb2.KvLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                    head_dim=layout.head_dim, block_size=layout.block_size, dtype=layout.dtype,
                                    model_fingerprint=layout.model_fingerprint)


def manifest_from_pb(pb: kv_transfer_pb2.KvManifest) -> TransferManifest:
    return TransferManifest(pb.request_id, pb.handle, layout_from_pb(pb.layout), tuple(pb.block_ids),
                            tuple(pb.block_digests), pb.codec, pb.transport, pb.shm_name, pb.payload_bytes,
                            tuple(range(h.start, h.stop) for h in pb.sender_kv_heads), pb.digests_in_trailer,
                            pb.cache_segment, tuple(pb.src_block_ids), pb.cache_num_blocks, pb.sender_epoch)


def manifest_to_pb(m: TransferManifest) -> kv_transfer_pb2.KvManifest:
    return kv_transfer_pb2.KvManifest(request_id=m.request_id, handle=m.handle, layout=layout_to_pb(m.layout),
                                      block_ids=m.block_ids, block_digests=m.block_digests, codec=m.codec,
                                      transport=m.transport, shm_name=m.shm_name, payload_bytes=m.payload_bytes,
                                      sender_kv_heads=[kv_transfer_pb2.KvRankHeads(start=h.start, stop=h.stop)
                                                       for h in m.sender_kv_heads],
                                      digests_in_trailer=m.digests_in_trailer, cache_segment=m.cache_segment,
                                      src_block_ids=m.src_block_ids, cache_num_blocks=m.cache_num_blocks,
                                      sender_epoch=m.sender_epoch)
