"""Multi-turn rollouts with tools, veRL's tool agent loop (actor_rollout_ref.rollout.multi_turn.*): the model writes,
calls a tool in Hermes style, reads what the tool returned, writes again; only its own tokens are trained.
Imports vllm and transformers only, where they are used (a tool worker imports this file and needs neither): copy
it anywhere.

    tools = load_tools(None)  # {"calculator": calculator}; or a file of plain functions (function_tool_path)
    check_template(tokenizer, tools)  # the chat template must render tools= and tool messages
    pool = ToolPool(None, workers=4, timeout=5.0, max_chars=256, side="middle")  # the calls' worker processes
    trajectories = generate(llm, prompt_ids, n=8, temperature=1.0, max_tokens=256, seed=0, pool=pool,
                            settings=dict(max_assistant_turns=4, max_user_turns=None, max_parallel_calls=1))
    sample = sampler(cfg, rollout.render_prompt)  # the loop's part: rollout.generate's signature
    t = trajectories[0]
    t.response_ids  # every token after the prompt: the model's turns and the tool responses between them
    t.loss_mask     # 1 on the tokens the model sampled, 0 on the tool responses' tokens
    t.logprobs      # vLLM's log-prob of each sampled token; 0.0 on tool tokens
    t.turn_ids      # 1, 3, 5, ... on assistant turn 1, 2, 3; 2, 4, ... on the tool responses after turn 1, 2
    t.text          # the last assistant turn, decoded: what is scored
    t.fields        # the batch fields it carries (the loss mask, turn ids, counts, calls): fsdp_train.add_fields

Token in, token out. Each turn generates from the exact token ids so far (vLLM's prompt_token_ids); a tool response
enters as the token ids the chat template writes for it, tokenised once (tool_response_ids). The history is never
decoded and re-encoded, so the trainer scores exactly the tokens vLLM sampled, in exactly their context.

A Hermes tool call, as Qwen2.5's and Qwen3's chat templates render one:
    <tool_call>\\n{"name": "calculator", "arguments": {"expression": "3 + 5"}}\\n</tool_call>
A malformed call, an unknown tool or a tool that raises becomes a tool response that says what went wrong (veRL's
wording where veRL has one), so the model can learn from it; it is counted (tool_calls/error_rate), never fatal.
The calls run in worker processes (ToolPool), side by side and each within a time limit: a call that hangs, exits
its process or prints cannot stall, end or garble the run (a timeout is counted apart, tool_calls/timeout_rate).
"""

import ast
import functools
import importlib.util
import inspect
import json
import math
import operator
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field

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
    tool_calls: list[dict] = field(default_factory=list)  # {"turn", "name", "arguments", "response", "error", ...}
    text: str = ""  # the last assistant turn, decoded with skip_special_tokens=True (what is scored)
    truncated: bool = False  # stopped by data.max_response_length (tool tokens included)
    assistant_turns: int = 0
    user_turns: int = 0  # tool-response turns, as veRL counts them
    done: bool = False

    @property
    def num_turns(self) -> int:
        """veRL's num_turns: user turns + assistant turns + 1 (the prompt)."""
        return self.user_turns + self.assistant_turns + 1

    @property
    def fields(self) -> dict:
        """The batch fields this sample carries, name -> (layout, value) (fsdp_train.add_fields pads them): its tool
        tokens out of the response mask (the loss mask narrows it), turn_ids per response token (2k - 1 on assistant
        turn k, 2k on the tool responses after it), per sample the turn and call counts and the tool calls."""
        calls = self.tool_calls
        return {
            "response_mask": ("response", self.loss_mask),
            "turn_ids": ("response", self.turn_ids),
            "num_turns": ("row", self.num_turns),
            "num_tool_calls": ("row", len(calls)),
            "num_tool_errors": ("row", sum(c["error"] is not None for c in calls)),
            "num_tool_timeouts": ("row", sum(c["timeout"] for c in calls)),
            "num_tool_dropped_answers": ("row", sum(c["dropped_answers"] for c in calls)),
            "tool_calls": ("row", calls),  # {"turn", "name", "arguments", "response", "error", "timeout", ...} each
        }


# ------------------------------------------------------------------------------------------- the tools
MAX_BITS = 1024  # the calculator's bound on an integer result (~308 digits), checked before it is computed


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
    "2 ** 3 * (1 + 1)" -> 16; a name, a call, an attribute or a string raises ValueError, and so does a step whose
    exponent is above 64 or whose integer result would exceed MAX_BITS bits (_check_size), before it is computed."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent larger than 64")
        _check_size(node.op, left, right)
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def _check_size(op: ast.operator, left, right) -> None:
    """Refuse a product or power of integers whose result would have more than MAX_BITS bits, from the operands'
    sizes alone: a * b has at most bits(a) + bits(b) bits, a ** b about b * log2|a|. Sums and quotients of
    operands within the bound stay within a bit of it; floats overflow at once (OverflowError). E.g.
    (9 ** 64) ** 64: 9 ** 64 has 203 bits, so the outer power would have ~13,000: refused."""
    if not (type(left) is int and type(right) is int):
        return
    if isinstance(op, ast.Mult):
        bits = left.bit_length() + right.bit_length()
    elif isinstance(op, ast.Pow) and right > 0 and abs(left) > 1:
        bits = right * math.log2(abs(left))
    else:
        return
    if bits > MAX_BITS:
        raise ValueError(f"the result would have about {int(bits)} bits, more than {MAX_BITS}")


def tool_functions(function_tool_path: str | None) -> dict:
    """The tools by name, without their schemas: the calculator, or every public plain function defined in a Python
    file. What a tool worker loads (ToolPool); load_tools checks the schemas too."""
    if function_tool_path is None:
        return {"calculator": calculator}
    where = f"rollout.multi_turn.function_tool_path {function_tool_path}"
    module = load_file(function_tool_path, where, ToolSetupError)
    tools = {
        name: fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_")
    }
    if not tools:
        raise ToolSetupError(f"{where}: defines no public function (a tool is a plain function, as the calculator)")
    return tools


def load_file(path: str, where: str, error: type) -> types.ModuleType:
    """A Python file imported as a module; error(one line, `where` first) when it is missing or its import raises
    (SystemExit too: a file that exits at import is a file that does not import)."""
    if not os.path.isfile(path):
        raise error(f"{where}: no such file")
    spec = importlib.util.spec_from_file_location("_flatgrpo_" + os.path.basename(path).split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        raise error(f"{where}: importing it raised {type(e).__name__}: {e}") from None
    return module


@functools.cache
def load_tools(function_tool_path: str | None) -> dict:
    """The tools by name: the calculator, or every public plain function defined in a Python file (veRL 0.9.1's
    function_tool_path: type hints and a Google-style docstring give the schema, transformers.get_json_schema).
    A file that does not import, defines no public function, or a function without a schema: ToolSetupError."""
    tools = tool_functions(function_tool_path)
    where = f"rollout.multi_turn.function_tool_path {function_tool_path}"
    for name in tools:
        tool_schemas({name: tools[name]}, where)  # a function without hints or docstring stops here
    return tools


def tool_schemas(tools: dict, where: str = "multi-turn") -> list[dict]:
    """The OpenAI function schemas the chat template's tools= receives, from each function's hints and docstring."""
    from transformers.utils import get_json_schema

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


# ------------------------------------------------------------------------------------------ running the calls
class WorkerPool:
    """Worker processes, each running one job at a time within a time limit, so that nothing a job does can stall
    or end the run: a tool call here (ToolPool), an agent's episode in agent.py. `command` starts a worker (a serve
    loop: worker_pipes, {"ready": true} once it has loaded what it runs, then a JSON line in and one out per job), in
    a session of its own: a stop signal to the rank's process group (torchrun forwards its own so, a terminal's
    Ctrl-C) never reaches it, and killing it (SIGKILL to its process group) kills whatever its job forked. Workers
    start `STARTS_AT_ONCE` at a time (many imports at once on a few cores would each take as many times as long),
    the first ones running jobs while the others start; one that cannot start stops the run (ToolSetupError, `where`).

        pool = WorkerPool([sys.executable, "multi_turn.py", "--serve-tools", ...], workers=4, timeout=5.0, where=...)
        job = pool.submit({"name": "calculator", "arguments": {"expression": "6 * 7"}})
        pool.poll(None)  -> [(job, {"id": job, "text": "42", "error": None, "dropped": 0})]

    Every job sent carries an id, unique in the pool's life, and every answer names the id it answers: a job's answer
    is the line of ITS worker that names ITS id (with every key in `keys`), never the next line the worker writes.
    Any other line (a second answer, a late one, an answer to another job, a line that is not an answer) is dropped,
    counted on the job during which it was read ("dropped"; one written while idle: on the next job sent), and its
    worker replaced once the job is answered (or before a job is sent, when it wrote while idle). A job with no answer
    within `timeout` seconds has its worker killed (never read again) and replaced: {"failed": "no answer within 5 s",
    "timeout": True}; so has one whose worker ends (os._exit, a crash): {"failed": "its process ended (exit status 3)
    without an answer", "timeout": False}. reuse=False: a worker runs one job, then is killed (with what it left)."""

    START_TIMEOUT = 60.0  # seconds for a worker to import what it runs and say it is ready
    STARTS_AT_ONCE = max(2, (os.cpu_count() or 2) // 2)

    def __init__(self, command: list[str], *, workers: int, timeout: float, where: str, keys=(), reuse=True):
        self.command, self.wanted, self.timeout, self.where, self.reuse = command, workers, timeout, where, reuse
        self.keys = {"id", *keys}
        self.idle, self.starting, self.busy = [], {}, {}  # starting: worker -> deadline; busy: -> (job id, deadline)
        self.queue, self.dropped, self.carried, self.last_id = [], {}, 0, 0  # carried: lines of idle workers
        self._start_more()

    def submit(self, job: dict) -> int:
        """Queue a job (sent to the next idle worker); returns its id."""
        self.last_id += 1
        self.queue.append({"id": self.last_id, **job})
        return self.last_id

    def wait_started(self) -> None:
        """Until every worker has started (ToolSetupError if one cannot)."""
        while self.starting:
            self.poll(None)

    def poll(self, wait: float | None, wake: int | None = None) -> list[tuple[int, dict]]:
        """Send what is queued to idle workers, then wait up to `wait` seconds (None: until something happens) for a
        worker's line or end, a deadline, or the file descriptor `wake` to be readable. Returns the jobs answered
        meanwhile: (id, answer), each answer with "dropped"."""
        answered = []
        self._send_queued()
        deadlines = [deadline for _, deadline in self.busy.values()] + list(self.starting.values())
        if deadlines:
            until = max(0.0, min(deadlines) - time.monotonic())
            wait = until if wait is None else min(wait, until)
        with selectors.DefaultSelector() as selector:
            for worker in [*self.busy, *self.starting]:
                selector.register(worker.fd, selectors.EVENT_READ, worker)
            if wake is not None:
                selector.register(wake, selectors.EVENT_READ, None)
            ready = [key.data for key, _ in selector.select(wait) if key.data is not None]
        for worker in ready:
            self._read(worker, answered)
        now = time.monotonic()
        for worker in [w for w, (_, deadline) in self.busy.items() if deadline <= now]:
            job = self.busy.pop(worker)[0]
            self._replace(worker)  # killed: whatever it writes later is never read
            failed = {"failed": f"no answer within {self.timeout:g} s", "timeout": True}
            answered.append((job, {"id": job, **failed, "dropped": self.dropped.pop(job)}))
        for worker in [w for w, deadline in self.starting.items() if deadline <= now]:
            self._started(worker, [])  # ToolSetupError: no answer within START_TIMEOUT
        self._send_queued()
        return answered

    def _start_more(self) -> None:
        """Start workers until there are `workers`, at most STARTS_AT_ONCE starting at a time."""
        while len(self.idle) + len(self.busy) + len(self.starting) < self.wanted:
            if len(self.starting) >= self.STARTS_AT_ONCE:
                return
            process = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                bufsize=0,
                start_new_session=True,
            )
            self.starting[_Worker(process)] = time.monotonic() + self.START_TIMEOUT

    def _started(self, worker: "_Worker", lines: list[str] | None) -> None:
        """A starting worker's first line: ready (it becomes idle), or what went wrong (ToolSetupError)."""
        if lines == []:  # a part of a line: wait for its rest
            if self.starting[worker] > time.monotonic():
                return
        del self.starting[worker]
        if lines != ['{"ready": true}']:
            _end(worker)
            message = "; ".join(lines or []) or f"no answer within {self.START_TIMEOUT:g} s"
            raise ToolSetupError(f"{self.where} could not start: {message}")
        self.idle.append(worker)
        self._start_more()

    def _send_queued(self) -> None:
        """Each queued job to an idle worker; a worker that wrote while idle (no job of its own: every line is
        dropped, and counted on the next job sent) or ended is replaced first."""
        while self.queue and self.idle:
            worker = self.idle.pop()
            lines = worker.read_lines(0.0)
            if lines is None or lines:
                self.carried += len(lines or [])
                self._replace(worker)
                continue
            job = self.queue.pop(0)
            self.dropped[job["id"]], self.carried = self.carried, 0
            worker.send(job)
            self.busy[worker] = (job["id"], time.monotonic() + self.timeout)

    def _read(self, worker: "_Worker", answered: list) -> None:
        """A worker's lines: ready, its job's answer, or its end (the job failed); any other line is dropped."""
        lines = worker.read_lines()
        if worker in self.starting:
            return self._started(worker, lines)
        if worker not in self.busy:  # killed at its deadline in this poll, or replaced
            return
        job, answer = self.busy[worker][0], None
        for line in lines or []:
            candidate = _answer(line, self.keys)
            if candidate is not None and candidate["id"] == job and answer is None:
                answer = candidate
            else:  # not this job's answer, or a second one
                self.dropped[job] += 1
                worker.strays += 1
        if answer is None and lines is not None:
            return  # still waiting for its answer
        if answer is None:  # the worker ended without it
            message = f"its process ended (exit status {worker.process.wait()}) without an answer"
            answer = {"id": job, "failed": message, "timeout": False}
        del self.busy[worker]
        answered.append((job, {**answer, "dropped": self.dropped.pop(job)}))
        if worker.strays or lines is None or not self.reuse:
            self._replace(worker)
        else:
            self.idle.append(worker)

    def _replace(self, worker: "_Worker") -> None:
        _end(worker)
        self._start_more()

    def close(self) -> None:
        """Ends the workers (they also end when this process does: their stdin closes)."""
        for worker in [*self.idle, *self.starting, *self.busy]:
            _end(worker)
        self.idle, self.starting, self.busy, self.wanted = [], {}, {}, 0


class ToolPool(WorkerPool):
    """Runs tool calls in worker processes (WorkerPool), side by side, each within a time limit, so that no sampled
    call and no tool can stall or end the run. `workers` processes (rollout.multi_turn.tool_workers), each `python
    multi_turn.py --serve-tools ...` (serve_tools): the tools imported once, then one call at a time. A call with
    no answer within `timeout` seconds (rollout.multi_turn.tool_timeout) has its worker killed (SIGKILL to its
    process group stops a sleep, a busy loop, a billion-bit integer and whatever the tool forked alike) and replaced;
    a worker that ends (os._exit, a crash) is replaced too. Either is an error response, as is a malformed call or
    an unknown tool (answered here).

        pool = ToolPool(None, workers=4, timeout=5.0, max_chars=256, side="middle")
        pool.run([{"name": "calculator", "arguments": {"expression": "6 * 7"}}, {"name": "search", "arguments": {}}])
        -> [{"text": "42", "error": None, "timeout": False, "dropped": 0},
            {"text": "Tool 'search' not found; tools: calculator", "error": <the same>, "timeout": False,
             "dropped": 0}]

    Each call is a job with an id: {"id": 7, "name": ..., "arguments": ...} -> {"id": 7, "text": ..., "error": ...};
    lines that answer no call of their worker are dropped and counted ("dropped"), as WorkerPool says. Responses are
    cut as veRL cuts them (truncate: max_chars, side) inside the worker, so a huge return value never crosses the
    pipe. tools, schemas: the tools by name and their schemas (load_tools, in this process)."""

    def __init__(self, function_tool_path: str | None, *, workers: int, timeout: float, max_chars: int, side: str):
        self.tools = load_tools(function_tool_path)
        self.schemas = tool_schemas(self.tools)
        served = json.dumps([function_tool_path, max_chars, side])
        command = [sys.executable, os.path.abspath(__file__), "--serve-tools", served]
        super().__init__(
            command, workers=workers, timeout=timeout, where="multi-turn: a tool worker", keys=("text", "error")
        )
        self.wait_started()

    def run(self, calls: list[dict]) -> list[dict]:
        """Each call's answer {"text", "error" (None, or the text: what went wrong), "timeout", "dropped" (lines not
        its own read while it ran, dropped)}, in order. Calls from parse_tool_calls: {"name", "arguments"} or
        {"error"}. At most len(workers) run at once; every call is answered, whatever its tool does."""
        answers, jobs = [None] * len(calls), {}
        for index, call in enumerate(calls):
            if "error" in call:  # not a call: parse_tool_calls says why
                answers[index] = _failed(call["error"])
            elif call["name"] not in self.tools:
                answers[index] = _failed(f"Tool '{call['name']}' not found; tools: {', '.join(self.tools)}")
            else:
                jobs[self.submit(call)] = index
        while jobs:
            for job, answer in self.poll(None):
                index = jobs.pop(job)
                if "failed" in answer:  # timed out, or its worker ended
                    message = f"Error executing tool '{calls[index]['name']}': {answer['failed']}"
                    answers[index] = {**_failed(message), "timeout": answer["timeout"]}
                else:
                    answers[index] = {"text": answer["text"], "error": answer["error"], "timeout": False}
                answers[index]["dropped"] = answer["dropped"]
        return [{"dropped": 0, **answer} for answer in answers]


class _Worker:
    """A worker process, its pipes, and what it wrote past its last full line (read unbuffered, so that a line
    waiting in a buffer can never hide from select); strays: lines it wrote that answered no job of its own."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.fd, self.unread, self.strays = process, process.stdout.fileno(), b"", 0

    def send(self, message: dict) -> None:
        line = memoryview((json.dumps(message, default=str) + "\n").encode())
        try:
            while line:
                line = line[os.write(self.process.stdin.fileno(), line) :]
        except BrokenPipeError:  # the worker is gone: its closed stdout answers (read_lines: None)
            pass

    def read_lines(self, timeout: float | None = None) -> list[str] | None:
        """The full lines the worker has written (waiting up to timeout seconds for the first, when given); None
        once it has ended (its stdout closed)."""
        if timeout is not None and not _poll(self.fd, timeout):
            return []
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        *lines, self.unread = (self.unread + chunk).split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]


def _poll(fd: int, timeout: float = 0.0) -> bool:
    """Is there something to read on fd (data, or its end) within timeout seconds?"""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def _end(worker: _Worker) -> None:
    """Kill a worker and everything in its process group (what its job forked), reap it, close its pipes."""
    try:
        os.killpg(worker.process.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
    worker.process.wait()
    for pipe in (worker.process.stdin, worker.process.stdout):
        try:
            pipe.close()
        except OSError:  # a job line it never read
            pass


def _answer(line: str, keys: set[str]) -> dict | None:
    """A worker's line as an answer (a JSON object with an integer "id" and every key in keys), or None when it is
    not one (nested past Python's depth too: never an exception in the rank's loop)."""
    try:
        answer = json.loads(line)
    except (ValueError, RecursionError):
        return None
    ok = isinstance(answer, dict) and keys <= set(answer) and type(answer["id"]) is int
    return answer if ok else None


def _failed(message: str) -> dict:
    return {"text": message, "error": message, "timeout": False}


def worker_pipes(load) -> tuple:
    """A worker's set-up (WorkerPool): on Linux it gets SIGKILL when the process that started it dies, even in the
    middle of a job (elsewhere it ends at its next read: stdin closed); it keeps its own copies of stdin and stdout
    for the protocol, so that what a job prints goes nowhere and what it reads is empty; then load(), what it runs.
    Returns (jobs, answers, loaded) once it has said {"ready": true}; a ValueError or ImportError of load is its one
    line instead, and the worker ends."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    jobs, answers = os.fdopen(os.dup(0), encoding="utf-8"), os.fdopen(os.dup(1), "w", encoding="utf-8")
    quiet = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(quiet, fd)
    try:
        loaded = load()
    except (ValueError, ImportError) as e:  # a ToolSetupError, agent.py's AgentError: one line
        answers.write(f"{e}\n")
        answers.flush()
        sys.exit(0)
    answers.write('{"ready": true}\n')
    answers.flush()
    return jobs, answers, loaded


def serve_tools(function_tool_path: str | None, max_chars: int, side: str) -> None:
    """A tool worker (ToolPool): imports the tools, says {"ready": true}, then answers each call read as a JSON line
    {"id", "name", "arguments"} on stdin with a JSON line {"id" (the call's), "text", "error"} on stdout (worker_pipes:
    what a tool prints goes nowhere and what it reads is empty); whatever it raises, SystemExit included, is an error
    response; its return value becomes text (tool_text), cut to max_chars (truncate)."""
    requests, answers, tools = worker_pipes(lambda: tool_functions(function_tool_path))
    for line in requests:
        call = json.loads(line)
        try:
            text, error = truncate(tool_text(tools[call["name"]](**call["arguments"])), max_chars, side), None
        except BaseException as e:  # the model's arguments or the tool itself: the model reads what went wrong
            what = str(e) if isinstance(e, Exception) else f"{type(e).__name__} {e}"
            text = error = f"Error executing tool '{call['name']}': {what}"
        answers.write(json.dumps({"id": call["id"], "text": text, "error": error}) + "\n")
        answers.flush()


def tool_text(value) -> str:
    """A tool's return value as the text the model reads, as veRL's function tools coerce it: a str as it is, a dict
    as JSON, anything else as str(value) (42 -> "42"). None (a missing return) and bytes (undecoded output) raise
    TypeError: an error response. Text that is not valid UTF-8 (a lone surrogate) has it replaced."""
    if value is None or isinstance(value, (bytes, bytearray)):
        raise TypeError(f"it returned {type(value).__name__}; a tool returns text")
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else str(value)
    return text.encode("utf-8", "replace").decode("utf-8")


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


# ------------------------------------------------------------------------------------- tokens in, tokens out
def tool_response_ids(tokenizer, responses: list[str], schemas: list[dict], template_kwargs: dict | None) -> list[int]:
    """The token ids that follow an assistant turn (which ends with eos) for its tool messages, up to and including
    the next assistant header (ids_after_assistant). Qwen2.5: ["8"] ->
    "\\n<|im_start|>user\\n<tool_response>\\n8\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"."""
    ids = ids_after_assistant(tokenizer, [{"role": "tool", "content": r} for r in responses], schemas, template_kwargs)
    if ids is None:
        raise ToolSetupError(
            f"multi-turn: the chat template does not end an assistant turn with the eos token {tokenizer.eos_token!r}"
        )
    return ids


def ids_after_assistant(tokenizer, messages: list[dict], tools, template_kwargs, cut: int | None = None) -> list | None:
    """The token ids that follow an assistant turn (which ends with eos) for the messages after it, through the next
    generation prompt: the chat template's text for [user, assistant, *messages] with the generation prompt, from the
    eos after the assistant's content on (its first `cut` characters), tokenised once; None when the template does
    not end an assistant turn with eos. Only the text after the assistant turn is read, so a template that renders
    an earlier assistant turn differently (Qwen3 drops the empty <think> block of a turn before the last) gives the
    same ids. What the template raises is raised."""
    marker = "flatgrpo-assistant-turn"
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}, *messages]
    after = tokenizer.apply_chat_template(
        history, tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    end = after.find(tokenizer.eos_token, after.find(marker) + len(marker))
    if marker not in after or end < 0:
        return None
    return tokenizer(after[end + len(tokenizer.eos_token) :][:cut], add_special_tokens=False)["input_ids"]


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
        except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError; RecursionError: nested
            calls.append({"error": f"Invalid tool call: {e}"})  # past Python's depth (the policy's text is input too)
    return calls


# -------------------------------------------------------------------------------------------- the rollout
def generate(
    llm,
    prompt_ids: list[list[int]],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    seed: int | None,
    pool: ToolPool,
    settings: dict,
    top_p: float = 1.0,
    top_k: int = -1,
    template_kwargs: dict | None = None,
) -> list[Trajectory]:
    """n trajectories per prompt (len(prompt_ids) * n, a prompt's n consecutive), turn by turn. Every active
    trajectory of a turn goes to vLLM in one call, and all their tool calls to the pool at once. The first turn is
    rollout.generate's call exactly (seed + i * n for prompt i): a model that calls no tool samples what a
    single-turn rollout samples. Turn t > 1 of trajectory k is seeded seed + (t - 1) * len(trajectories) + k, so no
    two requests of one call share a seed. max_tokens (data.max_response_length) bounds every token after the
    prompt, the tool responses' included: a trajectory that reaches it is truncated."""
    tokenizer = llm.get_tokenizer()
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=0, detokenize=False)
    trajectories = [Trajectory(prompt_ids=list(p)) for p in prompt_ids for _ in range(n)]
    turn = 0
    while any(not t.done for t in trajectories):
        turn += 1
        active = [k for k, t in enumerate(trajectories) if not t.done]
        completions = _sample_turn(llm, trajectories, active, n, turn, seed, max_tokens, sampling)
        calling = []  # (trajectory, its calls to answer)
        for k, completion in zip(active, completions, strict=True):
            t = trajectories[k]
            _add_tokens(t, list(completion.token_ids), completion.logprobs, 2 * turn - 1)
            t.assistant_turns += 1
            t.text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            t.truncated = completion.finish_reason == "length" or len(t.response_ids) >= max_tokens
            calls = parse_tool_calls(tokenizer.decode(completion.token_ids))
            t.done = t.truncated or not calls or _turn_limit_reached(t, settings)
            if not t.done:
                calling.append((t, calls))
        _answer_tool_calls(calling, pool, settings["max_parallel_calls"], tokenizer, template_kwargs, max_tokens)
    return trajectories


def _sample_turn(llm, trajectories, active, n, turn, seed, max_tokens, sampling) -> list:
    """One vLLM call: the first turn n samples per prompt (rollout.generate's requests), a later turn one sample
    per active trajectory from its whole history, with the tokens left of max_tokens. Returns one
    CompletionOutput per active trajectory, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

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


def _answer_tool_calls(calling: list, pool: ToolPool, max_parallel_calls: int, tokenizer, template_kwargs, max_tokens):
    """One turn's tool calls, of every trajectory still going, run side by side (pool.run): each trajectory's first
    max_parallel_calls calls (veRL's), answered as one tool segment (one user turn). A segment that does not fit in
    max_tokens is cut there and the trajectory ends truncated. calling: [(trajectory, the calls of its turn)]."""
    calling = [(t, calls[:max_parallel_calls]) for t, calls in calling]
    answers = iter(pool.run([call for _, calls in calling for call in calls]))
    rendered = {}  # the same responses render to the same ids: tokenised once per turn
    for t, calls in calling:
        responses = []
        for call in calls:
            answer = next(answers)
            outcome = {"response": answer["text"], "error": answer["error"], "timeout": answer["timeout"]}
            outcome["dropped_answers"] = answer["dropped"]
            t.tool_calls.append({"turn": t.assistant_turns, **call, **outcome})
            responses.append(answer["text"])
        if tuple(responses) not in rendered:
            rendered[tuple(responses)] = tool_response_ids(tokenizer, responses, pool.schemas, template_kwargs)
        ids = rendered[tuple(responses)]
        room = max_tokens - len(t.response_ids)
        _add_tokens(t, ids[:room], None, 2 * t.assistant_turns)
        t.user_turns += 1
        t.truncated = t.done = len(ids) >= room


# ------------------------------------------------------------------------------------------ the loop's parts
def sampler(cfg: dict, render):
    """A multi-turn run's sampling part (grpo.choose_parts), rollout.generate's drop-in: sample(llm, prompts, *,
    template_kwargs, n, temperature, top_p, top_k, max_tokens, seed) -> a Trajectory per sample. The chat prompts are
    rendered by render(tokenizer, messages, template_kwargs) (rollout.render_prompt) with template_kwargs (the run's
    data.apply_chat_template_kwargs) and the tools' schemas; the calls run in a ToolPool of rollout.multi_turn's
    tools, started at the first call."""
    settings = cfg["rollout"]["multi_turn"]
    tools, pools = load_tools(settings["function_tool_path"]), []

    def sample(llm, prompts, *, template_kwargs, n, temperature, top_p, top_k, max_tokens, seed):
        prompt_kwargs = {**(template_kwargs or {}), "tools": tool_schemas(tools)}
        if not pools:
            pools.append(
                ToolPool(
                    settings["function_tool_path"],
                    workers=settings["tool_workers"],
                    timeout=settings["tool_timeout"],
                    max_chars=settings["max_tool_response_length"],
                    side=settings["tool_response_truncate_side"],
                )
            )
        tokenizer = llm.get_tokenizer()
        return generate(
            llm,
            [render(tokenizer, messages, prompt_kwargs) for messages in prompts],
            n=n,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            pool=pools[0],
            settings=settings,
            top_p=top_p,
            top_k=top_k,
            template_kwargs=template_kwargs,
        )

    return sample


def prompt_kwargs(tokenizer, cfg: dict) -> dict:
    """The chat template's keyword arguments of a multi-turn run's prompts: data.apply_chat_template_kwargs and the
    tools' schemas (tools=), after checking that the template renders them (check_template: ToolSetupError)."""
    tools, template_kwargs = (
        load_tools(cfg["rollout"]["multi_turn"]["function_tool_path"]),
        cfg["data"]["apply_chat_template_kwargs"],
    )
    check_template(tokenizer, tools, template_kwargs)
    return {**(template_kwargs or {}), "tools": tool_schemas(tools)}


def field_metrics(fields: dict) -> dict:
    """The metrics of a step's multi-turn fields over the global batch (fields: each row field's values of every
    rank, as metrics.batch_metrics gathers them): turn_metrics."""
    keys = ("num_turns", "num_tool_calls", "num_tool_errors", "num_tool_timeouts", "num_tool_dropped_answers")
    return turn_metrics(*(fields[key] for key in keys))


def turn_metrics(
    num_turns: list[int], calls: list[int], errors: list[int], timeouts: list[int], dropped: list[int]
) -> dict:
    """veRL's num_turns/{min,max,mean} and the tool metrics, over the global batch: tool_calls/per_sample (mean
    calls), tool_calls/sample_share (share of samples with a call), tool_calls/error_rate (errors / calls, 0 with
    no call; a timeout is an error), tool_calls/timeout_rate (calls stopped at the time limit / calls),
    tool_calls/dropped_answers (the tool workers' answers that named no call of theirs, dropped: a count; 0 unless
    a tool forks or meddles with its worker's pipe). num_turns [3, 1], calls [1, 0], errors [1, 0], timeouts
    [1, 0], dropped [2, 0] -> mean 2, per_sample 0.5, share 0.5, error_rate 1, timeout_rate 1, dropped_answers 2."""
    return {
        "num_turns/min": min(num_turns),
        "num_turns/max": max(num_turns),
        "num_turns/mean": sum(num_turns) / len(num_turns),
        "tool_calls/per_sample": sum(calls) / len(calls),
        "tool_calls/sample_share": sum(c > 0 for c in calls) / len(calls),
        "tool_calls/error_rate": sum(errors) / max(1, sum(calls)),
        "tool_calls/timeout_rate": sum(timeouts) / max(1, sum(calls)),
        "tool_calls/dropped_answers": sum(dropped),
    }


if __name__ == "__main__":  # a tool worker: python multi_turn.py --serve-tools '[path or null, max_chars, side]'
    if sys.argv[1:2] == ["--serve-tools"]:
        serve_tools(*json.loads(sys.argv[2]))
