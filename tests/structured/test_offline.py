"""Structured output through `LLM.generate`: a random-weight model (pure noise unconstrained)
must produce valid JSON for every schema, regex matches, a listed choice, grammar sentences;
unconstrained requests in the same batch are unaffected; bad constraints are clear errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from loom import SamplingParams
from loom.engine.llm_engine import InvalidRequestError
from loom.loader.resolve import resolve_model
from loom.sampling_params import SamplingParamsError
from loom.structured.params import StructuredOutputsParams
from loom.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import make_llm  # noqa: F401
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow  # the packaged SmolLM2's tokenizer and engines

NAME = {"type": "string", "maxLength": 12}

SCHEMAS: list[dict] = [
    # flat object, required fields
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    # nested objects
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1}, "email": NAME}, "required": ["id", "email"]}},
     "required": ["user"]},
    # array of strings with bounds
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME,
     "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    # enums
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
     "size": {"type": "string", "enum": ["S", "M", "L"]}}, "required": ["color", "size"]},
    # numbers with bounds
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
     "count": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["score", "count"]},
    # required and optional fields, no extras
    {"type": "object", "properties": {"a": NAME, "b": {"type": "boolean"},
     "c": {"type": "null"}}, "required": ["a"], "additionalProperties": False},
    # array of objects
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer",
     "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["x", "ok"]},
     "minItems": 2, "maxItems": 3},
    # anyOf
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, NAME]}},
     "required": ["v"]},
    # $ref / $defs
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
     "y": {"type": "integer"}}, "required": ["x", "y"]}}, "type": "object",
     "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    # string pattern and const
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
     "kind": {"const": "address"}}, "required": ["zip", "kind"]},
]

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no)!",
    r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)",
    r"#[0-9a-f]{6}",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])",
]


@pytest.fixture(scope="module")
def noise_model(tmp_path_factory) -> str:
    """A tiny random Llama over SmolLM2's full 49152-token vocabulary (and its tokenizer)."""
    tok = Tokenizer.from_source(resolve_model(None))
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("noise") / "m",
                             vocab_size=tok.vocab_size, max_position_embeddings=1024)
    tok.hf.save_pretrained(folder)
    return str(folder)


def _params(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_noise_unconstrained_is_not_json(make_llm, noise_model) -> None:
    llm = make_llm(noise_model)
    out = llm.generate(["{"], SamplingParams(temperature=1.0, seed=0, max_tokens=40),
                       use_tqdm=False)
    with pytest.raises(ValueError):
        json.loads(out[0].outputs[0].text)


def test_json_schemas_always_valid(make_llm, noise_model) -> None:
    llm = make_llm(noise_model)
    params = [_params(i, json=schema) for i, schema in enumerate(SCHEMAS)]
    outs = llm.generate(["Answer in JSON:"] * len(SCHEMAS), params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)
    llm.engine.check_integrity()


def test_additional_properties_switch(make_llm, noise_model) -> None:
    # The schema allows extra keys; by default only the listed one is emitted.
    schema = {"type": "object", "properties": {"k": NAME}, "required": ["k"]}
    llm = make_llm(noise_model)
    outs = llm.generate(["x"] * 3, [_params(i, json=schema) for i in range(3)], use_tqdm=False)
    assert all(list(json.loads(o.outputs[0].text)) == ["k"] for o in outs)
    free = StructuredOutputsParams(json=schema, additional_properties=True)
    grammar = llm.engine.structured.compile(free).matcher()
    tokens = llm.engine.tokenizer.encode('{"k": "a", "extra": 1}', add_special_tokens=False)
    assert all(grammar.accept_token(t) for t in tokens)
    strict = llm.engine.structured.compile(StructuredOutputsParams(json=schema)).matcher()
    assert not all(strict.accept_token(t) for t in tokens)


@pytest.mark.parametrize("seed", [0, 1])
def test_regexes_match(make_llm, noise_model, seed) -> None:
    llm = make_llm(noise_model)
    outs = llm.generate(["Text:"] * len(REGEXES),
                        [_params(seed * 10 + i, regex=r) for i, r in enumerate(REGEXES)],
                        use_tqdm=False)
    for regex, out in zip(REGEXES, outs):
        assert re.fullmatch(regex, out.outputs[0].text), (regex, out.outputs[0].text)


def test_choice_and_greedy(make_llm, noise_model) -> None:
    llm = make_llm(noise_model)
    choices = ["positive", "negative", "neutral"]
    sampled = llm.generate(["Sentiment:"] * 6, [_params(i, choice=choices) for i in range(6)],
                           use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in sampled)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"choice": choices})
    out = llm.generate(["Sentiment:"], greedy, use_tqdm=False)
    assert out[0].outputs[0].text in choices


def test_grammars_lark_and_gbnf(make_llm, noise_model) -> None:
    llm = make_llm(noise_model)
    lark = 'start: expr\nexpr: NUM (OP NUM){0,3}\nNUM: /[1-9][0-9]?/\nOP: "+" | "-" | "*"'
    gbnf = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-c]'
    outs = llm.generate(["Expr:", "Tuple:"], [_params(3, grammar=lark), _params(4, grammar=gbnf)],
                        use_tqdm=False)
    assert re.fullmatch(r"[1-9][0-9]?([-+*][1-9][0-9]?){0,3}", outs[0].outputs[0].text)
    assert re.fullmatch(r"\([a-c](,[a-c]){0,2}\)", outs[1].outputs[0].text)


def test_mixed_batch_leaves_unconstrained_requests_alone(make_llm, noise_model) -> None:
    llm = make_llm(noise_model)
    prompts = ["The weather", "Once upon", "In 1900", "Dear sir"]
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)] * 2
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = [_params(i, json=s) for i, s in enumerate(SCHEMAS[:4])]
    mixed = llm.generate(prompts + ["JSON:"] * 4, plain + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    for schema, out in zip(SCHEMAS[:4], mixed[4:]):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    llm.engine.check_integrity()


def test_n_samples_and_preemption_keep_grammar(make_llm, noise_model) -> None:
    # A tiny cache forces preemption and recompute mid-JSON; each of n=3 samples is valid.
    llm = make_llm(noise_model, num_gpu_blocks_override=12, block_size=16, max_num_seqs=8)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60,
                            structured_outputs={"json": SCHEMAS[6]})
    outs = llm.generate(["a b c d e f", "g h i j k l"], params, use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 3
        for o in out.outputs:
            jsonschema.validate(json.loads(o.text), SCHEMAS[6])
    assert llm.engine.scheduler.num_preemptions_total > 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("constraint, needle", [
    ({"regex": "a(b"}, "regex"),
    ({"json": {"type": "foo"}}, "foo"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"json": "{not json"}, "not valid JSON"),
])
def test_invalid_constraints_are_clear_errors(make_llm, noise_model, constraint, needle) -> None:
    llm = make_llm(noise_model)
    with pytest.raises((InvalidRequestError, SamplingParamsError)) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert needle in str(info.value)
    # The engine is fine afterwards.
    out = llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"choice": ["ok"]}),
                       use_tqdm=False)
    assert out[0].outputs[0].text == "ok"


def test_params_validation() -> None:
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="choice"):
        StructuredOutputsParams(choice=[])
    for schema in (True, False, [1], "5"):
        with pytest.raises(SamplingParamsError, match="JSON schema object"):
            StructuredOutputsParams(json=schema)
    with pytest.raises(SamplingParamsError, match="unknown"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(SamplingParamsError, match="unknown"):  # the server's, not a client's
        SamplingParams(structured_outputs={"regex": "a", "thinking": "open"})
    with pytest.raises(SamplingParamsError, match="thinking"):
        StructuredOutputsParams(regex="a", thinking="always")
    assert SamplingParams(structured_outputs={"regex": "a", "enable_in_reasoning": True}
                          ).structured_outputs.enable_in_reasoning
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs.kind == "regex"


def test_compile_is_cached(make_llm, noise_model) -> None:
    llm = make_llm(noise_model)
    params = StructuredOutputsParams(json=SCHEMAS[0])
    first = llm.engine.structured.compile(params)
    again = llm.engine.structured.compile(StructuredOutputsParams(json=dict(SCHEMAS[0])))
    assert first is again


@pytest.mark.parametrize("constraint, answer", [
    ({"json": SCHEMAS[0]}, '{"name": "Ada", "age": 36}'), ({"json_object": True}, '{"a": 1}'),
    ({"regex": "[0-9]+"}, "42"), ({"choice": ["yes", "no"]}, "no"),
    ({"grammar": 'start: "x" N\nN: /[0-9]+/'}, "x12"), ({"grammar": 'root ::= "x" [0-9]+'}, "x12"),
])
def test_a_thinking_block_before_the_constraint(make_llm, noise_model, constraint,
                                                answer) -> None:
    """StructuredOutputsParams.thinking (set by the server for thinking models): "optional"
    takes the answer alone or after a whole <think> block, "open" (the prompt opened the
    block) free text up to </think> before it; never an answer that breaks the constraint,
    nor text the constraint does not allow outside a block."""
    manager = make_llm(noise_model).engine.structured
    tok = manager._tokenizer

    def accepts(mode: str | None, text: str) -> bool:
        m = manager.compile(StructuredOutputsParams(**constraint, thinking=mode)).matcher()
        ok = all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
        return ok and m.is_accepting()

    block = "<think>Maybe {x}, maybe <b>not</b>.</think>\n\n"
    texts = [answer, block + answer, block[len("<think>"):] + answer, block + "nope!",
             "Sure: " + answer]
    assert [accepts(None, t) for t in texts] == [True, False, False, False, False]
    assert [accepts("optional", t) for t in texts] == [True, True, False, False, False]
    assert [accepts("open", t) for t in texts] == [False, True, True, False, False]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": NAME, "days": {"type": "integer", "minimum": 1,
                                                                "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": NAME}, "required": ["tz"]}}},
]


def test_offline_chat_with_tools_and_forced_calls(make_llm, noise_model) -> None:
    from loom.tools.parsers import MAX_PARALLEL_CALLS, parser_for_template

    llm = make_llm(noise_model)
    parser = parser_for_template(llm.engine.tokenizer.chat_template)
    chat = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = llm.engine.tokenizer.decode(
        llm.chat(chat, SamplingParams(max_tokens=1), tools=TOOLS, use_tqdm=False)[0]
        .prompt_token_ids, skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    params = [_params(i, grammar=parser.grammar(TOOLS, parallel=True)) for i in range(4)]
    outs = llm.chat([chat] * 4, params, tools=TOOLS, use_tqdm=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in outs:
        view = parser.view(out.outputs[0].text, final=True)
        assert 1 <= len(view.calls) <= MAX_PARALLEL_CALLS, out.outputs[0].text
        for call in view.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
