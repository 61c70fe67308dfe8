"""data.py: the loaders for every dataset layout, bad rows and files named in one line, overlong prompts filtered and
counted (never truncated), the order of each batch's prompts and the ranks' shares."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data
import reward
from grpo_runs import GSM, VERL, write_jsonl

# ------------------------------------------------------------------------------------- data


def test_loaders_for_every_layout(tmp_path):
    """Both layouts, both file types; veRL rows keep data_source and extra_info (a reward file gets them),
    GSM8K rows get veRL's data_source; every row says where it came from (for error messages)."""

    def plain(rows):
        return [{k: v for k, v in r.items() if k != "where"} for r in rows]

    expected_gsm = [
        {
            "prompt": [{"role": "user", "content": g["question"] + " " + reward.INSTRUCTION}],
            "ground_truth": truth,
            "data_source": "openai/gsm8k",
            "extra_info": {"index": i, "question": g["question"], "answer": g["answer"]},
        }
        for i, (g, truth) in enumerate(zip(GSM, ["7", "1200"], strict=True))
    ]
    expected_verl = [
        {
            "prompt": VERL[0]["prompt"],
            "ground_truth": "72",
            "data_source": "openai/gsm8k",
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "prompt": VERL[1]["prompt"],
            "ground_truth": "three",
            "data_source": "my/task",
            "extra_info": {"split": "train", "index": 1},
        },
    ]
    assert plain(data.load_rows(write_jsonl(tmp_path / "g.jsonl", GSM), "train", None)) == expected_gsm
    assert plain(data.load_rows(write_jsonl(tmp_path / "v.jsonl", VERL), "train", None)) == expected_verl
    pq.write_table(pa.Table.from_pylist(VERL), tmp_path / "v.parquet")
    pq.write_table(pa.Table.from_pylist(GSM), tmp_path / "g.parquet")
    assert plain(data.load_rows(str(tmp_path / "v.parquet"), "train", None)) == expected_verl
    assert plain(data.load_rows(str(tmp_path / "g.parquet"), "train", None)) == expected_gsm
    both = data.load_rows(f"{tmp_path / 'g.parquet'},{tmp_path / 'v.parquet'}", "train", None)
    assert [r["where"] for r in both] == [f"{tmp_path / f}.parquet row {i}" for f in "gv" for i in (0, 1)]
    assert plain(both) == expected_gsm + expected_verl


@pytest.mark.parametrize(
    "rows, message",
    [
        ([GSM[0], {"question": "no answer"}], r"bad.jsonl: row 1: missing field 'answer'"),
        ([{"answer": "#### 3"}], r"bad.jsonl: row 0: missing field 'question'"),
        ([{"question": "q", "answer": "three"}], r"bad.jsonl: row 0: field 'answer': .*####"),
        (
            [VERL[0], {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}}],
            r"bad.jsonl: row 1: missing field 'reward_model.ground_truth'",
        ),
        ([{"prompt": "a string", "reward_model": {"ground_truth": "1"}}], r"bad.jsonl: row 0: field 'prompt'"),
        ([["not", "an", "object"]], r"bad.jsonl: row 0: expected an object"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        data.load_rows(write_jsonl(tmp_path / "bad.jsonl", rows), "train", None)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        data.load_rows(str(tmp_path / "missing.jsonl"), "train", None)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type; accepted: .parquet, .jsonl"):
        data.load_rows(str(tmp_path / "x.csv"), "train", None)
    (tmp_path / "broken.jsonl").write_text(json.dumps(GSM[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match="broken.jsonl: row 1: not valid JSON"):
        data.load_rows(str(tmp_path / "broken.jsonl"), "train", None)


def test_overlong_prompts_are_filtered_and_counted_never_truncated(tiny_tokenizer):
    rows = [
        {"prompt": [{"role": "user", "content": "short"}], "ground_truth": "1"},
        {"prompt": [{"role": "user", "content": "long " * 200}], "ground_truth": "2"},
    ]
    d = {"max_prompt_length": 64, "filter_overlong_prompts": True, "apply_chat_template_kwargs": None}
    kept, dropped = data.filter_overlong(rows, tiny_tokenizer, d)
    assert kept == rows[:1] and dropped == 1 and kept[0] is rows[0]
    with pytest.raises(ValueError, match="1 prompts exceed data.max_prompt_length=64"):
        data.filter_overlong(rows, tiny_tokenizer, {**d, "filter_overlong_prompts": False})
    # the boundary: a prompt of exactly max_prompt_length tokens (the chat template rendered, as vLLM gets it)
    text = tiny_tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    length = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert data.filter_overlong(rows[:1], tiny_tokenizer, {**d, "max_prompt_length": length}) == (rows[:1], 0)
    assert data.filter_overlong(rows[:1], tiny_tokenizer, {**d, "max_prompt_length": length - 1}) == ([], 1)


def test_data_order_and_rank_shares():
    rows = [{"i": i} for i in range(10)]
    assert [r["i"] for r in data.step_prompts(rows, 1, 4, False, 0)] == [0, 1, 2, 3]
    assert [r["i"] for r in data.step_prompts(rows, 3, 4, False, 0)] == [0, 1, 2, 3]  # drop_last: new epoch
    shuffled = [[r["i"] for r in data.step_prompts(rows, s, 4, True, 0)] for s in (1, 2, 3, 4)]
    assert shuffled[0] != [0, 1, 2, 3] and shuffled[:2] == [
        [r["i"] for r in data.step_prompts(rows, s, 4, True, 0)] for s in (1, 2)
    ]
    assert len(set(shuffled[0] + shuffled[1])) == 8 and shuffled[0] != shuffled[2]  # reshuffled per epoch
    for world in (1, 2, 4):
        shares = [data.local_positions(16, 8, world, r) for r in range(world)]
        assert sorted(p for s in shares for p in s) == list(range(16))
        for s in shares:  # each mini-batch split evenly over the ranks
            assert sum(p < 8 for p in s) == sum(p >= 8 for p in s) == 8 // world
