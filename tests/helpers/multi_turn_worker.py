"""Worker for test_multi_turn: one vLLM engine (world size 1) on tiny.py's tiny_tools model, multi_turn.generate in
several settings, every request vLLM receives recorded (the engine's own generate, wrapped to log its inputs, seeds
and outputs), written as JSON to OUT.

python tests/helpers/multi_turn_worker.py TINY_TOOLS_DIR OUT

  "calculator":  the calculator, 8 prompts x 4 samples, temperature 1, 96 tokens; also rollout.generate's
                 single-turn samples of the same prompts and seed ("single")
  "again":       the calculator case once more (the same seed): it must sample the same
  "failing":     a tool file whose calculator always raises: every call is an error the model reads
  "short":       the calculator with a 30-token budget: tool responses cut at the budget
  "hot":         temperature 1.6: the model's calls come out garbled (malformed, unknown names, bad arguments)
  "one_turn":    rollout.multi_turn.max_assistant_turns=1: a call is never answered
"""

import dataclasses
import json
import os
import sys
import tempfile

import data
import multi_turn
import rollout

SETTINGS = dict(max_assistant_turns=3, max_user_turns=None, max_parallel_calls=1)
FAILING = '''
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers, + - * / // % ** and brackets.
    """
    raise RuntimeError("the calculator is down")
'''


def recorded(llm, log: list):
    """llm.generate, each call's prompts (token ids), sampling n and seed, and completions (token ids) appended to
    log."""
    generate = llm.generate

    def wrapper(prompts, params, use_tqdm=False):
        outputs = generate(prompts, params, use_tqdm=use_tqdm)
        log.append(
            {
                "prompts": [list(p["prompt_token_ids"]) for p in prompts],
                "n": [p.n for p in params],
                "seeds": [p.seed for p in params],
                "completions": [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs],
            }
        )
        return outputs

    return wrapper


def main(model_dir: str, out: str) -> None:
    rows = data.load_rows("tiny", "test", {"test": os.path.join(model_dir, "test.jsonl")})[:8]
    llm = rollout.make_engine(os.path.join(model_dir, "model"), dtype="float32", max_model_len=256,
                              gpu_memory_utilization=0.4)  # fmt: skip
    failing = os.path.join(tempfile.mkdtemp(), "failing.py")
    with open(failing, "w") as f:
        f.write(FAILING)
    pools = {path: multi_turn.ToolPool(path, workers=2, timeout=5.0, max_chars=256, side="middle")
             for path in (None, failing)}  # fmt: skip
    tokenizer = llm.get_tokenizer()
    prompt_ids = [rollout.render_prompt(tokenizer, r["prompt"], {"tools": pools[None].schemas}) for r in rows]
    results = {}
    cases = {  # name: (tool file, response budget, temperature, settings)
        "calculator": (None, 96, 1.0, SETTINGS),
        "again": (None, 96, 1.0, SETTINGS),
        "failing": (failing, 96, 1.0, SETTINGS),
        "short": (None, 30, 1.0, SETTINGS),
        "hot": (None, 96, 1.6, SETTINGS),
        "one_turn": (None, 96, 1.0, {**SETTINGS, "max_assistant_turns": 1}),
    }
    plain_generate = llm.generate
    for name, (path, max_tokens, temperature, settings) in cases.items():
        log = []
        llm.generate = recorded(llm, log)
        trajectories = multi_turn.generate(
            llm, prompt_ids, n=4, temperature=temperature, max_tokens=max_tokens, seed=7, pool=pools[path],
            settings=settings,
        )  # fmt: skip
        llm.generate = plain_generate
        results[name] = {"requests": log, "trajectories": [dataclasses.asdict(t) for t in trajectories]}
    single = rollout.generate(llm, [r["prompt"] for r in rows], n=4, temperature=1.0, max_tokens=96, seed=7,
                              template_kwargs={"tools": pools[None].schemas})  # fmt: skip
    results["single"] = [s.response_ids for s in single]
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
