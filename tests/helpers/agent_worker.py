"""Worker for test_agent: one vLLM engine (world size 1) on tiny.py's tiny_tools model, the agent endpoint (agent.py)
and multi_turn.generate side by side, written as JSON to OUT.

python tests/helpers/agent_worker.py TINY_TOOLS_DIR AGENTS_DIR OUT

  "calculator":  AGENTS_DIR/logged.py's episode (examples/gsm8k_calculator_agent.py, its replies logged) through the
                 endpoint, and rollout.multi_turn's rollout with the calculator (max_assistant_turns 3), 8 test prompts
                 x 4 samples, seed 7, temperature 1, 96 tokens: each sample's prompt ids, response ids, loss mask,
                 vLLM's log-probs and reward
  "streamed":    the same episodes, every call streamed (logged.py's episode_streamed): samples as "calculator"'s
  "two_ranks":   multi_turn.generate on the training prompts and seed of each rank of a 2-rank run's step 1
                 (train_batch_size 8, ppo_mini_batch_size 4, n 4, seed 0), by prompt position
  "shapes":      AGENTS_DIR/shapes.py, an agent that writes requests as other agents do (a system or developer message,
                 content as a list of text parts, tool_choice none and auto, tool messages with their ids, user
                 follow-ups, its own client from OPENAI_BASE_URL, temperature / top_p / seed / max_tokens set), 2 test
                 prompts x 2: its samples and what it logged (AGENTS_DIR/shapes.jsonl)
  "latency":     AGENTS_DIR/latency.py, 4 episodes of one prompt: one calls on and on while the others send a 5 MB
                 message, a 30 MB body and a body nested 100,000 deep (what they saw: AGENTS_DIR/latency.jsonl)
  "commands":    rollout.agent.command "python AGENTS_DIR/commands.py", 1 test prompt x 4, a 3 s limit: its episodes
                 exit non-zero, hang, print garbage, print 0.25; their samples, rewards, the agent/* metrics
  "shell":       the same command, the next test prompt x 4 (a 120 s limit): examples/gsm8k_calculator_agent.sh
  "batches":     the calls in each engine step of the endpoint
  "together":    two requests of one episode planned on two threads and taken by one serve(): both answered, two
                 samples, two seeds
  "late":        a call still being sampled when its episode returns: refused, never recorded
"""

import dataclasses
import json
import os
import sys
import threading
import time
import types

import agent
import data
import grpo
import multi_turn
import reward
import rollout

SETTINGS = dict(max_assistant_turns=3, max_user_turns=None, max_parallel_calls=1)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(path: str | None, workers: int = 4, name: str = "episode", command=None, timeout=120.0) -> dict:
    """What agent.sampler reads of a run's configuration: tiny.yaml's lengths, the calculator recipe's budget."""
    return {
        "rollout": {"agent": {"path": path, "name": name, "num_workers": workers, "timeout": timeout,
                              "max_requests": 64, "port": 0, "command": command}},
        "data": {"max_prompt_length": 128, "max_response_length": 96, "apply_chat_template_kwargs": None},
        "model": {"path": "tiny_tools"},
    }  # fmt: skip


def as_dict(s, score: float) -> dict:
    return {"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "loss_mask": s.loss_mask,
            "logprobs": s.logprobs, "reward": score}  # fmt: skip


def submitted(endpoint, episode, bodies: list) -> list:
    """Each body submitted on a thread of its own, as the endpoint's HTTP threads do; returns the threads and their
    (status, reply) results once all are planned and queued (not yet served)."""
    results = [None] * len(bodies)

    def send(k):
        results[k] = endpoint.submit(episode.id, bodies[k])

    threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in range(len(bodies))]
    for thread in threads:
        thread.start()
    while endpoint.inbox.qsize() < len(bodies):
        time.sleep(0.01)
    return threads, results


def together(endpoint, row: dict, tokenizer) -> dict:
    """Two requests of one episode planned on two threads and taken by one serve() (as two threads of an agent send
    them), sampled side by side: their statuses, the episode's samples and each call's seed."""
    episode = agent.Episode(0, row, budget=96, seed=5, stride=1, sampling=dict(temperature=1.0, top_p=1.0, top_k=-1))
    endpoint.open([episode])
    body = json.dumps({"model": "tiny_tools", "messages": row["prompt"], "max_tokens": 8}).encode()
    threads, results = submitted(endpoint, episode, [body, body])
    endpoint.serve()
    seeds = [call["plan"]["seed"] for call in endpoint.running.values()]
    while endpoint.running:
        endpoint.step()
    for thread in threads:
        thread.join()
    endpoint.open([])
    return {
        "statuses": [status for status, _ in results],
        "seeds": seeds,
        "samples": [{"prompt_ids": s.prompt_ids, "calls": len(s.calls)} for s in episode.samples],
        "prompt_ids": rollout.render_prompt(tokenizer, row["prompt"]),
    }


def late(endpoint, row: dict) -> dict:
    """A call in the engine's running batch when its episode returns (its worker's answer comes before the engine's
    next step): the engine finishes it; it is refused (episode_over) and never recorded, and the episode keeps its
    reward, with one sample: its prompt alone."""
    episode = agent.Episode(0, row, budget=96, seed=5, stride=1, sampling=dict(temperature=1.0, top_p=1.0, top_k=-1))
    endpoint.open([episode])
    body = json.dumps({"model": "tiny_tools", "messages": row["prompt"], "max_tokens": 16}).encode()
    threads, results = submitted(endpoint, episode, [body])
    endpoint.serve()
    sampling = len(endpoint.running)
    episode.end({"id": 1, "reward": 1.0, "error": None, "dropped": 0})  # the worker's answer
    steps = 0
    while endpoint.running:
        endpoint.step()
        steps += 1
    threads[0].join()
    last = episode.finish(endpoint, score=None)
    samples = [*last.earlier, last]
    endpoint.open([])
    status, reply = results[0]
    return {"sampling": sampling, "steps": steps, "status": status, "code": reply.get("error", {}).get("code"),
            "samples": [{"calls": len(s.calls), "response": len(s.response_ids), "reward": s.reward,
                         "error": s.outcome["error"]} for s in samples]}  # fmt: skip


def summary(samples, rewards) -> dict:
    """What the tests read of a sampler's samples (each episode's last, the ones before it in its .earlier): every
    sample's fields, its reward and text, in the episode's order; agent.field_metrics."""
    rewards = [reward for last, reward in zip(samples, rewards.tolist(), strict=True) for _ in (*last.earlier, last)]
    samples = [s for last in samples for s in (*last.earlier, last)]
    rows = [{**dataclasses.asdict(s), "earlier": len(s.earlier), "fields": {k: v[1] for k, v in s.fields.items()}}
            for s in samples]  # fmt: skip
    fields = {key: [row["fields"][key] for row in rows] for key in rows[0]["fields"]}
    return {"samples": rows, "rewards": rewards, "metrics": agent.field_metrics(fields)}


def main(model_dir: str, agents: str, out: str) -> None:
    paths = {split: os.path.join(model_dir, f"{split}.jsonl") for split in ("train", "test")}
    test_rows = data.load_rows("tiny", "test", paths)[:8]
    llm = rollout.make_engine(os.path.join(model_dir, "model"), dtype="float32", max_model_len=128 + 96,
                              gpu_memory_utilization=0.4)  # fmt: skip
    pool = multi_turn.ToolPool(None, workers=2, timeout=5.0, max_chars=256, side="middle")
    tokenizer = llm.get_tokenizer()
    run = types.SimpleNamespace(llm=llm, val_rows=[], gen_cursor=1)  # training batch 1: policy version 0
    sampling = dict(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=96)

    def multi_turn_rollout(rows, seed):
        prompt_ids = [rollout.render_prompt(tokenizer, r["prompt"], {"tools": pool.schemas}) for r in rows]
        trajectories = multi_turn.generate(llm, prompt_ids, n=4, temperature=1.0, max_tokens=96, seed=seed, pool=pool,
                                           settings=SETTINGS)  # fmt: skip
        return [
            as_dict(t, reward.compute_score(t.text, rows[k // 4]["ground_truth"])) for k, t in enumerate(trajectories)
        ]

    results = {}
    calculator = agent.sampler(config(os.path.join(agents, "logged.py")))
    samples, rewards, _ = calculator(run, test_rows, {}, n=4, seed=7, **sampling)
    results["calculator"] = {
        "agent": [as_dict(s, r) for s, r in zip(samples, rewards.tolist(), strict=True)],
        "multi_turn": multi_turn_rollout(test_rows, 7),
        "episodes": [s.episode for s in samples],
    }
    streamed = agent.sampler(config(os.path.join(agents, "logged.py"), name="episode_streamed"))
    samples, rewards, _ = streamed(run, test_rows, {}, n=4, seed=7, **sampling)
    results["streamed"] = [as_dict(s, r) for s, r in zip(samples, rewards.tolist(), strict=True)]
    train_rows = data.load_rows("tiny", "train", paths)
    prompts = data.step_prompts(train_rows, 1, 8, shuffle=False, seed=0)
    results["two_ranks"] = {}
    for rank in (0, 1):
        positions = data.local_positions(8, 4, 2, rank)
        trajectories = multi_turn_rollout([prompts[p] for p in positions], grpo.sample_seed(0, 1, rank))
        for i, p in enumerate(positions):
            results["two_ranks"][str(p)] = trajectories[i * 4 : (i + 1) * 4]
    shapes = agent.sampler(config(os.path.join(agents, "shapes.py"), workers=2))
    results["shapes"] = summary(*shapes(run, test_rows[:2], {}, n=2, seed=3, **sampling)[:2])
    latency = agent.sampler(config(os.path.join(agents, "latency.py")))
    results["latency"] = summary(*latency(run, test_rows[:1], {}, n=4, seed=3, **sampling)[:2])
    command = f"{sys.executable} {os.path.join(agents, 'commands.py')}"
    run.parts = types.SimpleNamespace(score=lambda row, text, _: (reward.compute_score(text, row["ground_truth"]), {}))
    run.cfg = {"reward": {}}
    for name, timeout, rows in (("commands", 3.0, test_rows[:1]), ("shell", 120.0, test_rows[1:2])):
        commands = agent.sampler(config(None, workers=4, command=command, timeout=timeout))
        results[name] = {**summary(*commands(run, rows, {}, n=4, seed=3, **sampling)[:2]),
                         "ground_truth": rows[0]["ground_truth"]}  # fmt: skip
    results["batches"] = calculator.state["endpoint"].batch_sizes
    results["together"] = together(calculator.state["endpoint"], test_rows[0], tokenizer)
    results["late"] = late(calculator.state["endpoint"], test_rows[0])
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
