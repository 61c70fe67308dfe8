"""tiny.py: the offline tokenizer, data and warm-started model that every other test stands on."""

import json
import os
import re

from transformers import AutoTokenizer
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

import reward
import rollout
import tiny


def test_instruction_matches_the_reward_prompt():
    assert tiny.INSTRUCTION == reward.INSTRUCTION


def test_dataset_is_gsm8k_format_deterministic_and_split():
    a, b = tiny.make_dataset(seed=3, n_train=300, n_test=50), tiny.make_dataset(seed=3, n_train=300, n_test=50)
    assert a == b and a != tiny.make_dataset(seed=4, n_train=300, n_test=50)
    assert not {r["question"] for r in a["train"]} & {r["question"] for r in a["test"]}
    for row in a["train"] + a["test"]:
        assert set(row) == {"question", "answer"}
        truth = reward.extract_ground_truth(row["answer"])
        for expr, value in re.findall(r"<<([^=]+)=(-?\d+)>>", row["answer"]):  # every calculator step is right
            assert eval(expr) == int(value)  # noqa: S307 -- our own generated arithmetic
        assert truth == row["answer"].split("\n")[-1].removeprefix("#### ")


def test_tokenizer_round_trips_through_save_and_autotokenizer(tiny_tokenizer, random_models):
    loaded = AutoTokenizer.from_pretrained(random_models["tied"])
    assert isinstance(loaded, Qwen2Tokenizer)  # transformers rebuilt it from vocab + merges
    for text in ["What is 3+4?\n", "  two  spaces\n\nand 1,234 #### -5.", "Ünïcode ✓ 数字", "<|im_end|>"]:
        assert loaded.decode(loaded(text)["input_ids"]) == text
        assert loaded(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
    assert [loaded.decode([i]) for i in loaded("1234")["input_ids"]] == ["1", "2", "3", "4"]  # Qwen2 digit split
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"


def test_build_is_cached_and_the_warm_start_answers_some_questions(tiny_build):
    marker = os.path.join(tiny_build["dir"], "COMPLETE")
    before = os.path.getmtime(marker)
    assert tiny.build(os.path.dirname(tiny_build["dir"]), seed=0) == tiny_build  # a cache hit: same paths
    assert os.path.getmtime(marker) == before
    with open(tiny_build["test"]) as f:
        rows = [json.loads(line) for line in f][:60]
    llm = rollout.make_engine(tiny_build["model"], dtype="float32", max_model_len=256, gpu_memory_utilization=0.2)
    samples = rollout.generate(
        llm, [reward.make_prompt(r["question"]) for r in rows], n=1, temperature=0.0, max_tokens=48
    )
    truths = [reward.extract_ground_truth(r["answer"]) for r in rows]
    last_number = [(re.findall(r"-?\d+", s.text) or [None])[-1] for s in samples]
    solved = sum(n == t for n, t in zip(last_number, truths, strict=True)) / len(rows)
    assert solved > 0.5  # it knows the arithmetic...
    strict = sum(reward.compute_score(s.text, t) for s, t in zip(samples, truths, strict=True)) / len(rows)
    assert strict < solved  # ...but, like an Instruct model, often ignores the "####" format
    del llm
