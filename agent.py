"""Bring your agent: an agent written against the OpenAI API, trained token for token. During generation each rank
serves an OpenAI-compatible endpoint in front of its own vLLM engine; the agent's episodes run in worker processes,
each with an `openai.OpenAI` client bound to its own URL, and every token the engine samples for them is recorded.
veRL's agent loop with an outside agent (its RemoteAgentLoop proxy), TRL's rollout_func. Imports the standard library
(vllm, torch and openai where they are used; a worker imports this file and needs none but openai): copy it anywhere.

    # my_agent.py: one function; given a client bound to its episode and a data row, it returns the episode's reward
    def episode(client, row):
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=row["prompt"])
        return 1.0 if "#### " + row["ground_truth"] in (reply.choices[0].message.content or "") else 0.0

    python grpo.py --config tiny.yaml rollout.agent.path=my_agent.py      # grpo.choose_parts: parts(cfg)

The endpoint. http://127.0.0.1:PORT/<episode id>/v1: POST chat/completions, GET models. The URL names the episode
(as veRL's proxy does): every request is matched to its episode by that id, never by order. Handler threads only
queue a request; ONE thread (the rank's own, in run_episodes) calls the engine, step by step: a request joins the
running batch at the next step (vLLM's continuous batching, as its server does). A request is rendered with the
model's chat template (its tools= too, and data.apply_chat_template_kwargs, add_generation_prompt), sampled with the
run's settings (rollout.temperature, top_p, top_k: not the request's), and Hermes tool calls in the output become
OpenAI tool_calls; an agent that asks for logprobs gets vLLM's, the very ones recorded.

Token for token. Each call's prompt ids, sampled ids and vLLM's log-probs are recorded. A later call whose messages
are a sample's last call's messages, plus the assistant message the endpoint returned to it, plus new messages
(compared normalised: role, content, tool calls' names and parsed arguments), continues that sample: its prompt is
the sample so far + the chat template's ids for the new messages alone (the text after the assistant turn's eos,
tokenised once, as multi_turn.tool_response_ids does), never re-rendered. Any other call (the agent rewrote or
trimmed its history, changed its tools, or sent it while that sample's call was being sampled) is rendered from
scratch and starts a new sample of the same episode, with its reward: a split, counted (agent/split_rate), never
aligned by guesswork.

    episode:   call 1                 call 2 (extends call 1)                    call 3 (rewrote history: a split)
    sample 0:  [prompt 1][sampled 1]  [tool message ids][sampled 2]
    mask:       ---------  1 1 1 1 1   0 0 0 0 0 0 0 0   1 1 1 1
    sample 1:                                                                     [prompt 3, rendered][sampled 3]

The budget: data.max_response_length per episode, over every token after a sample's prompt (sampled and appended);
a call's max_tokens is what is left, a call with nothing left is answered with finish_reason "length" unsampled, and
appended ids that do not fit are cut there. Hostile episodes end with reward 0 and are counted, and the run goes on:
one that raises, exits its process, hangs past rollout.agent.timeout (its worker killed), floods (more than
rollout.agent.max_requests requests), or sends a request the endpoint refuses (an OpenAI-style error: an unknown
model, n > 1, streaming, a huge message, malformed JSON, tools the template cannot render). docs/features.md.
"""

import functools
import http.server
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # Hermes, as multi_turn.py (veRL's parser)
MODELS = re.compile(r"(/[^/]+)?/v1/models(/(?P<model>.+))?/?")  # GET [/<episode>]/v1/models[/<id>]
API_KEY = "flatgrpo"  # any key: the endpoint checks none (it listens on 127.0.0.1 only)
MAX_BODY = 32 * 2**20  # bytes of one request's body; a larger one is refused (413) before it is read
ROLES = ("system", "developer", "user", "assistant", "tool")


class AgentError(ValueError):
    """An agent file, setting or port the run cannot use; the message is one line."""


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        kind = {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}
        self.status = status
        self.body = {"error": {"message": message, "type": kind.get(status, "invalid_request_error"), "param": param,
                               "code": code}}  # fmt: skip


# ----------------------------------------------------------------------------------------- the loop's part
def parts(cfg: dict, parts, group_advantages):
    """The step's parts for rollout.agent.path (grpo.choose_parts), after check_settings: scored_samples (n episodes
    of each row by the agent file, one sample each, grpo.sample_and_score's signature: the episode's last, which
    validation scores; the samples before it, where the agent rewrote its history, travel with it), sample_groups
    (the default's, each episode's earlier samples before its last in its group: episode_groups), advantages (GRPO's
    over episodes: episode_advantages with group_advantages, losses.grpo_advantages) and field_metrics (agent/*)."""
    check_settings(cfg)
    parts.scored_samples, parts.field_metrics = sampler(cfg), field_metrics
    parts.sample_groups = episode_groups(parts.sample_groups)
    parts.advantages = functools.partial(episode_advantages, group_advantages=group_advantages)
    return parts


def episode_groups(sample_groups):
    """The step's sample_groups with each episode's samples all in its group, in the episode's order: the samples
    before its last (AgentSample.earlier) put before it, each with the episode's reward."""

    def every_sample(run, prompts: list[dict], t: dict) -> list[dict]:
        import torch

        groups = sample_groups(run, prompts, t)
        for group in groups:
            last = group["samples"]
            group["samples"] = [s for sample in last for s in (*sample.earlier, sample)]
            counts = torch.tensor([len(sample.earlier) + 1 for sample in last])  # [n]: each episode's samples
            group["rewards"] = group["rewards"].repeat_interleave(counts)
            group["extras"] = [e for s, e in zip(last, group["extras"], strict=True) for _ in range(len(s.earlier) + 1)]
        return groups

    return every_sample


def episode_advantages(run, batch: dict, group_advantages) -> dict:
    """adv for an agent's rows: GRPO's advantage of each episode (group_advantages: losses.grpo_advantages, over the
    episodes of each prompt, batch["uid"]), an episode of several rows (which share its reward) counting once, then
    given to each of its rows and broadcast over its tokens of the response mask: batch["advantages"] [B, R] (veRL's
    multi-trajectory groups). batch["episode"] [B]: each row's episode, i * n + j for episode j of prompt i."""
    first_row = {}  # episode -> its first row
    for k, episode in enumerate(batch["episode"].tolist()):
        first_row.setdefault(episode, k)
    rows = list(first_row.values())
    norm = run.cfg["algorithm"]["norm_adv_by_std_in_grpo"]
    per_episode = group_advantages(batch["rewards"][rows], batch["uid"][rows].tolist(), norm_by_std=norm)  # [E]
    index = {episode: i for i, episode in enumerate(first_row)}
    per_row = per_episode[[index[episode] for episode in batch["episode"].tolist()]]  # [B]
    batch["advantages"] = per_row[:, None] * batch["response_mask"]  # [B, R]
    return {}


def check_settings(cfg: dict) -> None:
    """One line (AgentError) before anything loads: what an agent's run cannot serve (its episodes score themselves
    and may give a prompt more than n samples, which only GRPO's advantage groups by episode), the agent file (it
    must import in a worker and define the function), and a fixed port that cannot be bound."""
    settings, algorithm = cfg["rollout"]["agent"], cfg["algorithm"]
    refused = {
        "rollout.multi_turn.enable": cfg["rollout"]["multi_turn"]["enable"],
        "custom_reward_function.path": cfg["custom_reward_function"]["path"],
        "algorithm.filter_groups.enable": algorithm["filter_groups"]["enable"],
        "reward.overlong_buffer.enable": cfg["reward"]["overlong_buffer"]["enable"],
        "algorithm.use_kl_in_reward": algorithm["use_kl_in_reward"],
        f"algorithm.adv_estimator={algorithm['adv_estimator']}": algorithm["adv_estimator"] != "grpo",
    }
    for key, on in refused.items():
        if on:
            raise AgentError(
                f"config: {key} is not served with rollout.agent.path (the episodes score themselves, and an episode "
                "may give several samples, which only GRPO's advantage groups by episode); set it off"
            )
    EpisodeWorkers.check(settings["path"], settings["name"])
    if settings["port"]:
        port = settings["port"] + int(os.environ.get("LOCAL_RANK", 0))
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        except OSError as e:
            raise AgentError(f"config: rollout.agent.port: 127.0.0.1:{port} cannot be bound ({e.strerror})") from None


def sampler(cfg: dict):
    """scored_samples(run, rows, t, *, n, temperature, top_p, top_k, max_tokens, seed) -> (samples, rewards [N],
    extras): n episodes of each row, run by the agent file's function against this rank's endpoint (both started at
    the first call, kept for the run), each giving one sample or more (AgentSample): its last, with its episode's
    reward, the ones before it in its .earlier. t["gen"]: their wall time (the episodes score themselves:
    t["reward"] is 0)."""
    settings, data = cfg["rollout"]["agent"], cfg["data"]
    state = {}

    def scored_samples(run, rows, t, *, n, temperature, top_p, top_k, max_tokens, seed):
        import torch

        start = time.perf_counter()
        if not state:
            state["endpoint"] = Endpoint(
                run.llm,
                model=cfg["model"]["path"],
                port=settings["port"] + int(os.environ.get("LOCAL_RANK", 0)) if settings["port"] else 0,
                max_prompt_length=data["max_prompt_length"],
                max_model_len=data["max_prompt_length"] + data["max_response_length"],
                max_requests=settings["max_requests"],
                template_kwargs=data["apply_chat_template_kwargs"],
            )
            state["workers"] = EpisodeWorkers(
                settings["path"], settings["name"], workers=settings["num_workers"], timeout=settings["timeout"]
            )
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        episodes = [
            Episode(k, row, budget=max_tokens, seed=seed, stride=len(rows) * n, sampling=sampling)
            for k, row in enumerate(row for row in rows for _ in range(n))
        ]
        state["endpoint"].run_episodes(episodes, state["workers"])
        samples = []  # each episode's last sample, the ones before it in its .earlier
        for episode in episodes:
            *earlier, last = episode.finish(state["endpoint"])
            last.earlier = earlier
            samples.append(last)
        t["gen"], t["reward"] = time.perf_counter() - start, 0.0
        return samples, torch.tensor([s.reward for s in samples], dtype=torch.float32), [{} for _ in samples]

    scored_samples.state = state  # the endpoint (its batch_sizes) and the workers, once started
    return scored_samples


def field_metrics(fields: dict) -> dict:
    """agent/* over the global batch (fields: each row field's values of every rank, metrics.batch_metrics), per
    episode: error_rate (ended with reward 0: raised, exited, timed out, refused, flooded, returned no number),
    timeout_rate, refused_rate (a request refused, flooding included), split_rate (more than one sample),
    calls_per_episode (requests answered), samples_per_episode."""
    episodes = max(1, sum(fields["episode_starts"]))
    return {
        "agent/error_rate": sum(fields["episode_errors"]) / episodes,
        "agent/timeout_rate": sum(fields["episode_timeouts"]) / episodes,
        "agent/refused_rate": sum(fields["episode_refusals"]) / episodes,
        "agent/split_rate": sum(fields["episode_splits"]) / episodes,
        "agent/calls_per_episode": sum(fields["num_calls"]) / episodes,
        "agent/samples_per_episode": len(fields["episode_starts"]) / episodes,
    }


# ------------------------------------------------------------------------------------------------ episodes
@dataclass
class AgentSample:
    """One sample of an episode (rollout.Sample's fields, and the calls it holds): its prompt and every token after
    it, the sampled ones with mask 1 and vLLM's log-probs, the appended ones (the chat template's ids for the
    messages between calls) with mask 0 and log-prob 0."""

    prompt_ids: list[int]
    episode: int  # i * n + j: episode j of this rank's row i
    first: bool  # the episode's first sample (its metrics are counted there)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)  # {"call", "prompt_ids", "sampled_ids", "logprobs", "finish"}
    text: str = ""  # the content of its last call's answer
    truncated: bool = False
    reward: float = 0.0
    outcome: dict = field(default_factory=dict)  # the episode's: error, timeout, refused, splits
    history: tuple = ()  # (messages + the answer, normalised; tools) of its last call: what a next call extends
    in_flight: int = 0  # its calls being sampled (a call that extends it meanwhile starts a new sample)
    earlier: list = field(default_factory=list)  # the episode's samples before this one, its last (agent.sampler)

    @property
    def fields(self) -> dict:
        """The batch fields it carries (fsdp_train.add_fields): the loss mask narrows the response mask; its episode;
        per sample its calls (recorded for the dumps) and the episode's counts (on its first sample)."""
        counted, outcome = int(self.first), self.outcome
        return {
            "response_mask": ("response", self.loss_mask),
            "episode": ("row", self.episode),
            "num_calls": ("row", len(self.calls)),
            "episode_starts": ("row", counted),
            "episode_errors": ("row", counted * int(outcome["error"] is not None)),
            "episode_timeouts": ("row", counted * int(outcome["timeout"])),
            "episode_refusals": ("row", counted * int(outcome["refused"])),
            "episode_splits": ("row", counted * int(outcome["samples"] > 1)),
            "agent_error": ("row", outcome["error"] or ""),
            "agent_calls": ("row", self.calls),
        }


class Episode:
    """One episode: its id (in its URL), its row, its samples, and what decides each call's tokens (plan, record).
    k: i * n + j (episode j of row i); seed: the run's for this batch, or None; stride: the episodes of the batch.
    Call 1 is seeded seed + k, call t > 1 seed + (t - 1) * stride + k: multi_turn.generate's seeds, so an agent
    that does what rollout.multi_turn does samples what it samples."""

    def __init__(self, k: int, row: dict, *, budget: int, seed: int | None, stride: int, sampling: dict):
        self.k, self.row, self.budget, self.seed, self.stride, self.sampling = k, row, budget, seed, stride, sampling
        self.id = f"{k}-{secrets.token_hex(8)}"  # unguessable: no episode can address another's
        self.samples: list[AgentSample] = []
        self.calls = self.planned = self.requests = self.used = 0  # calls answered, planned; requests; budget used
        self.reward = None
        self.error, self.timeout, self.refused, self.over = None, False, False, False

    def fail(self, error: str, refused: bool = False) -> None:
        """The episode has failed (its reward will be 0): the first reason is kept; later requests are refused."""
        self.error = self.error or error
        self.refused = self.refused or refused

    def plan(self, request: dict, tokenizer, limits: dict) -> dict:
        """What the episode's next call samples: {"sample" (the one it continues, or None for a new one), "appended"
        (ids between the sample's tokens and the sampled ones), "prompt_ids", "max_tokens", "seed"}. The call continues
        the sample whose last call it extends (that call's messages, its answer as returned, new messages; the longest
        such history), unless a call of that sample is still being sampled. RequestError for a prompt the model cannot
        take or a template that cannot render it."""
        messages, tools = request["messages"], request["tools"]
        seen = [normalised(m) for m in messages]
        extended = [s for s in self.samples if s.history[1] == tools and seen[: len(s.history[0])] == s.history[0]]
        sample = max((s for s in extended if not s.in_flight), key=lambda s: len(s.history[0]), default=None)
        appended = None
        if sample is not None:
            new = messages[len(sample.history[0]) :]
            appended = render_after_assistant(tokenizer, new, tools, limits["template_kwargs"])
        if appended is not None:  # the same sample, token for token
            room = min(self.budget - self.used, limits["max_model_len"] - len(sample.prompt_ids + sample.response_ids))
            appended = appended[: max(0, room)]
            prompt_ids = sample.prompt_ids + sample.response_ids + appended
        else:  # the first call, or a history the endpoint did not write: rendered from scratch
            sample, prompt_ids = None, render(tokenizer, messages, tools, limits["template_kwargs"])
            longest = limits["max_prompt_length"] if not self.samples else limits["max_model_len"] - 1
            if len(prompt_ids) > longest:
                raise RequestError(
                    400,
                    f"This model's maximum context length is {limits['max_model_len']} tokens and an episode's first "
                    f"prompt may have {limits['max_prompt_length']} (data.max_prompt_length); your messages resulted "
                    f"in {len(prompt_ids)} tokens",
                    param="messages",
                    code="context_length_exceeded",
                )
        left = self.budget - self.used - len(appended or [])
        cap = request["max_tokens"] or left
        max_tokens = min(left, cap, limits["max_model_len"] - len(prompt_ids))
        self.planned += 1
        t = self.planned  # call t of the episode
        seed = None if self.seed is None else self.seed + (t - 1) * self.stride + self.k
        return {"sample": sample, "appended": appended or [], "prompt_ids": prompt_ids, "max_tokens": max_tokens,
                "seed": seed}  # fmt: skip

    def record(self, request: dict, plan: dict, sampled: list[int], logprobs: list[float], answer: dict) -> None:
        """Call plan's tokens into its sample (a new one unless it continues one), and the call as the sample's history
        that a next call may extend. answer: the assistant message returned, with its finish reason."""
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
            sample.truncated = answer["finish_reason"] == "length"
            sample.calls.append({"call": self.calls, "prompt_ids": plan["prompt_ids"], "sampled_ids": sampled,
                                 "logprobs": logprobs, "finish": answer["finish_reason"]})  # fmt: skip
            said = [normalised(m) for m in request["messages"]] + [normalised(template_message(answer["message"], 0))]
            sample.history = (said, request["tools"])
        self.used += len(plan["appended"]) + len(sampled)

    def finish(self, endpoint: "Endpoint") -> list[AgentSample]:
        """The episode's samples, each with its reward (0 after a failure) and its outcome; an episode that called
        nothing gets one sample without a response (its row's prompt), so that it still counts in its group."""
        if not self.samples:
            prompt = render(endpoint.tokenizer, self.row["prompt"], None, endpoint.limits["template_kwargs"])
            self.samples.append(AgentSample(prompt_ids=prompt, episode=self.k, first=True))
        reward = 0.0 if self.error is not None else self.reward
        outcome = {"error": self.error, "timeout": self.timeout, "refused": self.refused, "samples": len(self.samples)}
        for sample in self.samples:
            sample.reward, sample.outcome, sample.history = reward, outcome, ()  # (the history stays here)
        return self.samples


# ------------------------------------------------------------------------------------------ the endpoint
class Endpoint:
    """An OpenAI-compatible endpoint in front of one engine, on 127.0.0.1 (port 0: a free one, the OS's pick). Its
    HTTP threads queue each chat-completions request (submit); run_episodes, on the calling thread, takes them
    (serve) into the engine's running batch and steps the engine (step) while the episodes run in their workers."""

    def __init__(self, llm, *, model: str, port: int, max_prompt_length: int, max_model_len: int,
                 max_requests: int, template_kwargs: dict | None):  # fmt: skip
        self.llm, self.tokenizer, self.model = llm, llm.get_tokenizer(), model
        self.limits = dict(max_prompt_length=max_prompt_length, max_model_len=max_model_len, max_requests=max_requests,
                           template_kwargs=template_kwargs)  # fmt: skip
        self.episodes, self.inbox, self.lock = {}, [], threading.Lock()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        self.running = {}  # the engine's request id -> (call, episode, request, plan) of each call being sampled
        self.added = 0  # calls given to the engine so far (their ids)
        self.batch_sizes = []  # the calls in each engine step (bench/agent_endpoint.py)
        try:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        except OSError as e:
            raise AgentError(f"rollout.agent.port: 127.0.0.1:{port} cannot be bound ({e.strerror})") from None
        self.server.daemon_threads, self.server.endpoint = True, self
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="agent-endpoint").start()

    def url(self, episode: "Episode") -> str:
        return f"http://127.0.0.1:{self.port}/{episode.id}/v1"

    def submit(self, episode_id: str, body: bytes | None) -> tuple[int, dict]:
        """An HTTP thread's request (body None: too large to read), queued for the engine's thread; returns its
        (status, body) once answered."""
        call = {"episode": episode_id, "body": body, "done": threading.Event()}
        with self.lock:
            if episode_id not in self.episodes:
                return 404, RequestError(404, f"no episode {episode_id!r} is running", code="unknown_episode").body
            self.inbox.append(call)
        os.write(self.wake_write, b".")
        call["done"].wait()
        return call["status"], call["answer"]

    def run_episodes(self, episodes: list[Episode], workers: "EpisodeWorkers") -> None:
        """Runs every episode in the workers, answering their requests until each has ended."""
        with self.lock:
            self.episodes = {e.id: e for e in episodes}
        try:
            workers.run([(e, self.url(e)) for e in episodes], self)
        finally:
            with self.lock:
                self.episodes = {}
            self.serve()  # what is still queued: refused (404: no episode runs)
            if self.running:  # the calls of episodes that ended meanwhile (timed out, exited): never answered
                self.llm.llm_engine.abort_request(list(self.running))
                for call, episode, _, _ in self.running.values():
                    refusal = _over(call, episode)
                    self._answer(call, refusal.status, refusal.body)
                self.running = {}

    def serve(self) -> None:
        """Take every queued request: a refused one is answered at once, the others join the engine's running batch
        (step)."""
        try:
            while os.read(self.wake_read, 4096):  # drain the wake-ups (one byte per request)
                pass
        except BlockingIOError:
            pass
        with self.lock:
            calls, self.inbox = self.inbox, []
        todo = []  # (call, episode, request, plan)
        for call in calls:
            episode = self.episodes.get(call["episode"])
            try:
                if episode is None or episode.over or episode.error is not None:  # refused; its outcome stays
                    refusal = _over(call, episode)
                    self._answer(call, refusal.status, refusal.body)
                    continue
                episode.requests += 1
                if episode.requests > self.limits["max_requests"]:
                    message = f"more than {self.limits['max_requests']} requests (rollout.agent.max_requests)"
                    episode.fail(f"flooded: {message}", refused=True)
                    raise RequestError(429, f"episode {episode.id}: {message}", code="too_many_requests")
                if call["body"] is None:
                    raise RequestError(413, f"a request body of more than {MAX_BODY} bytes", code="body_too_large")
                request = parse_request(call["body"], self.model)
                plan = episode.plan(request, self.tokenizer, self.limits)
            except Exception as e:  # a RequestError, or a request this code did not foresee: never the run's end
                self._refuse(call, episode, e)
                continue
            if plan["max_tokens"] <= 0:  # the budget is spent: "length", nothing sampled
                self._reply(call, episode, request, plan, [], [], "length", "")
            else:
                todo.append((call, episode, request, plan))
        if todo:
            from vllm import SamplingParams
            from vllm.inputs import tokens_input
            from vllm.sampling_params import RequestOutputKind

            params = [
                SamplingParams(n=1, max_tokens=plan["max_tokens"], seed=plan["seed"], logprobs=request["top_logprobs"],
                               detokenize=bool(request["stop"]), stop=request["stop"], **episode.sampling)
                for _, episode, request, plan in todo
            ]  # fmt: skip
            for (call, episode, request, plan), sampling in zip(todo, params, strict=True):
                self.added += 1
                request_id = f"agent-{self.added}"  # the engine's id of this call
                sampling.output_kind = RequestOutputKind.FINAL_ONLY  # one output per call, when it is done
                try:
                    self.llm.llm_engine.add_request(request_id, tokens_input(plan["prompt_ids"]), sampling)
                except Exception as e:  # the engine's own checks: this call refused, the run goes on
                    self._refuse(call, episode, e)
                    continue
                self.running[request_id] = (call, episode, request, plan)
                if plan["sample"] is not None:
                    plan["sample"].in_flight += 1

    def step(self) -> None:
        """One step of the engine (vLLM's continuous batching: every running call advances by a token, and a call
        queued since joins them); each finished call answered and recorded in its episode, unless that is over."""
        self.batch_sizes.append(len(self.running))
        for output in self.llm.llm_engine.step():
            if output.finished:
                call, episode, request, plan = self.running.pop(output.request_id)
                if plan["sample"] is not None:
                    plan["sample"].in_flight -= 1
                if episode.over:  # timed out or exited while sampled: nothing recorded
                    refusal = _over(call, episode)
                    self._answer(call, refusal.status, refusal.body)
                    continue
                completion = output.outputs[0]
                sampled = list(completion.token_ids)
                logprobs = [lp[token].logprob for token, lp in zip(sampled, completion.logprobs, strict=True)]
                asked = request["logprobs"]  # the agent asked for them (and top_logprobs alternatives)
                content = self._token_logprobs(sampled, completion.logprobs, request["top_logprobs"]) if asked else []
                if isinstance(completion.stop_reason, str):  # a stop string: vLLM's text ends before it
                    text = completion.text
                else:  # the text of the ids, without the eos (or stop token) that ended them
                    text = self.tokenizer.decode(sampled[:-1] if completion.finish_reason == "stop" else sampled)
                self._reply(call, episode, request, plan, sampled, logprobs, completion.finish_reason, text, content)

    def _reply(self, call, episode, request, plan, sampled, logprobs, finish, text="", content=()) -> None:
        """The chat completion of a call (assistant_message of its text; its tool calls' ids unique in the episode:
        call_<call>_<i>), recorded in its episode, sent; content: the sampled tokens' log-probs when asked for
        (request["logprobs"], _token_logprobs)."""
        number = episode.calls + 1  # this call's, once recorded
        special = self.tokenizer.all_special_tokens
        answer = assistant_message(text, finish, request["parse_tools"], special, call_ids=f"call_{number}")
        episode.record(request, plan, sampled, logprobs, answer)
        body = {
            "id": f"chatcmpl-{episode.id}-{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, **answer,
                         "logprobs": {"content": list(content), "refusal": None} if request["logprobs"] else None}],
            "usage": {"prompt_tokens": len(plan["prompt_ids"]), "completion_tokens": len(sampled),
                      "total_tokens": len(plan["prompt_ids"]) + len(sampled)},
        }  # fmt: skip
        self._answer(call, 200, body)

    def _token_logprobs(self, sampled: list[int], engine_logprobs: list[dict], top: int) -> list[dict]:
        """OpenAI's choice.logprobs.content: per sampled token its text, vLLM's log-prob (the one recorded) and
        bytes, and the `top` most likely tokens at that place (vLLM's, by rank)."""

        def entry(token: int, logprob: float) -> dict:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, alternatives in zip(sampled, engine_logprobs, strict=True):
            ranked = sorted(alternatives.items(), key=lambda item: item[1].rank)[:top]
            content.append({**entry(token, alternatives[token].logprob),
                            "top_logprobs": [entry(t, lp.logprob) for t, lp in ranked]})  # fmt: skip
        return content

    @staticmethod
    def _refuse(call: dict, episode: "Episode | None", error: Exception) -> None:
        """Answer a call with its error (a RequestError's, or a 500 for one this code did not foresee); its episode
        has failed (refused)."""
        if not isinstance(error, RequestError):
            message = f"the endpoint could not serve the request: {type(error).__name__}: {str(error)[:300]}"
            error = RequestError(500, message, code="internal_error")
        if episode is not None and episode.error is None:
            episode.fail(f"refused ({error.status}): {error}", refused=True)
        Endpoint._answer(call, error.status, error.body)

    @staticmethod
    def _answer(call: dict, status: int, body: dict) -> None:
        call["status"], call["answer"] = status, body
        call["done"].set()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "flatgrpo"}]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _over(call: dict, episode: "Episode | None" = None) -> RequestError:
    """The refusal of a request of an episode that is not running (404), is over or has failed (400)."""
    if episode is None:
        return RequestError(404, f"episode {call['episode']} is not running", code="episode_over")
    reason = "is over" if episode.error is None else f"has failed: {episode.error}"
    return RequestError(400, f"episode {call['episode']} {reason}", code="episode_over")


class Handler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive, as the openai client expects): POST /<episode>/v1/chat/completions, queued for the engine
    (Endpoint.submit); GET /v1/models (also under /<episode>), answered here. Anything else: an OpenAI-style 404."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) != 4 or parts[1:] != ["v1", "chat", "completions"]:
            self._drain()
            return self._send(*self._not_found())
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:  # such a body is never read (its episode is told: 413), so the connection ends
            self.close_connection = True
        self._send(*self.server.endpoint.submit(parts[0], None if length > MAX_BODY else self.rfile.read(length)))

    def do_GET(self):
        route, endpoint = MODELS.fullmatch(self.path.split("?")[0]), self.server.endpoint
        if route is None:
            return self._send(*self._not_found())
        if route["model"] is None:
            return self._send(200, endpoint.models())
        if route["model"] == endpoint.model:
            return self._send(200, endpoint.models()["data"][0])
        error = RequestError(404, f"The model `{route['model']}` does not exist.", "model", "model_not_found")
        self._send(404, error.body)

    def _not_found(self) -> tuple[int, dict]:
        message = (
            f"no route {self.command} {self.path}; this endpoint serves /<episode>/v1/chat/completions, /v1/models"
        )
        return 404, RequestError(404, message, code="not_found").body

    def _drain(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
        else:
            self.rfile.read(length)

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client is gone (a worker killed mid-request)
            self.close_connection = True

    def log_message(self, *args):  # no access log on the console
        pass


# ------------------------------------------------------------------------------------------- requests
def parse_request(body: bytes, model: str) -> dict:
    """A chat-completions request's body -> {"messages" (for the chat template), "tools" (list or None),
    "max_tokens" (or None), "stop" (list or None), "parse_tools", "logprobs" (bool), "top_logprobs" (0-20)};
    RequestError (OpenAI's status and wording) for what the endpoint refuses: not JSON, a model other than `model`,
    n > 1, streaming, a tool_choice that forces a call, a response format other than text, a logit bias (these three
    would change what is sampled: the samples must be the policy's), the deprecated functions, audio, content that
    is not text, a malformed message or tool. temperature, top_p, seed and penalties are accepted and ignored: the
    samples are the run's policy's (rollout.temperature, top_p, top_k). Any other field is ignored, as vLLM's server
    ignores it."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested past Python's depth
        raise RequestError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(request, dict):
        raise RequestError(400, "the request body is not a JSON object", code="invalid_request")
    if request.get("model") != model:
        raise RequestError(
            404, f"The model `{request.get('model')}` does not exist; this endpoint serves `{model}` (GET /v1/models)",
            param="model", code="model_not_found",
        )  # fmt: skip
    if request.get("stream"):
        raise RequestError(400, "streaming is not supported (stream: true)", param="stream", code="unsupported")
    if request.get("n") not in (None, 1):
        raise RequestError(
            400, f"n = {request.get('n')!r}: one completion per request (an episode's calls are its samples)",
            param="n", code="unsupported",
        )  # fmt: skip
    choice = request.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(400, f"tool_choice {choice!r}: accepted auto, none", param="tool_choice", code="unsupported")
    response_format = request.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if response_format is not None and kind != "text":
        raise RequestError(
            400, f"response_format {kind!r}: text only (a format would constrain the sampling)",
            param="response_format", code="unsupported",
        )  # fmt: skip
    refused = {
        "functions": "deprecated in the API: send tools",
        "function_call": "deprecated in the API: send tools and tool_choice",
        "logit_bias": "a logit bias would change what is sampled; the samples are the policy's",
        "audio": "text only",
    }
    for key, why in refused.items():
        if request.get(key):
            raise RequestError(400, f"{key}: {why}", param=key, code="unsupported")
    if request.get("modalities") not in (None, ["text"]):
        raise RequestError(400, f"modalities {request['modalities']!r}: text only", param="modalities",
                           code="unsupported")  # fmt: skip
    logprobs, top = request.get("logprobs"), request.get("top_logprobs")
    if not isinstance(logprobs, (bool, type(None))):
        raise RequestError(400, f"logprobs = {logprobs!r}: true or false", param="logprobs", code="invalid")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20 or not logprobs):
        raise RequestError(
            400, f"top_logprobs = {top!r}: an integer 0-20, with logprobs true", param="top_logprobs", code="invalid"
        )
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: a non-empty list of messages", param="messages", code="invalid_messages")
    tools = request.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(_is_tool(t) for t in tools)):
        raise RequestError(
            400, 'tools: a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}',
            param="tools", code="invalid_tools",
        )  # fmt: skip
    stop = request.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or None
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, "stop: a string or a list of strings", param="stop", code="invalid_stop")
    max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(400, f"max_tokens = {max_tokens!r}: an integer >= 1", param="max_tokens", code="invalid")
    return {
        "messages": [template_message(m, i) for i, m in enumerate(messages)],
        "tools": tools,
        "max_tokens": max_tokens,
        "stop": stop,
        "parse_tools": tools is not None and choice != "none",
        "logprobs": bool(logprobs),
        "top_logprobs": top or 0,
    }


def _is_tool(tool) -> bool:
    if not isinstance(tool, dict):
        return False
    function = tool.get("function")
    return tool.get("type") == "function" and isinstance(function, dict) and isinstance(function.get("name"), str)


def template_message(message, index: int) -> dict:
    """One OpenAI message as chat templates read it (vLLM's OpenAI server's conversion): content a string (text parts
    joined by newlines; null: ""), "developer" as "system", tool calls' arguments parsed from their JSON string (a
    template writes them as JSON again); tool_call_id and name kept. RequestError for anything else."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(400, f"{where}: a message with a role of {', '.join(ROLES)}", param=where, code="invalid")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(400, f"{where}: only text content parts", param=where, code="unsupported_content")
        content = "\n".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise RequestError(
            400, f"{where}: content must be a string or a list of text parts", param=where, code="invalid"
        )
    out = {"role": "system" if message["role"] == "developer" else message["role"], "content": content or ""}
    calls = message.get("tool_calls") or []
    if calls:
        if not isinstance(calls, list) or not all(_is_call(c) for c in calls):
            raise RequestError(400, f"{where}: malformed tool_calls", param=where, code="invalid")
        out["tool_calls"] = [_template_call(c) for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _is_call(call) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _template_call(call: dict) -> dict:
    """An OpenAI tool call as a chat template reads it: its JSON arguments parsed (as vLLM does), or as sent if not
    JSON; '{"expression": "1+2"}' -> {"expression": "1+2"}."""
    function = {"name": call["function"]["name"], "arguments": _arguments(call["function"].get("arguments"))}
    return {"id": call.get("id"), "type": "function", "function": function}


def _arguments(arguments):
    """A tool call's arguments for the template: the JSON string parsed (as vLLM does), or as sent if not JSON."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested past Python's depth
            return arguments
    return arguments if arguments is not None else {}


def normalised(message: dict) -> tuple:
    """What two messages must share for one to stand for the other: role, content, tool calls (name and parsed
    arguments), tool_call_id and name (a template may write them). Call ids the endpoint made are not compared."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or [])  # fmt: skip
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id"), message.get("name")


# --------------------------------------------------------------------------------- tokens in, tokens out
def render(tokenizer, messages: list[dict], tools: list | None, template_kwargs: dict | None) -> list[int]:
    """Messages (and tools) -> prompt ids: the chat template with add_generation_prompt (rollout.render_prompt),
    tokenised without adding special tokens: a template that writes the BOS gets one, never two."""
    return tokenizer(render_text(tokenizer, messages, tools, template_kwargs), add_special_tokens=False)["input_ids"]


def render_text(tokenizer, messages: list[dict], tools: list | None, template_kwargs: dict | None) -> str:
    """The chat template's text of messages (and tools) with the generation prompt; RequestError when the template
    cannot render them."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
    except Exception as e:  # jinja's errors, a template's raise_exception, a type it cannot add
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RequestError(
            400, f"the chat template cannot render the request: {message}", code="template_error"
        ) from None


def render_after_assistant(tokenizer, messages: list[dict], tools: list | None, template_kwargs) -> list[int] | None:
    """The ids that follow an assistant turn (which ends with eos) for the messages after it, through the next
    generation prompt: the chat template's text for [user, assistant, *messages], from the eos after the assistant's
    content on, tokenised once (multi_turn.tool_response_ids, for any messages). None when the template does not end
    an assistant turn with eos (the call is then rendered from scratch)."""
    marker = "flatgrpo-assistant-turn"
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}, *messages]
    text = render_text(tokenizer, history, tools, template_kwargs)
    end = text.find(tokenizer.eos_token, text.find(marker) + len(marker))
    if marker not in text or end < 0:
        return None
    return tokenizer(text[end + len(tokenizer.eos_token) :], add_special_tokens=False)["input_ids"]


def assistant_message(text: str, finish: str, parse_tools: bool, special_tokens: list[str], call_ids="call") -> dict:
    """The choice a call returns: {"message": {"role", "content", "tool_calls"?}, "finish_reason"}. text: the sampled
    ids decoded with their special tokens, without the eos that ended them. With tools (tool_choice not none), Hermes
    calls become tool_calls as vLLM's hermes parser makes them: content the text before the first <tool_call> (null if
    none), finish_reason "tool_calls", each call's id call_ids + "_<i>"; a call that does not parse leaves the whole
    text as content, unparsed. Special tokens are left out of the content (vLLM's skip_special_tokens)."""
    calls = parse_tool_calls(text) if parse_tools else []
    for token in special_tokens:
        text = text.replace(token, "")
    if not calls or any("error" in c for c in calls):
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish}
    content = text[: text.find("<tool_call>")]
    tool_calls = [
        {"id": f"{call_ids}_{i}", "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
        for i, c in enumerate(calls)
    ]  # fmt: skip
    finish = "tool_calls" if finish == "stop" else finish
    return {
        "message": {"role": "assistant", "content": content or None, "tool_calls": tool_calls},
        "finish_reason": finish,
    }


def parse_tool_calls(text: str) -> list[dict]:
    """Hermes tool calls in a turn's text, each {"name", "arguments"} or {"error"} (multi_turn.parse_tool_calls):
    only complete <tool_call>...</tool_call> pairs count, each JSON with a name and an object of arguments."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('expected {"name": "...", "arguments": {...}}')
            if not isinstance(call.get("arguments", {}), dict):
                raise ValueError("the arguments are not a JSON object")
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
        except (ValueError, RecursionError) as e:  # the policy's text: JSON nested past Python's depth too
            calls.append({"error": f"Invalid tool call: {e}"})
    return calls


# ------------------------------------------------------------------------------------ the episodes' workers
class EpisodeWorkers:
    """Runs episodes in worker processes, `workers` at once, each within `timeout` seconds, so that no agent can
    stall or end the run. Each worker is `python agent.py --serve-episodes '[path, name]'` (serve_episodes): the
    agent file imported once, then one episode at a time. An episode with no answer in time has its worker killed
    (SIGKILL) and replaced, and so has one whose worker ends (os._exit, a crash): either is a failed episode.
    Every answer names its episode: {"episode": id, "reward"} (or "error"); any other line (not JSON, another
    episode's, a second answer, a line while idle) is never taken for an answer: the worker is replaced, and the
    episode it runs, if any, has failed. Each worker is a session of its own, as multi_turn's tool workers are: a
    stop signal to the rank's process group (torchrun forwards its own so, a terminal's Ctrl-C) never reaches an
    episode, which the step still needs; killing a worker kills what its episode forked (its process group).
    Workers start STARTS_AT_ONCE at a time (many imports at once on a few cores would each take as many times as
    long), the first ones running episodes while the others start."""

    START_TIMEOUT = 60.0  # seconds for a worker to import the agent file and the openai client
    STARTS_AT_ONCE = max(2, (os.cpu_count() or 2) // 2)

    def __init__(self, path: str, name: str, *, workers: int, timeout: float):
        self.command = [sys.executable, os.path.abspath(__file__), "--serve-episodes", json.dumps([path, name])]
        self.where, self.wanted, self.timeout = f"rollout.agent.path {path}", workers, timeout
        self.idle, self.starting, self.busy = [], {}, {}  # starting: worker -> deadline; busy: -> (episode, deadline)
        self.unread = {}  # worker -> what it wrote past its last full line
        self.selector = None  # while episodes run: the workers' stdout and the endpoint's wake-up
        self._start_more()

    @classmethod
    def check(cls, path: str, name: str) -> None:
        """AgentError (one line) unless the agent file imports in a worker and defines the function."""
        if not os.path.isfile(path):
            raise AgentError(f"rollout.agent.path {path}: no such file")
        pool = cls(path, name, workers=1, timeout=0.0)
        (worker,) = pool.starting
        ready, deadline = selectors.DefaultSelector(), time.monotonic() + cls.START_TIMEOUT
        ready.register(worker.stdout, selectors.EVENT_READ)
        try:
            lines = []
            while lines == [] and ready.select(max(0.0, deadline - time.monotonic())):
                lines = pool._lines(worker)
            pool._started(worker, (lines or [""])[0])
        finally:
            ready.close()
            pool.close()

    def _start_more(self) -> None:
        """Start workers until there are `workers`, at most STARTS_AT_ONCE starting at a time."""
        while len(self.idle) + len(self.busy) + len(self.starting) < self.wanted:
            if len(self.starting) >= self.STARTS_AT_ONCE:
                return
            worker = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.starting[worker] = time.monotonic() + self.START_TIMEOUT
            if self.selector is not None:
                self.selector.register(worker.stdout, selectors.EVENT_READ, worker)

    def _started(self, worker: subprocess.Popen, line: str) -> None:
        """A starting worker's first line: ready (it becomes idle), or what went wrong (AgentError)."""
        del self.starting[worker]
        if line.strip() != '{"ready": true}':
            _kill(worker)
            message = line.strip() or f"no answer within {self.START_TIMEOUT:g} s"
            raise AgentError(f"{self.where}: a worker could not start: {message}")
        self.idle.append(worker)
        self._start_more()

    def run(self, jobs: list, endpoint: "Endpoint") -> None:
        """Runs each job (episode, base_url) in a worker until each episode has ended: its worker's answer sets its
        reward or error; a late one is killed (a timeout), one that ends is an error. Meanwhile the endpoint takes
        its queued requests whenever its wake-up pipe is readable (serve) and steps the engine while calls are
        running (step)."""
        self.selector = selectors.DefaultSelector()
        self.selector.register(endpoint.wake_read, selectors.EVENT_READ, None)
        for worker in self.idle + list(self.starting):
            self.selector.register(worker.stdout, selectors.EVENT_READ, worker)
        queue = list(jobs)
        try:
            while queue or self.busy:
                while queue and self.idle:
                    self._assign(self.idle.pop(0), *queue.pop(0))
                deadlines = [d for _, d in self.busy.values()] + list(self.starting.values())
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, _ in self.selector.select(0.0 if endpoint.running else wait):
                    if key.data is None:
                        endpoint.serve()
                    elif key.data in self.idle or key.data in self.busy or key.data in self.starting:
                        self._read(key.data)
                if endpoint.running:
                    endpoint.step()
                now = time.monotonic()
                for worker in [w for w, (_, deadline) in self.busy.items() if deadline <= now]:
                    episode = self.busy[worker][0]
                    episode.timeout = True
                    episode.fail(f"timed out: no answer within {self.timeout:g} s (rollout.agent.timeout)")
                    self._replace(worker)
                for worker in [w for w, deadline in self.starting.items() if deadline <= now]:
                    self._started(worker, "")  # AgentError: no answer within START_TIMEOUT
        finally:
            self.selector.close()
            self.selector = None

    def _assign(self, worker: subprocess.Popen, episode: Episode, base_url: str) -> None:
        job = {"episode": episode.id, "base_url": base_url, "row": episode.row}
        self.busy[worker] = (episode, time.monotonic() + self.timeout)
        try:
            worker.stdin.write((json.dumps(job, default=str) + "\n").encode())
            worker.stdin.flush()
        except BrokenPipeError:  # the worker is gone: its closed stdout says so (_read)
            pass

    def _lines(self, worker: subprocess.Popen) -> list[str] | None:
        """The full lines the worker has written since (read unbuffered: a part of a line waits for its rest and
        never blocks this thread); None once it has ended (its stdout closed)."""
        chunk = os.read(worker.stdout.fileno(), 1 << 16)
        if not chunk:
            return None
        *lines, self.unread[worker] = (self.unread.get(worker, b"") + chunk).split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]

    def _read(self, worker: subprocess.Popen) -> None:
        """A worker's lines: ready, its episode's answer, or its end (the process ended); anything else replaces it."""
        lines = self._lines(worker)
        if lines == []:
            return  # a part of a line
        if worker in self.starting:
            return self._started(worker, (lines or [""])[0])
        episode = self.busy[worker][0] if worker in self.busy else None
        if lines is None:  # os._exit, a crash, a signal; or an idle worker gone
            if episode is not None:
                episode.fail(f"exited: its process ended (exit status {worker.wait()}) without an answer")
            return self._replace(worker)
        answer = _answer(lines[0], episode)
        if answer is None or len(lines) > 1:  # not its episode's answer, or more than one line
            if episode is not None and answer is None:
                episode.fail(f"its worker wrote a line that is not the episode's answer: {lines[0][:200]!r}")
            return self._replace(worker)
        del self.busy[worker]
        episode.over = True
        if "error" in answer:
            episode.fail(answer["error"])
        else:
            episode.reward = answer["reward"]
        self.idle.append(worker)

    def _replace(self, worker: subprocess.Popen) -> None:
        """Kill a worker (late, ended, or writing what is not an answer: its episode is over) and start another in
        its place."""
        episode = self.busy.pop(worker, (None, 0.0))[0]
        if episode is not None:
            episode.over = True
        if worker in self.idle:
            self.idle.remove(worker)
        self.selector.unregister(worker.stdout)
        self.unread.pop(worker, None)
        _kill(worker)
        self._start_more()

    def close(self) -> None:
        """Ends the workers (they also end when this process does)."""
        for worker in self.idle + list(self.starting) + list(self.busy):
            _kill(worker)
        self.idle, self.starting, self.busy, self.unread, self.wanted = [], {}, {}, {}, 0


def _answer(line: str, episode: Episode | None) -> dict | None:
    """A worker's line as the answer of `episode` ({"episode": its id, "reward": a number} or {..., "error": text}),
    or None when it is not one."""
    try:
        answer = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's depth
        return None
    if episode is None or not isinstance(answer, dict) or answer.get("episode") != episode.id:
        return None
    if isinstance(answer.get("error"), str) or isinstance(answer.get("reward"), float):
        return answer
    return None


def _kill(worker: subprocess.Popen) -> None:
    """SIGKILL to a worker's process group (the worker and whatever its episode forked), then reap the worker."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
    worker.kill()  # (the group is the worker's own: start_new_session)
    worker.wait()
    for pipe in (worker.stdin, worker.stdout):
        try:
            pipe.close()
        except OSError:  # a job line it never read
            pass


def load_episode(path: str, name: str):
    """The agent file's function `name`, taking (client, row); AgentError (one line) otherwise."""
    where = f"rollout.agent.path {path}"
    spec = importlib.util.spec_from_file_location("_flatgrpo_agent", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # SystemExit too: a file that exits at import does not import
        raise AgentError(f"{where}: importing it raised {type(e).__name__}: {e}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise AgentError(f"{where}: defines no function {name!r} (rollout.agent.name)")
    try:
        inspect.signature(function).bind(None, None)
    except (TypeError, ValueError):
        raise AgentError(f"{where}: {name}() must take two arguments, (client, row)") from None
    return function


def serve_episodes(path: str, name: str) -> None:
    """An episode worker (EpisodeWorkers): imports the agent file, says {"ready": true}, then runs each episode read
    as a JSON line {"episode", "base_url", "row"}: the function gets an openai.OpenAI client bound to base_url (no
    retries: a refused request raises at once; OPENAI_BASE_URL and OPENAI_API_KEY are set too, for an agent that makes
    its own client) and the row, and its answer is a line {"episode", "reward"} or {"episode", "error"}. What the
    agent prints goes nowhere and what it reads is empty (the protocol keeps its own copies of stdin and stdout). A
    process the episode forked that returns from it (or raises) ends there, silently: only the worker answers, and
    only it reads the next job. SIGTERM and SIGINT do nothing here (the rank decides when the run stops; the worker
    is killed with SIGKILL); what the agent starts gets their default handling back."""
    _end_with_parent()
    worker = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)  # a handler, not SIG_IGN, which the agent's subprocesses would inherit
    jobs, answers = os.fdopen(os.dup(0), encoding="utf-8"), os.fdopen(os.dup(1), "w", encoding="utf-8")
    quiet = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(quiet, fd)
    try:
        function = load_episode(path, name)
        import openai
    except (AgentError, ImportError) as e:
        answers.write(f"{e}\n")
        answers.flush()
        return
    answers.write('{"ready": true}\n')
    answers.flush()
    shared = openai.OpenAI(base_url="http://127.0.0.1", api_key=API_KEY, max_retries=0)  # its connections reused
    for line in jobs:
        job = json.loads(line)
        os.environ.update(OPENAI_BASE_URL=job["base_url"], OPENAI_API_KEY=API_KEY)
        if shared.is_closed():  # an episode closed its client
            shared = openai.OpenAI(base_url="http://127.0.0.1", api_key=API_KEY, max_retries=0)
        client = shared.with_options(base_url=job["base_url"])
        try:
            reward = function(client, job["row"])
            if isinstance(reward, numbers.Real) and math.isfinite(reward):  # a float, an int, numpy's
                answer = {"reward": float(reward)}
            else:
                answer = {"error": f"returned {str(reward)[:200]!r}, not a number (an episode returns its reward)"}
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the episode failed, the worker goes on
            answer = {"error": f"raised {type(e).__name__}: {str(e)[:500]}"}
        if os.getpid() != worker:  # a process the episode forked came back here: it never answers
            os._exit(0)
        answers.write(json.dumps({"episode": job["episode"], **answer}) + "\n")
        answers.flush()


def _ignore(signum, frame) -> None:
    pass


def _end_with_parent() -> None:
    """Linux: this worker gets SIGKILL when the process that started it dies, even in the middle of an episode."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker ends at its next read (stdin closed)
        pass


if __name__ == "__main__":  # an episode worker: python agent.py --serve-episodes '[path, name]'
    if sys.argv[1:2] == ["--serve-episodes"]:
        serve_episodes(*json.loads(sys.argv[2]))
