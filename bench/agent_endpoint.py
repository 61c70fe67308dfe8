"""What the agent endpoint costs (agent.py, docs/features.md "Bring your agent"): the same episodes run by
examples/gsm8k_calculator_agent.py through the endpoint (64 in flight: a worker each), once as plain replies and once
with every call streamed (its episode_streamed), and by rollout.multi_turn on the engine directly, in one process with
one engine (tiny.py's tiny_tools model, fp32, 16 prompts x 4 samples, 96 tokens, seed 0). All three sample the same
tokens (checked here; vLLM's log-probs differ by fp32 noise at most, printed). Printed for each: requests per second,
the seconds inside the engine, the engine's batch sizes (the sequences each engine step advances: multi_turn sends a
turn's requests in one llm.generate call, the endpoint lets each request join the running batch at the next step),
and the endpoint's wall time against the direct run's.

    .venv/bin/python bench/agent_endpoint.py [--prompts 16] [--workers 64] [--repeats 2]

Each side runs `repeats` times after one warm-up pass (the workers' start, the engine's first batches); the best
time is kept. A request is one call of an episode: one assistant turn of a multi-turn trajectory.
"""

import argparse
import os
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import agent
    import data
    import multi_turn
    import rollout
    import tiny

    built = tiny.build(os.path.join(ROOT, ".cache", "tiny"), seed=0, tools=True)
    rows = data.load_rows("tiny", "test", {"test": built["test"]})[: args.prompts]
    llm = rollout.make_engine(built["model"], dtype="float32", max_model_len=128 + 96, gpu_memory_utilization=0.4)
    sampling = dict(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=96, seed=0)
    n, episodes = 4, args.prompts * 4

    pool = multi_turn.ToolPool(None, workers=4, timeout=5.0, max_chars=256, side="middle")
    settings = dict(max_assistant_turns=3, max_user_turns=None, max_parallel_calls=1)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [rollout.render_prompt(tokenizer, r["prompt"], {"tools": pool.schemas}) for r in rows]
    batches, engine_seconds, step = [], [0.0], llm.llm_engine.step

    def timed_step():  # every engine step, both sides: the sequences it advances, its seconds
        batches.append(llm.llm_engine.get_num_unfinished_requests())
        start = time.perf_counter()
        outputs = step()
        engine_seconds[0] += time.perf_counter() - start
        return outputs

    llm.llm_engine.step = timed_step

    def direct():
        return multi_turn.generate(llm, prompt_ids, n=n, pool=pool, settings=settings, **sampling)

    def config(name: str) -> dict:  # what agent.sampler reads: the example agent, one reply or streamed
        return {
            "rollout": {"agent": {"path": os.path.join(ROOT, "examples", "gsm8k_calculator_agent.py"), "name": name,
                                  "num_workers": args.workers, "timeout": 600.0, "max_requests": 64, "port": 0,
                                  "command": None}},
            "data": {"max_prompt_length": 128, "max_response_length": 96, "apply_chat_template_kwargs": None},
            "model": {"path": "tiny_tools"},
        }  # fmt: skip

    samplers = {"endpoint": agent.sampler(config("episode")), "streamed": agent.sampler(config("episode_streamed"))}
    run = types.SimpleNamespace(llm=llm, val_rows=[], gen_cursor=1)

    def through(name: str):
        return lambda: samplers[name](run, rows, {}, n=n, **sampling)[0]

    results = {}
    for name, side in (("direct", direct), ("endpoint", through("endpoint")), ("streamed", through("streamed"))):
        side()  # warm-up: the workers start, the engine's first batches
        best = None
        for _ in range(args.repeats):
            del batches[:]
            engine_seconds[0], start = 0.0, time.perf_counter()
            samples = side()
            seconds = time.perf_counter() - start
            if best is None or seconds < best[0]:
                best = (seconds, list(batches), samples, engine_seconds[0])
        results[name] = best
    sides = ("endpoint", "streamed")
    pairs = [pair for side in sides for pair in zip(results["direct"][2], results[side][2], strict=True)]
    same = all(a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids for a, b in pairs)
    drift = max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs, strict=True))
    print(f"{episodes} episodes ({args.prompts} prompts x {n}), examples/gsm8k_calculator_agent.py, "
          f"{args.workers} worker(s); the same tokens both ways: {same}; log-probs within {drift:.1g}")  # fmt: skip
    calls = {"direct": sum(t.assistant_turns for t in results["direct"][2])}
    calls.update({side: sum(len(s.calls) for s in results[side][2]) for side in ("endpoint", "streamed")})
    for name, (seconds, sizes, _, in_engine) in results.items():
        print(
            f"  {name:8s}: {seconds:5.2f} s ({in_engine:.2f} s in the engine), {calls[name]} requests, "
            f"{calls[name] / seconds:6.1f} requests/s; {len(sizes)} engine steps, sequences per step: mean "
            f"{statistics.mean(sizes):.1f}, median {statistics.median(sizes):g}, max {max(sizes)}"
        )
    for side in ("endpoint", "streamed"):
        print(f"  {side} / direct: {results[side][0] / results['direct'][0]:.2f}x the time")
        samplers[side].state["workers"].close()
        samplers[side].state["endpoint"].server.shutdown()
    pool.close()


if __name__ == "__main__":
    main()
