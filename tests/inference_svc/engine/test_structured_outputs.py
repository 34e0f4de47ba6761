"""Structured outputs in the engine: every output of a random-weight model is valid for its grammar (JSON schema,
JSON object, regex, choice, EBNF), under sampling, penalties and biases; speculative decoding and the prefix cache
leave a constrained output unchanged; a grammar the engine cannot compile is refused naming the field."""

from __future__ import annotations

import json
import re

import pytest

from inference_svc.engine import Engine, EngineConfig
from inference_svc.engine.types import SamplingParams, StructuredOutput
from inference_svc.errors import InvalidRequestError

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "kind"],
    "additionalProperties": False,
}
PROMPTS = ["def main():", "The answer is", "import os\nimport sys\n"]


def _json(schema: dict) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema), "response_format")


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return Engine.from_bundle(qwen3_dir, EngineConfig(dtype="float32", kv_cache_memory="8MiB"))


def test_json_schema_outputs_validate_greedy_and_sampled(engine):
    params = [SamplingParams(max_new_tokens=120, structured=_json(SCHEMA))]
    params += [
        SamplingParams(max_new_tokens=120, temperature=1.0, seed=s, top_p=0.95, structured=_json(SCHEMA))
        for s in range(4)
    ]
    for p in params:
        for r in engine.generate(PROMPTS, p):
            assert r.finish_reason.value == "stop", (r.text, r.finish_reason)
            jsonschema.validate(json.loads(r.text), SCHEMA)


def test_grammar_wins_over_penalties_and_bias(engine):
    brace = engine.tokenizer.encode("{")[0]
    quote = engine.tokenizer.encode('"')[0]
    p = SamplingParams(
        max_new_tokens=120, temperature=0.8, seed=3, repetition_penalty=1.3, presence_penalty=1.0,
        frequency_penalty=0.5, logit_bias={brace: 100.0, quote: -100.0}, min_tokens=5, structured=_json(SCHEMA),
    )  # fmt: skip
    for r in engine.generate(PROMPTS, p):
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_regex_choice_grammar_and_json_object(engine):
    regex = r"[a-z]{2,5}-[0-9]{3}"
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.0, seed=1,
                                                   structured=StructuredOutput("regex", regex)))  # fmt: skip
    assert all(re.fullmatch(regex, r.text) for r in out), [r.text for r in out]
    choices = ["yes", "no", "maybe so"]
    so = StructuredOutput("choice", json.dumps(choices))
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.0, seed=2, structured=so))
    assert all(r.text in choices for r in out), [r.text for r in out]
    ebnf = 'root ::= "(" expr ")"\nexpr ::= num | num "+" num\nnum ::= [1-9] [0-9]?'
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=40, structured=StructuredOutput("grammar", ebnf)))
    assert all(re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", r.text) for r in out), [r.text for r in out]
    close = engine.tokenizer.encode("}")[0]
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=60, logit_bias={close: 30.0},
                                                   structured=StructuredOutput("json_object")))  # fmt: skip
    assert all(isinstance(json.loads(r.text), dict) for r in out), [r.text for r in out]


def test_unconstrained_requests_beside_constrained_are_unchanged(engine):
    plain = SamplingParams(max_new_tokens=12)
    alone = engine.generate(PROMPTS, plain)
    mixed = engine.generate(
        PROMPTS * 2, [plain] * 3 + [SamplingParams(max_new_tokens=40, structured=_json(SCHEMA))] * 3
    )
    assert [r.token_ids for r in mixed[:3]] == [r.token_ids for r in alone]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_gives_the_plain_constrained_output(engine, temperature):
    """Prompt-lookup drafts continue the prompt's own text, which the grammar mostly refuses: those drafts are
    rejected and the output is token for token plain constrained decoding's (greedy), and valid (sampled)."""
    prompts = ['{"name": "ab", "ok": true, "kind": "cat"} {"name": "ab", "ok": true, "kind": "cat"}', *PROMPTS]
    base = dict(max_new_tokens=120, temperature=temperature, seed=7, structured=_json(SCHEMA))
    plain = engine.generate(prompts, SamplingParams(**base, num_speculative_tokens=0))
    before = engine.stats()
    spec = engine.generate(prompts, SamplingParams(**base, num_speculative_tokens=4))
    after = engine.stats()
    assert after.spec_draft_tokens_total > before.spec_draft_tokens_total  # drafts were made and verified
    for r in spec:
        jsonschema.validate(json.loads(r.text), SCHEMA)
    if temperature == 0.0:
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_prefix_cache_hit_gives_the_same_constrained_output(make_engine, qwen3_dir):
    engine = make_engine(qwen3_dir, enable_prefix_caching=True)
    prompt = "import os\nimport sys\n" * 12  # several full blocks: the second request reads them from the cache
    p = SamplingParams(max_new_tokens=80, structured=_json(SCHEMA))
    first = engine.generate([prompt], p)[0]
    second = engine.generate([prompt], p)[0]
    assert second.usage.cached_prompt_tokens > 0
    assert second.token_ids == first.token_ids
    jsonschema.validate(json.loads(second.text), SCHEMA)


def test_a_grammar_the_engine_cannot_compile_is_refused_naming_the_field(engine):
    bad = [
        StructuredOutput("json", "{not json", "response_format"),
        StructuredOutput("json", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', "response_format"),
        StructuredOutput("regex", "(unclosed", "structured_outputs"),
        StructuredOutput("grammar", 'root ::= "a" undefined_rule', "structured_outputs"),
        StructuredOutput("choice", "[]", "structured_outputs"),
    ]
    for so in bad:
        with pytest.raises(InvalidRequestError) as err:
            engine.generate(["x"], SamplingParams(structured=so))
        assert err.value.field == so.param, (so, err.value)
    assert not engine.has_unfinished_requests()
    # the engine still serves
    assert engine.generate(["x"], SamplingParams(max_new_tokens=3))[0].token_ids


def test_compiled_grammars_are_cached_by_text(engine):
    so = _json(SCHEMA)
    a = engine.grammar_compiler.compile(so)
    b = engine.grammar_compiler.compile(_json(SCHEMA))
    assert a.compiled is b.compiled and so.compiled is None


def test_control_tokens_are_never_produced_as_grammar_text(engine):
    """A string field may hold any character, but never a control token's text (its id is special)."""
    eos = engine.tokenizer.eos_id
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}, "required": ["s"]}
    p = SamplingParams(max_new_tokens=80, temperature=1.5, seed=11, structured=_json(schema))
    for r in engine.generate(PROMPTS, p):
        body = r.token_ids[:-1] if r.token_ids[-1] == eos else r.token_ids
        assert not set(body) & engine.tokenizer.control_ids(), r.token_ids
        jsonschema.validate(json.loads(r.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_grammar_wins_where_min_tokens_leaves_it_nothing(engine, temperature):
    """Once "ok" is written the grammar allows only EOS, which min_tokens bans: the grammar's EOS is taken."""
    so = StructuredOutput("choice", json.dumps(["ok"]))
    p = SamplingParams(max_new_tokens=10, min_tokens=8, temperature=temperature, seed=1, structured=so)
    for r in engine.generate(PROMPTS, p):
        assert r.text == "ok" and r.finish_reason.value == "stop", (r.text, r.token_ids)


def test_bitmask_kernels_agree():
    import torch

    from inference_svc.engine.grammar import apply_bitmask, apply_bitmask_torch, bitmask_width

    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 7), (3, 512), (5, 1000)):
        logits = torch.randn(rows, vocab, generator=g)  # [S, V]
        mask = torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_width(vocab)), dtype=torch.int32, generator=g)
        fast, ref = apply_bitmask(logits, mask), apply_bitmask_torch(logits, mask)
        assert torch.equal(fast, ref)
        bit = (mask[0, 0] >> 3) & 1  # token 3 of row 0
        assert (fast[0, 3] == float("-inf")) == (bit == 0)


def test_a_draft_model_under_a_grammar_gives_the_plain_output(llama_dir, qwen3_dir, make_engine):
    """Another model drafts, blind to the grammar: the drafts it refuses are rejected, so greedy output is plain
    constrained decoding's token for token, and sampled output is valid."""
    plain = make_engine(llama_dir)
    spec = make_engine(llama_dir, speculative=str(qwen3_dir), num_speculative_tokens=3, speculative_max_batch=0)
    p = SamplingParams(max_new_tokens=120, structured=_json(SCHEMA))
    want = [r.token_ids for r in plain.generate(PROMPTS, p)]
    got = spec.generate(PROMPTS, p)
    assert spec.stats().spec_draft_tokens_total > 0
    assert [r.token_ids for r in got] == want
    sampled = SamplingParams(max_new_tokens=120, temperature=1.0, seed=5, structured=_json(SCHEMA))
    for r in spec.generate(PROMPTS, sampled):
        jsonschema.validate(json.loads(r.text), SCHEMA)
