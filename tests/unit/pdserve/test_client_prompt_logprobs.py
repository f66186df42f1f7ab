"""The Python client's min_tokens, logit_bias and prompt_logprobs options and its prompt logprobs results."""

from pdserve.client import Chunk, PromptLogprob, collect, generate_request
from protos.pdserve.v1 import common_pb2, generation_pb2


def test_options_reach_the_sampling_params():
    request = generate_request("hi", {"min_tokens": 3, "logit_bias": {7: -100.0, 9: 2.5}, "prompt_logprobs": 2})
    assert request.sampling.min_tokens == 3
    assert dict(request.sampling.logit_bias) == {7: -100.0, 9: 2.5}
    assert request.sampling.HasField("prompt_logprobs") and request.sampling.prompt_logprobs == 2
    assert not generate_request("hi", {}).sampling.HasField("prompt_logprobs")


def test_prompt_logprobs_come_from_the_first_chunk():
    first = generation_pb2.GenerateResponse(request_id="r", text="a", token_ids=[5], prompt_logprobs=[
        common_pb2.PromptTokenLogprob(rank=2, logprob=common_pb2.TokenLogprob(
            token_id=4, logprob=-1.5, top=[common_pb2.TopLogprob(token_id=3, logprob=-0.25)]))])
    last = generation_pb2.GenerateResponse(request_id="r", text="b", token_ids=[6],
                                           finish_reason=common_pb2.FINISH_REASON_LENGTH)
    completion = collect([Chunk.from_pb(first), Chunk.from_pb(last)])
    assert completion.prompt_logprobs == (PromptLogprob(4, -1.5, 2, ((3, -0.25),)),)
    assert completion.text == "ab"
