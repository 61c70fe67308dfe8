"""An offline tiny Qwen2 + tokenizer + GSM8K-style data, for the tests and the CPU demo.

    python tiny.py                      # build (or reuse) the default tiny set-up, print where it is
    python tiny.py --out DIR --seed 1   # another seed / place

Everything is built here, deterministically from a seed, with no hub access, and cached on disk
(a second call returns in milliseconds):
  tokenizer   byte-level BPE with Qwen2's pre-tokenizer, Qwen's special tokens and a ChatML
              chat template; loads with AutoTokenizer and in vLLM (transformers 5 rebuilds Qwen2
              tokenizers from vocab + merges, so we train with exactly Qwen2's pipeline)
  data        train.jsonl / test.jsonl with GSM8K's columns `question` and `answer`
              ("...steps...\\n#### 42"), short arithmetic word problems
  base        a randomly initialised tiny Qwen2ForCausalLM (tied embeddings)
  model       `base` after a short supervised warm start: our stand-in for an Instruct model.
              Like Qwen2.5-Instruct on GSM8K, it solves many problems but often ends with
              "The answer is N." instead of the requested "#### N" (which scores 0): the warm-start
              targets use "####" in only FORMAT_SHARE of the examples. GRPO's reward teaches the
              format and sharpens the arithmetic; see docs/demo.md, "why the tiny run learns".

tiny.build(tools=True) (model.path `tiny_tools`): the same data, a tokenizer that also knows the Hermes tool tags,
a chat template that renders `tools=` and tool messages the way Qwen2.5's does (compactly), and a warm start in
which TOOL_SHARE of the answers compute through a calculator tool call first (multi_turn.py runs it):
    <tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 5"}}\n</tool_call><|im_end|>
    \n<|im_start|>user\n<tool_response>\n8\n</tool_response><|im_end|>\n<|im_start|>assistant\n   (not trained)
    The answer is 8.<|im_end|>

Also: `save_random_model(path, ...)` writes any Qwen2 shape (tied or untied) with this tokenizer,
e.g. the Qwen2.5-0.5B shape used by the benchmarks (`QWEN25_05B`); `save_random_family_model(path, tokenizer,
config_class, ...)` a model of any transformers family (Gemma2Config, CohereConfig, ...).
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import time

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VERSION = 2  # bump when anything below changes what gets built
MODELS = {"tiny": {}, "tiny_tools": {"tools": True}, "tiny_teacher": {"teacher": True}}  # names -> build's keywords
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# tiny_tools: Qwen2.5's tool tags (added tokens, not special: they survive skip_special_tokens) and a ChatML
# template that renders `tools=` (one line per tool, where Qwen2.5 writes the JSON schema) and a run of tool messages
# as one user turn of <tool_response> blocks, as Qwen2.5's template does.
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools' }}"
    "{%- for tool in tools %}{{- '\\n' + tool.function.name + ': ' + tool.function.description }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The calculator's schema as transformers.utils.get_json_schema writes it for multi_turn.calculator.
CALCULATOR_SCHEMA = {
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
TOOL_SHARE = 0.5  # share of tiny_tools' warm-start answers that call the calculator first
TOOLS_SFT_BATCH = 16  # tiny_tools' warm-start batch: its sequences are longer; half the build time of 32
# Qwen2's pre-tokenizer (transformers' tokenization_qwen2.py): digits split one by one.
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 (verbatim)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # = reward.py's

TINY = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    vocab_size=151936,
)
PROGRESS_EVERY = 100  # warm-start steps between two progress lines
FORMAT_SHARE = 0.3  # share of warm-start targets that end with "#### N"
VOCAB_SIZE = 512
N_TRAIN, N_TEST = 4000, 200
SFT_STEPS, SFT_BATCH, SFT_LR = 600, 32, 2e-3
# tiny_teacher: the tiny model trained further on answers that all end with "#### N" (on-policy distillation's demo)
TEACHER_STEPS, TEACHER_LR, TEACHER_FORMAT_SHARE = 40, 3e-4, 1.0
KINDS = ["add", "sub", "mul", "add_sub"]
# Operands of add / sub / add_sub in LO..HI, of mul in 2..MUL_HI: single digits, so that the warm start
# gets the arithmetic right (~94% greedy, ignoring the format) within its ~2-minute budget; GRPO's
# visible gain is then the format ("#### N"). With operands up to 20 or 30 the tiny model's sums are
# poor (greedy 60% / 40% ignoring format) and GRPO's noisy gradients make them worse before better.
LO, HI, MUL_HI = 2, 9, 9

NAMES = ["Tom", "Ann", "Sam", "Mia", "Leo", "Eva", "Max", "Zoe", "Ben", "Ivy"]
ITEMS = ["apple", "book", "coin", "pen", "card", "shell", "egg", "toy"]


# ------------------------------------------------------------------------------------ data
def make_problem(rng: random.Random) -> dict:
    """One GSM8K-format problem: {"question", "answer"} with the answer as "steps\\n#### N"."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(KINDS)
    a, b = rng.randint(LO, HI), rng.randint(LO, HI)
    if kind == "add":
        q = f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?"
        steps, n = [f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}"], a + b
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {item}s and gives away {b}. How many {item}s does {name} have left?"
        steps, n = [f"{a} - {b} = <<{a}-{b}={a - b}>>{a - b}"], a - b
    elif kind == "mul":
        a, b = rng.randint(2, MUL_HI), rng.randint(2, MUL_HI)
        q = f"{name} buys {a} boxes with {b} {item}s in each box. How many {item}s does {name} buy?"
        steps, n = [f"{a} * {b} = <<{a}*{b}={a * b}>>{a * b}"], a * b
    else:
        c = rng.randint(1, a + b - 1)
        q = f"{name} has {a} {item}s, gets {b} more and then gives away {c}. How many {item}s are left?"
        steps = [f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}", f"{a + b} - {c} = <<{a + b}-{c}={a + b - c}>>{a + b - c}"]
        n = a + b - c
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {n}"}


def make_dataset(seed: int, n_train: int = N_TRAIN, n_test: int = N_TEST) -> dict[str, list[dict]]:
    """Train and test splits with no question in both."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n_train + n_test:
        row = make_problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return {"train": rows[:n_train], "test": rows[n_train:]}


def chat_response(answer: str, use_hashes: bool) -> str:
    """How our stand-in Instruct model answers: the steps without GSM8K's <<calc>> marks, then
    "#### N" (the format veRL's scorer accepts) or "The answer is N." (which scores 0)."""
    *steps, final = answer.split("\n")
    steps = [s.split(" = <<")[0] + " = " + s.split(">>")[-1] for s in steps]
    number = final.removeprefix("#### ")
    return "\n".join(steps) + ("\n#### " + number if use_hashes else f"\nThe answer is {number}.")


# ------------------------------------------------------------------------------- tokenizer
def build_tokenizer(texts: list[str], tools: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts` with Qwen2's normaliser, pre-tokenizer and decoder. tools: also Qwen2.5's
    tool tags as added tokens, and the template that renders tools."""
    tok = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    if tools:
        tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
        model_max_length=TINY["max_position_embeddings"],
    )


def save_random_model(
    path: str, tokenizer, seed: int = 0, tie_word_embeddings: bool = True, dtype: torch.dtype = torch.float32, **shape
) -> str:
    """Write a randomly initialised Qwen2ForCausalLM (HF safetensors) + `tokenizer` to `path`."""
    return save_random_family_model(
        path,
        tokenizer,
        Qwen2Config,
        seed=seed,
        dtype=dtype,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
        use_sliding_window=False,
        **shape,
    )


def save_random_family_model(path: str, tokenizer, config_class, seed: int = 0, dtype=torch.float32, **kwargs) -> str:
    """Write a randomly initialised causal LM of any transformers family + `tokenizer` to `path`.
    config_class: the family's config class (Qwen2Config, Gemma2Config, CohereConfig, ...); the model is
    AutoModelForCausalLM's class for it. The config: the TINY shape, the tokenizer's vocabulary and special
    tokens, head_dim = hidden_size / num_attention_heads and the dtype, each only where the class defines the key
    (its defaults' keys and its attribute_map's: GPT-NeoX has no num_key_value_heads, Qwen2 no head_dim, as their
    released config.json files), then kwargs as given (another shape, the family's own keys: the caller's to keep
    real). E.g. save_random_family_model(p, tok, Gemma2Config, final_logit_softcapping=30.0)."""
    settings = {
        **TINY,
        "vocab_size": len(tokenizer),
        "dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
        **kwargs,
    }
    settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    known = set(config_class().to_dict()) | set(config_class.attribute_map)
    config = config_class(**{key: v for key, v in settings.items() if key in known or key in kwargs})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    _save(model, tokenizer, path)
    return path


def _save(model, tokenizer, path: str) -> None:
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


# ------------------------------------------------------------------------------- warm start
def warm_start(
    model,
    tokenizer,
    rows: list[dict],
    seed: int,
    steps: int | None = None,
    verbose: bool = False,
    tools: bool = False,
    lr: float = SFT_LR,
    format_share: float = FORMAT_SHARE,
) -> None:
    """Supervised fine-tuning on chat-formatted (prompt, response) pairs; loss on the response only (with tools: on
    the model's own turns, not on the tool responses); format_share of the answers end with "#### N". verbose: a
    progress line every PROGRESS_EVERY steps (the build's longest part: ~1-2 minutes on 2 cores)."""
    steps = SFT_STEPS if steps is None else steps
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    examples = [sft_example(tokenizer, row, rng, tools, format_share) for row in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    model.train()
    start = time.time()
    for step in range(steps):
        size = TOOLS_SFT_BATCH if tools else SFT_BATCH
        batch = [examples[i] for i in torch.randint(len(examples), (size,), generator=gen).tolist()]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _ in batch])  # [B, L]
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float32)  # [B, L]
        attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])  # [B, L]
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [B, L-1, V]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, L-1]
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if verbose and (step + 1) % PROGRESS_EVERY == 0:
            say(f"warm start {step + 1}/{steps} steps, loss {loss.item():.3f} ({time.time() - start:.0f} s)")
    model.eval()


def sft_example(
    tokenizer, row: dict, rng: random.Random, tools: bool, format_share: float = FORMAT_SHARE
) -> tuple[list[int], list[int]]:
    """One warm-start example: (token ids, loss mask), the mask 1 on the model's own tokens. Each segment is
    tokenised alone, as a multi-turn rollout appends them (token in, token out)."""
    use_hashes = rng.random() < format_share
    user = [{"role": "user", "content": row["question"] + " " + INSTRUCTION}]
    schemas = [CALCULATOR_SCHEMA] if tools else None
    prompt = tokenizer.apply_chat_template(user, tools=schemas, add_generation_prompt=True, tokenize=False)
    segments = [(prompt, 0)]
    if tools and rng.random() < TOOL_SHARE:  # compute through the calculator, then answer
        call, result = calculator_call(row["answer"])
        segments += [(call + "<|im_end|>", 1), (tool_response_text(tokenizer, user, result), 0)]
        number = row["answer"].split("#### ")[-1]
        segments.append(("#### " + number if use_hashes else f"The answer is {number}.", 1))
        segments[-1] = (segments[-1][0] + "<|im_end|>", 1)
    else:
        segments.append((chat_response(row["answer"], use_hashes) + "<|im_end|>", 1))
    ids, mask = [], []
    for text, trained in segments:
        tokens = tokenizer(text)["input_ids"]
        ids, mask = ids + tokens, mask + [trained] * len(tokens)
    return ids, mask


def calculator_call(answer: str) -> tuple[str, str]:
    """A GSM8K answer's arithmetic as one Hermes calculator call, and the result the tool returns:
    "3 + 5 = <<3+5=8>>8\\n8 - 2 = <<8-2=6>>6\\n#### 6" -> ('<tool_call>\\n{"name": "calculator", "arguments":
    {"expression": "3 + 5 - 2"}}\\n</tool_call>', "6")."""
    *steps, final = answer.split("\n")
    expression = steps[0].split(" = ")[0]
    for step in steps[1:]:  # "8 - 2 = ..." continues the previous result: "3 + 5" -> "3 + 5 - 2"
        expression += " " + step.split(" = ")[0].split(" ", 1)[1]
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>", final.removeprefix("#### ")


def tool_response_text(tokenizer, user: list[dict], result: str) -> str:
    """What the chat template writes after an assistant turn (which ends with <|im_end|>) for one tool message,
    up to the next assistant turn's header: "\\n<|im_start|>user\\n<tool_response>\\n8\\n</tool_response>..."."""
    schemas = [CALCULATOR_SCHEMA]
    history = [*user, {"role": "assistant", "content": "x"}]
    before = tokenizer.apply_chat_template(history, tools=schemas, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*history, {"role": "tool", "content": result}], tools=schemas, add_generation_prompt=True, tokenize=False
    )
    return after[len(before) - 1 :]  # from the "\\n" after the assistant's <|im_end|>


# ------------------------------------------------------------------------------------ build
def cache_key(seed: int, tools: bool = False) -> str:
    """The cache directory's hash: every constant the build depends on, so a change rebuilds."""
    recipe = [VERSION, seed, TINY, FORMAT_SHARE, VOCAB_SIZE, N_TRAIN, N_TEST, SFT_STEPS, SFT_BATCH, SFT_LR]
    recipe += [KINDS, LO, HI, MUL_HI]
    if tools:
        recipe += [TOOL_TAGS, TOOLS_CHAT_TEMPLATE, CALCULATOR_SCHEMA, TOOL_SHARE, TOOLS_SFT_BATCH]
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:10]


def build(out_dir: str = ".cache/tiny", seed: int = 0, tools: bool = False, teacher: bool = False) -> dict[str, str]:
    """Build (or reuse) everything; returns paths: model, base, train, test, dir. tools: the tiny_tools set-up
    (a tokenizer and template for tool calls, a warm start that calls the calculator; the same data). teacher: the
    tiny_teacher set-up (build_teacher)."""
    if teacher:
        return build_teacher(out_dir, seed)
    key = cache_key(seed, tools)
    root = os.path.join(out_dir, f"seed{seed}-{'tools-' if tools else ''}{key}")
    paths = {
        "dir": root,
        "model": os.path.join(root, "model"),
        "base": os.path.join(root, "base"),
        "train": os.path.join(root, "train.jsonl"),
        "test": os.path.join(root, "test.jsonl"),
    }
    if os.path.exists(os.path.join(root, "COMPLETE")):
        return paths
    say(f"building the offline tiny model, tokenizer and data in {root} (once: later runs reuse it; ~4 min on 2 cores)")
    start = time.time()
    tmp = f"{root}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    data = make_dataset(seed)
    for split, rows in data.items():
        with open(os.path.join(tmp, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    corpus = [r["question"] + " " + INSTRUCTION for r in data["train"]]
    corpus += [chat_response(r["answer"], h) for r in data["train"] for h in (True, False)]
    if tools:
        corpus += [calculator_call(r["answer"])[0] for r in data["train"]] + ["# Tools\ncalculator: Evaluate an"]
    tokenizer = build_tokenizer(corpus, tools)
    save_random_model(os.path.join(tmp, "base"), tokenizer, seed=seed)
    model = Qwen2ForCausalLM.from_pretrained(os.path.join(tmp, "base"), dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # the build runs alone (other ranks wait for it)
    try:
        warm_start(model, tokenizer, data["train"], seed, verbose=True, tools=tools)
    finally:
        torch.set_num_threads(threads)
    _save(model, tokenizer, os.path.join(tmp, "model"))
    open(os.path.join(tmp, "COMPLETE"), "w").close()
    try:
        os.rename(tmp, root)  # atomic: a half-built directory is never mistaken for a cache hit
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"built in {time.time() - start:.0f} s")
    return paths


def build_teacher(out_dir: str = ".cache/tiny", seed: int = 0) -> dict[str, str]:
    """The tiny_teacher set-up: the tiny set-up's model (build) trained TEACHER_STEPS more warm-start steps on answers
    that all end with "#### N" (TEACHER_FORMAT_SHARE), so that greedy decoding answers in the scorer's format: a
    teacher that solves the demo's task, with the student's tokenizer and data (on-policy distillation's demo,
    recipes/tiny_distill.yaml). Cached beside it by its own key; returns the same paths, model the teacher's."""
    student = build(out_dir, seed)
    recipe = [cache_key(seed), TEACHER_STEPS, TEACHER_LR, TEACHER_FORMAT_SHARE]
    root = os.path.join(out_dir, f"seed{seed}-teacher-{hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:10]}")
    paths = {**student, "dir": root, "model": os.path.join(root, "model")}
    if os.path.exists(os.path.join(root, "COMPLETE")):
        return paths
    say(f"building the tiny teacher in {root} (once; about a minute on 2 cores)")
    start, tmp = time.time(), f"{root}.tmp-{os.getpid()}"
    model = Qwen2ForCausalLM.from_pretrained(student["model"], dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(student["model"])
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # the build runs alone (other ranks wait for it)
    try:
        rows = make_dataset(seed)["train"]
        warm_start(
            model, tokenizer, rows, seed + 1, TEACHER_STEPS, True, lr=TEACHER_LR, format_share=TEACHER_FORMAT_SHARE
        )
    finally:
        torch.set_num_threads(threads)
    _save(model, tokenizer, os.path.join(tmp, "model"))
    open(os.path.join(tmp, "COMPLETE"), "w").close()
    try:
        os.rename(tmp, root)  # atomic, as build's
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"teacher built in {time.time() - start:.0f} s")
    return paths


def say(message: str) -> None:
    """One progress line of the build on the console (the build runs once, before anything else prints)."""
    print(f"tiny: {message}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".cache/tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tools", action="store_true", help="the tiny_tools set-up (multi-turn with a calculator)")
    ap.add_argument("--teacher", action="store_true", help="the tiny_teacher set-up (on-policy distillation's demo)")
    args = ap.parse_args()
    t0 = time.time()
    print(json.dumps(build(args.out, args.seed, args.tools, args.teacher), indent=1), f"\n({time.time() - t0:.1f} s)")
