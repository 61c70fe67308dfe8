"""An agent written with the openai client: GSM8K with a calculator tool, trained by flatgrpo (agent.py).
python grpo.py --config recipes/tiny_calculator_agent.yaml      (tiny.py's tiny_tools model, on a CPU)
... rollout.agent.name=episode_streamed                         (every call streamed: the same samples)

It offers the model the calculator (tools=), runs each call itself and sends back the answer as a tool message, for
up to three turns of the model, then scores the last answer with veRL's GSM8K rule. It does what rollout.multi_turn
does with the calculator (max_assistant_turns=3, max_parallel_calls=1), in the same words, so that the two runs can
be compared token for token: a call the endpoint could not parse into tool_calls is answered with what was wrong
with it, as multi_turn answers it, where a plain agent would just stop.
"""

import json

import openai

from multi_turn import calculator, parse_tool_calls, truncate  # flatgrpo's safe evaluator, Hermes parser and cut
from reward import compute_score  # veRL's GSM8K rule

CALCULATOR = {  # the schema transformers.utils.get_json_schema writes for multi_turn.calculator
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "Numbers, + - * / // % ** and brackets."}},
            "required": ["expression"],
        },
        "return": {"type": "string"},
    },
}
MAX_TURNS = 3


def episode(client, row, stream: bool = False) -> float:
    """One GSM8K question: the model may call the calculator, reads its answer, writes again; the reward is the
    GSM8K score (1 for the right number after "#### ") of its last answer."""
    model = client.models.list().data[0].id
    messages, text = list(row["prompt"]), ""
    for _ in range(MAX_TURNS):
        reply = ask(client, stream, model=model, messages=messages, tools=[CALCULATOR])
        choice = reply.choices[0]
        message = choice.message
        messages.append(message.model_dump(exclude_none=True))
        if reply.usage.completion_tokens:  # a call past the budget is answered without sampling
            text = message.content or ""
        if choice.finish_reason == "length":  # the response budget is spent
            break
        if message.tool_calls:
            call = message.tool_calls[0]  # one call per turn, as multi_turn's max_parallel_calls=1
            answer, call_id = run(call.function.name, json.loads(call.function.arguments)), call.id
        elif calls := parse_tool_calls(text):  # a call that does not parse: say what is wrong with it
            answer, call_id = calls[0].get("error") or run(calls[0]["name"], calls[0]["arguments"]), "call_0"
        else:
            break
        messages.append({"role": "tool", "tool_call_id": call_id, "content": answer})
    return compute_score(text, row["ground_truth"])


def episode_streamed(client, row) -> float:
    """The same episode with every call streamed (stream: true): the same samples, the same reward."""
    return episode(client, row, stream=True)


def ask(client, stream: bool, **request):
    """One chat completion: as one reply, or streamed and put together by the openai client's stream helper (the
    usage in the stream's last chunk). The helper raises on a reply cut at the length limit, the whole completion in
    hand: here the response budget's end, a reply like any other."""
    if not stream:
        return client.chat.completions.create(**request)
    with client.chat.completions.stream(**request, stream_options={"include_usage": True}) as chunks:
        try:
            return chunks.get_final_completion()
        except openai.LengthFinishReasonError as cut:
            return cut.completion


def run(name: str, arguments: dict) -> str:
    """The tool's answer, worded as multi_turn's ToolPool words it (256 characters at most, cut in the middle)."""
    if name != "calculator":
        return f"Tool '{name}' not found; tools: calculator"
    try:
        return truncate(calculator(**arguments), 256, "middle")
    except Exception as e:
        return f"Error executing tool 'calculator': {e}"
