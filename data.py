"""What flatgrpo reads and writes besides the model's math: datasets in GSM8K's and veRL's formats, the
prompts of each generation batch, the task's scorer (veRL's GSM8K rule or a user's reward file), the model
directory, and the dumped batches of the seed's Experiment 1. Plumbing for grpo.py, not the algorithm.

    rows = load_rows("~/data/gsm8k/train.parquet", "train", None)   # [{"prompt", "ground_truth", ...}]
    prompts = step_prompts(rows, 3, batch=96, shuffle=False, seed=0)   # the 3rd batch, epoch-wise order
    gsm8k_score(row, response_text, cfg["reward"])   # -> (reward, extras)
"""

import glob
import json
import os
import random

import torch
import torch.distributed as dist

import cluster
import fsdp_train
import losses
import reward
import rollout
from config import ConfigError

GSM8K = "openai/gsm8k"  # veRL's data_source of GSM8K rows, and of flatgrpo's tiny GSM8K-format rows


# ------------------------------------------------------------------------------------- datasets
def load_rows(source: str, split: str, tiny_paths: dict | None) -> list[dict]:
    """Rows {"prompt": chat messages, "ground_truth": str, "data_source": str, "extra_info": dict,
    "where": "file row i"} from:
      "openai/gsm8k"            the hub dataset (question / answer columns), split train or test;
      "tiny"                    tiny.py's synthetic GSM8K-format set;
      a .parquet or .jsonl path in veRL's layout (prompt, reward_model.ground_truth, data_source, extra_info)
                                or GSM8K's (question, answer); a comma-separated list of paths is concatenated.
    A row without the needed fields stops the run with the file, row and field."""
    if source == GSM8K:
        import datasets

        try:
            records = datasets.load_dataset(GSM8K, "main", split=split).to_list()
        except Exception as e:  # offline, no network: one line, and the way out
            raise ValueError(
                f"data: openai/gsm8k could not be loaded from the hub ({type(e).__name__}); pass "
                "local files instead, e.g. veRL's data.train=~/data/gsm8k/train.parquet"
            ) from None
        return _rows_from_records(records, f"openai/gsm8k[{split}]")
    paths = [tiny_paths[split]] if source == "tiny" else [p.strip() for p in source.split(",")]
    return [row for path in paths for row in _rows_from_records(_read_file(path), path)]


def _read_file(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"data: {path} does not exist (accepted: openai/gsm8k, tiny, *.parquet, *.jsonl)")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if not path.endswith(".jsonl"):
        raise ValueError(f"data: {path}: unsupported file type; accepted: .parquet, .jsonl")
    with open(path) as f:
        return [_json(line, f"data: {path}: row {i}") for i, line in enumerate(f) if line.strip()]


def _json(line: str, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None


def _rows_from_records(records: list[dict], where: str) -> list[dict]:
    """Records of either layout -> rows {"prompt", "ground_truth", "data_source", "extra_info", "where"}."""
    rows = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"data: {where}: row {i}: expected an object, got {type(r).__name__}")
        if "prompt" in r or "reward_model" in r:
            row = _verl_row(r, f"data: {where}: row {i}")
        else:
            row = _gsm8k_row(r, i, f"data: {where}: row {i}")
        row["where"] = f"{where} row {i}"
        rows.append(row)
    return rows


def _verl_row(r: dict, where: str) -> dict:
    """veRL's preprocessed layout: prompt (chat messages), reward_model.ground_truth, data_source, extra_info."""
    prompt, rm = r.get("prompt"), r.get("reward_model")
    is_chat = isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt)
    if not is_chat or not prompt:
        raise ValueError(f"{where}: field 'prompt' must be a non-empty list of chat messages")
    if not isinstance(rm, dict) or rm.get("ground_truth") in (None, ""):
        raise ValueError(f"{where}: missing field 'reward_model.ground_truth'")
    data_source = str(r.get("data_source") or GSM8K)
    truth = str(rm["ground_truth"]) if data_source == GSM8K else rm["ground_truth"]
    return {
        "prompt": [dict(m) for m in prompt],
        "ground_truth": truth,
        "data_source": data_source,
        "extra_info": r.get("extra_info") or {},
    }


def _gsm8k_row(r: dict, index: int, where: str) -> dict:
    """GSM8K's layout: question, answer ("...steps...\\n#### 42"); the prompt is veRL's (reward.make_prompt)."""
    for field in ("question", "answer"):
        if not isinstance(r.get(field), str) or not r[field]:
            raise ValueError(
                f"{where}: missing field {field!r} "
                "(accepted layouts: question/answer, or prompt/reward_model.ground_truth)"
            )
    try:
        truth = reward.extract_ground_truth(r["answer"])
    except ValueError as e:
        raise ValueError(f"{where}: field 'answer': {e}") from None
    return {
        "prompt": reward.make_prompt(r["question"]),
        "ground_truth": truth,
        "data_source": GSM8K,
        "extra_info": {"index": index, "question": r["question"], "answer": r["answer"]},
    }


def filter_overlong(rows: list[dict], tokenizer, d: dict) -> tuple[list[dict], int]:
    """Drop prompts longer than data.max_prompt_length tokens (never truncate; a prompt of exactly that many
    tokens is kept); returns (kept, dropped)."""
    template_kwargs = d["apply_chat_template_kwargs"]
    kept = [
        r for r in rows if len(rollout.render_prompt(tokenizer, r["prompt"], template_kwargs)) <= d["max_prompt_length"]
    ]
    if not d["filter_overlong_prompts"] and len(kept) < len(rows):
        raise ValueError(
            f"data: {len(rows) - len(kept)} prompts exceed data.max_prompt_length="
            f"{d['max_prompt_length']} tokens; raise it or set data.filter_overlong_prompts=true"
        )
    return kept, len(rows) - len(kept)


def step_prompts(rows: list[dict], step: int, batch: int, shuffle: bool, seed: int) -> list[dict]:
    """The prompts of generation batch `step` (1-based): epoch-wise order, the last partial batch dropped
    (veRL's drop_last). A pure function of the counter, so a resumed run sees the same data."""
    per_epoch = len(rows) // batch
    epoch, index = divmod(step - 1, per_epoch)
    order = list(range(len(rows)))
    if shuffle:
        random.Random(seed * 100_003 + epoch).shuffle(order)
    return [rows[i] for i in order[index * batch : (index + 1) * batch]]


def local_positions(batch: int, mini: int, world: int, rank: int) -> list[int]:
    """Positions (in the step's prompt list) that this rank owns: every mini-batch is split evenly
    over the ranks, so a mini-batch holds the same prompts at any world size."""
    share = mini // world
    return [j * mini + rank * share + i for j in range(batch // mini) for i in range(share)]


# ------------------------------------------------------------------------------------- the scorer
def gsm8k_score(row: dict, text: str, settings: dict) -> tuple[float, dict]:
    """(reward, extras) of a response decoded with skip_special_tokens: veRL's GSM8K rule (reward.compute_score with
    the reward.* keys, settings), with the extracted answer as "pred" (majority voting in validation). A reward
    file's function is the other scorer (reward_files.py)."""
    pred = reward.extract_solution(text, method=settings["method"], clip_chars=settings["clip_chars"])
    return reward.compute_score(
        text,
        row["ground_truth"],
        method=settings["method"],
        format_score=settings["format_score"],
        score=settings["score"],
        clip_chars=settings["clip_chars"],
    ), {"pred": pred or "[no answer]"}


def check_scorer(rows: list[dict], cfg: dict) -> None:
    """Without a reward file only GSM8K rows can be scored: say so before anything trains."""
    other = next((r for r in rows if r["data_source"] != GSM8K), None)
    if other and cfg["custom_reward_function"]["path"] is None:
        raise ConfigError(
            f"data: {other['where']}: data_source {other['data_source']!r} has no built-in scorer; "
            f"accepted: {GSM8K}, or a reward file in custom_reward_function.path"
        )


# ------------------------------------------------------------------------------------- the model
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja"]  # config, weights, tokenizer, chat template


def resolve_model(path: str, download: bool) -> str:
    """model.path -> the local directory that the tokenizer, the trainer and vLLM all read.
    A local directory must hold config.json and *.safetensors. Anything else must be a hub id
    (org/name): downloaded once per node into the Hugging Face cache (HF_HUB_CACHE), or, with download=False
    or HF_HUB_OFFLINE=1, found there."""
    if os.path.isdir(path):
        missing = [what for what in ("config.json", "*.safetensors") if not glob.glob(os.path.join(path, what))]
        if missing:
            raise ConfigError(f"config: model.path = {path!r}: the directory has no {' and no '.join(missing)}")
        return path
    if path.count("/") != 1 or path.startswith((".", "/", "~")):
        raise ConfigError(
            f"config: model.path = {path!r}: no such directory; accepted: a local model directory "
            "(config.json, *.safetensors) or a hub id such as Qwen/Qwen2.5-1.5B-Instruct"
        )
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, allow_patterns=HUB_FILES, local_files_only=not download)
    except Exception as e:  # offline, no network, unknown or gated repo: all end the run the same way
        raise ConfigError(
            f"config: model.path = {path!r}: not a local directory, and the hub copy could not be "
            f"fetched ({type(e).__name__}); download it where the hub is reachable and pass the local "
            "directory"
        ) from None


# ------------------------------------------------------------------------------- dump / replay
def dump_batch(run, step: int, batch: dict):
    """Save the step's GLOBAL training batch (all ranks, in global prompt order) to
    <trainer.dump_batches>/step_<N>.pt: every entry of the batch, re-padded by its layout (fsdp_train.layout_of):
    token ids, the attention mask (every sampled token), the response mask the loss uses (after rejection
    sampling), rewards (the scores) and the per-token rewards (veRL's token_level_rewards: the score at the last
    token, minus the KL in the reward), advantages and returns, old, reference and vLLM log-probs, the IS weights,
    and the samples' own fields (a multi-turn run's turns and tool calls, a Mixture-of-Experts model's routing).
    The seed's Experiment 1: replay them elsewhere with trainer.replay_batches."""
    n, root = run.cfg["rollout"]["n"], run.cfg["trainer"]["dump_batches"]
    if "token_level_rewards" not in batch:  # GRPO's: the score at the last sampled token, the returns its advantages
        width = batch["response_mask"].shape[1]
        sampled = batch["attention_mask"][:, -width:].float()  # [B, R]
        scores = {"token_level_rewards": losses.token_level_scores(batch["rewards"], sampled)}
        batch = {**batch, **scores, "returns": batch["advantages"]}
    rows = []
    for i in range(batch["input_ids"].shape[0]):
        row = {k: v[i] for k, v in batch.items() if k not in SKIPPED}
        row["position"] = run.positions[batch["uid"][i]]  # the prompt's place in the step's prompt list
        if "episode" in batch:  # an agent's episode of several rows: position * n + j in the dump, for its replay
            row["episode"] = torch.tensor(row["position"] * n + batch["episode"][i].item() % n)
        rows.append(row)
    gathered = [None] * run.world
    dist.all_gather_object(gathered, (batch.get("layouts", {}), rows))
    if run.rank == 0:
        layouts = gathered[0][0]
        everyone = [r for _, part in gathered for r in part]
        full = _whole_batch(sorted(everyone, key=lambda r: r["position"]), layouts)  # stable: samples stay in order
        os.makedirs(root, exist_ok=True)
        torch.save(full, os.path.join(root, f"step_{step}.pt.tmp"))
        os.replace(os.path.join(root, f"step_{step}.pt.tmp"), os.path.join(root, f"step_{step}.pt"))
    dist.barrier()


SKIPPED = ("layouts", "update_logprobs", "uid")  # not per row / the update's own log-probs (in the metrics) /
# this rank's prompt index (the dump keeps each row's position instead)


def _whole_batch(rows: list[dict], layouts: dict) -> dict:
    """Rows gathered from all ranks (each rank's rows padded to its own widths) -> one batch, every entry re-padded
    to the widest by its layout: "token" entries from each row's first token (fsdp_train.add_fields), "response"
    ones on the right, "row" ones stacked (numbers) or listed."""
    prompts, responses = [], []
    for r in rows:
        width = len(r["response_mask"])
        prompts.append(r["input_ids"][:-width][r["attention_mask"][:-width].bool()].tolist())
        responses.append(r["input_ids"][-width:][r["attention_mask"][-width:].bool()].tolist())
    full = fsdp_train.make_batch(prompts, responses, pad_id=0)
    full["response_mask"] = _stack_padded(rows, "response_mask", full["response_mask"].shape[1])  # after rejection
    fields = [{} for _ in rows]
    for key in rows[0]:
        if key in full or key == "position":
            continue
        value = rows[0][key]
        layout, fill = layouts.get(key) or ("response" if torch.is_tensor(value) and value.dim() else "row", 0)
        for r, row_fields in zip(rows, fields, strict=True):
            row_fields[key] = (layout, _own_part(r, key, layout), fill)
    if fields[0]:
        fsdp_train.add_fields(full, fields)
    return full


def _own_part(row: dict, key: str, layout: str):
    """One gathered row's value of an entry without its rank's left padding: a "token" entry from the row's first
    token on; a "response" entry as it is (right-padded, re-padded to the widest); a "row" number as a number."""
    value = row[key]
    if layout == "token":
        return value[int(row["attention_mask"].argmax()) :]  # [P_rank + R_rank - left padding, ...]
    return value.item() if layout == "row" and torch.is_tensor(value) and value.dim() == 0 else value


def _stack_padded(rows: list[dict], key: str, width: int) -> torch.Tensor:
    """rows' per-token tensors [R_i] -> [B, width], zero-padded or cut to width."""
    return torch.stack([torch.nn.functional.pad(r[key], (0, width - r[key].shape[0]))[:width] for r in rows])


def load_replay(run, step: int) -> dict:
    """This rank's rows of a dumped step (the prompt positions it would have sampled): a complete batch
    with rewards, advantages, old and reference log-probs (and, when dumped, vLLM's log-probs, the IS
    weights and the post-rejection response mask). The step counts as one generation batch (run.gen_cursor)."""
    path = os.path.join(run.cfg["trainer"]["replay_batches"], f"step_{step}.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"trainer.replay_batches: {path} missing (the dump has fewer steps than this run)")
    n = run.cfg["rollout"]["n"]
    run.gen_cursor = step
    dumped = torch.load(path)
    for key in ("sampler_logprobs", "staleness"):  # a stale batch's (rollout ranks): the replay checks its old ones
        dumped.pop(key, None)
        dumped.get("layouts", {}).pop(key, None)
    if "episode" not in dumped:  # n rows per prompt, in position order
        batch = fsdp_train.select(dumped, [p * n + j for p in run.positions for j in range(n)])
        batch["uid"] = torch.arange(len(run.positions)).repeat_interleave(n)  # [B]: each row's prompt, this rank's
        return batch
    episodes = dumped["episode"].tolist()  # an agent's dump: position * n + j, an episode's rows together
    batch = fsdp_train.select(dumped, [k for p in run.positions for k, e in enumerate(episodes) if e // n == p])
    local = {p: i for i, p in enumerate(run.positions)}  # back to this rank's episodes, i * n + j
    batch["uid"] = torch.tensor([local[e // n] for e in batch["episode"].tolist()])
    batch["episode"] = torch.tensor([local[e // n] * n + e % n for e in batch["episode"].tolist()])
    return batch


def dumped_reference(reference):
    """A replayed batch's reference part: its dumped reference log-probs kept; reference (run, batch, t) for a dump
    without them."""

    def dumped_or_computed(run, batch: dict, t: dict) -> None:
        if "ref_logprobs" not in batch:
            reference(run, batch, t)

    return dumped_or_computed


def dumped_advantages(run, batch: dict) -> dict:
    """A replayed batch's advantages part: the dumped advantages (and returns), as they are."""
    return {}


def dumping(advantages):
    """trainer.dump_batches: the advantages part, then the step's batch saved (dump_batch, at run.step): the batch
    the update trains on, old and reference log-probs, rewards and advantages."""

    def advantages_then_dump(run, batch: dict) -> dict:
        out = advantages(run, batch)
        dump_batch(run, run.step, batch)
        return out

    return advantages_then_dump


def read_split(source: str, split: str, tiny_paths: dict | None, tokenizer, data_cfg: dict) -> tuple[list[dict], int]:
    """(rows, how many were filtered out as overlong) of one split; each node's first rank reads first (it may
    download), the node's other ranks then read the same files."""

    def read(first: bool):
        return filter_overlong(load_rows(source, split, tiny_paths), tokenizer, data_cfg)

    return cluster.node_first(read)
