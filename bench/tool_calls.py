"""A tool turn's wall-clock on the tool demo: the calls the tiny_tools model makes (recipes/tiny_calculator.yaml's
prompts, n and budget), answered as multi_turn.py answers them (ToolPool: worker processes, side by side, with a
time limit) against the serial in-process way it answered them before (each call run in the trainer's process,
then its tokens rendered, one trajectory after another). Both in this process, on the same turns.

    .venv/bin/python bench/tool_calls.py [--prompts 16] [--workers 4] [--repeats 20]

Prints, per tool turn and in all: the calls, the serial seconds, the pool's seconds and their ratio; and the cost
of one call through the pool (a round trip to a worker) against one call in process.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import data  # noqa: E402
import multi_turn  # noqa: E402
import rollout  # noqa: E402
import tiny  # noqa: E402


def recorded_turns(llm, prompt_ids: list, n: int, max_tokens: int, pool) -> list[list[tuple]]:
    """The demo's tool turns: for each turn, [(trajectory, its calls)] as multi_turn.generate hands them over."""
    turns, answer = [], multi_turn._answer_tool_calls

    def record(calling, *args):
        turns.append([(multi_turn.Trajectory(**vars(t)), list(calls)) for t, calls in calling])
        return answer(calling, *args)

    multi_turn._answer_tool_calls = record
    try:
        settings = dict(max_assistant_turns=3, max_user_turns=None, max_parallel_calls=1)
        multi_turn.generate(llm, prompt_ids, n=n, temperature=1.0, max_tokens=max_tokens, seed=0, pool=pool,
                            settings=settings)  # fmt: skip
    finally:
        multi_turn._answer_tool_calls = answer
    return [turn for turn in turns if turn]


def serial_turn(calling, tools: dict, tokenizer, schemas, max_tokens: int) -> None:
    """The way before ToolPool: each trajectory's call run in this process, then its response tokens rendered."""
    for t, calls in calling:
        responses = []
        for call in calls[:1]:
            try:
                text = str(tools[call["name"]](**call["arguments"])) if "name" in call else call["error"]
            except Exception as e:
                text = f"Error executing tool '{call['name']}': {e}"
            responses.append(multi_turn.truncate(text, 256, "middle"))
        ids = multi_turn.tool_response_ids(tokenizer, responses, schemas, None)
        t.response_ids = t.response_ids + ids[: max_tokens - len(t.response_ids)]


def pool_turn(calling, pool, tokenizer, max_tokens: int) -> None:
    """multi_turn's way: every call of the turn to the pool at once, then the response tokens."""
    multi_turn._answer_tool_calls(calling, pool, 1, tokenizer, None, max_tokens)


def copies(turn):
    return [(multi_turn.Trajectory(**vars(t)), calls) for t, calls in turn]


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per rank (the demo: 16 over 2 ranks, 8 each)")
    ap.add_argument("--workers", type=int, default=4, help="rollout.multi_turn.tool_workers")
    ap.add_argument("--repeats", type=int, default=20, help="timings per turn and way (the best is kept)")
    args = ap.parse_args()
    paths = tiny.build(".cache/tiny", seed=0, tools=True)
    llm = rollout.make_engine(paths["model"], dtype="float32", max_model_len=256, gpu_memory_utilization=0.4)
    tokenizer = llm.get_tokenizer()
    pool = multi_turn.ToolPool(None, workers=args.workers, timeout=5.0, max_chars=256, side="middle")
    rows = data.load_rows("tiny", "train", {"train": paths["train"]})[: args.prompts]
    prompt_ids = [rollout.render_prompt(tokenizer, r["prompt"], {"tools": pool.schemas}) for r in rows]
    turns = recorded_turns(llm, prompt_ids, n=8, max_tokens=96, pool=pool)
    print(f"tool turns of {args.prompts} prompts x 8 samples: calls {[len(turn) for turn in turns]}")
    print(f"{'turn':>4} {'calls':>6} {'serial s':>10} {'pool s':>10} {'pool / serial':>14}")
    total_serial = total_pool = 0.0
    for k, turn in enumerate(turns, start=1):
        serial = best_of(args.repeats, lambda turn=turn: serial_turn(copies(turn), pool.tools, tokenizer,
                                                                        pool.schemas, 96))  # fmt: skip
        pooled = best_of(args.repeats, lambda turn=turn: pool_turn(copies(turn), pool, tokenizer, 96))
        total_serial, total_pool = total_serial + serial, total_pool + pooled
        print(f"{k:>4} {len(turn):>6} {serial:>10.4f} {pooled:>10.4f} {pooled / serial:>14.2f}")
    ratio = total_pool / total_serial
    print(f" all {sum(map(len, turns)):>6} {total_serial:>10.4f} {total_pool:>10.4f} {ratio:>14.2f}")
    calls = [calls[0] for turn in turns for _, calls in turn if "name" in calls[0]]
    in_process = best_of(args.repeats, lambda: [multi_turn.calculator(**c["arguments"]) for c in calls]) / len(calls)
    one_by_one = statistics.median(best_of(3, lambda c=c: pool.run([c])) for c in calls[:20])
    side_by_side = best_of(args.repeats, lambda: pool.run(calls)) / len(calls)
    print(f"one call: in process {in_process * 1e6:.1f} us; through the pool one at a time {one_by_one * 1e6:.0f} us "
          f"(a round trip), {len(calls)} side by side {side_by_side * 1e6:.0f} us each")  # fmt: skip
    pool.close()


if __name__ == "__main__":
    main()
