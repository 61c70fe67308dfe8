"""Bring your agent: any agent program that speaks the OpenAI API, trained token for token. During generation each
rank serves an OpenAI-compatible endpoint in front of its own vLLM engine; the agent's episodes run in worker
processes against it, and every token the engine samples for them is recorded. veRL's agent loop with an outside
agent (its RemoteAgentLoop proxy), TRL's rollout_func. Imports the standard library and multi_turn.py (its worker
pool and Hermes parser; vllm, torch and openai where they are used): copy the two files anywhere.

    # my_agent.py: one function; given a client bound to its episode and a data row, it returns the episode's reward
    def episode(client, row):
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=row["prompt"])     # stream=True works too
        return 1.0 if "#### " + row["ground_truth"] in (reply.choices[0].message.content or "") else 0.0

    python grpo.py --config tiny.yaml rollout.agent.path=my_agent.py      # grpo.choose_parts: parts(cfg)
    python grpo.py --config tiny.yaml rollout.agent.command="sh examples/gsm8k_calculator_agent.sh"   # any program

A command runs once per episode (serve_episodes): OPENAI_BASE_URL and OPENAI_API_KEY in its environment, the row as
one JSON line on its stdin and in the file $FLATGRPO_ROW; it may print its reward (a number: all it prints), else
the run's scorer scores its last assistant message. It is killed, with what it started, when its episode ends.

The endpoint. http://127.0.0.1:PORT/<episode id>/v1: POST chat/completions (stream: true too), GET models. The URL
names the episode (as veRL's proxy does): every request is matched to its episode by that id, never by order. A
request is read and validated by vLLM's own OpenAI model (ChatCompletionRequest), rendered with the model's chat
template (its tools= too, data.apply_chat_template_kwargs, add_generation_prompt) and tokenised on its own HTTP
thread; ONE thread (the rank's own, in run_episodes) calls the engine, step by step: a request joins the running
batch at the next step (vLLM's continuous batching, as its server does), so no request waits on another's
rendering. Samples follow the run's settings (rollout.temperature, top_p, top_k: not the request's); Hermes tool
calls in the output become OpenAI tool_calls (multi_turn's parser); the reply, built with vLLM's response models,
says which policy version sampled it (model_version); an agent that asks for logprobs gets vLLM's, the very ones
recorded.

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
one that raises, exits, hangs past rollout.agent.timeout (its worker killed), floods (more than
rollout.agent.max_requests requests), prints what is not a reward, or sends a request the endpoint refuses (an
OpenAI-style error: an unknown model, n > 1, a huge message, malformed JSON, tools the template cannot render). A
request longer than the context can hold on its length alone (characters > tokens allowed x the longest token's
characters) is refused before it is tokenised. docs/features.md.
"""

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
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

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
        kind = {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}
        self.status = status
        self.body = {"error": {"message": message, "type": kind.get(status, "invalid_request_error"), "param": param,
                               "code": code}}  # fmt: skip


# ----------------------------------------------------------------------------------------- the loop's part
def parts(cfg: dict):
    """The loop's parts for rollout.agent.path or .command (grpo.choose_parts), after check_settings:
    scored_samples (an episode of the agent per sample, grpo.sample_and_score's signature) and field_metrics."""
    check_settings(cfg)
    return SimpleNamespace(scored_samples=sampler(cfg), field_metrics=field_metrics)


def check_settings(cfg: dict) -> None:
    """One line (AgentError) before anything loads: what an agent's run cannot serve (its episodes score themselves
    and may give a prompt more than n samples, which only GRPO's advantage groups by episode), the agent file (it
    must import in a worker and define the function) or command (its program must exist), and a fixed port that
    cannot be bound."""
    settings, algorithm = cfg["rollout"]["agent"], cfg["algorithm"]
    refused = {
        "rollout.multi_turn.enable": cfg["rollout"]["multi_turn"]["enable"],
        "custom_reward_function.path": cfg["custom_reward_function"]["path"] and not settings["command"],
        "algorithm.filter_groups.enable": algorithm["filter_groups"]["enable"],
        "reward.overlong_buffer.enable": cfg["reward"]["overlong_buffer"]["enable"],
        "algorithm.use_kl_in_reward": algorithm["use_kl_in_reward"],
        f"algorithm.adv_estimator={algorithm['adv_estimator']}": algorithm["adv_estimator"] != "grpo",
        "rollout.agent.path with rollout.agent.command": settings["path"] and settings["command"],
    }
    for key, on in refused.items():
        if on:
            raise AgentError(
                f"config: {key} is not served with an agent (the episodes score themselves, and an episode may give "
                "several samples, which only GRPO's advantage groups by episode); set it off"
            )
    if settings["command"]:
        try:
            program = shlex.split(settings["command"])[0]
        except (ValueError, IndexError) as e:
            raise AgentError(f"rollout.agent.command {settings['command']!r}: not a command ({e})") from None
        if shutil.which(program) is None and not os.path.isfile(program):
            raise AgentError(f"rollout.agent.command: no program {program!r} (not on PATH, not a file)")
    else:
        if not os.path.isfile(settings["path"]):
            raise AgentError(f"rollout.agent.path {settings['path']}: no such file")
        pool = episode_workers({**settings, "num_workers": 1})
        try:
            pool.wait_started()  # ToolSetupError: the worker's line (load_episode's) says why
        finally:
            pool.close()
    if settings["port"]:
        port = settings["port"] + int(os.environ.get("LOCAL_RANK", 0))
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        except OSError as e:
            raise AgentError(f"config: rollout.agent.port: 127.0.0.1:{port} cannot be bound ({e.strerror})") from None


def sampler(cfg: dict):
    """scored_samples(run, rows, t, *, n, temperature, top_p, top_k, max_tokens, seed) -> (samples, rewards [N],
    extras): n episodes of each row, run by the agent against this rank's endpoint (both started at the first call,
    kept for the run), each giving one sample or more (AgentSample), each sample its episode's reward (a command
    that prints none: run.parts.score's on its last assistant message). t["gen"]: their wall time."""
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
            state["workers"] = episode_workers(settings)
        sampling, version = dict(temperature=temperature, top_p=top_p, top_k=top_k), policy_version(run, rows)
        episodes = [
            Episode(k, row, budget=max_tokens, seed=seed, stride=len(rows) * n, sampling=sampling, version=version)
            for k, row in enumerate(row for row in rows for _ in range(n))
        ]
        run_episodes(state["endpoint"], episodes, state["workers"])
        score = lambda row, text: run.parts.score(row, text, run.cfg["reward"])[0]  # noqa: E731
        samples = [s for e in episodes for s in e.finish(state["endpoint"], score)]
        t["gen"], t["reward"] = time.perf_counter() - start, 0.0
        return samples, torch.tensor([s.reward for s in samples], dtype=torch.float32), [{} for _ in samples]

    scored_samples.state = state  # the endpoint (its batch_sizes) and the workers, once started
    return scored_samples


def policy_version(run, rows: list) -> int:
    """The version of the weights that sample these rows: the step whose update made them (0: model.path). Rollout
    ranks say what they hold (run.policy_version: at staleness k, batch s is sampled by step s - 1 - j's, j <= k);
    on a rank's own engine, training batch s (run.gen_cursor = s) is sampled by step s - 1's weights, and validation
    after step s (rows of run.val_rows) by step s's."""
    if hasattr(run, "policy_version"):
        return run.policy_version
    validating = any(row is rows[0] for row in run.val_rows)
    return getattr(run, "gen_cursor", 0) - (not validating)


def field_metrics(fields: dict) -> dict:
    """agent/* over the global batch (fields: each row field's values of every rank, metrics.batch_metrics), per
    episode: error_rate (ended with reward 0: raised, exited, timed out, refused, flooded, returned or printed no
    number), timeout_rate, refused_rate (a request refused, flooding included), split_rate (more than one sample),
    calls_per_episode (requests answered), samples_per_episode; dropped_lines (a count: lines of the episodes'
    workers that were no answer of theirs, dropped)."""
    episodes = max(1, sum(fields["episode_starts"]))
    return {
        "agent/error_rate": sum(fields["episode_errors"]) / episodes,
        "agent/timeout_rate": sum(fields["episode_timeouts"]) / episodes,
        "agent/refused_rate": sum(fields["episode_refusals"]) / episodes,
        "agent/split_rate": sum(fields["episode_splits"]) / episodes,
        "agent/calls_per_episode": sum(fields["num_calls"]) / episodes,
        "agent/samples_per_episode": len(fields["episode_starts"]) / episodes,
        "agent/dropped_lines": sum(fields["episode_dropped_lines"]),
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
    calls: list[dict] = field(default_factory=list)  # {"call", "prompt_ids", "sampled_ids", "logprobs", "finish",
    text: str = ""  # the content of its last call's answer                             "model_version"}
    truncated: bool = False
    reward: float = 0.0
    outcome: dict = field(default_factory=dict)  # the episode's: error, timeout, refused, samples, dropped
    history: tuple = ()  # (messages + the answer, normalised; tools) of its last call: what a next call extends
    in_flight: int = 0  # its calls planned or being sampled (a call that extends it meanwhile starts a new sample)

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
            "episode_dropped_lines": ("row", counted * outcome["dropped"]),
            "agent_error": ("row", outcome["error"] or ""),
            "agent_calls": ("row", self.calls),
        }


class Episode:
    """One episode: its id (in its URL), its row, its samples, and what decides each call's tokens (plan, settle,
    record), under its lock (a call is planned on its HTTP thread, sampled and recorded on the engine's).
    k: i * n + j (episode j of row i); seed: the run's for this batch, or None; stride: the episodes of the batch;
    version: the policy version that samples it. Call 1 is seeded seed + k, call t > 1 seed + (t - 1) * stride + k:
    multi_turn.generate's seeds, so an agent that does what rollout.multi_turn does samples what it samples."""

    def __init__(self, k: int, row: dict, *, budget: int, seed: int | None, stride: int, sampling: dict, version=0):
        self.k, self.row, self.budget, self.seed, self.stride, self.sampling = k, row, budget, seed, stride, sampling
        self.id, self.version = f"{k}-{secrets.token_hex(8)}", version  # unguessable: none can address another's
        self.samples: list[AgentSample] = []
        self.calls = self.planned = self.requests = self.used = self.dropped = 0  # answered, planned; budget used
        self.reward, self.text, self.lock = None, "", threading.RLock()  # text: its last sampled answer's content
        self.error, self.timeout, self.refused, self.over = None, False, False, False

    def fail(self, error: str, refused: bool = False) -> None:
        """The episode has failed (its reward will be 0): the first reason is kept; later requests are refused."""
        with self.lock:
            self.error = self.error or error
            self.refused = self.refused or refused

    def plan(self, request: dict, tokenizer, limits: dict) -> dict:
        """What the episode's next call samples: {"sample" (the one it continues, reserved: in_flight; or None for a
        new one), "appended" (ids between the sample's tokens and the sampled ones), "prompt_ids", "seed"}. The call
        continues the sample whose last call it extends (that call's messages, its answer as returned, new messages;
        the longest such history), unless a call of that sample is planned or being sampled. Renders and tokenises
        (on the caller's thread); RequestError for a prompt the model cannot take or a template that cannot render
        it: a prompt whose characters alone exceed the tokens allowed x limits["longest"] (the longest token's
        characters) is refused untokenised, and appended text past the room left is cut there before tokenising."""
        messages, tools, kwargs = request["messages"], request["tools"], limits["template_kwargs"]
        seen = [normalised(m) for m in messages]
        with self.lock:
            extended = [s for s in self.samples if s.history[1] == tools and seen[: len(s.history[0])] == s.history[0]]
            sample = max((s for s in extended if not s.in_flight), key=lambda s: len(s.history[0]), default=None)
            longest = limits["max_prompt_length"] if not self.samples else limits["max_model_len"] - 1
            self.planned += 1  # call t of the episode
            seed = None if self.seed is None else self.seed + (self.planned - 1) * self.stride + self.k
            plan = {"sample": sample, "held": sample, "appended": [], "seed": seed}
            if sample is not None:
                sample.in_flight += 1
                room = min(
                    self.budget - self.used, limits["max_model_len"] - len(sample.prompt_ids + sample.response_ids)
                )
        try:
            if sample is not None:
                cut = (max(0, room) + 2) * limits["longest"]  # characters that give more ids than fit
                plan["appended"] = render_after_assistant(
                    tokenizer, messages[len(sample.history[0]) :], tools, kwargs, cut
                )
                if plan["appended"] is not None:
                    return plan
                self.release(plan)  # a template without an eos after the assistant turn: rendered from scratch
                plan.update(sample=None, appended=[])
            text = render_text(tokenizer, messages, tools, kwargs)
            ids = None if len(text) > longest * limits["longest"] else tokenizer(text, add_special_tokens=False)
            if ids is None or len(ids["input_ids"]) > longest:
                length = f"{len(text)} characters" if ids is None else f"{len(ids['input_ids'])} tokens"
                raise RequestError(
                    400,
                    f"This model's maximum context length is {limits['max_model_len']} tokens and an episode's first "
                    f"prompt may have {limits['max_prompt_length']} (data.max_prompt_length); your messages resulted "
                    f"in {length} (more than {longest} tokens)",
                    param="messages",
                    code="context_length_exceeded",
                )
            return {**plan, "prompt_ids": ids["input_ids"]}
        except BaseException:
            self.release(plan)
            raise

    def release(self, plan: dict) -> None:
        """The call no longer holds the sample it continues (answered, refused, or rendered from scratch)."""
        with self.lock:
            held = plan.pop("held", None)
            if held is not None:
                held.in_flight -= 1

    def settle(self, plan: dict, request: dict, limits: dict) -> None:
        """On the engine's thread, with the budget as it is now: the call's prompt (a continued sample's tokens and
        the appended ids, cut to the room left) and its max_tokens (what is left of the budget, the request's cap,
        the context)."""
        with self.lock:
            sample = plan["sample"]
            if sample is not None:
                room = min(
                    self.budget - self.used, limits["max_model_len"] - len(sample.prompt_ids + sample.response_ids)
                )
                plan["appended"] = plan["appended"][: max(0, room)]
                plan["prompt_ids"] = sample.prompt_ids + sample.response_ids + plan["appended"]
            left = self.budget - self.used - len(plan["appended"])
            cap = request["max_tokens"] or left
            plan["max_tokens"] = min(left, cap, limits["max_model_len"] - len(plan["prompt_ids"]))

    def record(self, request: dict, plan: dict, sampled: list[int], logprobs: list[float], answer: dict) -> None:
        """Call plan's tokens into its sample (a new one unless it continues one), and the call as the sample's history
        that a next call may extend. answer: the assistant message returned, with its finish reason."""
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
                sample.truncated = answer["finish_reason"] == "length"
                sample.calls.append({"call": self.calls, "prompt_ids": plan["prompt_ids"], "sampled_ids": sampled,
                                     "logprobs": logprobs, "finish": answer["finish_reason"],
                                     "model_version": self.version})  # fmt: skip
                said = [normalised(m) for m in request["messages"]] + [normalised(template_message(answer["message"]))]
                sample.history = (said, request["tools"])
            self.used += len(plan["appended"]) + len(sampled)
            self.text = sample.text if sampled else self.text

    def end(self, answer: dict) -> None:
        """Its worker's answer (multi_turn.WorkerPool's): a reward (None: a command that printed none), an error, a
        timeout or the worker's end (both failures); lines of its worker that were no answer are counted."""
        with self.lock:
            self.over, self.dropped = True, answer["dropped"]
            if answer.get("timeout"):
                self.timeout = True
                self.fail(f"timed out: {answer['failed']} (rollout.agent.timeout)")
            elif "failed" in answer:
                self.fail(f"exited: {answer['failed']}")
            elif answer["error"] is not None or not isinstance(answer["reward"], (float, type(None))):
                self.fail(str(answer["error"] or f"its worker answered {str(answer)[:200]}"))
            else:
                self.reward = answer["reward"]

    def finish(self, endpoint: "Endpoint", score) -> list[AgentSample]:
        """The episode's samples, each with its reward (0 after a failure; score(row, text) of its last sampled
        answer when it gave none) and its outcome; an episode that called nothing gets one sample without a
        response (its row's prompt), so that it still counts in its group."""
        if not self.samples:
            prompt = render(endpoint.tokenizer, self.row["prompt"], None, endpoint.limits["template_kwargs"])
            self.samples.append(AgentSample(prompt_ids=prompt, episode=self.k, first=True))
        reward = 0.0 if self.error is not None else self.reward
        reward = score(self.row, self.text) if reward is None else reward
        outcome = {"error": self.error, "timeout": self.timeout, "refused": self.refused, "samples": len(self.samples),
                   "dropped": self.dropped}  # fmt: skip
        for sample in self.samples:
            sample.reward, sample.outcome, sample.history = reward, outcome, ()  # (the history stays here)
        return self.samples


# ------------------------------------------------------------------------------------------ the endpoint
def run_episodes(endpoint: "Endpoint", episodes: list[Episode], workers: multi_turn.WorkerPool) -> None:
    """Runs every episode in the workers until each has ended (its worker's answer, a timeout, its end), serving its
    requests meanwhile: this thread, the engine's, takes the planned calls (endpoint.serve) whenever the endpoint's
    wake-up pipe is readable and steps the engine while calls are running (endpoint.step)."""
    endpoint.open(episodes)
    jobs = {workers.submit({"episode": e.id, "base_url": endpoint.url(e), "row": e.row}): e for e in episodes}
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
    """An OpenAI-compatible endpoint in front of one engine, on 127.0.0.1 (port 0: a free one, the OS's pick). Its
    HTTP threads read, plan and queue each chat-completions request (submit); run_episodes, on the calling thread,
    takes them (serve) into the engine's running batch and steps the engine (step) while the episodes run."""

    def __init__(self, llm, *, model: str, port: int, max_prompt_length: int, max_model_len: int,
                 max_requests: int, template_kwargs: dict | None):  # fmt: skip
        import vllm.entrypoints.openai.chat_completion.protocol  # noqa: F401  (imported once, here)

        self.llm, self.tokenizer, self.model = llm, llm.get_tokenizer(), model
        longest = max(map(len, self.tokenizer.get_vocab()))  # characters: a token's text has at most its raw form's
        self.limits = dict(max_prompt_length=max_prompt_length, max_model_len=max_model_len, max_requests=max_requests,
                           template_kwargs=template_kwargs, longest=longest)  # fmt: skip
        self.episodes, self.inbox, self.lock = {}, [], threading.Lock()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        self.running = {}  # the engine's request id -> each call being sampled
        self.added = 0  # calls given to the engine so far (their ids)
        self.batch_sizes = []  # the calls in each engine step (bench/agent_endpoint.py)
        try:
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        except OSError as e:
            raise AgentError(f"rollout.agent.port: 127.0.0.1:{port} cannot be bound ({e.strerror})") from None
        self.server.daemon_threads, self.server.endpoint = True, self
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="agent-endpoint").start()

    def url(self, episode: Episode) -> str:
        return f"http://127.0.0.1:{self.port}/{episode.id}/v1"

    def open(self, episodes: list[Episode]) -> None:
        with self.lock:
            self.episodes = {e.id: e for e in episodes}

    def close_episodes(self) -> None:
        """After run_episodes: every episode over; a call still queued or sampled is refused (episode_over)."""
        with self.lock:
            episodes, self.episodes = list(self.episodes.values()), {}
        for episode in episodes:
            episode.over = True
        self.serve()
        if self.running:  # the calls of episodes that ended meanwhile (timed out, exited): never answered
            self.llm.llm_engine.abort_request(list(self.running))
            for call in self.running.values():
                call["episode"].release(call["plan"])
                self._answer(call, _over(call["episode"]))
            self.running = {}

    def submit(self, episode_id: str, body: bytes | None) -> tuple[int, dict | list]:
        """An HTTP thread's request (body None: too large to read), on that thread: counted, read, planned (rendered
        and tokenised), queued for the engine's thread; returns (status, the reply or a stream's chunks) once
        answered. A refusal fails the episode (refused), but that of an episode that is over or has failed."""
        with self.lock:
            episode = self.episodes.get(episode_id)
        if episode is None:
            return 404, RequestError(404, f"no episode {episode_id!r} is running", code="unknown_episode").body
        with episode.lock:
            if episode.over or episode.error is not None:  # refused; its outcome stays
                return _over(episode).status, _over(episode).body
            episode.requests += 1
            if episode.requests > self.limits["max_requests"]:
                message = f"more than {self.limits['max_requests']} requests (rollout.agent.max_requests)"
                episode.fail(f"flooded: {message}", refused=True)
                return 429, RequestError(429, f"episode {episode.id}: {message}", code="too_many_requests").body
        try:
            if body is None:
                raise RequestError(413, f"a request body of more than {MAX_BODY} bytes", code="body_too_large")
            request = parse_request(body, self.model)
            call = {"episode": episode, "request": request, "done": threading.Event()}
            call["plan"] = episode.plan(request, self.tokenizer, self.limits)
        except Exception as e:  # a RequestError, or a request this code did not foresee: never the run's end
            return self._refuse(episode, e)
        with self.lock:
            self.inbox.append(call)
        os.write(self.wake_write, b".")
        call["done"].wait()
        return call["refusal"] if "refusal" in call else (200, self._reply(call))

    def serve(self) -> None:
        """On the engine's thread: every planned call joins the engine's running batch (step); that of an episode
        that is over is refused, one with no budget left answered with "length", unsampled."""
        try:
            while os.read(self.wake_read, 4096):  # drain the wake-ups (one byte per request)
                pass
        except BlockingIOError:
            pass
        with self.lock:
            calls, self.inbox = self.inbox, []
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        for call in calls:
            episode, request, plan = call["episode"], call["request"], call["plan"]
            try:
                with episode.lock:
                    if episode.over:
                        episode.release(plan)
                        self._answer(call, _over(episode))
                        continue
                    episode.settle(plan, request, self.limits)
                if plan["max_tokens"] <= 0:  # the budget is spent: "length", nothing sampled
                    self._finish(call, [], [], "length", "")
                    continue
                sampling = SamplingParams(n=1, max_tokens=plan["max_tokens"], seed=plan["seed"],
                                          logprobs=request["top_logprobs"], detokenize=bool(request["stop"]),
                                          stop=request["stop"], **episode.sampling)  # fmt: skip
                sampling.output_kind = RequestOutputKind.FINAL_ONLY  # one output per call, when it is done
                self.added += 1
                self.llm.llm_engine.add_request(f"agent-{self.added}", tokens_input(plan["prompt_ids"]), sampling)
            except Exception as e:  # a call this code did not foresee, the engine's own checks: refused, never the end
                episode.release(plan)
                self._answer(call, self._refuse(episode, e))
                continue
            self.running[f"agent-{self.added}"] = call

    def step(self) -> None:
        """One step of the engine (vLLM's continuous batching: every running call advances by a token, and a call
        queued since joins them); each finished call recorded and answered (_finish)."""
        self.batch_sizes.append(len(self.running))
        for output in self.llm.llm_engine.step():
            if output.finished:
                call, completion = self.running.pop(output.request_id), output.outputs[0]
                sampled = list(completion.token_ids)
                logprobs = [lp[token].logprob for token, lp in zip(sampled, completion.logprobs, strict=True)]
                if isinstance(completion.stop_reason, str):  # a stop string: vLLM's text ends before it
                    text = completion.text
                else:  # the text of the ids, without the eos (or stop token) that ended them
                    text = self.tokenizer.decode(sampled[:-1] if completion.finish_reason == "stop" else sampled)
                self._finish(call, sampled, logprobs, completion.finish_reason, text, completion.logprobs)

    def _finish(self, call, sampled, logprobs, finish, text, alternatives=None) -> None:
        """A call's end: its answer (assistant_message; its tool calls' ids unique in the episode: call_<call>_<i>)
        recorded in its episode, then built and sent on the call's own thread; unless the episode is over (its worker
        answered, timed out or ended while the call was sampled): then refused, and never recorded or trained."""
        episode, request = call["episode"], call["request"]
        with episode.lock:
            episode.release(call["plan"])
            if episode.over:
                return self._answer(call, _over(episode))
            number = episode.calls + 1  # this call's, once recorded
            special = self.tokenizer.all_special_tokens
            answer = assistant_message(text, finish, request["parse_tools"], special, call_ids=f"call_{number}")
            episode.record(request, call["plan"], sampled, logprobs, answer)
        call.update(number=number, answer=answer, sampled=sampled, logprobs=logprobs, alternatives=alternatives)
        call["done"].set()

    def _reply(self, call: dict) -> dict | list[dict]:
        """The chat completion of a recorded call, with vLLM's OpenAI models: a ChatCompletionResponse, or (stream)
        the ChatCompletionStreamResponse chunks OpenAI streams: the role (and the log-probs asked for), the content in
        pieces, each tool call whole, the finish reason, the usage (stream_options.include_usage). Both say what was
        recorded, and carry model_version: the policy version that sampled it."""
        from vllm.entrypoints.generate.base.protocol import DeltaToolCall
        from vllm.entrypoints.openai.chat_completion import protocol as api

        request, answer, episode = call["request"], call["answer"], call["episode"]
        head = dict(id=f"chatcmpl-{episode.id}-{call['number']}", model=self.model, model_version=episode.version)
        prompt, sampled = len(call["plan"]["prompt_ids"]), len(call["sampled"])
        usage = api.UsageInfo(prompt_tokens=prompt, completion_tokens=sampled, total_tokens=prompt + sampled)
        logprobs = None
        if request["logprobs"]:
            content = self._token_logprobs(call["sampled"], call["alternatives"], request["top_logprobs"])
            logprobs = api.ChatCompletionLogProbs(content=content)
        message, finish = answer["message"], answer["finish_reason"]
        calls = [
            api.ToolCall(id=c["id"], function=api.FunctionCall(**c["function"])) for c in message.get("tool_calls", [])
        ]
        if not request["stream"]:
            said = api.ChatMessage(role="assistant", content=message["content"], tool_calls=calls)
            choice = api.ChatCompletionResponseChoice(index=0, message=said, logprobs=logprobs, finish_reason=finish)
            return api.ChatCompletionResponse(**head, choices=[choice], usage=usage).model_dump(exclude_none=True)
        deltas = [api.DeltaMessage(role="assistant", content="")]
        deltas += [api.DeltaMessage(content=piece) for piece in re.findall(r"\s*\S+|\s+", message["content"] or "")]
        deltas += [api.DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=c.id, type="function",
                                                                  function=c.function.model_dump())])
                   for i, c in enumerate(calls)]  # fmt: skip
        choices = [api.ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=None) for delta in deltas]
        choices[0].logprobs = logprobs
        choices.append(api.ChatCompletionResponseStreamChoice(index=0, delta=api.DeltaMessage(), finish_reason=finish))
        chunks = [api.ChatCompletionStreamResponse(**head, choices=[choice]) for choice in choices]
        chunks += [api.ChatCompletionStreamResponse(**head, choices=[], usage=usage)] if request["usage"] else []
        return [chunk.model_dump(exclude_none=True) for chunk in chunks]

    def _token_logprobs(self, sampled: list[int], alternatives: list[dict] | None, top: int) -> list[dict]:
        """OpenAI's choice.logprobs.content: per sampled token its text, vLLM's log-prob (the one recorded) and
        bytes, and the `top` most likely tokens at that place (vLLM's, by rank)."""

        def entry(token: int, logprob: float) -> dict:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, ranked in zip(sampled, alternatives or [], strict=True):
            best = sorted(ranked.items(), key=lambda item: item[1].rank)[:top]
            content.append({**entry(token, ranked[token].logprob),
                            "top_logprobs": [entry(t, lp.logprob) for t, lp in best]})  # fmt: skip
        return content

    @staticmethod
    def _refuse(episode: Episode, error: Exception) -> tuple[int, dict]:
        """A call's error (a RequestError's, or a 500 for one this code did not foresee); its episode has failed
        (refused). Returns (status, body)."""
        if not isinstance(error, RequestError):
            message = f"the endpoint could not serve the request: {type(error).__name__}: {str(error)[:300]}"
            error = RequestError(500, message, code="internal_error")
        episode.fail(f"refused ({error.status}): {error}", refused=True)
        return error.status, error.body

    @staticmethod
    def _answer(call: dict, refusal) -> None:
        """Answer a call with a refusal (a RequestError, or (status, body))."""
        call["refusal"] = (refusal.status, refusal.body) if isinstance(refusal, RequestError) else refusal
        call["done"].set()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "flatgrpo"}]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _over(episode: Episode) -> RequestError:
    """The refusal of a request of an episode that is over or has failed (400): its outcome stays."""
    reason = "is over" if episode.error is None else f"has failed: {episode.error}"
    return RequestError(400, f"episode {episode.id} {reason}", code="episode_over")


class Handler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive, as the openai client expects): POST /<episode>/v1/chat/completions (Endpoint.submit,
    on this thread), answered as JSON or, streamed, as server-sent events ("data: <chunk>" each, then "data:
    [DONE]"); GET /v1/models (also under /<episode>). Anything else: an OpenAI-style 404."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) != 4 or parts[1:] != ["v1", "chat", "completions"]:
            self._drain()
            return self._send(*self._not_found())
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:  # such a body is never read (its episode is told: 413), so the connection ends
            self.close_connection = True
        status, reply = self.server.endpoint.submit(parts[0], None if length > MAX_BODY else self.rfile.read(length))
        if isinstance(reply, list):
            events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in reply) + "data: [DONE]\n\n"
            return self._send(status, events.encode(), "text/event-stream")
        self._send(status, reply)

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

    def _send(self, status: int, body: dict | bytes, kind: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client is gone (a worker killed mid-request)
            self.close_connection = True

    def log_message(self, *args):  # no access log on the console
        pass


# ------------------------------------------------------------------------------------------- requests
def parse_request(body: bytes, model: str) -> dict:
    """A chat-completions request's body, read and validated by vLLM's own OpenAI model (ChatCompletionRequest, as
    its server reads it) -> {"messages" (for the chat template), "tools" (as sent, or None), "max_tokens" (or
    None), "stop" (list or None), "parse_tools", "logprobs" (bool), "top_logprobs" (0-20), "stream", "usage"};
    RequestError (OpenAI's status and wording) for what the endpoint refuses: what vLLM's model refuses, a model
    other than `model`, n > 1, a tool_choice that forces a call, a response format other than text, a logit bias
    (these three would change what is sampled: the samples must be the policy's), the deprecated functions, audio,
    content that is not text, a malformed message. temperature, top_p, seed, penalties and vLLM's sampling fields
    are accepted and ignored: the samples are the run's policy's (rollout.temperature, top_p, top_k)."""
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
        raise RequestError(
            404, f"The model `{parsed.model}` does not exist; this endpoint serves `{model}` (GET /v1/models)",
            param="model", code="model_not_found",
        )  # fmt: skip
    extra, kind = parsed.model_extra or {}, getattr(parsed.response_format, "type", "text")
    refused = {  # key: (refused, why)
        "n": (
            parsed.n not in (None, 1),
            f"n = {parsed.n}: one completion per request (an episode's calls are its samples)",
        ),
        "tool_choice": (parsed.tool_choice not in ("auto", "none"), f"{parsed.tool_choice!r}: accepted auto, none"),
        "response_format": (kind != "text", f"{kind!r}: text only (a format would constrain the sampling)"),
        "logit_bias": (
            bool(parsed.logit_bias),
            "a logit bias would change what is sampled; the samples are the policy's",
        ),
        "functions": (bool(extra.get("functions")), "deprecated in the API: send tools"),
        "function_call": (bool(extra.get("function_call")), "deprecated in the API: send tools and tool_choice"),
        "audio": (bool(extra.get("audio")), "text only"),
        "modalities": (extra.get("modalities") not in (None, ["text"]), "text only"),
    }
    for key, (on, why) in refused.items():
        if on:
            raise RequestError(400, f"{key}: {why}", param=key, code="unsupported")
    top, stop = parsed.top_logprobs or 0, [parsed.stop] if isinstance(parsed.stop, str) else parsed.stop or None
    max_tokens = next((m for m in (parsed.max_completion_tokens, vars(parsed)["max_tokens"]) if m is not None), None)
    if not parsed.messages:
        raise RequestError(400, "messages: a non-empty list of messages", param="messages", code="invalid_messages")
    invalid = {  # key: (invalid, the accepted values)
        "top_logprobs": (not 0 <= top <= 20, f"{top}: an integer 0-20, with logprobs true"),
        "stop": (stop is not None and not all(stop), "non-empty strings"),
        "max_tokens": (max_tokens is not None and max_tokens < 1, f"{max_tokens}: an integer >= 1"),
    }
    for key, (on, accepted) in invalid.items():
        if on:
            raise RequestError(400, f"{key}: {accepted}", param=key, code="invalid")
    tools = raw.get("tools") or None  # as sent: the template renders what the agent wrote
    return {
        "messages": [template_message(m, i) for i, m in enumerate(raw["messages"])],
        "tools": tools,
        "max_tokens": max_tokens,
        "stop": stop,
        "parse_tools": tools is not None and parsed.tool_choice != "none",
        "logprobs": bool(parsed.logprobs),
        "top_logprobs": top,
        "stream": bool(parsed.stream),
        "usage": bool(parsed.stream and parsed.stream_options and parsed.stream_options.include_usage),
    }


def template_message(message, index: int = 0) -> dict:
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
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and isinstance(c["function"].get("name"), str) for c in calls):  # fmt: skip
        raise RequestError(400, f"{where}: malformed tool_calls", param=where, code="invalid")
    if calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {"name": c["function"]["name"],
                              "arguments": _arguments(c["function"].get("arguments"))}} for c in calls]  # fmt: skip
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _arguments(arguments):
    """A tool call's arguments for the template: the JSON string parsed (as vLLM does), or as sent if not JSON;
    '{"expression": "1+2"}' -> {"expression": "1+2"}."""
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


def render_after_assistant(tokenizer, messages: list[dict], tools, template_kwargs, cut=None) -> list[int] | None:
    """The ids that follow an assistant turn (which ends with eos) for the messages after it, through the next
    generation prompt: the chat template's text for [user, assistant, *messages], from the eos after the assistant's
    content on (its first `cut` characters), tokenised once (multi_turn.tool_response_ids, for any messages). None
    when the template does not end an assistant turn with eos (the call is then rendered from scratch)."""
    marker = "flatgrpo-assistant-turn"
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}, *messages]
    text = render_text(tokenizer, history, tools, template_kwargs)
    end = text.find(tokenizer.eos_token, text.find(marker) + len(marker))
    if marker not in text or end < 0:
        return None
    return tokenizer(text[end + len(tokenizer.eos_token) :][:cut], add_special_tokens=False)["input_ids"]


def assistant_message(text: str, finish: str, parse_tools: bool, special_tokens: list[str], call_ids="call") -> dict:
    """The choice a call returns: {"message": {"role", "content", "tool_calls"?}, "finish_reason"}. text: the sampled
    ids decoded with their special tokens, without the eos that ended them. With tools (tool_choice not none), Hermes
    calls (multi_turn.parse_tool_calls) become tool_calls as vLLM's hermes parser makes them: content the text before
    the first <tool_call> (null if none), finish_reason "tool_calls", each call's id call_ids + "_<i>"; a call that
    does not parse leaves the whole text as content, unparsed. Special tokens are left out of the content (vLLM's
    skip_special_tokens)."""
    calls = multi_turn.parse_tool_calls(text) if parse_tools else []
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


# ------------------------------------------------------------------------------------ the episodes' workers
def episode_workers(settings: dict) -> multi_turn.WorkerPool:
    """The rank's episode workers (multi_turn.WorkerPool: the tool pool's design), rollout.agent.num_workers of them,
    each episode within rollout.agent.timeout: `python agent.py --serve-episodes [path, name, command]`
    (serve_episodes). An agent file's worker imports it once and runs one episode after another; a command's runs
    one, then is killed with whatever the command left running."""
    served = json.dumps([settings["path"], settings["name"], settings["command"]])
    what = (
        f"rollout.agent.command {settings['command']!r}"
        if settings["command"]
        else f"rollout.agent.path {settings['path']}"
    )
    return multi_turn.WorkerPool(
        [sys.executable, os.path.abspath(__file__), "--serve-episodes", served],
        workers=settings["num_workers"],
        timeout=settings["timeout"],
        where=f"{what}: a worker",
        keys=("reward", "error"),
        reuse=not settings["command"],
    )


def serve_episodes(path: str | None, name: str, command: str | None) -> None:
    """An episode worker (WorkerPool): loads the agent (load_episode, or a command's runner: run_command), says
    {"ready": true}, then runs each episode read as a JSON line {"id", "episode", "base_url", "row"} and answers
    {"id", "reward" (a float, or None: the run's scorer decides), "error" (None, or what went wrong)}, with
    OPENAI_BASE_URL and OPENAI_API_KEY set for it. A process the episode forked that returns from it ends there,
    silently: only the worker answers, and only it reads the next job. SIGTERM and SIGINT do nothing here (the rank
    decides when the run stops; the worker is killed with SIGKILL); what the agent starts gets their default
    handling back."""
    jobs, answers = multi_turn.worker_pipes()
    worker = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)  # a handler, not SIG_IGN, which the agent's subprocesses would inherit
    try:
        run = run_command(command) if command else run_function(load_episode(path, name))
    except (AgentError, ImportError) as e:
        answers.write(f"{e}\n")
        answers.flush()
        return
    answers.write('{"ready": true}\n')
    answers.flush()
    for line in jobs:
        job = json.loads(line)
        os.environ.update(OPENAI_BASE_URL=job["base_url"], OPENAI_API_KEY=API_KEY)
        reward, error = run(job)
        if os.getpid() != worker:  # a process the episode forked came back here: it never answers
            os._exit(0)
        answers.write(json.dumps({"id": job["id"], "reward": reward, "error": error}) + "\n")
        answers.flush()


def run_function(function):
    """run(job) -> (reward, error) of an agent file's function: it gets an openai.OpenAI client bound to the
    episode's URL (no retries: a refused request raises at once) and the row, and returns a finite number."""
    import openai

    clients = [openai.OpenAI(base_url="http://127.0.0.1", api_key=API_KEY, max_retries=0)]  # its connections reused

    def run(job: dict) -> tuple:
        if clients[0].is_closed():  # an episode closed its client
            clients[0] = openai.OpenAI(base_url="http://127.0.0.1", api_key=API_KEY, max_retries=0)
        try:
            reward = function(clients[0].with_options(base_url=job["base_url"]), job["row"])
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the episode failed, the worker goes on
            return None, f"raised {type(e).__name__}: {str(e)[:500]}"
        if isinstance(reward, numbers.Real) and math.isfinite(reward):  # a float, an int, numpy's
            return float(reward), None
        return None, f"returned {str(reward)[:200]!r}, not a number (an episode returns its reward)"

    return run


def run_command(command: str):
    """run(job) -> (reward, error) of rollout.agent.command: the command (/bin/sh) with the row as one JSON line on
    its stdin and in the file $FLATGRPO_ROW; its reward is what it prints, a number (nothing: None, the run's
    scorer's). Exiting non-zero, or printing anything else, is an error. Its output is read as it comes (the first
    4 KiB of stdout kept, the last line of stderr), so that no amount of it can fill this process."""

    def run(job: dict) -> tuple:
        with tempfile.NamedTemporaryFile("w+", suffix=".json") as row:
            row.write(json.dumps(job["row"], default=str) + "\n")
            row.flush()
            row.seek(0)
            process = subprocess.Popen(command, shell=True, stdin=row, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       env={**os.environ, "FLATGRPO_ROW": row.name})  # fmt: skip
            out, err = _outputs(process)
        printed = out.decode("utf-8", "replace").strip()
        if process.returncode:
            last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            return None, f"exited with status {process.returncode}: {last[0][:300]}".rstrip(": ")
        try:
            reward = float(printed) if printed else None
        except ValueError:
            reward = math.nan
        if reward is not None and not math.isfinite(reward):
            return None, f"printed {printed[:200]!r}, not a reward (a number, or nothing: the run's scorer)"
        return reward, None

    return run


def _outputs(process: subprocess.Popen, keep: int = 4096) -> tuple[bytes, bytes]:
    """What a process writes until it ends: the first `keep` bytes of its stdout and the last of its stderr (what
    a process it left running writes later is not waited for)."""
    kept = {process.stdout.fileno(): b"", process.stderr.fileno(): b""}
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and (process.poll() is None or selector.select(0)):
            for key, _ in selector.select(0.1):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                elif key.fd == process.stdout.fileno():
                    kept[key.fd] = (kept[key.fd] + chunk)[:keep]
                else:
                    kept[key.fd] = (kept[key.fd] + chunk)[-keep:]
    process.wait()
    return kept[process.stdout.fileno()], kept[process.stderr.fileno()]


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


def _ignore(signum, frame) -> None:
    pass


if __name__ == "__main__":  # an episode worker: python agent.py --serve-episodes '[path, name, command]'
    if sys.argv[1:2] == ["--serve-episodes"]:
        serve_episodes(*json.loads(sys.argv[2]))
