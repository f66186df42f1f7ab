"""OpenAI / vLLM structured-output fields -> one StructuredOutputSpec on the request's SamplingParams (exact
specs; the parameter named for each bad input), and the same through the gRPC protobuf edge."""
from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputSpec as Spec
from gateway.openai_protocol import parse_chat, parse_completion
from gateway.generation_pb import fields_from_pb
from gateway.validation import ModelSpec
from pdserve.client import generate_request
from protos.convert import sampling_from_pb, sampling_to_pb
from protos.pdserve.v1 import common_pb2, generation_pb2
from word_tokenizer import WORDS, word_tokenizer

MODEL = ModelSpec(name="tiny", max_model_len=16, vocab_size=len(WORDS), fingerprint="fp")
USER = [{"role": "user", "content": "hello"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")


def chat(tokenizer, **body):
    return parse_chat({"messages": USER, **body}, MODEL, tokenizer, seed_source=lambda: 1)


def param_of(tokenizer, **body) -> str:
    with pytest.raises(InvalidRequestError) as info:
        chat(tokenizer, **body)
    return info.value.field


@pytest.mark.parametrize("body, spec, param", [
    ({"response_format": {"type": "json_object"}}, Spec.json_object(), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     Spec.json_schema(SCHEMA), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, Spec.json_object(),
     "response_format.json_schema"),
    ({"structured_outputs": {"json": SCHEMA}}, Spec.json_schema(SCHEMA), "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, Spec.regex("a+"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, Spec.choice(["x", "y"]), "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, Spec.grammar("root ::= \"a\""),
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, Spec.json_object(), "structured_outputs.json_object"),
    ({"guided_json": '{"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}'},
     Spec.json_schema(SCHEMA), "guided_json"),
    ({"guided_regex": "[0-9]+"}, Spec.regex("[0-9]+"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, Spec.choice(["yes", "no"]), "guided_choice"),
    ({"guided_grammar": "root ::= \"a\""}, Spec.grammar("root ::= \"a\""), "guided_grammar"),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, Spec.regex("a"), "guided_regex"),
])
def test_each_field_becomes_one_spec(tokenizer, body, spec, param):
    parsed = chat(tokenizer, **body)
    assert parsed.request.sampling.structured_output == spec
    assert parsed.structured_param == param


def test_completions_take_the_same_fields(tokenizer):
    parsed = parse_completion({"prompt": "hello", "guided_choice": ["a", "b"]}, MODEL, tokenizer)
    assert parsed.request.sampling.structured_output == Spec.choice(["a", "b"])
    assert chat(tokenizer).request.sampling.structured_output is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_json": {}}, "guided_choice"),     # fields are checked in FIELDS order
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 2]}, "guided_choice[1]"),
    ({"guided_choice": ["a", ""]}, "guided_choice[1]"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_bad_structured_output_names_the_parameter(tokenizer, body, param):
    assert param_of(tokenizer, **body) == param


@pytest.mark.parametrize("spec", [Spec.json_schema(SCHEMA), Spec.json_object(), Spec.regex("a|b"),
                                  Spec.choice(["x", "y z"]), Spec.grammar("root ::= \"a\"")])
def test_the_spec_survives_the_protobuf_edge(spec):
    params = SamplingParams(max_tokens=3, structured_output=spec)
    pb = common_pb2.SamplingParams.FromString(sampling_to_pb(params).SerializeToString())
    assert sampling_from_pb(pb) == params
    assert sampling_from_pb(common_pb2.SamplingParams()).structured_output is None   # old clients: unconstrained


@pytest.mark.parametrize("structured, field", [
    (common_pb2.StructuredOutput(), "sampling.structured_output"),
    (common_pb2.StructuredOutput(json_object=False), "sampling.structured_output.json_object"),
    (common_pb2.StructuredOutput(json_schema="{oops"), "sampling.structured_output.json_schema"),
])
def test_a_bad_grpc_structured_output_names_the_field(structured, field):
    request = generation_pb2.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(
        structured_output=structured))
    with pytest.raises(InvalidRequestError) as info:
        fields_from_pb(request)
    assert info.value.field == field


def test_the_python_client_sends_the_spec():
    request = generate_request("hello", {"structured_output": Spec.choice(["a", "b"]), "max_tokens": 2})
    assert sampling_from_pb(request.sampling).structured_output == Spec.choice(["a", "b"])
