"""multi_turn.py: multi-turn rollouts with a calculator tool on tiny.py's tiny_tools model.

- The pieces, in process: the calculator's safe evaluator, Hermes parsing, failed calls as tool responses, veRL's
  truncation, the tool-response tokens against the chat template's text, tool files, the metrics.
- One vLLM engine (tests/helpers/multi_turn_worker.py) with every request it receives recorded: each turn generates from
  the whole history token for token, the loss mask is 1 exactly on what vLLM sampled, a sample without tool calls
  is the single-turn sample, a raising tool and a short budget do not stop the rollout.
- Runs of grpo.py: 2 ranks with a dump (vLLM's log-probs = the trainer's at fp32; the dump audited), its replay
  at 1 rank (the same update), the replay with garbage at the tool positions (still the same update), a raising
  tool (the run goes on), and one-line errors.
"""

import json
import os
import re
import time

import pytest
import torch
from test_families import SYNC, plain_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema

import fp32_noise
import multi_turn
import tiny
from conftest import ROOT, cli_calls, run_python
from grpo_runs import comparable, error_line_of_call, read_metrics, run_grpo

# the recipe's keys (recipes/tiny_calculator.yaml) as overrides on grpo_runs' SMALL run: 2 mini-batches per step
MULTI_TURN = [
    "model.path=tiny_tools",
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.max_assistant_turns=3",
    "data.max_response_length=96",
    "trainer.total_steps=2",
    "trainer.val_every=2",
    "data.val_max_samples=16",
    "trainer.export_hf=false",
]
TOOL_PATH = "rollout.multi_turn.function_tool_path"
ANSWER = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
ARITHMETIC = re.compile(r"[\d\s+\-*/()]+")


@pytest.fixture(scope="module")
def tools_build():
    """tiny.build(tools=True), cached in .cache/tiny; a lock as conftest's tiny_build (the other worker may build)."""
    import fcntl

    cache = os.path.join(ROOT, ".cache", "tiny")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock-tools"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return tiny.build(cache, seed=0, tools=True)


@pytest.fixture(scope="module")
def tokenizer(tools_build):
    return AutoTokenizer.from_pretrained(tools_build["model"])


# ------------------------------------------------------------------------------------------- the pieces
def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    calc = multi_turn.calculator
    assert [calc(e) for e in ("3 + 5 - 2", "7 * 9", "7 / 2", "(2 + 3) ** 2", "-4 + 1", "9 // 2", "9 % 4")] == [
        "6",
        "63",
        "3.5",
        "25",
        "-3",
        "4",
        "1",
    ]
    assert calc("10 / 4 * 2") == "5"  # an integral float is written as an integer
    for bad in ("__import__('os').system('ls')", "open('x')", "a + 1", "'1' + '2'", "[1, 2]", "2 ** 100"):
        with pytest.raises(ValueError):
            calc(bad)
    with pytest.raises(ZeroDivisionError):
        calc("1 / 0")
    with pytest.raises(SyntaxError):
        calc("3 +")


def test_the_calculator_refuses_a_result_too_large_before_computing_it():
    """Each exponent within the bound, but the value would grow to billions of bits: refused at the first step past
    multi_turn.MAX_BITS (1024), in microseconds (Python would compute the nested power for minutes). A product is
    bounded by its operands' bit lengths, a power by exponent x log2|base|: 2**960 (961 bits) times 2**62 (63 bits)
    is computed, times 2**63 (64 bits) is refused."""
    calc = multi_turn.calculator
    assert calc("(2 ** 64) ** 15 * 2 ** 62") == str(2**1022)
    big = "9" * 100  # 333 bits
    assert calc(f"{big} ** 3") == str(int(big) ** 3)
    for hostile, bits in [
        ("((((9**64)**64)**64)**64)**64", 12984),  # (9**64)**64 is the first step past the bound
        ("(2 ** 64) ** 15 * 2 ** 63", 1025),
        ("(2 ** 64) ** 17", 1088),
        (f"{big} ** 4", 1328),
    ]:
        with pytest.raises(ValueError, match=f"the result would have about {bits} bits, more than 1024"):
            calc(hostile)
    assert calc("1.5 ** 20") == "3325.25673"  # floats overflow by themselves (OverflowError), at once
    with pytest.raises(OverflowError):
        calc("1e300 * 1e300 ** 2")


def test_the_size_bound_computes_an_integer_and_a_float_in_either_order():
    """The size bound covers a product or power of two integers; an integer and a float (GSM8K has decimals), on
    either side of each operator it covers (* and **), are computed, the values worked out by hand, a 900-bit
    integer times 1.5 included."""
    calc = multi_turn.calculator
    cases = {
        "3 * 0.5": "1.5",
        "0.5 * 3": "1.5",
        "12 * 0.25": "3",
        "0.25 * 12": "3",
        "-8 * 0.125": "-1",
        "0.125 * -8": "-1",
        "(2 ** 60) ** 15 * 1.5": str(3 * 2**899),  # 1.5 x 2^900 is an integral float: written as the integer 3 x 2^899
        "1.5 * (2 ** 60) ** 15": str(3 * 2**899),
        "9 ** 0.5": "3",
        "2 ** 0.5": "1.414213562",  # sqrt 2 to 10 significant digits
        "0.5 ** 2": "0.25",
        "2.5 ** 3": "15.625",
        "4 ** -0.5": "0.5",
    }
    assert {expression: calc(expression) for expression in cases} == cases


def test_the_calculator_schema_is_the_one_the_tiny_model_learned():
    """transformers' schema of multi_turn.calculator (what tools= receives) = the one tiny.py's warm start renders."""
    assert get_json_schema(multi_turn.calculator) == tiny.CALCULATOR_SCHEMA
    assert multi_turn.tool_schemas(multi_turn.load_tools(None)) == [tiny.CALCULATOR_SCHEMA]


def test_hermes_tool_calls_are_parsed_and_malformed_ones_named():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
    assert multi_turn.parse_tool_calls("Let me compute.\n" + call) == [
        {"name": "calculator", "arguments": {"expression": "1 + 2"}}
    ]
    assert len(multi_turn.parse_tool_calls(call + call)) == 2
    assert multi_turn.parse_tool_calls("no call, or an unclosed <tool_call>{") == []
    for body, message in [
        ('{"name": "calculator", "arguments": {"expression": "1', "Invalid tool call: Unterminated string"),
        ('{"arguments": {}}', 'Invalid tool call: expected {"name": "...", "arguments": {...}}'),
        ('["calculator"]', 'Invalid tool call: expected {"name"'),
        ('{"name": "calculator", "arguments": "1 + 2"}', "Invalid tool call: the arguments are not a JSON object"),
        ("[" * 100_000 + "]" * 100_000, "Invalid tool call: maximum recursion depth"),  # the policy's text is input
    ]:
        (parsed,) = multi_turn.parse_tool_calls(f"<tool_call>{body}</tool_call>")
        assert parsed["error"].startswith(message), parsed


@pytest.fixture(scope="module")
def calculator_pool():
    pool = multi_turn.ToolPool(None, workers=2, timeout=5.0, max_chars=256, side="middle")
    yield pool
    pool.close()


def test_a_failed_call_becomes_a_tool_response_that_says_what_went_wrong(calculator_pool):
    def run(call):
        (answer,) = calculator_pool.run([call])
        assert answer["timeout"] is False
        return answer["text"], answer["error"]

    assert run({"name": "calculator", "arguments": {"expression": "6 * 7"}}) == ("42", None)
    text, error = run({"name": "search", "arguments": {}})
    assert text == error == "Tool 'search' not found; tools: calculator"
    text, error = run({"name": "calculator", "arguments": {"expression": "1 / 0"}})
    assert text == error == "Error executing tool 'calculator': division by zero"
    text, error = run({"name": "calculator", "arguments": {"x": "1"}})
    assert text == error and text.startswith("Error executing tool 'calculator': ") and "'x'" in text
    text, error = run({"error": "Invalid tool call: Expecting value"})
    assert text == error == "Invalid tool call: Expecting value"
    text, error = run({"name": "calculator", "arguments": {"expression": "((((9**64)**64)**64)**64)**64"}})
    assert text == error == "Error executing tool 'calculator': the result would have about 12984 bits, more than 1024"


def bare_trajectory() -> multi_turn.Trajectory:
    """A trajectory after one assistant turn of two sampled tokens."""
    t = multi_turn.Trajectory(prompt_ids=[1, 2], response_ids=[5, 6], loss_mask=[1, 1], turn_ids=[1, 1])
    t.logprobs, t.assistant_turns = [-0.5, -0.5], 1
    return t


def test_a_malformed_call_is_answered_and_the_trajectory_goes_on(tokenizer, calculator_pool):
    """A turn whose only call is not JSON: the trajectory gets a tool response naming the error (mask 0) and stays
    open for the next turn, as after a good call (veRL would end it)."""
    t = bare_trajectory()
    calls = multi_turn.parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": 3</tool_call>')
    multi_turn._answer_tool_calls([(t, calls)], calculator_pool, 1, tokenizer, None, max_tokens=96)
    (record,) = t.tool_calls
    assert record["error"].startswith("Invalid tool call: ") and not t.done and not t.truncated
    assert tokenizer.decode(t.response_ids[2:]) == ANSWER.format(record["error"])
    assert t.loss_mask[2:] == [0] * (len(t.response_ids) - 2) and t.turn_ids[2:] == [2] * (len(t.response_ids) - 2)


def test_max_parallel_calls_answers_a_turns_first_calls_in_one_user_turn(tokenizer, calculator_pool):
    """veRL's max_parallel_calls = 2 of a turn's three calls: the first two run, in order, answered as one user turn
    (two <tool_response> blocks); the third is not run. Two trajectories' turns are answered in one pool.run."""
    first, second = bare_trajectory(), bare_trajectory()
    calls = [{"name": "calculator", "arguments": {"expression": e}} for e in ("2 + 3", "7 * 6", "9 - 1")]
    multi_turn._answer_tool_calls(
        [(first, calls), (second, calls[2:])], calculator_pool, 2, tokenizer, None, max_tokens=96
    )
    assert [c["response"] for c in first.tool_calls] == ["5", "42"] and first.user_turns == 1
    assert tokenizer.decode(first.response_ids[2:]) == ANSWER.format("5\n</tool_response>\n<tool_response>\n42")
    assert [c["response"] for c in second.tool_calls] == ["8"]
    assert tokenizer.decode(second.response_ids[2:]) == ANSWER.format("8")


def test_a_tokenizer_that_adds_a_bos_adds_none_to_tool_responses(tokenizer):
    """A tokenizer whose post-processor adds a BOS (Llama 3's) when tokenising with special tokens: the tool
    responses' ids are the template's text alone, exactly as with the plain tokenizer (no BOS in mid-sequence)."""
    import copy

    from tokenizers import processors

    bos = "<|endoftext|>"  # a special token of the tiny tokenizer, standing in for Llama 3's <|begin_of_text|>
    with_bos = copy.deepcopy(tokenizer)
    with_bos.bos_token = bos
    bos_id = with_bos.convert_tokens_to_ids(bos)
    with_bos._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    assert with_bos("8")["input_ids"][0] == bos_id  # it does add one
    schemas = [tiny.CALCULATOR_SCHEMA]
    ids = multi_turn.tool_response_ids(with_bos, ["8", "9"], schemas, None)
    assert ids == multi_turn.tool_response_ids(tokenizer, ["8", "9"], schemas, None) and bos_id not in ids
    multi_turn.check_template(with_bos, multi_turn.load_tools(None))


HOSTILE = '''"""A calculator that misbehaves: its calls run, in turn, a function that never answers, one that raises,
one that returns None (and prints), one that ends its process, one that returns 1 MB and one that forks (both
processes answer) (a counter in a file next to this one, shared by the ranks' workers), so that a run's calls meet
every one of them. The only tool is calculator:
the prompts are the tiny_tools model's own."""
import fcntl
import os
import sys
import time


def _sleeps_forever(expression: str) -> str:
    """Never answers.

    Args:
        expression: Anything.
    """
    while True:
        time.sleep(60)


def _raises(expression: str) -> str:
    """Raises.

    Args:
        expression: Anything.
    """
    raise RuntimeError("the tool broke")


def _returns_none(expression: str) -> str:
    """Forgets to return.

    Args:
        expression: Anything.
    """
    print("a tool that prints", expression)


def _exits(expression: str) -> str:
    """Ends its process.

    Args:
        expression: Anything.
    """
    os._exit(3)


def _returns_a_megabyte(expression: str) -> str:
    """A 1 MB string.

    Args:
        expression: Anything.
    """
    return "7" * 2**20


def _forks(expression: str) -> str:
    """Forks: both processes return, and its worker answers twice.

    Args:
        expression: Anything.
    """
    os.fork()
    return "forked"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers, + - * / // % ** and brackets.
    """
    with open(os.path.join(os.path.dirname(__file__), "count"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        k = len(f.read())
        f.write(".")
    behaviours = [_sleeps_forever, _raises, _returns_none, _exits, _returns_a_megabyte, _forks]
    return behaviours[k % len(behaviours)](expression)
'''
HOSTILE_LIMITS = [
    "rollout.multi_turn.tool_timeout=1",
    "rollout.multi_turn.tool_workers=2",
    "rollout.multi_turn.tool_response_truncate_side=left",  # not the default (middle): the key reaches the workers
]
# what the model reads from each of HOSTILE's tools (the 1 MB string cut to max_tool_response_length 256, its end kept)
HOSTILE_ANSWERS = {
    "timeout": "Error executing tool '{}': no answer within 1 s",
    "raises": "Error executing tool '{}': the tool broke",
    "none": "Error executing tool '{}': it returned NoneType; a tool returns text",
    "exits": "Error executing tool '{}': its process ended (exit status 3) without an answer",
    "megabyte": "(truncated)..." + "7" * 256,
    "forks": "forked",  # its second answer dropped (tool_calls/dropped_answers)
}


def test_every_hostile_tool_is_answered_within_the_time_limit(tmp_path):
    """HOSTILE's calculator six times (each of its behaviours in turn), and more (sys.exit, recursion, reading
    stdin, bytes, a number, a dict), all in one pool.run with one worker and a 1 s limit: every call is answered, in
    order; the hung ones as timeouts; the worker, killed or ended, is replaced (the calls after it are answered by
    new ones). Nothing a tool prints reaches this process's output."""
    tools = tmp_path / "hostile.py"
    tools.write_text(
        HOSTILE
        + "\n\ndef misc(kind: str) -> str:\n"
        + '    """Other failures.\n\n    Args:\n        kind: Which.\n    """\n'
        + "    if kind == 'exit':\n        sys.exit(5)\n"
        + "    if kind == 'recurse':\n        return misc(kind)\n"
        + "    if kind == 'stdin':\n        return input()\n"
        + "    return {'bytes': b'raw', 'number': 42, 'dict': {'a': 1}}[kind]\n"
    )
    pool = multi_turn.ToolPool(str(tools), workers=1, timeout=1.0, max_chars=256, side="left")  # in order
    calls = [{"name": "calculator", "arguments": {"expression": "1"}}] * 6  # each of HOSTILE's behaviours
    calls += [{"name": "misc", "arguments": {"kind": kind}} for kind in ("exit", "recurse", "stdin", "bytes")]
    calls += [{"name": "misc", "arguments": {"kind": kind}} for kind in ("number", "dict")]
    calls += [{"name": "calculator", "arguments": {"expression": "1"}}]  # the sixth: it never answers, again

    start = time.monotonic()
    answers = pool.run(calls)
    elapsed = time.monotonic() - start
    pool.close()
    assert elapsed < 30, elapsed  # one 1 s limit (and the new workers' start-ups), not a hang
    texts = [a["text"] for a in answers]
    kinds = ("timeout", "raises", "none", "exits", "megabyte", "forks")
    assert texts[:6] == [HOSTILE_ANSWERS[kind].format("calculator") for kind in kinds]
    assert texts[6] == "Error executing tool 'misc': SystemExit 5"
    assert texts[7] == "Error executing tool 'misc': maximum recursion depth exceeded"
    assert texts[8] == "Error executing tool 'misc': EOF when reading a line"
    assert texts[9] == "Error executing tool 'misc': it returned bytes; a tool returns text"
    assert texts[10:] == ["42", '{"a": 1}', HOSTILE_ANSWERS["timeout"].format("calculator")]
    assert [a["timeout"] for a in answers] == [True] + [False] * 11 + [True]
    assert [a["error"] is None for a in answers] == [False] * 4 + [True, True] + [False] * 4 + [True, True, False]
    assert sum(a["dropped"] for a in answers) == 1  # the fork's second answer


def test_tool_calls_run_side_by_side_up_to_the_worker_count(tmp_path):
    """Eight calls of a tool that sleeps 0.5 s, four workers: each call's (start, end) as the tool saw them; at some
    moment four run at once, never five, and all eight ran in worker processes other than this one."""
    tools = tmp_path / "slow.py"
    log = tmp_path / "log"
    tools.write_text(
        "import os, time\n\n\ndef slow(x: str) -> str:\n"
        + '    """Sleeps.\n\n    Args:\n        x: A tag.\n    """\n'
        + "    start = time.time()\n    time.sleep(0.5)\n"
        + f"    with open({str(log)!r}, 'a') as f:\n"
        + "        f.write(f'{os.getpid()} {start} {time.time()}\\n')\n"
        + "    return x\n"
    )
    pool = multi_turn.ToolPool(str(tools), workers=4, timeout=10.0, max_chars=256, side="middle")
    answers = pool.run([{"name": "slow", "arguments": {"x": str(k)}} for k in range(8)])
    pool.close()
    assert [a["text"] for a in answers] == [str(k) for k in range(8)]
    runs = [line.split() for line in log.read_text().splitlines()]
    assert len(runs) == 8 and os.getpid() not in {int(pid) for pid, _, _ in runs}
    intervals = [(float(a), float(b)) for _, a, b in runs]
    most = max(sum(a <= t < b for a, b in intervals) for t, _ in intervals)
    assert most == 4, intervals


# Tools that break the one-call-one-answer rule of a worker's pipe (ToolPool: every answer names its call's id)
UNRULY = '''import os
import sys
import time


def echo(text: str, wait: float = 0.0) -> str:
    """Returns its text, after `wait` seconds.

    Args:
        text: The text.
        wait: Seconds to sleep first.
    """
    time.sleep(wait)
    return text


def fork(delay: float) -> str:
    """Forks: both processes return, so the worker answers twice; the child after `delay` seconds.

    Args:
        delay: Seconds the child sleeps first.
    """
    if os.fork() == 0:
        time.sleep(delay)
        return "the child"
    return "the parent"


def late(delay: float) -> str:
    """Never answers in time: a child in a session of its own (out of reach of the worker's process group) answers
    `delay` seconds later, on the pipe of a worker killed at its timeout; the worker itself sleeps.

    Args:
        delay: Seconds the child sleeps first.
    """
    if os.fork() == 0:
        os.setsid()
        time.sleep(delay)
        return "too late"
    time.sleep(60)
    return "never"


def meddle(text: str) -> str:
    """Writes, on its worker's own answer stream, an answer to the call after its own (the next id) before its own
    answer: the worker answers out of order.

    Args:
        text: The text.
    """
    worker = sys._getframe(1).f_locals  # serve_tools: the call it runs and its answer stream
    worker["answers"].write('{"id": %d, "text": "not yours", "error": null}\\n' % (worker["call"]["id"] + 1))
    worker["answers"].flush()
    return text
'''


def echo(text: str, wait: float = 0.0) -> dict:
    return {"name": "echo", "arguments": {"text": text, "wait": wait}}


@pytest.fixture
def unruly_tools(tmp_path) -> str:
    path = tmp_path / "unruly.py"
    path.write_text(UNRULY)
    return str(path)


def test_a_tool_that_forks_answers_its_call_once_and_every_later_call_gets_its_own_answer(unruly_tools):
    """One worker. A tool that forks, both processes returning, makes the worker answer twice (both naming the call):
    the child at once, or 0.3 s later, while later calls run. The first answer is the call's; the second is dropped,
    counted, and the worker replaced: every later call, in this run and the next, gets its own answer (read by
    position, "the child" was the answer of the call after, or two after)."""
    pool = multi_turn.ToolPool(unruly_tools, workers=1, timeout=5.0, max_chars=256, side="middle")
    first = pool.idle[0].process.pid
    calls = [{"name": "fork", "arguments": {"delay": 0.0}}, echo("a"), echo("b", 0.2)]
    calls += [{"name": "fork", "arguments": {"delay": 0.3}}, echo("c", 0.2), echo("d", 0.2), echo("e")]
    answers = pool.run(calls)
    replaced = first not in {w.process.pid for w in pool.idle}
    answers += pool.run([echo("f"), echo("g")])
    pool.close()
    texts = [a["text"] for a in answers]
    assert texts[0] in ("the parent", "the child") and texts[3] in ("the parent", "the child"), texts
    assert [texts[k] for k in (1, 2, 4, 5, 6, 7, 8)] == list("abcdefg"), texts
    assert all(a["error"] is None and not a["timeout"] for a in answers)
    assert sum(a["dropped"] for a in answers) >= 1, answers  # at least one second answer was seen and dropped
    assert replaced


def test_a_tool_that_answers_after_its_timeout_is_never_read_again(unruly_tools):
    """One worker, a 1 s limit: a tool whose forked child (out of the worker's process group) writes its answer 0.3 s
    after the timeout, on the pipe of the worker killed then. The call is a timeout; the later calls, in this run
    and in one after the late answer was written, get their own answers, and nothing is read or dropped."""
    pool = multi_turn.ToolPool(unruly_tools, workers=1, timeout=1.0, max_chars=256, side="middle")
    answers = pool.run([{"name": "late", "arguments": {"delay": 1.3}}, echo("a"), echo("b")])
    time.sleep(1.0)  # the late answer is written now, to a pipe no one reads
    answers += pool.run([echo("c"), echo("d")])
    pool.close()
    assert answers[0]["text"] == "Error executing tool 'late': no answer within 1 s" and answers[0]["timeout"]
    assert [a["text"] for a in answers[1:]] == list("abcd")
    assert [a["dropped"] for a in answers] == [0] * 5


def test_a_late_answer_from_an_earlier_turn_never_answers_a_later_turns_call(unruly_tools):
    """One worker, one pool.run per turn (as multi_turn's rollout calls it). Turn 1: a tool that forks, the child
    answering 0.5 s after the parent, when turn 1 has its answer and turn 2's call runs on the same worker (it waits
    2 s). The child's line names turn 1's call, which was the first of its turn, as turn 2's call is of its own: the
    late line is dropped and counted on turn 2's call, which gets its own answer, and the worker is replaced; turn 3
    gets its own. (With ids unique within a turn only, turn 2's answer was "the child".)"""
    pool = multi_turn.ToolPool(unruly_tools, workers=1, timeout=5.0, max_chars=256, side="middle")
    first = pool.idle[0].process.pid
    turns = [pool.run([{"name": "fork", "arguments": {"delay": 0.5}}])]
    assert pool.idle[0].process.pid == first  # the child has not answered yet: the same worker runs turn 2
    turns.append(pool.run([echo("mine", 2.0)]))
    replaced = first not in {w.process.pid for w in pool.idle}  # after the stray line
    turns.append(pool.run([echo("again")]))
    pool.close()
    assert [[a["text"] for a in turn] for turn in turns] == [["the parent"], ["mine"], ["again"]]
    assert [[a["dropped"] for a in turn] for turn in turns] == [[0], [1], [0]]
    assert all(a["error"] is None and not a["timeout"] for turn in turns for a in turn)
    assert replaced


def test_answers_out_of_order_are_matched_by_id(unruly_tools):
    """Two workers. The first call's tool writes, on its worker's pipe, an answer naming the second call's id (which
    the other worker runs) before its own: that line is dropped and counted on the first call, whose own answer is
    the one naming its id; the second call's answer is its own worker's; the meddling worker is replaced; the
    calls after get their own answers."""
    pool = multi_turn.ToolPool(unruly_tools, workers=2, timeout=5.0, max_chars=256, side="middle")
    meddling, other = pool.idle[-1].process.pid, pool.idle[0].process.pid  # the first call goes to the last idle
    answers = pool.run([{"name": "meddle", "arguments": {"text": "mine"}}, echo("b", 0.3), echo("c"), echo("d")])
    assert {w.process.pid for w in pool.idle} & {meddling, other} == {other}
    answers += pool.run([{"name": "meddle", "arguments": {"text": "again"}}, echo("e", 0.3), echo("f")])
    pool.close()
    assert [a["text"] for a in answers] == ["mine", "b", "c", "d", "again", "e", "f"]
    assert [a["dropped"] for a in answers] == [1, 0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_the_truncate_side_holds_in_the_workers(side):
    """rollout.multi_turn.tool_response_truncate_side, through a worker (the cut is made there): the calculator's
    ten-digit result cut to 4 characters as veRL cuts it, written out by hand."""
    pool = multi_turn.ToolPool(None, workers=1, timeout=5.0, max_chars=4, side=side)
    (answer,) = pool.run([{"name": "calculator", "arguments": {"expression": "1234567890 * 1"}}])
    pool.close()
    cut = {"left": "(truncated)...7890", "right": "1234...(truncated)", "middle": "12...(truncated)...90"}
    assert answer["text"] == cut[side] and answer["error"] is None


def test_long_tool_responses_are_cut_as_verl_cuts_them():
    text = "abcdefghij"
    assert multi_turn.truncate(text, 10, "middle") == text
    assert multi_turn.truncate(text, 4, "left") == "(truncated)...ghij"
    assert multi_turn.truncate(text, 4, "right") == "abcd...(truncated)"
    assert multi_turn.truncate(text, 4, "middle") == "ab...(truncated)...ij"


def test_tool_responses_are_the_tokens_of_the_templates_text(tokenizer):
    """After an assistant turn (ending with <|im_end|>, as sampled): the text Qwen2.5's template writes for tool
    messages, through the next assistant header, tokenised once; two responses are one user turn."""
    schemas = [tiny.CALCULATOR_SCHEMA]
    ids = multi_turn.tool_response_ids(tokenizer, ["8"], schemas, None)
    assert ids == tokenizer(ANSWER.format("8"), add_special_tokens=False)["input_ids"]
    two = multi_turn.tool_response_ids(tokenizer, ["8", "9"], schemas, None)
    assert tokenizer.decode(two) == ANSWER.format("8\n</tool_response>\n<tool_response>\n9")
    multi_turn.check_template(tokenizer, multi_turn.load_tools(None))


def test_prompts_are_measured_as_rendered_with_the_tools(tools_build, tokenizer, tmp_path):
    """A multi-turn run's prompts carry the tools' schemas (the template's system block): grpo.load_data (in process)
    keeps exactly the prompts that fit data.max_prompt_length as rendered WITH tools=, counted here by rendering
    each with the tokenizer; measured without the tools, all would fit."""
    import config
    import fsdp_train
    import grpo

    questions = [f"Tom has {k} apples" + " and one more" * k + "." for k in range(8)]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"question": q, "answer": f"{k}\n#### {k}"}) + "\n" for k, q in enumerate(questions))
    )

    def length(question: str, **kwargs) -> int:
        messages = [{"role": "user", "content": question + " " + tiny.INSTRUCTION}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    with_tools = sorted(length(q, tools=[tiny.CALCULATOR_SCHEMA]) for q in questions)
    limit = with_tools[3]  # the four shortest fit with the tools; every prompt fits without them
    assert max(length(q) for q in questions) <= limit
    fits = [q for q in questions if length(q, tools=[tiny.CALCULATOR_SCHEMA]) <= limit]
    overrides = ["model.path=tiny_tools", "rollout.multi_turn.enable=true", f"data.train={rows}", f"data.val={rows}"]
    overrides += [f"data.max_prompt_length={limit}", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"]
    fsdp_train.init_distributed()
    cfg = config.load_config("tiny.yaml", overrides)
    _, _, train_rows, val_rows, _ = grpo.load_data(cfg, grpo.choose_parts(cfg), 0, 1)
    assert len(fits) == 4
    assert [r["extra_info"]["question"] for r in train_rows] == [r["extra_info"]["question"] for r in val_rows] == fits


def test_a_template_without_tools_stops_in_one_line(tiny_build):
    plain = AutoTokenizer.from_pretrained(tiny_build["model"])  # tiny.py's default: no tools in its template
    with pytest.raises(multi_turn.ToolSetupError, match="the chat template does not render tools="):
        multi_turn.check_template(plain, multi_turn.load_tools(None))


def test_tool_files_give_their_plain_functions_or_stop_in_one_line(tmp_path):
    good = tmp_path / "tools.py"
    good.write_text(
        "import math\n\n"
        "def square_root(x: float) -> float:\n"
        '    """The square root.\n\n    Args:\n        x: A number.\n    """\n'
        "    return math.sqrt(x)\n\n"
        "def _helper():\n    pass\n"
    )
    tools = multi_turn.load_tools(str(good))
    assert list(tools) == ["square_root"] and tools["square_root"](9.0) == 3.0
    assert multi_turn.tool_schemas(tools)[0]["function"]["parameters"]["properties"]["x"]["type"] == "number"
    cases = {
        "none.py": ("X = 1\n", "defines no public function"),
        "nodoc.py": ("def f(x: int) -> int:\n    return x\n", "tool 'f': no schema"),
        "broken.py": ("import not_a_module_anywhere\n", "importing it raised ModuleNotFoundError"),
    }
    for name, (source, message) in cases.items():
        (tmp_path / name).write_text(source)
        with pytest.raises(multi_turn.ToolSetupError, match=message) as e:
            multi_turn.load_tools(str(tmp_path / name))
        assert str(tmp_path / name) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(multi_turn.ToolSetupError, match="no such file"):
        multi_turn.load_tools(str(tmp_path / "missing.py"))


def test_turn_metrics_on_known_values():
    m = multi_turn.turn_metrics(
        num_turns=[3, 1, 5, 1], calls=[1, 0, 2, 0], errors=[1, 0, 1, 0], timeouts=[0, 0, 1, 0], dropped=[0, 0, 3, 0]
    )
    assert m == {
        "num_turns/min": 1,
        "num_turns/max": 5,
        "num_turns/mean": 2.5,
        "tool_calls/per_sample": 0.75,
        "tool_calls/sample_share": 0.5,
        "tool_calls/error_rate": 2 / 3,
        "tool_calls/timeout_rate": 1 / 3,
        "tool_calls/dropped_answers": 3,
    }
    assert multi_turn.turn_metrics([1], [0], [0], [0], [0])["tool_calls/error_rate"] == 0.0


# ------------------------------------------------------------------------------ one engine, every request
@pytest.fixture(scope="module")
def engine(tools_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("multi-turn-engine") / "record.json"
    run_python("tests/helpers/multi_turn_worker.py", tools_build["dir"], str(out))
    return json.loads(out.read_text())


def segments(t: dict) -> list[tuple[int, list[int], list[int]]]:
    """A trajectory's response as (turn id, token ids, loss mask) runs."""
    runs = []
    for token, mask, turn in zip(t["response_ids"], t["loss_mask"], t["turn_ids"], strict=True):
        if not runs or runs[-1][0] != turn:
            runs.append((turn, [], []))
        runs[-1][1].append(token)
        runs[-1][2].append(mask)
    return runs


@pytest.mark.parametrize("case", ["calculator", "failing", "short"])
def test_every_turn_generates_from_the_whole_history_and_only_its_samples_are_trained(engine, case):
    """Turn 1: the prompts, n samples each. Turn t > 1: one request per trajectory still going, whose prompt is its
    whole history (prompt, every sampled turn, every tool response) token for token; what vLLM returned for it
    is the trajectory's turn t exactly, with loss mask 1 and its own log-probs; tool tokens have mask 0, log-prob 0."""
    record, n = engine[case], 4
    trajectories, requests = record["trajectories"], record["requests"]
    assert requests[0]["n"] == [n] * len(requests[0]["prompts"])
    assert requests[0]["prompts"] == [trajectories[k]["prompt_ids"] for k in range(0, len(trajectories), n)]
    for turn, request in enumerate(requests, start=1):
        if turn == 1:  # the prompts' n completions each, trajectory k = prompt k // n's (k % n)-th
            asked = list(enumerate(trajectories))
            completions = [c for per_prompt in request["completions"] for c in per_prompt]
        else:  # one request per trajectory still going
            asked = [(k, t) for k, t in enumerate(trajectories) if t["assistant_turns"] >= turn]
            completions = [c for (c,) in request["completions"]]
            assert request["n"] == [1] * len(asked)
        assert len(completions) == len(asked)
        for j, ((k, t), sampled) in enumerate(zip(asked, completions, strict=True)):
            start = sum(len(ids) for turn_id, ids, _ in segments(t) if turn_id < 2 * turn - 1)
            if turn > 1:
                assert request["prompts"][j] == t["prompt_ids"] + t["response_ids"][:start], (case, k, turn)
            assert t["response_ids"][start : start + len(sampled)] == sampled, (case, k, turn)
            assert set(t["turn_ids"][start : start + len(sampled)]) == {2 * turn - 1}
    for t in trajectories:
        sampled = [m for turn_id, _, mask in segments(t) for m in mask if turn_id % 2 == 1]
        assert all(m == 1 for m in sampled) and sum(t["loss_mask"]) == len(sampled)
        assert all(lp == 0.0 for lp, m in zip(t["logprobs"], t["loss_mask"], strict=True) if m == 0)
    assert any(t["user_turns"] >= 1 for t in trajectories), "the tiny_tools model never called the tool"
    assert case == "short" or any(t["assistant_turns"] >= 2 for t in trajectories)  # short: cut in the response


def assert_tool_segments_answer_the_calls(t: dict, tokenizer) -> None:
    """A trajectory's tool segments, one per call (the worker's max_parallel_calls=1: one call a turn), each the
    template's text of its call's response; the last one may be cut at the response budget, where the trajectory
    ends truncated."""
    tool_segments = [ids for turn_id, ids, _ in segments(t) if turn_id % 2 == 0]
    assert len(tool_segments) == t["user_turns"] == len(t["tool_calls"]) == len({c["turn"] for c in t["tool_calls"]})
    for j, (ids, call) in enumerate(zip(tool_segments, t["tool_calls"], strict=True)):
        full = ANSWER.format(call["response"])
        cut_at_the_budget = t["truncated"] and j == len(tool_segments) - 1 and t["turn_ids"][-1] % 2 == 0
        assert tokenizer.decode(ids) == full or (cut_at_the_budget and full.startswith(tokenizer.decode(ids)))


def test_tool_responses_are_the_calculators_results_in_the_templates_text(engine, tokenizer):
    """Each tool segment decodes to the template's text of the calculator's answer (the last one may be cut at the
    budget), which is Python's value of the expression the model wrote (an independent evaluation), or the error
    the model is shown."""
    checked = 0
    for t in engine["calculator"]["trajectories"]:
        assert_tool_segments_answer_the_calls(t, tokenizer)
        for call in t["tool_calls"]:
            expression = call.get("arguments", {}).get("expression", "")
            if call["error"] is None and ARITHMETIC.fullmatch(expression):
                value = eval(expression)  # the test's own evaluation: digits, operators and brackets only
                assert float(call["response"]) == pytest.approx(value)
                checked += 1
    assert checked, "no call of the calculator on an arithmetic expression was answered"


def effective_seeds(requests: list[dict]) -> list[int]:
    """Every sample's seed in one multi_turn.generate call: a request of n samples with seed s draws them with
    s, s + 1, ..., s + n - 1 (vLLM's children of a seeded request)."""
    seeds = []
    for request in requests:
        for seed, n in zip(request["seeds"], request["n"], strict=True):
            seeds += [seed + j for j in range(n)]
    return seeds


def test_later_turns_are_seeded_apart_and_reproducibly(engine):
    """Within one generate call no two samples share a seed, across prompts, trajectories and turns (a later turn
    reusing another trajectory's seed would sample its choices again); the same call again samples the same."""
    cases = ("calculator", "failing", "hot")
    for case in cases:
        requests = engine[case]["requests"]
        assert all(seed is not None for r in requests for seed in r["seeds"])
        seeds = effective_seeds(requests)
        assert len(set(seeds)) == len(seeds), case
    assert any(len(engine[case]["requests"]) >= 2 for case in cases), "no trajectory reached a second turn"
    assert engine["again"] == engine["calculator"]


def test_a_garbled_call_is_answered_and_the_trajectory_goes_on(engine, tokenizer):
    """At temperature 1.6 the model's calls come out garbled: every call, malformed or not, is answered by a tool
    segment holding its response (or the part the budget holds), and a trajectory whose call was answered writes
    again unless the budget or the turn limit ended it."""
    trajectories = engine["hot"]["trajectories"]
    malformed = [c for t in trajectories for c in t["tool_calls"] if c["error"] and "name" not in c]
    assert malformed and all(c["response"].startswith("Invalid tool call: ") for c in malformed)
    for t in trajectories:
        assert_tool_segments_answer_the_calls(t, tokenizer)
        last_call_turn = max((c["turn"] for c in t["tool_calls"]), default=0)
        if last_call_turn and not t["truncated"]:
            assert t["assistant_turns"] == last_call_turn + 1  # it wrote again (the limit is 3 turns)


def test_max_assistant_turns_ends_a_trajectory_at_its_call(engine, tokenizer):
    """rollout.multi_turn.max_assistant_turns=1: every trajectory is its first turn; a call written there is never
    run or answered (no tool segment, no record), and some trajectories did write one."""
    trajectories = engine["one_turn"]["trajectories"]
    assert all(t["assistant_turns"] == 1 and t["user_turns"] == 0 and not t["tool_calls"] for t in trajectories)
    assert all(set(t["turn_ids"]) == {1} for t in trajectories)
    assert any(multi_turn.parse_tool_calls(tokenizer.decode(t["response_ids"])) for t in trajectories)


def test_a_sample_without_tool_calls_is_the_single_turn_sample(engine):
    """multi_turn's first turn is rollout.generate's request: what the model writes without calling a tool is what
    a single-turn rollout samples with the same seed."""
    plain = [t for t in engine["calculator"]["trajectories"] if not t["tool_calls"]]
    assert plain
    for k, t in enumerate(engine["calculator"]["trajectories"]):
        if not t["tool_calls"]:
            assert t["response_ids"] == engine["single"][k]


def test_a_raising_tool_is_read_as_an_error_and_the_rollout_goes_on(engine, tokenizer):
    """Every call that reached the tool gets the tool's exception as its response (a malformed one is answered as
    malformed before any tool runs), and the model writes again after it."""
    trajectories = engine["failing"]["trajectories"]
    calls = [c for t in trajectories for c in t["tool_calls"]]
    reached = [c for c in calls if "name" in c]
    assert reached and all(c["error"] == "Error executing tool 'calculator': the calculator is down" for c in reached)
    assert all(c["error"].startswith("Invalid tool call: ") for c in calls if "name" not in c)
    assert any(t["assistant_turns"] >= 2 for t in trajectories)  # the model wrote again after the error
    for t in trajectories:
        assert_tool_segments_answer_the_calls(t, tokenizer)


def test_the_response_budget_bounds_the_tool_tokens_too(engine):
    """data.max_response_length holds everything after the prompt: a tool response that does not fit is cut at
    the budget, and the trajectory ends there, truncated."""
    trajectories = engine["short"]["trajectories"]
    assert all(len(t["response_ids"]) <= 30 for t in trajectories)
    cut_in_a_tool_response = [t for t in trajectories if t["turn_ids"] and t["turn_ids"][-1] % 2 == 0]
    assert cut_in_a_tool_response
    assert all(t["truncated"] and len(t["response_ids"]) == 30 for t in cut_in_a_tool_response)
    assert all(t["truncated"] == (len(t["response_ids"]) == 30) for t in trajectories)


# ------------------------------------------------------------------------------------------ runs of grpo.py
@pytest.fixture(scope="module")
def mt_run(tools_build, tiny_build, tmp_path_factory):
    """2 ranks, 2 steps (2 mini-batches each: the old-log-prob pass compares with vLLM), dumped, with HOSTILE's tools
    (its calculator runs, in turn, a tool that never answers, one that raises, one that returns None, one that ends
    its process, one that returns 1 MB and one that forks; a 1 s limit, 2 workers per rank, responses cut on the
    left); its replay at 1 rank; the replay of a copy whose tool positions hold garbage."""
    root = tmp_path_factory.mktemp("multi-turn-run")
    (root / "tools").mkdir()
    (root / "tools" / "hostile.py").write_text(HOSTILE)
    hostile = [f"{TOOL_PATH}={root / 'tools' / 'hostile.py'}", *HOSTILE_LIMITS]
    run_grpo(root / "run", 2, *MULTI_TURN, *hostile, f"trainer.dump_batches={root / 'dump'}")
    garbage = root / "garbage"
    garbage.mkdir()
    for step in (1, 2):
        b = torch.load(root / "dump" / f"step_{step}.pt")
        tool = (b["turn_ids"] % 2 == 0) & (b["turn_ids"] > 0)  # [B, R]
        for key in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "returns"):
            b[key] = torch.where(tool, torch.full_like(b[key], 1e3), b[key])
        torch.save(b, garbage / f"step_{step}.pt")
    replays = {}
    for name, dump in (("replay", root / "dump"), ("garbage", garbage)):
        run_grpo(root / name, 1, *MULTI_TURN, *hostile, f"trainer.replay_batches={dump}")
        replays[name] = read_metrics(root / name)
    return root, read_metrics(root / "run"), replays


def test_a_multi_turn_run_trains_with_vllms_log_probs_equal_to_the_trainers(mt_run, tools_build):
    """fp32: over the sampled tokens of every turn, vLLM's log-probs are the trainer's (SYNC, as every family), and
    the trainer's are transformers' plain forward within fp32 noise (measured here): no re-tokenisation drift."""
    root, logged, _ = mt_run
    steps = [r for r in logged if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] <= SYNC and r["timing_s/old_log_prob"] > 0 for r in steps)
    assert all(r["tool_calls/sample_share"] > 0.1 and r["num_turns/max"] >= 3 for r in steps)
    assert "val-core/openai/gsm8k/reward/mean@1" in logged[-1]
    b = torch.load(root / "dump" / "step_1.pt")
    mask = b["response_mask"]
    assert (mask * (b["rollout_logprobs"] - b["old_logprobs"])).abs().max() <= SYNC
    model = AutoModelForCausalLM.from_pretrained(tools_build["model"], dtype=torch.float32)  # what sampled step 1
    ref, noise = fp32_noise.measure(
        lambda dtype: plain_logprobs(fp32_noise.float64_copy(model) if dtype == torch.float64 else model, b)
    )
    fp32_noise.check(b["old_logprobs"] * mask, ref["logp"], noise["logp"], "multi-turn old log-probs")


def test_the_dumped_multi_turn_batches_hold_turns_masks_and_tool_calls(mt_run, tokenizer):
    """The audit of a dump: the loss mask is the assistant turns' tokens; vLLM's log-probs are 0 exactly on the
    tool tokens; each tool segment is the template's text of its recorded call's response; the counts agree with
    the calls and with the logged metrics."""
    root, logged, _ = mt_run
    for step in (1, 2):
        b = torch.load(root / "dump" / f"step_{step}.pt")
        width = b["response_mask"].shape[1]
        sampled = b["attention_mask"][:, -width:].bool()  # [B, R]
        turn = b["turn_ids"]  # [B, R]
        assert torch.equal(turn > 0, sampled)
        assert torch.equal(b["response_mask"].bool(), (turn % 2 == 1) & sampled)
        assert (b["rollout_logprobs"][(turn % 2 == 0) & sampled] == 0).all()
        assert ((turn % 2 == 0) & sampled).any()
        for i, calls in enumerate(b["tool_calls"]):
            assert b["num_tool_calls"][i] == len(calls)
            assert b["num_tool_errors"][i] == sum(c["error"] is not None for c in calls)
            ids = b["input_ids"][i, -width:]
            for k, call in enumerate(calls):
                text, full = tokenizer.decode(ids[turn[i] == 2 * (k + 1)].tolist()), ANSWER.format(call["response"])
                cut = sampled[i].sum() == 96 and turn[i].max() == 2 * (k + 1)  # the budget ends inside it
                assert call["turn"] == k + 1 and (text == full or cut and full.startswith(text))
            assert b["num_turns"][i] == turn[i].max() + 1  # veRL's: assistant turns + tool turns + 1
        m = logged[step]
        assert m["num_turns/mean"] == pytest.approx(b["num_turns"].float().mean().item())
        assert m["tool_calls/per_sample"] == pytest.approx(b["num_tool_calls"].float().mean().item())


def test_a_multi_turn_update_is_the_same_at_one_and_two_ranks(mt_run):
    """The 2-rank run's batches replayed at 1 rank: every metric both log (the tool counts are the batch's)."""
    _, logged, replays = mt_run
    for x, y in zip(logged[1:], replays["replay"], strict=True):
        keys = [k for k in comparable(x) if k in y and not k.startswith(("rollout/", "val-"))]
        assert len(keys) >= 30 and "actor/grad_norm" in keys
        for key in keys:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)


def test_tool_positions_do_not_move_the_update(mt_run):
    """Advantages, old / reference / vLLM log-probs of 1000 at every tool token: the same update (loss, gradient,
    KL, entropy, token counts) as the plain replay. A tool token that reached the loss, its token-mean
    denominator, the KL or the entropy would move them by orders of magnitude."""
    _, _, replays = mt_run
    for x, y in zip(replays["replay"], replays["garbage"], strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "actor/ppo_kl"):
            assert y[key] == pytest.approx(x[key], rel=1e-6, abs=1e-9), key


def test_hostile_tools_are_answered_counted_and_dumped_and_the_run_goes_on(mt_run):
    """The 2-rank run with HOSTILE's tools completed its steps (mt_run). In its dumps every call has a response, one
    of what HOSTILE's tools give (each of them met), the hung ones flagged as timeouts, the 1 MB one cut to
    max_tool_response_length (its end kept: tool_response_truncate_side=left), a forking one's second answer dropped
    and counted; the per-sample counts and the logged rates are those of the calls."""
    root, logged, _ = mt_run
    seen, dropped_in_all = set(), 0
    for step in (1, 2):
        b = torch.load(root / "dump" / f"step_{step}.pt")
        calls = [c for per_sample in b["tool_calls"] for c in per_sample]
        answers = {HOSTILE_ANSWERS[kind].format("calculator"): kind for kind in HOSTILE_ANSWERS}
        assert all(c["response"] in answers for c in calls if "name" in c), {c["response"][:80] for c in calls}
        seen |= {answers[c["response"]] for c in calls if c["response"] in answers}
        assert all(c["timeout"] == (c["response"] == HOSTILE_ANSWERS["timeout"].format("calculator")) for c in calls)
        assert all((c["error"] is None) == (answers.get(c["response"]) in ("megabyte", "forks")) for c in calls)
        timeouts = [sum(c["timeout"] for c in per_sample) for per_sample in b["tool_calls"]]
        assert b["num_tool_timeouts"].tolist() == timeouts
        m = logged[step]
        assert m["tool_calls/timeout_rate"] == pytest.approx(sum(timeouts) / len(calls))
        assert m["tool_calls/error_rate"] == pytest.approx(sum(c["error"] is not None for c in calls) / len(calls))
        dropped = [sum(c["dropped_answers"] for c in per_sample) for per_sample in b["tool_calls"]]
        assert b["num_tool_dropped_answers"].tolist() == dropped and m["tool_calls/dropped_answers"] == sum(dropped)
        dropped_in_all += sum(dropped)
    assert seen == set(HOSTILE_ANSWERS)
    assert dropped_in_all >= 1  # of the forks' second answers, those read before the run ended


def test_the_turn_limit_holds_in_every_dumped_sample(mt_run):
    """rollout.multi_turn.max_assistant_turns=3, counted from the dumps: at most 3 turns of the model and 2 of tool
    responses per sample, a tool segment only after a turn of the model, turn ids in order."""
    root, _, _ = mt_run
    for step in (1, 2):
        b = torch.load(root / "dump" / f"step_{step}.pt")
        for turns in b["turn_ids"].tolist():
            written = [t for k, t in enumerate(turns) if t and (k == 0 or turns[k - 1] != t)]  # each segment's id
            assert written == list(range(1, len(written) + 1)), written  # 1, 2, 3, ...: model, tool, model, ...
            assert sum(t % 2 == 1 for t in written) <= 3 and sum(t % 2 == 0 for t in written) <= 2


def test_bad_multi_turn_input_stops_in_one_line(tiny_build, tmp_path):
    """A chat template without tools, a tool file without functions or that does not import: one line, before any
    model loads."""
    empty, broken = tmp_path / "empty.py", tmp_path / "broken.py"
    empty.write_text("X = 1\n")
    broken.write_text("import not_a_module_anywhere\n")
    cases = [
        (["rollout.multi_turn.enable=true"], "error: multi-turn: the chat template does not render tools="),
        (
            [
                "model.path=tiny_tools",
                "rollout.multi_turn.enable=true",
                f"rollout.multi_turn.function_tool_path={empty}",
            ],
            f"error: {TOOL_PATH} {empty}: defines no public function",
        ),
        (
            ["model.path=tiny_tools", "rollout.multi_turn.enable=true", f"{TOOL_PATH}={broken}"],
            f"error: {TOOL_PATH} {broken}: importing it raised ModuleNotFoundError",
        ),
        (["rollout.multi_turn.tool_response_truncate_side=top"], "accepted: left, middle, right"),
    ]
    calls = {
        str(k): ["--config", "tiny.yaml", f"trainer.output_dir={tmp_path}", *argv] for k, (argv, _) in enumerate(cases)
    }
    results = cli_calls(calls, tmp_path)
    for k, (_, message) in enumerate(cases):
        assert message in error_line_of_call(results[str(k)])
