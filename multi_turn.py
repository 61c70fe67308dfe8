"""Multi-turn rollouts with tools, veRL's tool agent loop (actor_rollout_ref.rollout.multi_turn.*): the model writes,
calls a tool in Hermes style, reads what the tool returned, writes again; only its own tokens are trained.
Imports vllm and transformers only: copy it anywhere.

    tools = load_tools(None)  # {"calculator": calculator}; or a file of plain functions (function_tool_path)
    check_template(tokenizer, tools)  # the chat template must render tools= and tool messages
    trajectories = generate(llm, prompt_ids, n=8, temperature=1.0, max_tokens=256, seed=0, tools=tools,
                            settings=dict(max_assistant_turns=4, max_user_turns=None, max_parallel_calls=1,
                                          max_tool_response_length=256, tool_response_truncate_side="middle"))
    t = trajectories[0]
    t.response_ids  # every token after the prompt: the model's turns and the tool responses between them
    t.loss_mask     # 1 on the tokens the model sampled, 0 on the tool responses' tokens
    t.logprobs      # vLLM's log-prob of each sampled token; 0.0 on tool tokens
    t.turn_ids      # 1, 3, 5, ... on assistant turn 1, 2, 3; 2, 4, ... on the tool responses after turn 1, 2
    t.text          # the last assistant turn, decoded: what is scored

Token in, token out. Each turn generates from the exact token ids so far (vLLM's prompt_token_ids); a tool response
enters as the token ids the chat template writes for it, tokenised once (tool_response_ids). The history is never
decoded and re-encoded, so the trainer scores exactly the tokens vLLM sampled, in exactly their context.

A Hermes tool call, as Qwen2.5's and Qwen3's chat templates render one:
    <tool_call>\\n{"name": "calculator", "arguments": {"expression": "3 + 5"}}\\n</tool_call>
A malformed call, an unknown tool or a tool that raises becomes a tool response that says what went wrong (veRL's
wording where veRL has one), so the model can learn from it; it is counted (tool_calls/error_rate), never fatal.
"""

import ast
import functools
import importlib.util
import inspect
import json
import operator
import os
import re
from dataclasses import dataclass, field

import torch
from transformers.utils import get_json_schema
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # veRL's HermesToolParser


class ToolSetupError(ValueError):
    """A tool file, a tool or a chat template multi-turn cannot use; the message is one line."""


@dataclass
class Trajectory:
    """One sample of a multi-turn rollout: rollout.Sample's fields, plus the mask, turns and tool calls."""

    prompt_ids: list[int]  # the rendered chat prompt (tools= included), tokenised
    response_ids: list[int] = field(default_factory=list)  # the model's turns and the tool responses, in order
    logprobs: list[float] = field(default_factory=list)  # vLLM's, per response token; 0.0 on tool tokens
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled by the model; 0: a tool response's token
    turn_ids: list[int] = field(default_factory=list)  # 2k - 1: assistant turn k; 2k: the tool responses after it
    tool_calls: list[dict] = field(default_factory=list)  # {"turn", "name", "arguments", "response", "error"}
    text: str = ""  # the last assistant turn, decoded with skip_special_tokens=True (what is scored)
    truncated: bool = False  # stopped by data.max_response_length (tool tokens included)
    assistant_turns: int = 0
    user_turns: int = 0  # tool-response turns, as veRL counts them
    done: bool = False

    @property
    def num_turns(self) -> int:
        """veRL's num_turns: user turns + assistant turns + 1 (the prompt)."""
        return self.user_turns + self.assistant_turns + 1


# ------------------------------------------------------------------------------------------- the tools
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers, + - * / // % ** and brackets.
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _evaluate(node):
    """A safe evaluator of arithmetic syntax trees: numbers, + - * / // % **, unary + and -; never eval().
    "2 ** 3 * (1 + 1)" -> 16; a name, a call, an attribute or a string raises ValueError."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent larger than 64")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


@functools.cache
def load_tools(function_tool_path: str | None) -> dict:
    """The tools by name: the calculator, or every public plain function defined in a Python file (veRL 0.9.1's
    function_tool_path: type hints and a Google-style docstring give the schema, transformers.get_json_schema)."""
    if function_tool_path is None:
        return {"calculator": calculator}
    where = f"rollout.multi_turn.function_tool_path {function_tool_path}"
    if not os.path.isfile(function_tool_path):
        raise ToolSetupError(f"{where}: no such file")
    spec = importlib.util.spec_from_file_location("_flatgrpo_tools", function_tool_path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ToolSetupError(f"{where}: importing it raised {type(e).__name__}: {e}") from None
    tools = {
        name: fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_")
    }
    if not tools:
        raise ToolSetupError(f"{where}: defines no public function (a tool is a plain function, as the calculator)")
    for name in tools:
        tool_schemas({name: tools[name]}, where)  # a function without hints or docstring stops here
    return tools


def tool_schemas(tools: dict, where: str = "multi-turn") -> list[dict]:
    """The OpenAI function schemas the chat template's tools= receives, from each function's hints and docstring."""
    schemas = []
    for name, fn in tools.items():
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ToolSetupError(f"{where}: tool {name!r}: no schema: {message}") from None
    return schemas


def check_template(tokenizer, tools: dict, template_kwargs: dict | None = None) -> None:
    """Stop in one line when the chat template cannot run tools: it must write each tool's name for tools=, and
    render a tool message after an assistant turn that ends with the tokenizer's eos token."""
    schemas = tool_schemas(tools)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tools=schemas, tokenize=False, **(template_kwargs or {})
    )
    missing = [name for name in tools if name not in rendered]
    if missing:
        raise ToolSetupError(f"multi-turn: the chat template does not render tools= (no {missing[0]!r} in the prompt)")
    probe = "tool-output-probe"
    if probe not in tokenizer.decode(tool_response_ids(tokenizer, [probe], schemas, template_kwargs)):
        raise ToolSetupError("multi-turn: the chat template does not render a message of role 'tool'")


# ------------------------------------------------------------------------------------- tokens in, tokens out
def tool_response_ids(tokenizer, responses: list[str], schemas: list[dict], template_kwargs: dict | None) -> list[int]:
    """The token ids that follow an assistant turn (which ends with eos) for its tool messages, up to and including
    the next assistant header: the chat template's text for [user, assistant, tool, tool, ...] with the generation
    prompt, from the eos after the assistant's content on, tokenised once. Qwen2.5: ["8"] ->
    "\\n<|im_start|>user\\n<tool_response>\\n8\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n". Only the text
    after the assistant turn is read, so a template that renders an earlier assistant turn differently (Qwen3 drops
    the empty <think> block of a turn before the last) gives the same ids."""
    marker = "flatgrpo-assistant-turn"
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    messages += [{"role": "tool", "content": r} for r in responses]
    after = tokenizer.apply_chat_template(
        messages, tools=schemas, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    end = after.find(tokenizer.eos_token, after.find(marker) + len(marker))
    if marker not in after or end < 0:
        raise ToolSetupError(
            f"multi-turn: the chat template does not end an assistant turn with the eos token {tokenizer.eos_token!r}"
        )
    return tokenizer(after[end + len(tokenizer.eos_token) :], add_special_tokens=False)["input_ids"]


def parse_tool_calls(text: str) -> list[dict]:
    """Hermes tool calls in a turn's text, each {"name", "arguments"} or {"error"}:
    '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "1+2"}}\\n</tool_call>'
    -> [{"name": "calculator", "arguments": {"expression": "1+2"}}]; '<tool_call>{"name": 1</tool_call>' ->
    [{"error": "Invalid tool call: ..."}]. Only complete <tool_call>...</tool_call> pairs count, as in veRL."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('expected {"name": "...", "arguments": {...}}')
            if not isinstance(call.get("arguments", {}), dict):
                raise ValueError("the arguments are not a JSON object")
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            calls.append({"error": f"Invalid tool call: {e}"})
    return calls


def run_tool_call(tools: dict, call: dict, settings: dict) -> tuple[str, str | None]:
    """(the tool response's text, the error or None). Every failure is a response the model reads."""
    if "error" in call:
        return call["error"], call["error"]
    if call["name"] not in tools:
        message = f"Tool '{call['name']}' not found; tools: {', '.join(tools)}"
        return message, message
    try:
        text = str(tools[call["name"]](**call["arguments"]))
    except Exception as e:  # the model's arguments or the tool itself: it reads what went wrong
        message = f"Error executing tool '{call['name']}': {e}"
        return message, message
    return truncate(text, settings["max_tool_response_length"], settings["tool_response_truncate_side"]), None


def truncate(text: str, max_chars: int, side: str) -> str:
    """veRL's cut of a long tool response, in characters: keep the end (left), the start (right) or both (middle)."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        return "(truncated)..." + text[-max_chars:]
    if side == "right":
        return text[:max_chars] + "...(truncated)"
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + text[-half:]


# -------------------------------------------------------------------------------------------- the rollout
def generate(
    llm,
    prompt_ids: list[list[int]],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    seed: int | None,
    tools: dict,
    settings: dict,
    top_p: float = 1.0,
    top_k: int = -1,
    template_kwargs: dict | None = None,
) -> list[Trajectory]:
    """n trajectories per prompt (len(prompt_ids) * n, a prompt's n consecutive), turn by turn. Every active
    trajectory of a turn goes to vLLM in one call. The first turn is rollout.generate's call exactly (seed + i * n
    for prompt i): a model that calls no tool samples what a single-turn rollout samples. Turn t > 1 of
    trajectory k is seeded seed + (t - 1) * len(trajectories) + k. max_tokens (data.max_response_length) bounds
    every token after the prompt, the tool responses' included: a trajectory that reaches it is truncated."""
    tokenizer, schemas = llm.get_tokenizer(), tool_schemas(tools)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=0, detokenize=False)
    trajectories = [Trajectory(prompt_ids=list(p)) for p in prompt_ids for _ in range(n)]
    turn = 0
    while any(not t.done for t in trajectories):
        turn += 1
        active = [k for k, t in enumerate(trajectories) if not t.done]
        completions = _sample_turn(llm, trajectories, active, n, turn, seed, max_tokens, sampling)
        for k, completion in zip(active, completions, strict=True):
            t = trajectories[k]
            _add_tokens(t, list(completion.token_ids), completion.logprobs, 2 * turn - 1)
            t.assistant_turns += 1
            t.text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            t.truncated = completion.finish_reason == "length" or len(t.response_ids) >= max_tokens
            calls = parse_tool_calls(tokenizer.decode(completion.token_ids))
            t.done = t.truncated or not calls or _turn_limit_reached(t, settings)
            if not t.done:
                _answer_tool_calls(t, calls, tokenizer, tools, schemas, settings, template_kwargs, max_tokens)
    return trajectories


def _sample_turn(llm, trajectories, active, n, turn, seed, max_tokens, sampling) -> list:
    """One vLLM call: the first turn n samples per prompt (rollout.generate's requests), a later turn one sample
    per active trajectory from its whole history, with the tokens left of max_tokens. Returns one
    CompletionOutput per active trajectory, in order."""
    if turn == 1:
        prompts = [trajectories[i * n].prompt_ids for i in range(len(trajectories) // n)]
        requests = [
            SamplingParams(n=n, max_tokens=max_tokens, seed=None if seed is None else seed + i * n, **sampling)
            for i in range(len(prompts))
        ]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], requests, use_tqdm=False)
        return [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
    first_seed = None if seed is None else seed + (turn - 1) * len(trajectories)  # past turn 1's seed + k
    histories, requests = [], []
    for k in active:
        t = trajectories[k]
        histories.append(TokensPrompt(prompt_token_ids=t.prompt_ids + t.response_ids))
        request_seed = None if seed is None else first_seed + k
        requests.append(SamplingParams(n=1, max_tokens=max_tokens - len(t.response_ids), seed=request_seed, **sampling))
    return [out.outputs[0] for out in llm.generate(histories, requests, use_tqdm=False)]


def _add_tokens(t: Trajectory, ids: list[int], logprobs, turn_id: int) -> None:
    """Append a segment: the model's (vLLM's log-probs, mask 1; turn_id odd) or a tool response's (logprobs None:
    0.0, mask 0; turn_id even)."""
    sampled = logprobs is not None
    t.response_ids += ids
    t.logprobs += [lp[i].logprob for i, lp in zip(ids, logprobs, strict=True)] if sampled else [0.0] * len(ids)
    t.loss_mask += [1 if sampled else 0] * len(ids)
    t.turn_ids += [turn_id] * len(ids)


def _turn_limit_reached(t: Trajectory, settings: dict) -> bool:
    """veRL's limits, checked after an assistant turn: max_assistant_turns, max_user_turns (null: none)."""
    assistant, user = settings["max_assistant_turns"], settings["max_user_turns"]
    return bool(assistant and t.assistant_turns >= assistant) or bool(user and t.user_turns >= user)


def _answer_tool_calls(t, calls, tokenizer, tools, schemas, settings, template_kwargs, max_tokens) -> None:
    """Run the turn's first max_parallel_calls calls and append their responses as one tool segment. A segment
    that does not fit in max_tokens is cut there and the trajectory ends truncated."""
    responses = []
    for call in calls[: settings["max_parallel_calls"]]:
        text, error = run_tool_call(tools, call, settings)
        t.tool_calls.append({"turn": t.assistant_turns, **call, "response": text, "error": error})
        responses.append(text)
    ids = tool_response_ids(tokenizer, responses, schemas, template_kwargs)
    room = max_tokens - len(t.response_ids)
    _add_tokens(t, ids[:room], None, 2 * t.assistant_turns)
    t.user_turns += 1
    t.truncated = t.done = len(ids) >= room


# ------------------------------------------------------------------------------------------ batch and metrics
def batch_fields(trajectories: list[Trajectory], response_mask: torch.Tensor) -> dict:
    """The batch's multi-turn fields, for responses right-padded as response_mask [B, R] (1 on every response
    token): the response mask with the tool responses' tokens out (the loss mask), turn_ids [B, R] (0 past the
    end); per trajectory num_turns, num_tool_calls and num_tool_errors [B], and its tool calls (a list)."""
    width = response_mask.shape[1]

    def padded(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor([r + [0] * (width - len(r)) for r in rows])

    return {
        "response_mask": response_mask * padded([t.loss_mask for t in trajectories]),  # [B, R]
        "turn_ids": padded([t.turn_ids for t in trajectories]),  # [B, R]
        "num_turns": torch.tensor([t.num_turns for t in trajectories]),  # [B]
        "num_tool_calls": torch.tensor([len(t.tool_calls) for t in trajectories]),  # [B]
        "num_tool_errors": torch.tensor([sum(c["error"] is not None for c in t.tool_calls) for t in trajectories]),
        "tool_calls": [t.tool_calls for t in trajectories],  # B lists of {"turn", "name", "arguments", ...}
    }


def turn_metrics(num_turns: list[int], calls: list[int], errors: list[int]) -> dict:
    """veRL's num_turns/{min,max,mean} and the tool metrics, over the global batch: tool_calls/per_sample (mean
    calls), tool_calls/sample_share (share of samples with a call), tool_calls/error_rate (errors / calls, 0 with
    no call). num_turns [3, 1], calls [1, 0], errors [1, 0] -> mean 2, per_sample 0.5, share 0.5, error_rate 1."""
    return {
        "num_turns/min": min(num_turns),
        "num_turns/max": max(num_turns),
        "num_turns/mean": sum(num_turns) / len(num_turns),
        "tool_calls/per_sample": sum(calls) / len(calls),
        "tool_calls/sample_share": sum(c > 0 for c in calls) / len(calls),
        "tool_calls/error_rate": sum(errors) / max(1, sum(calls)),
    }
