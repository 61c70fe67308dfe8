"""Bring your agent: any program that speaks the OpenAI API, trained token for token. Each rank serves an
OpenAI-compatible endpoint in front of its vLLM engine (vLLM's own request and reply models); the episodes run in
worker processes (multi_turn.WorkerPool) against it, and every token sampled for them is recorded: a call extending a
sample's last call continues it token for token, any other starts a new sample (a split). A hostile episode ends with
reward 0, counted; the run goes on. veRL's RemoteAgentLoop proxy, TRL's rollout_func; docs/features.md, "Bring your
agent". Imports the standard library and multi_turn.py.

    def episode(client, row):  # my_agent.py: client, an openai.OpenAI bound to the episode; returns the reward
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=row["prompt"])
        return 1.0 if "#### " + row["ground_truth"] in (reply.choices[0].message.content or "") else 0.0

    python grpo.py --config tiny.yaml rollout.agent.path=my_agent.py         # grpo.choose_parts: parts(cfg, parts, ...)
    python grpo.py --config tiny.yaml rollout.agent.command="sh examples/gsm8k_calculator_agent.sh"  # any program
"""

import contextlib
import functools
import http.server
import importlib
import inspect
import json
import math
import numbers
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import multi_turn  # the worker pool and the Hermes parser: one design, one parser, for tools and agents

MODELS = re.compile(r"(/[^/]+)?/v1/models(/(?P<model>.+))?/?")  # GET [/<episode>]/v1/models[/<id>]
API_KEY = "flatgrpo"  # any key: the endpoint checks none (it listens on 127.0.0.1 only)
MAX_BODY = 32 * 2**20  # bytes of one request's body; a larger one is refused (413) before it is read
ROLES = ("system", "developer", "user", "assistant", "tool")


class AgentError(ValueError):
    """An agent file, command, setting or port the run cannot use; the message is one line."""


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        kind = {404: "not_found_error", 429: "rate_limit_error", 500: "server_error"}.get(status)
        error = {"message": message, "type": kind or "invalid_request_error", "param": param, "code": code}
        self.status, self.body = status, {"error": error}


# ----------------------------------------------------------------------------------------- the loop's part
def parts(cfg: dict, parts, group_advantages):
    """The step's parts (grpo.choose_parts), after check_settings: scored_samples (sampler), sample_groups
    (episode_groups), advantages (episode_advantages over group_advantages: losses.grpo_advantages), field_metrics."""
    check_settings(cfg)
    parts.scored_samples, parts.field_metrics = sampler(cfg), field_metrics
    parts.sample_groups = episode_groups(parts.sample_groups)
    parts.advantages = functools.partial(episode_advantages, group_advantages=group_advantages)
    return parts


def episode_groups(sample_groups):
    """The step's sample_groups with all of each episode's samples in its group, in order: the ones before its last
    (AgentSample.earlier, where the agent rewrote its history) before it, with the episode's reward and extras."""

    def every_sample(run, prompts: list[dict], t: dict) -> list[dict]:
        groups = sample_groups(run, prompts, t)
        for group in groups:
            counts = [len(sample.earlier) + 1 for sample in group["samples"]]  # [n]: each episode's samples
            group["samples"] = [s for sample in group["samples"] for s in (*sample.earlier, sample)]
            group["rewards"] = group["rewards"].repeat_interleave(group["rewards"].new_tensor(counts).long())
            group["extras"] = [e for e, count in zip(group["extras"], counts, strict=True) for _ in range(count)]
        return groups

    return every_sample


def episode_advantages(run, batch: dict, group_advantages) -> dict:
    """adv: GRPO's advantage of each episode over its prompt's episodes (group_advantages by batch["uid"]), an
    episode of several rows (batch["episode"] [B], sharing its reward) counted once, given to each of its rows and
    broadcast over the response mask: batch["advantages"] [B, R] (veRL's multi-trajectory groups)."""
    episodes, first_row = batch["episode"].tolist(), {}  # [B]: i * n + j for episode j of prompt i
    for k, episode in enumerate(episodes):
        first_row.setdefault(episode, k)  # episode -> its first row
    rows, norm = list(first_row.values()), run.cfg["algorithm"]["norm_adv_by_std_in_grpo"]  # [E]
    per_episode = group_advantages(batch["rewards"][rows], batch["uid"][rows].tolist(), norm_by_std=norm)  # [E]
    index = {episode: i for i, episode in enumerate(first_row)}  # episode -> its place in per_episode
    batch["advantages"] = per_episode[[index[e] for e in episodes]][:, None] * batch["response_mask"]  # [B, R]
    return {}


def check_settings(cfg: dict) -> None:
    """One line (AgentError) before anything loads: what an agent's run cannot serve, an agent file that does not
    import in a worker or lacks the function, a command whose program does not exist, a port taken."""
    settings, algorithm = cfg["rollout"]["agent"], cfg["algorithm"]
    refused = [key for key, on in {"rollout.multi_turn.enable": cfg["rollout"]["multi_turn"]["enable"],
               "custom_reward_function.path": cfg["custom_reward_function"]["path"] and not settings["command"],
               "algorithm.filter_groups.enable": algorithm["filter_groups"]["enable"],
               "reward.overlong_buffer.enable": cfg["reward"]["overlong_buffer"]["enable"],
               "algorithm.use_kl_in_reward": algorithm["use_kl_in_reward"],
               f"algorithm.adv_estimator={algorithm['adv_estimator']}": algorithm["adv_estimator"] != "grpo",
               "rollout.agent.path and .command": settings["path"] and settings["command"]}.items() if on]  # fmt: skip
    if refused:
        raise AgentError(f"config: {refused[0]} is not served with an agent (rollout.agent.path/command: its episodes "
                         "score themselves and may give several samples, grouped by GRPO); set it off")  # fmt: skip
    if settings["command"]:
        program = (settings["command"].split() or [""])[0]
        if shutil.which(program) is None and not os.path.isfile(program):
            raise AgentError(f"rollout.agent.command: no program {program!r} (not on PATH, not a file)")
    elif not os.path.isfile(settings["path"]):
        raise AgentError(f"rollout.agent.path {settings['path']}: no such file")
    else:
        with contextlib.closing(episode_workers({**settings, "num_workers": 1})) as pool:
            pool.wait_started()  # ToolSetupError: the worker's line (load_episode's) says why
    http_server(settings["port"]).server_close()  # the rank's port, bound as the endpoint binds it, then freed


def sampler(cfg: dict):
    """scored_samples(run, rows, t, *, n, ...) -> (samples, rewards [N], extras): n episodes of each row against the
    rank's endpoint and workers (started at the first call, kept), each its last sample (Episode.finish), which
    validation scores, with its reward (a silent command's: run.parts.score's); t["gen"]: their time (t["reward"] 0)."""
    settings, data = cfg["rollout"]["agent"], cfg["data"]
    state = {}

    def scored_samples(run, rows, t, *, n, temperature, top_p, top_k, max_tokens, seed):
        import torch

        start = time.perf_counter()
        if not state:
            limits = dict(max_prompt_length=data["max_prompt_length"], max_requests=settings["max_requests"],
                          max_model_len=data["max_prompt_length"] + data["max_response_length"],
                          template_kwargs=data["apply_chat_template_kwargs"])  # fmt: skip
            state.update(endpoint=Endpoint(run.llm, model=cfg["model"]["path"], port=settings["port"], **limits),
                         workers=episode_workers(settings))  # fmt: skip
        sampling, version = dict(temperature=temperature, top_p=top_p, top_k=top_k), policy_version(run, rows)
        episodes = [Episode(k, row, budget=max_tokens, seed=seed, stride=len(rows) * n, sampling=sampling,
                            version=version) for k, row in enumerate(r for r in rows for _ in range(n))]  # fmt: skip
        run_episodes(state["endpoint"], episodes, state["workers"])
        score = lambda row, text: run.parts.score(row, text, run.cfg["reward"])[0]  # noqa: E731
        samples = [episode.finish(state["endpoint"], score) for episode in episodes]  # each episode's last
        t["gen"], t["reward"] = time.perf_counter() - start, 0.0
        return samples, torch.tensor([s.reward for s in samples], dtype=torch.float32), [{} for _ in samples]

    scored_samples.state = state  # the endpoint (its batch_sizes) and the workers, once started
    return scored_samples


def policy_version(run, rows: list) -> int:
    """The step whose weights sample these rows: what rollout ranks hold (run.policy_version); on the rank's own
    engine, step s - 1's for training batch s (run.gen_cursor = s), step s's for validation after step s."""
    validating = any(row is rows[0] for row in run.val_rows)
    return getattr(run, "policy_version", run.gen_cursor - (not validating))


def field_metrics(fields: dict) -> dict:
    """agent/* over the global batch (metrics.batch_metrics' fields), per episode: error_rate (failures),
    timeout_rate, refused_rate, split_rate, calls_per_episode, samples_per_episode; dropped_lines (no answer)."""
    episodes = max(1, sum(fields["episode_starts"]))
    rates = {"error_rate": "errors", "timeout_rate": "timeouts", "refused_rate": "refusals", "split_rate": "splits"}
    return {**{f"agent/{name}": sum(fields[f"episode_{key}"]) / episodes for name, key in rates.items()},
            "agent/calls_per_episode": sum(fields["num_calls"]) / episodes,
            "agent/samples_per_episode": len(fields["episode_starts"]) / episodes,
            "agent/dropped_lines": sum(fields["episode_dropped_lines"])}  # fmt: skip


# ------------------------------------------------------------------------------------------------ episodes
@dataclass
class AgentSample:
    """One sample of an episode (rollout.Sample's fields and its calls): its prompt and every token after it, sampled
    (mask 1, vLLM's log-probs) or appended (the template's ids for the messages between calls: mask 0, log-prob 0)."""

    prompt_ids: list[int]
    episode: int  # i * n + j: episode j of this rank's row i
    first: bool  # the episode's first sample (its metrics are counted there)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)  # {"call", "prompt_ids", "sampled_ids", "logprobs", "finish", ...}
    text: str = ""  # the content of its last call's answer
    reward: float = 0.0
    outcome: dict = field(default_factory=dict)  # the episode's: error, timeout, refused, samples, dropped
    history: tuple = ()  # (messages + the answer, normalised; tools) of its last call: what a next call extends
    in_flight: int = 0  # its calls planned or being sampled (a call that extends it meanwhile starts a new sample)
    earlier: list = field(default_factory=list)  # the episode's samples before this one, its last (Episode.finish)

    @functools.cached_property  # one dict: a field added to it stays (rollout ranks' policy_version)
    def fields(self) -> dict:
        """Its batch fields (fsdp_train.add_fields): the loss mask, its episode, its calls, the episode's counts."""
        counted, outcome = int(self.first), self.outcome
        counts = {"starts": 1, "errors": outcome["error"] is not None, "timeouts": outcome["timeout"],
                  "refusals": outcome["refused"], "splits": outcome["samples"] > 1,
                  "dropped_lines": outcome["dropped"]}  # fmt: skip
        return {"response_mask": ("response", self.loss_mask), "episode": ("row", self.episode),
                "num_calls": ("row", len(self.calls)), "agent_error": ("row", outcome["error"] or ""),
                "agent_calls": ("row", self.calls),
                **{f"episode_{key}": ("row", counted * int(value)) for key, value in counts.items()}}  # fmt: skip


class Episode:
    """One episode (k = i * n + j: episode j of row i): its samples; its calls, planned on their threads and recorded
    on the engine's, under its lock; call t seeded seed + (t - 1) * stride + k, as multi_turn.generate seeds."""

    def __init__(self, k: int, row: dict, *, budget: int, seed: int | None, stride: int, sampling: dict, version=0):
        self.k, self.row, self.budget, self.seed, self.stride, self.sampling = k, row, budget, seed, stride, sampling
        self.id, self.version = f"{k}-{os.urandom(8).hex()}", version  # unguessable: none can address another's
        self.samples: list[AgentSample] = []
        self.calls = self.planned = self.requests = self.used = self.dropped = 0  # answered, planned; budget used
        self.reward, self.text, self.lock = None, "", threading.RLock()  # text: its last sampled answer's content
        self.error, self.timeout, self.refused, self.over = None, False, False, False

    def fail(self, error: str, refused: bool = False) -> None:
        """The episode has failed (its reward will be 0): the first reason is kept; later requests are refused."""
        with self.lock:
            self.error, self.refused = self.error or error, self.refused or refused

    def refuse(self, error: Exception) -> tuple[int, dict]:
        """(status, body) of a request's error (500: one this code did not foresee); the episode has failed, refused."""
        if not isinstance(error, RequestError):
            message = f"the endpoint could not serve the request: {type(error).__name__}: {str(error)[:300]}"
            error = RequestError(500, message, code="internal_error")
        self.fail(f"refused ({error.status}): {error}", refused=True)
        return error.status, error.body

    def over_reply(self) -> tuple[int, dict]:  # to a request of the episode over or failed: its outcome stays
        reason = "is over" if self.error is None else f"has failed: {self.error}"
        return 400, RequestError(400, f"episode {self.id} {reason}", code="episode_over").body

    def plan(self, request: dict, tokenizer, limits: dict) -> dict:
        """The next call: {"sample" (the one it continues, held; None: a new one), "appended" (the new messages' ids,
        cut to the room left), "prompt_ids", "max_tokens", "seed", "seen" (the messages normalised)}: it continues the
        sample whose last call it extends (the longest), unless another call holds it. RequestError for what the
        template cannot render or the model cannot take (untokenised past the tokens allowed x limits["longest"])."""
        messages, tools, kwargs = request["messages"], request["tools"], limits["template_kwargs"]
        seen = [normalised(m) for m in messages]
        with self.lock:
            extended = [s for s in self.samples if s.history[1] == tools and seen[: len(s.history[0])] == s.history[0]]
            sample = max((s for s in extended if not s.in_flight), key=lambda s: len(s.history[0]), default=None)
            longest = limits["max_prompt_length"] if not self.samples else limits["max_model_len"] - 1
            self.planned += 1  # call t of the episode
            seed = None if self.seed is None else self.seed + (self.planned - 1) * self.stride + self.k
            plan = {"sample": sample, "held": sample, "appended": [], "seed": seed, "seen": seen}
            if sample is not None:
                sample.in_flight += 1
                so_far = sample.prompt_ids + sample.response_ids  # fixed while the call holds the sample
                room = max(0, min(self.budget - self.used, limits["max_model_len"] - len(so_far)))
        try:
            if sample is not None:  # the new messages' text cut where it gives more ids than fit
                new, cut = messages[len(sample.history[0]) :], (room + 2) * limits["longest"]
                appended = multi_turn.ids_after_assistant(tokenizer, new, tools, kwargs, cut)
                if appended is None:  # a template without an eos after the assistant turn: rendered from scratch
                    self.release(plan)
                    plan["sample"] = None
                else:
                    plan.update(appended=appended[:room], prompt_ids=so_far + appended[:room])
            if plan["sample"] is None:
                text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                     **(kwargs or {}))  # fmt: skip
                ids = None if len(text) > longest * limits["longest"] else tokenizer(text, add_special_tokens=False)
                if ids is None or len(ids["input_ids"]) > longest:
                    length = f"{len(text)} characters" if ids is None else f"{len(ids['input_ids'])} tokens"
                    raise RequestError(400, f"This model's maximum context length is {limits['max_model_len']} tokens "
                                       f"(a first prompt: data.max_prompt_length {limits['max_prompt_length']}); "
                                       f"your messages resulted in {length}", "messages",
                                       "context_length_exceeded")  # fmt: skip
                plan["prompt_ids"] = ids["input_ids"]
        except Exception as e:  # a RequestError, or what the template raises (jinja's errors, its raise_exception)
            self.release(plan)
            if isinstance(e, RequestError):
                raise
            message = f"the chat template cannot render the request: {(str(e) or type(e).__name__).splitlines()[0]}"
            raise RequestError(400, message, None, "template_error") from None
        left = self.budget - self.used - len(plan["appended"])  # the budget as it is now (self.used: one read)
        plan["max_tokens"] = min(left, request["max_tokens"] or left, limits["max_model_len"] - len(plan["prompt_ids"]))
        return plan

    def release(self, plan: dict) -> None:  # the call no longer holds the sample it continues
        with self.lock:
            if (held := plan.pop("held", None)) is not None:
                held.in_flight -= 1

    def record(self, request: dict, plan: dict, sampled: list[int], logprobs: list[float], answer: dict) -> None:
        """Call plan's tokens into its sample (a new one unless it continues one), and the call (with the answer
        returned) as the sample's history, which a next call may extend."""
        with self.lock:
            self.calls += 1
            sample = plan["sample"]
            if sample is None and (sampled or not self.samples):  # a new sample (a split after the first)
                sample = AgentSample(prompt_ids=plan["prompt_ids"], episode=self.k, first=not self.samples)
                self.samples.append(sample)
            if sample is not None:
                sample.response_ids += plan["appended"] + sampled
                sample.logprobs += [0.0] * len(plan["appended"]) + logprobs
                sample.loss_mask += [0] * len(plan["appended"]) + [1] * len(sampled)
                sample.text = answer["message"]["content"] or ""
                sample.calls.append({"call": self.calls, "prompt_ids": plan["prompt_ids"], "sampled_ids": sampled,
                                     "logprobs": logprobs, "finish": answer["finish_reason"],
                                     "model_version": self.version})  # fmt: skip
                sample.history = (plan["seen"] + [normalised(template_message(answer["message"]))], request["tools"])
            self.used += len(plan["appended"]) + len(sampled)
            self.text = sample.text if sampled else self.text

    def end(self, answer: dict) -> None:
        """Its worker's answer (a reward, None: the run's scorer's; an error; a timeout; the worker's end)."""
        with self.lock:
            self.over, self.dropped, self.reward = True, answer["dropped"], answer.get("reward")
            self.timeout = answer.get("timeout", False)
            if "failed" in answer:
                self.fail(f"timed out: {answer['failed']} (rollout.agent.timeout)" if self.timeout else
                          f"exited: {answer['failed']}")  # fmt: skip
            elif answer["error"] is not None or not isinstance(answer["reward"], (float, type(None))):
                self.fail(str(answer["error"] or f"its worker answered {str(answer)[:200]}"))

    def finish(self, endpoint: "Endpoint", score) -> AgentSample:
        """Its last sample (one without a call: its prompt), the ones before it in its .earlier, each with its reward
        (0 after a failure; score(row, text) of its last sampled answer when it gave none) and its outcome."""
        if not self.samples:  # its row's prompt as rollout.render_prompt renders it (no special tokens added)
            kwargs = endpoint.limits["template_kwargs"] or {}
            prompt = endpoint.tokenizer.apply_chat_template(self.row["prompt"], add_generation_prompt=True, **kwargs)
            self.samples.append(AgentSample(prompt_ids=prompt["input_ids"], episode=self.k, first=True))
        reward = 0.0 if self.error is not None else self.reward
        reward = score(self.row, self.text) if reward is None else reward
        outcome = {"error": self.error, "timeout": self.timeout, "refused": self.refused, "samples": len(self.samples),
                   "dropped": self.dropped}  # fmt: skip
        for sample in self.samples:
            sample.reward, sample.outcome, sample.history = reward, outcome, ()  # (the history stays here)
        self.samples[-1].earlier = self.samples[:-1]
        return self.samples[-1]


# ------------------------------------------------------------------------------------------ the endpoint
def run_episodes(endpoint: "Endpoint", episodes: list[Episode], workers: multi_turn.WorkerPool) -> None:
    """The episodes run by the workers until each ends, this thread (the engine's) serving their calls meanwhile."""
    endpoint.open(episodes)
    url = f"http://127.0.0.1:{endpoint.port}/{{}}/v1"  # the episode's id in its URL
    jobs = {workers.submit({"base_url": url.format(e.id), "row": e.row}): e for e in episodes}
    try:
        while jobs:
            for job, answer in workers.poll(0.0 if endpoint.running else None, wake=endpoint.wake_read):
                jobs.pop(job).end(answer)
            endpoint.serve()
            if endpoint.running:
                endpoint.step()
    finally:
        endpoint.close_episodes()


class Endpoint:
    """An OpenAI endpoint on 127.0.0.1 in front of one engine: HTTP threads plan requests (submit), one thread steps."""

    def __init__(self, llm, *, model: str, port: int, **limits):
        import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401  (imported once, here)

        self.llm, self.tokenizer, self.model = llm, llm.get_tokenizer(), model
        longest = max(map(len, self.tokenizer.get_vocab()))  # characters: a token's text has at most its raw form's
        self.limits = {**limits, "longest": longest}  # max_prompt_length, max_model_len, max_requests, template_kwargs
        self.episodes, self.inbox = {}, queue.SimpleQueue()  # inbox: the planned calls, from the HTTP threads
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        self.running, self.added, self.batch_sizes = {}, 0, []  # engine id -> call; calls added; calls per step
        self.server = http_server(port)
        self.server.endpoint, self.port = self, self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="agent-endpoint").start()

    def open(self, episodes: list[Episode]) -> None:  # the episodes whose requests it serves
        self.episodes = {e.id: e for e in episodes}  # a new dict each time: submit reads it without a lock

    def close_episodes(self) -> None:  # the episodes have ended: a call still queued or sampled is refused
        self.open([])
        self.serve()
        self.llm.llm_engine.abort_request(list(self.running))  # calls of episodes that ended (timed out, exited)
        for call in self.running.values():  # refused: never answered
            _answer(call, call["episode"].over_reply())
        self.running = {}

    def submit(self, episode_id: str, body: bytes | None) -> tuple[int, dict | list]:
        """An HTTP thread's request (None: too large), counted, read, planned, queued: (status, reply or chunks)."""
        episode = self.episodes.get(episode_id)  # one read of the dict open() set
        if episode is None:
            return 404, RequestError(404, f"no episode {episode_id!r} is running", code="unknown_episode").body
        with episode.lock:
            if episode.over or episode.error is not None:  # refused; its outcome stays
                return episode.over_reply()
            episode.requests += 1
            if episode.requests > self.limits["max_requests"]:
                message = f"more than {self.limits['max_requests']} requests (rollout.agent.max_requests)"
                episode.fail(f"flooded: {message}", refused=True)
                return 429, RequestError(429, f"episode {episode.id}: {message}", code="too_many_requests").body
        try:
            if body is None:
                raise RequestError(413, f"a body of over {MAX_BODY} bytes, or no byte count", code="body_too_large")
            call = {"episode": episode, "request": parse_request(body, self.model), "done": threading.Event()}
            call["plan"] = episode.plan(call["request"], self.tokenizer, self.limits)
        except Exception as e:  # a RequestError, or a request this code did not foresee: never the run's end
            return episode.refuse(e)
        self.inbox.put(call)
        os.write(self.wake_write, b".")
        call["done"].wait()
        return call["refusal"] if "refusal" in call else (200, self._reply(call))

    def serve(self) -> None:
        """On the engine's thread: each planned call joins the running batch (no budget left: "length", unsampled)."""
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_read, 1 << 20)  # the wake-ups: a byte per request (a pipe holds 64 KiB)
        while not self.inbox.empty():
            call = self.inbox.get()
            episode, request, plan = call["episode"], call["request"], call["plan"]
            try:
                if plan["max_tokens"] <= 0:  # the budget is spent: "length", nothing sampled
                    self._finish(call, [], [], "length", "")
                    continue
                sampling = SamplingParams(n=1, max_tokens=plan["max_tokens"], seed=plan["seed"], stop=request["stop"],
                                          logprobs=request["top_logprobs"], detokenize=bool(request["stop"]),
                                          output_kind=RequestOutputKind.FINAL_ONLY, **episode.sampling)  # fmt: skip
                self.added += 1
                self.llm.llm_engine.add_request(f"agent-{self.added}", tokens_input(plan["prompt_ids"]), sampling)
                self.running[f"agent-{self.added}"] = call
            except Exception as e:  # what this code did not foresee, the engine's own checks: refused, never the end
                _answer(call, episode.refuse(e))

    def step(self) -> None:
        """One step of the engine (every running call advances by a token); each finished call, _finish'ed."""
        self.batch_sizes.append(len(self.running))
        for output in self.llm.llm_engine.step():  # the finished calls alone (FINAL_ONLY)
            call, completion = self.running.pop(output.request_id), output.outputs[0]
            sampled = list(completion.token_ids)
            logprobs = [lp[token].logprob for token, lp in zip(sampled, completion.logprobs, strict=True)]
            ids = sampled[:-1] if completion.finish_reason == "stop" else sampled  # without the eos that ended them
            text = completion.text if isinstance(completion.stop_reason, str) else self.tokenizer.decode(ids)
            self._finish(call, sampled, logprobs, completion.finish_reason, text, completion.logprobs)

    def _finish(self, call, sampled, logprobs, finish, text, alternatives=None) -> None:
        """A call's answer recorded (tool call ids call_<call>_<i>); an over episode's is refused, never recorded."""
        episode, request = call["episode"], call["request"]
        with episode.lock:
            if episode.over:
                return _answer(call, episode.over_reply())
            episode.release(call["plan"])
            number = episode.calls + 1  # this call's, once recorded
            special = self.tokenizer.all_special_tokens
            answer = assistant_message(text, finish, request["parse_tools"], special, call_ids=f"call_{number}")
            episode.record(request, call["plan"], sampled, logprobs, answer)
        call.update(number=number, answer=answer, sampled=sampled, alternatives=alternatives)
        call["done"].set()

    def _reply(self, call: dict) -> dict | list[dict]:
        """A recorded call's reply, with vLLM's OpenAI models: a ChatCompletionResponse, or (stream) OpenAI's chunks:
        the role (and log-probs asked for), the content in pieces, each tool call, the finish reason, the usage
        (stream_options.include_usage). Both say what was recorded, and model_version: the policy that sampled it."""
        from vllm.entrypoints.openai.chat_completion import protocol as api

        request, (message, finish), episode = call["request"], call["answer"].values(), call["episode"]
        head = dict(id=f"chatcmpl-{episode.id}-{call['number']}", model=self.model, model_version=episode.version)
        prompt, sampled = len(call["plan"]["prompt_ids"]), len(call["sampled"])
        usage = api.UsageInfo(prompt_tokens=prompt, completion_tokens=sampled, total_tokens=prompt + sampled)
        logprobs = request["logprobs"] and api.ChatCompletionLogProbs(content=[  # vLLM's, by rank: the ones recorded
            {**self._logprob(token, ranked[token].logprob), "top_logprobs": [self._logprob(t, lp.logprob) for t, lp in
             sorted(ranked.items(), key=lambda item: item[1].rank)[: request["top_logprobs"]]]}
            for token, ranked in zip(call["sampled"], call["alternatives"] or [], strict=True)]) or None  # fmt: skip
        calls = message.get("tool_calls", [])  # dicts, as the message is: vLLM's models read and check them
        if not request["stream"]:
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            return api.ChatCompletionResponse(**head, choices=[choice], usage=usage).model_dump(exclude_none=True)
        deltas = [api.DeltaMessage(role="assistant", content=None if message["content"] is None else "")]
        deltas += [api.DeltaMessage(content=piece) for piece in re.findall(r"\s*\S+|\s+", message["content"] or "")]
        deltas += [api.DeltaMessage(tool_calls=[{"index": i, **c}]) for i, c in enumerate(calls)]
        choices = [{"index": 0, "delta": d, "logprobs": None if k else logprobs} for k, d in enumerate(deltas)]
        choices.append({"index": 0, "delta": {}, "finish_reason": finish})  # the last chunk: the finish reason alone
        chunks = [api.ChatCompletionStreamResponse(**head, choices=[choice]) for choice in choices]
        chunks += [api.ChatCompletionStreamResponse(**head, choices=[], usage=usage)] if request["usage"] else []
        return [chunk.model_dump(exclude_none=True) for chunk in chunks]

    def _logprob(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _answer(call: dict, refusal: tuple[int, dict]) -> None:  # a queued call refused: the sample it held released
    call["episode"].release(call["plan"])
    call["refusal"] = refusal
    call["done"].set()


def http_server(port: int) -> http.server.ThreadingHTTPServer:
    """The endpoint's server (Handler) on 127.0.0.1 at rollout.agent.port + LOCAL_RANK (0: a free port); AgentError."""
    port = port + int(os.environ.get("LOCAL_RANK", 0)) if port else 0
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as e:
        raise AgentError(f"config: rollout.agent.port: 127.0.0.1:{port} cannot be bound ({e.strerror})") from None


class Handler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive): POST /<episode>/v1/chat/completions (Endpoint.submit), GET models (MODELS); else 404s."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        parts, length = self.path.split("?")[0].strip("/").split("/"), self.headers.get("Content-Length") or "0"
        readable = length.isdigit() and int(length) <= MAX_BODY  # else never read: its episode is told (413)
        self.close_connection, body = not readable, (self.rfile.read(int(length)) if readable else None)
        if parts[1:] != ["v1", "chat", "completions"]:
            return self._send(404, RequestError(404, f"no route POST {self.path}", code="not_found").body)
        self._send(*self.server.endpoint.submit(parts[0], body))

    def do_GET(self):
        route, model = MODELS.fullmatch(self.path.split("?")[0]), self.server.endpoint.model
        served = {"id": model, "object": "model", "created": 0, "owned_by": "flatgrpo"}
        if route is None:
            return self._send(404, RequestError(404, f"no route GET {self.path}", code="not_found").body)
        if route["model"] in (None, model):
            return self._send(200, {"object": "list", "data": [served]} if route["model"] is None else served)
        self._send(404, RequestError(404, f"no model `{route['model']}`", "model", "model_not_found").body)

    def _send(self, status: int, body: dict | list) -> None:  # a list: a stream, "data: <chunk>" each, "data: [DONE]"
        stream = isinstance(body, list)
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in body) + "data: [DONE]\n\n" if stream else json.dumps(body)
        data = text.encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client is gone (a worker killed mid-request)
            self.close_connection = True

    def log_message(self, *args):  # no access log on the console
        return


# ------------------------------------------------------------------------------------------- requests
def parse_request(body: bytes, model: str) -> dict:
    """A chat-completions body read by vLLM's own OpenAI model (ChatCompletionRequest, as its server reads it), its
    sampling fields ignored; RequestError (OpenAI's status and wording) for what it refuses and what `refused` lists."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMClientError

    try:
        raw = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's depth
        raise RequestError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise RequestError(400, "the request body is not a JSON object", code="invalid_request")
    try:
        parsed = ChatCompletionRequest.model_validate(raw)
    except (ValueError, RecursionError, TypeError, VLLMClientError) as e:  # pydantic's ValidationError; vLLM's
        error = e.errors()[0] if hasattr(e, "errors") else {"loc": [getattr(e, "parameter", "")], "msg": str(e)}
        where = ".".join(map(str, error["loc"])) or None
        code = {"tools": "invalid_tools", "messages": "invalid_messages"}.get(str(where).split(".")[0], "invalid")
        raise RequestError(400, f"{where}: {error['msg']}", param=where, code=code) from None
    if parsed.model != model:
        raise RequestError(404, f"The model `{parsed.model}` does not exist; this endpoint serves `{model}` (GET "
                           "/v1/models)", param="model", code="model_not_found")  # fmt: skip
    kind = getattr(parsed.response_format, "type", "text")
    top, stop = parsed.top_logprobs or 0, [parsed.stop] if isinstance(parsed.stop, str) else parsed.stop or None
    max_tokens = next((m for m in (parsed.max_completion_tokens, vars(parsed)["max_tokens"]) if m is not None), None)
    refused = {  # key: (refused, why[, code: else unsupported, what would make the samples other than the policy's])
        "n": (parsed.n not in (None, 1), f"{parsed.n}: one completion per request (the calls are the samples)"),
        "tool_choice": (parsed.tool_choice not in ("auto", "none"), f"{parsed.tool_choice!r}: accepted auto, none"),
        "response_format": (kind != "text", f"{kind!r}: text only (a format would constrain the sampling)"),
        "logit_bias": (bool(parsed.logit_bias), "it would change what is sampled; the samples are the policy's"),
        "messages": (not parsed.messages, "a non-empty list of messages", "invalid_messages"),
        "top_logprobs": (not 0 <= top <= 20, f"{top}: an integer 0-20, with logprobs true", "invalid"),
        "stop": (stop is not None and not all(stop), "non-empty strings", "invalid"),
        "max_tokens": (max_tokens is not None and max_tokens < 1, f"{max_tokens}: an integer >= 1", "invalid"),
    }  # fmt: skip
    for key, (on, why, *code) in refused.items():
        if on:
            raise RequestError(400, f"{key}: {why}", param=key, code=(code or ["unsupported"])[0])
    tools = raw.get("tools") or None  # as sent: the template renders what the agent wrote
    return {"messages": [template_message(m, i) for i, m in enumerate(raw["messages"])], "tools": tools,
            "max_tokens": max_tokens, "stop": stop, "parse_tools": tools is not None and parsed.tool_choice != "none",
            "logprobs": bool(parsed.logprobs), "top_logprobs": top, "stream": bool(parsed.stream),
            "usage": bool(parsed.stream and parsed.stream_options and parsed.stream_options.include_usage)}  # fmt: skip


def template_message(message: dict, index: int = 0) -> dict:
    """A message as chat templates read it (vLLM's server's conversion): content a string (text parts joined by
    newlines), "developer" as "system", tool calls' arguments parsed. RequestError for another role or content."""
    content, where = message.get("content"), f"messages[{index}]"
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(400, f"{where}: only text content parts", param=where, code="unsupported_content")
        content = "\n".join(p["text"] for p in content)
    if message["role"] not in ROLES:
        raise RequestError(400, f"{where}: a message with a role of {', '.join(ROLES)}", param=where, code="invalid")
    out = {"role": "system" if message["role"] == "developer" else message["role"], "content": content or ""}
    for c in message.get("tool_calls") or []:  # the arguments parsed from their JSON (as sent when not JSON)
        with contextlib.suppress(ValueError, RecursionError):  # RecursionError: nested past Python's depth
            c = {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        out.setdefault("tool_calls", []).append({"id": c["id"], "type": "function", "function": c["function"]})
    return {**out, **{key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)}}


def normalised(message: dict) -> tuple:
    """What two messages must share for one to stand for the other (not the call ids the endpoint made)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or [])  # fmt: skip
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id"), message.get("name")


def assistant_message(text: str, finish: str, parse_tools: bool, special_tokens: list[str], call_ids="call") -> dict:
    """{"message", "finish_reason"} of the sampled text (without the eos; its special tokens left out). With tools,
    Hermes calls (multi_turn's parser) become tool_calls as vLLM's hermes parser makes them: content the text before
    the first (null if none), finish_reason "tool_calls", ids call_ids_<i>; one that does not parse: all content."""
    calls = multi_turn.parse_tool_calls(text) if parse_tools else []
    for token in special_tokens:
        text = text.replace(token, "")
    if not calls or any("error" in c for c in calls):
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish}
    tool_calls = [{"id": f"{call_ids}_{i}", "type": "function",
                   "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                  for i, c in enumerate(calls)]  # fmt: skip
    message = {"role": "assistant", "content": text[: text.find("<tool_call>")] or None, "tool_calls": tool_calls}
    return {"message": message, "finish_reason": "tool_calls" if finish == "stop" else finish}


# ------------------------------------------------------------------------------------ the episodes' workers
def episode_workers(settings: dict) -> multi_turn.WorkerPool:
    """The rank's episode workers (multi_turn.WorkerPool); a command's runs one episode, then is killed with it."""
    served = json.dumps([settings["path"], settings["name"], settings["command"]])
    return multi_turn.WorkerPool([sys.executable, os.path.abspath(__file__), "--serve-episodes", served],
                                 workers=settings["num_workers"], timeout=settings["timeout"], where="a worker",
                                 keys=("reward", "error"), reuse=not settings["command"])  # fmt: skip


def serve_episodes(path: str | None, name: str, command: str | None) -> None:
    """An episode worker (WorkerPool's): loads the agent, then runs each episode ({"id", "base_url", "row"}, its
    OPENAI_BASE_URL and OPENAI_API_KEY set), answering {"id", "reward" (None: the run's scorer's), "error"}."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # do nothing here: the rank decides when to stop
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN, which the agent's subprocesses would inherit
    jobs, answers, loaded = multi_turn.worker_pipes(lambda: None if command else load_episode(path, name))
    (function, openai), worker, client = loaded or (None, None), os.getpid(), None
    for line in jobs:
        job = json.loads(line)
        os.environ.update(OPENAI_BASE_URL=job["base_url"], OPENAI_API_KEY=API_KEY)
        if command:
            reward, error = run_command(command, job["row"])
        else:  # the function, given an openai.OpenAI client bound to the episode (no retries: a refusal raises)
            if client is None or client.is_closed():  # one client, its connections reused (unless an episode closed it)
                client = openai.OpenAI(base_url="http://127.0.0.1", api_key=API_KEY, max_retries=0)
            try:
                reward = function(client.with_options(base_url=job["base_url"]), job["row"])
                ok = isinstance(reward, numbers.Real) and math.isfinite(reward)  # a float, an int, numpy's
                reward, error = (float(reward), None) if ok else (None, f"returned {str(reward)[:200]!r}, not a number")
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: the episode failed, the worker goes on
                reward, error = None, f"raised {type(e).__name__}: {str(e)[:500]}"
        if os.getpid() != worker:  # a process the episode forked came back here: it never answers
            os._exit(0)
        answers.write(json.dumps({"id": job["id"], "reward": reward, "error": error}) + "\n")
        answers.flush()


def run_command(command: str, row: dict) -> tuple:
    """(reward, error) of rollout.agent.command (/bin/sh; the row a JSON line on stdin and in $FLATGRPO_ROW): all it
    prints, a number (nothing: None); exiting non-zero (stderr's last line) or printing anything else, an error."""
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as file, tempfile.TemporaryFile() as err:
        print(json.dumps(row, default=str), file=file, flush=True)
        file.seek(0)
        process = subprocess.Popen(command, shell=True, stdin=file, stdout=subprocess.PIPE, stderr=err,
                                   env={**os.environ, "FLATGRPO_ROW": file.name})  # fmt: skip
        printed = process.stdout.read(4096).decode("utf-8", "replace").strip()
        while process.stdout.read(1 << 16):  # the rest, dropped
            pass
        err.seek(max(0, err.seek(0, 2) - 4096))
        said = (err.read().decode("utf-8", "replace").strip().splitlines() or [""])[-1][:300]
    if process.wait():
        return None, f"exited with status {process.returncode}" + (f": {said}" if said else "")
    with contextlib.suppress(ValueError):
        if not printed or math.isfinite(float(printed)):  # nothing, or a number
            return float(printed) if printed else None, None
    return None, f"printed {printed[:200]!r}, not a reward (a number, or nothing: the run's scorer)"


def load_episode(path: str, name: str) -> tuple:
    """(The agent file's function `name`, taking (client, row); the openai module); AgentError (one line) otherwise."""
    where = f"rollout.agent.path {path}"
    function = getattr(multi_turn.load_file(path, where, AgentError), name, None)
    if not callable(function):
        raise AgentError(f"{where}: defines no function {name!r} (rollout.agent.name)")
    try:
        inspect.signature(function).bind(None, None)
    except (TypeError, ValueError):
        raise AgentError(f"{where}: {name}() must take two arguments, (client, row)") from None
    return function, importlib.import_module("openai")  # its client's module, imported here, once


if __name__ == "__main__":  # an episode worker: python agent.py --serve-episodes '[path, name, command]'
    if sys.argv[1:2] == ["--serve-episodes"]:
        serve_episodes(*json.loads(sys.argv[2]))
