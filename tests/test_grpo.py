"""grpo.py: config loading and its errors, data loaders, and short end-to-end tiny runs
(world sizes 1 and 2, resume after a kill, dump at 1 rank / replay at 2)."""

import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import config
import dapo
import data
import fsdp_train
import metrics
import reward
import rollout
from conftest import ROOT, cli_calls, free_port, threads

VAL_KEY = "val-core/openai/gsm8k/reward/mean@1"  # veRL's name of greedy validation accuracy on GSM8K

# ------------------------------------------------------------------------------------ config


def test_defaults_yaml_and_overrides(tmp_path):
    cfg = config.load_config(
        os.path.join(ROOT, "gsm8k.yaml"), ["actor.lr=3e-6", "trainer.total_steps=7", "trainer.logger=[console, wandb]"]
    )
    assert cfg["actor"]["lr"] == 3e-6 and isinstance(cfg["actor"]["lr"], float)  # "3e-6": YAML 1.1 string
    assert cfg["trainer"]["total_steps"] == 7 and cfg["trainer"]["logger"] == ["console", "wandb"]
    assert cfg["data"]["train_batch_size"] == 96 and cfg["actor"]["clip_ratio_high"] == 0.28
    assert cfg["actor"]["entropy_coeff"] == 0.003 and cfg["actor"]["kl_loss_coef"] == 0.001
    assert config.load_config(None, [])["actor"]["lr"] == config.DEFAULTS["actor"]["lr"]
    assert config.load_config(None, ["actor.kl_loss_coef=0"])["actor"]["kl_loss_coef"] == 0.0  # int -> float
    rc = config.load_config(
        None,
        [
            "algorithm.rollout_correction.rollout_is_threshold=0.5_2",  # not YAML's 0.52
            "algorithm.rollout_correction.rollout_rs_threshold=3",
        ],
    )["algorithm"]["rollout_correction"]
    assert rc["rollout_is_threshold"] == "0.5_2" and rc["rollout_rs_threshold"] == 3.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.lrr=1", "unknown key 'actor.lrr'; accepted: actor.lr, actor.lr_warmup_steps"),
        ("optim.lr=1", "unknown key 'optim.lr'; accepted: model, data, rollout"),
        ("actor.lr=fast", "actor.lr = 'fast' has type str; expected float"),
        ("data.train_batch_size=1.5", "data.train_batch_size = 1.5 has type float; expected int"),
        ("data.shuffle=1", "data.shuffle = 1 has type int; expected bool"),
        ("trainer.total_steps=ten", "trainer.total_steps = 'ten' has type str; expected int"),
        ("actor.loss_agg_mode=sum", "accepted: token-mean, token-sum, seq-mean-token-sum"),
        ("actor.policy_loss.loss_mode=ppo", "loss_mode = 'ppo'; accepted: vanilla, gspo, cispo, sapo, geo_mean"),
        (
            "algorithm.adv_estimator=gae",
            "adv_estimator = 'gae'; accepted: grpo, rloo, reinforce_plus_plus_baseline, reinforce_plus_plus",
        ),
        ("algorithm.kl_penalty=full", "algorithm.kl_penalty = 'full'; accepted: kl, k1, abs"),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type = 'pid'; accepted: fixed, adaptive"),
        ("algorithm.gamma=1.5", "algorithm.gamma = 1.5; accepted: 0 <= value <= 1"),
        ("actor.tau_neg=0", "actor.tau_neg = 0.0; accepted: > 0"),
        ("actor.loss_scale_factor=0", "actor.loss_scale_factor = 0.0; accepted: > 0"),
        ("algorithm.adv_estimator=rloo rollout.n=1", "adv_estimator = rloo needs rollout.n > 1"),
        ("algorithm.adv_estimator=reinforce_plus_plus_baseline rollout.n=1", "needs rollout.n > 1"),
        (
            "actor.policy_loss.loss_mode=geo_mean algorithm.adv_estimator=reinforce_plus_plus "
            "algorithm.use_kl_in_reward=true",
            "loss_mode = geo_mean takes one advantage per response",
        ),
        (
            "actor.policy_loss.loss_mode=geo_mean algorithm.adv_estimator=reinforce_plus_plus algorithm.gamma=0.9",
            "geo_mean",
        ),
        ("actor.kl_loss_type=full", "accepted: kl, k1, abs"),
        ("actor.clip_ratio_c=1", "actor.clip_ratio_c = 1.0; accepted: > 1"),
        ("actor.lr=-1", "actor.lr = -1.0; accepted: > 0"),
        ("rollout.temperature=-1", "rollout.temperature = -1.0; accepted: > 0"),
        ("rollout.top_p=2", "rollout.top_p = 2.0; accepted: 0 < value <= 1"),
        ("rollout.top_k=0", "rollout.top_k = 0; accepted: -1 (off) or >= 1"),
        ("rollout.top_p=0.8", "rollout.top_p = 0.8, rollout.top_k = -1; accepted for training: top_p 1 and top_k -1"),
        ("rollout.top_k=50", "rollout.top_p = 1.0, rollout.top_k = 50; accepted for training: top_p 1 and top_k -1"),
        ("data.apply_chat_template_kwargs=thinking", "data.apply_chat_template_kwargs = 'thinking' has type str"),
        ("actor.grad_clip=-1", "actor.grad_clip = -1.0; accepted: > 0"),
        ("data.max_response_length=0", "data.max_response_length = 0; accepted: >= 1"),
        ("trainer.total_steps=0", "trainer.total_steps = 0; accepted: >= 1"),
        ("rollout.n=0", "rollout.n = 0; accepted: >= 1"),
        ("actor.clip_ratio_high=-0.1", "actor.clip_ratio_high = -0.1; accepted: >= 0"),
        ("actor.clip_ratio_low=-1", "actor.clip_ratio_low = -1.0; accepted: >= 0 (>= 1: no lower bound"),
        ("actor.lr_warmup_steps=-2", "actor.lr_warmup_steps = -2; accepted: >= 0"),
        ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization = 0.0; accepted: 0 < value <= 1"),
        (
            "rollout.tensor_parallel_size=2",
            "rollout.tensor_parallel_size = 2; accepted: 1 (each rank runs its own engine",
        ),
        ("rollout.sleep_level=2", "rollout.sleep_level = 2; accepted: 1 (level 2 discards the weights; wrong outputs"),
        ("trainer.resume=/tmp", "trainer.resume = '/tmp' is not a checkpoint"),
        ("algorithm.rollout_correction.rollout_is=seq", "rollout_is = 'seq'; accepted: token, sequence"),
        (
            "algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2_1",
            "rollout_is = 'token', rollout_is_threshold = '2_1', rollout_is_batch_normalize = False, rollout_rs = None",
        ),
        (
            "algorithm.rollout_correction.rollout_rs=token_k9",
            "rollout_rs = 'token_k9', rollout_rs_threshold = None: "
            "rollout_rejection_mask: modes='token_k9'; accepted: a comma",
        ),
        (
            "algorithm.rollout_correction.rollout_rs=token_k2",
            "rollout_rs = 'token_k2', rollout_rs_threshold = None: rollout_rejection_mask: thresholds=None",
        ),
        (
            "algorithm.rollout_correction.bypass_mode=true algorithm.rollout_correction.rollout_is=token",
            "rollout_is = 'token' with bypass_mode=true; accepted: null",
        ),
        (
            "algorithm.rollout_corection.rollout_is=token",
            "unknown key 'algorithm.rollout_corection.rollout_is'; accepted: "
            "algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo",
        ),
        (
            "data.gen_batch_size=4",
            "data.gen_batch_size = 4; accepted: null or data.train_batch_size, unless "
            "algorithm.filter_groups.enable=true",
        ),
        ("rollout.val_n=4", "rollout.val_n = 4 needs rollout.val_temperature > 0"),
        (
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len = 0; accepted: 0 < value <= data.max_response_length",
        ),
        ("custom_reward_function.path=7", "custom_reward_function.path = 7 has type int; expected str"),
        (
            "actor.logprob_chunk_size=-1",
            "actor.logprob_chunk_size = -1; accepted: >= 0 (response positions per lm_head",
        ),
        ("actor.betas=[0.9]", "actor.betas = [0.9]; accepted: two numbers in [0, 1)"),
        ("actor.lr=.inf", "actor.lr = inf; accepted: a finite number"),
        ("trainer.logger=[tensorboard]", "trainer.logger = ['tensorboard']; accepted: a list of: console, wandb"),
        (
            "rollout.cudagraph_capture_sizes=[8,0]",
            "rollout.cudagraph_capture_sizes = [8, 0]; accepted: null (vLLM's sizes) or a list of batch sizes >= 1",
        ),
        ("rollout.cudagraph_capture_sizes=[]", "rollout.cudagraph_capture_sizes = []; accepted: null"),
        ("rollout.cudagraph_capture_sizes=64", "rollout.cudagraph_capture_sizes = 64 has type int; expected list"),
        ("model.compute_dtype=fp16", "accepted: float32, bfloat16, float16"),
        ("actor.ppo_mini_batch_size=5", "multiple of actor.ppo_mini_batch_size (5)"),
        ("trainer.resume=/no/such/dir", "is not a checkpoint; accepted: off, auto, or a complete checkpoint directory"),
        ("actor.lr", "is not key.sub=value"),
    ],
)
def test_config_errors_name_the_key_and_the_accepted_values(override, message):
    """config.load_config's checks, then an optional feature's own when its key is set (grpo.choose_parts: the GRPO
    family's, the rollout correction's, DAPO's): one line, an error flatgrpo defines, before anything loads."""
    import grpo

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as e:
        grpo.choose_parts(config.load_config(None, override.split(" ")))
    assert grpo.one_line(e.value) and "\n" not in str(e.value)


def test_an_overlong_buffer_as_long_as_the_responses_is_accepted():
    """reward.overlong_buffer.len = data.max_response_length is the boundary veRL accepts (its DAPO manager asserts
    max_resp_len >= len): every response is then in the buffer; one token more is refused."""
    on = [
        "reward.overlong_buffer.enable=true",
        "data.max_response_length=48",
        "reward.overlong_buffer.penalty_factor=1",
    ]
    import grpo

    grpo.choose_parts(config.load_config(None, [*on, "reward.overlong_buffer.len=48"]))
    with pytest.raises(dapo.DapoError, match=r"len = 49; accepted: 0 < value <= data.max_response_length \(48\)"):
        grpo.choose_parts(config.load_config(None, [*on, "reward.overlong_buffer.len=49"]))
    assert [dapo.overlong_penalty(length, 48, 48, 1.0) for length in (0, 12, 48)] == [0.0, -0.25, -1.0]


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lr: 1e-5\n  cliprange: 0.2\n")
    with pytest.raises(config.ConfigError, match=f"{bad}.*unknown key 'actor.cliprange'"):
        config.load_config(str(bad), [])
    bad.write_text("actors:\n  lr: 1\n")
    with pytest.raises(config.ConfigError, match=f"{bad}.*unknown key 'actors.lr'; accepted: model, data, rollout"):
        config.load_config(str(bad), [])
    bad.write_text("trainer:\n  dump_batches: a\n  replay_batches: b\n")
    with pytest.raises(config.ConfigError, match="exclusive"):
        config.load_config(str(bad), [])


def error_line_of_call(result: dict) -> str:
    """The one line a cli_calls call that stopped with an error printed: status 1, nothing else on stderr."""
    assert result["exit"] == 1 and len(result["stderr"].splitlines()) == 1, result
    return result["stderr"].rstrip("\n")


def test_cli_stops_with_one_line_before_loading_anything(cli):
    results, files = cli
    assert error_line_of_call(results["bad override"]) == "error: config: actor.lr = 'x' has type str; expected float"
    assert not os.path.exists(files["never"])


def test_every_ranged_key_is_a_known_key_and_every_default_is_accepted():
    for key in config.TYPES:
        assert key in config.FLAT, key
    rules = []
    for section in config.SCHEMA.values():  # every rule parses (a rule that cannot be evaluated would only
        for entry in section.values():  # fail once a user sets that key)
            for e in entry.values() if isinstance(entry, dict) else [entry]:
                if isinstance(e, tuple) and isinstance(e[1], str):
                    rules.append(e[1])
                    assert e[0] is None or config._passes(e[1], e[0]), e
    assert len(rules) > 40
    for path in (None, os.path.join(ROOT, "gsm8k.yaml"), os.path.join(ROOT, "tiny.yaml")):
        config.load_config(path, [])


def one_error_line(proc) -> str:
    """The single line a bad run ends with; no traceback from our ranks."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr.replace("torch.distributed.elastic", "")
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "path, message",
    [
        (
            "/nonexistent/model",
            "error: config: model.path = '/nonexistent/model': no such directory; accepted: "
            "a local model directory (config.json, *.safetensors) or a hub id",
        ),
        (
            "nobody/no-such-model",
            "error: config: model.path = 'nobody/no-such-model': not a "
            "local directory, and the hub copy could not be fetched",
        ),
    ],
)
def test_cli_wrong_model_path_stops_with_one_line(cli, path, message):
    """An offline machine (HF_HUB_OFFLINE=1, an empty hub cache): a missing directory, and a hub id not cached."""
    results, _ = cli
    assert error_line_of_call(results[f"model.path={path}"]).startswith(message)


def test_routing_replay_of_a_dense_model_stops_in_one_line(cli):
    """actor.router_replay.mode with the tiny dense model (moe.py; test_moe has the other refusals)."""
    results, _ = cli
    line = error_line_of_call(results["dense R2"])
    assert line.startswith("error: model ") and line.endswith(
        "actor.router_replay.mode needs a Mixture-of-Experts model; Qwen2ForCausalLM has no router (accepted for it: "
        "disabled)"
    ), line


def test_model_directory_without_weights_or_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(config.ConfigError, match=r"model.path = .*: the directory has no \*.safetensors$"):
        data.resolve_model(str(tmp_path), download=False)
    (tmp_path / "config.json").unlink()
    with pytest.raises(config.ConfigError, match=r"has no config.json and no \*.safetensors"):
        data.resolve_model(str(tmp_path), download=False)


@pytest.fixture(scope="module")
def cli(tiny_build, reward_files, tmp_path_factory) -> tuple[dict, dict]:
    """The command lines of these tests that stop before a model loads, run in ONE process (tests/cli_calls.py:
    importing vLLM costs seconds per process): ({name: {"stdout", "stderr", "exit"}}, {name: a file they read or
    write})."""
    root = tmp_path_factory.mktemp("cli")
    files = {"gsm": write_jsonl(root / "gsm.jsonl", GSM), "other": write_jsonl(root / "other.jsonl", VERL)}
    files["bad"] = write_jsonl(root / "bad.jsonl", [GSM[0], {"question": "no answer"}])
    files["never"] = str(root / "never")
    small = ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "trainer.total_steps=1"]
    calls = {"defaults": ["--print-config"]}
    for name in SHIPPED_CONFIGS:  # test_every_printed_key_is_documented_with_its_value
        calls[name] = ["--print-config", "--config", name]
    calls |= {
        "gsm8k lr": ["--print-config", "--config", "gsm8k.yaml", "actor.lr=3e-6"],
        "help": ["--help"],
        # VERL's row 1 is of data source my/task: no built-in scorer
        "train rows": ["--config", "tiny.yaml", *small, f"data.train={files['other']}", f"data.val={files['gsm']}"],
        "val rows": ["--config", "tiny.yaml", *small, f"data.train={files['gsm']}", f"data.val={files['other']}"],
        "val_only rows": ["--config", "tiny.yaml", "trainer.val_only=true", f"data.val={files['other']}"],
        "bad override": ["--config", "tiny.yaml", "actor.lr=x", f"trainer.output_dir={files['never']}"],
        "bad data": ["--config", "tiny.yaml", f"data.train={files['bad']}"],
    }
    calls["dense R2"] = ["--config", "tiny.yaml", *small, "actor.router_replay.mode=R2"]  # test_moe's replay errors
    for path in ("/nonexistent/model", "nobody/no-such-model"):  # test_cli_wrong_model_path_stops_with_one_line
        calls[f"model.path={path}"] = ["--config", "tiny.yaml", f"model.path={path}"]
    for key in ("path=/no/such/reward.py", "name=nope", "path={broken}"):  # test_bad_reward_files_stop_with_one_line
        path = [] if key.startswith("path") else [f"custom_reward_function.path={reward_files['constant']}"]
        calls[key] = ["--config", "tiny.yaml", *SMALL, "trainer.val_only=true", *path]
        calls[key].append(f"custom_reward_function.{key.format(**reward_files)}")
    for k, argv in enumerate(calls.values()):  # an output directory of its own for every call that would write one
        if argv[0] == "--config" and not any(a.startswith("trainer.output_dir=") for a in argv):
            argv.append(f"trainer.output_dir={root / f'run{k}'}")
    hub = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root / "hub")}  # an offline machine
    return cli_calls(calls, root, env=hub), files


def test_print_config_and_help(cli):
    results, _ = cli
    printed = yaml.safe_load(results["gsm8k lr"]["stdout"])
    assert printed == config.load_config(os.path.join(ROOT, "gsm8k.yaml"), ["actor.lr=3e-6"])
    assert printed["actor"]["lr"] == 3e-6 and printed["trainer"]["verbose"] is False
    text = results["help"]["stdout"]
    assert results["help"]["exit"] == 0
    assert "the new\nweights go back into the same vLLM engine, every step." in text and "--print-config" in text


def yaml_value(value) -> str:
    """A value as one line of YAML, as the table writes it: "off" -> 'off', None -> null, [0.9, 0.999]."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()


SHIPPED_CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.yaml")))  # tiny.yaml, ...


def documented_keys() -> tuple[list[str], dict[str, dict]]:
    """docs/verl-mapping.md's section "Every key" as (its config files, {key: {"defaults": value, file: value}}):
    the header names the files (`tiny.yaml`, ...), each cell is a YAML value, an empty file cell the default."""
    with open(os.path.join(ROOT, "docs", "verl-mapping.md")) as f:
        section = re.search(r"\n## \d+\. Every key[^\n]*\n(.*?)(?=\n## |\Z)", f.read(), re.DOTALL)[1]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip().strip("`") for cell in lines[0].strip("|").split("|")]
    files = [cell for cell in header if cell.endswith(".yaml")]
    table = {}
    for line in lines[1:]:  # the rule line "|---|..." is not among them
        key, default, *cells = [cell.strip().strip("`") for cell in line.strip("|").split("|")][: 2 + len(files)]
        table[key] = {"defaults": yaml.safe_load(default)}
        for file, cell in zip(files, cells, strict=True):
            table[key][file] = yaml.safe_load(cell) if cell else table[key]["defaults"]
    return files, table


def test_every_printed_key_is_documented_with_its_value(cli):
    """Golden defaults: `grpo.py --print-config` with no file, and with each config file at the repository's top
    level (tiny.yaml, gsm8k.yaml, ...), prints exactly the keys of docs/verl-mapping.md's table "Every key", each
    with the value the table gives (the default, or the file's). A new key fails here until its row is written, a
    new config file until its column is, a changed default or shipped value until the table says so."""
    results, _ = cli
    files, table = documented_keys()
    assert sorted(files) == SHIPPED_CONFIGS and len(table) > 80, files
    for name in ("defaults", *files):
        printed = config._flat(yaml.safe_load(results[name]["stdout"]))
        row = "| `{}` | `{}` |" + " |" * len(files) + " veRL's key |"
        missing = [row.format(k, yaml_value(v)) for k, v in printed.items() if k not in table]
        assert not missing, 'docs/verl-mapping.md, "Every key", lacks the rows\n' + "\n".join(missing)
        assert set(table) <= set(printed), f"documented, never printed: {sorted(set(table) - set(printed))}"
        wrong = {k: (v, table[k][name]) for k, v in printed.items() if v != table[k][name]}
        assert not wrong, f"--print-config ({name}) vs docs/verl-mapping.md, key: (printed, documented): {wrong}"


def stated_values(text: str) -> list[tuple[str, object]]:
    """(key, value) of every "`key` (value)" in a text, where key is a flatgrpo key and value one YAML value that
    the key accepts (not a remark: "`actor.ppo_max_token_len_per_gpu` (activations)")."""
    stated = []
    for m in re.finditer(r"`([\w.]+)` \(([^()\s,]+)\)", text):
        if m[1] in config.FLAT:
            try:
                stated.append((m[1], config._check(m[1], yaml.safe_load(m[2]), config.FLAT[m[1]])))
            except config.ConfigError:
                pass
    return stated


def recipe_values(readme: str) -> list[tuple[str, object]]:
    """(flatgrpo key, value) of the veRL key mapping rows "`verl.key=value` | `flatgrpo.key` | note" (one key each
    side) in docs/verl-mapping.md's section "veRL key mapping (the seed recipe)", except where the note says
    gsm8k.yaml differs: the seed recipe's values, as gsm8k.yaml's."""
    section = readme.split("veRL key mapping (the seed recipe)\n")[1].split("\n## ")[0]
    out = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        verl, ours = (
            re.fullmatch(r"`[\w.]+=([^`]+)`", cells[0]),
            re.fullmatch(r"`([\w.]+)`", cells[1] if cells[1:] else ""),
        )
        if verl and ours and ours[1] in config.FLAT and "gsm8k.yaml" not in line:
            out.append((ours[1], config._check(ours[1], yaml.safe_load(verl[1]), config.FLAT[ours[1]])))
    return out


def test_the_readme_states_the_defaults_and_the_recipe_values(cli):
    """Where README.md or a page of docs/ says "`key` (value)", value is the key's default; docs/verl-mapping.md's
    veRL key mapping gives the seed recipe's values, which gsm8k.yaml must hold."""
    results, _ = cli
    defaults, gsm8k = (config._flat(yaml.safe_load(results[name]["stdout"])) for name in ("defaults", "gsm8k.yaml"))
    pages = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    text = "".join(open(page).read() for page in pages)
    stated = stated_values(text)
    assert len(stated) >= 5
    assert [(k, defaults[k]) for k, _ in stated] == stated
    with open(os.path.join(ROOT, "docs", "verl-mapping.md")) as f:
        recipe = recipe_values(f.read())
    assert len(recipe) >= 15
    assert [(k, gsm8k[k]) for k, _ in recipe] == recipe


@pytest.mark.parametrize("call", ["train rows", "val rows", "val_only rows"])
def test_rows_without_a_scorer_stop_at_start_up(cli, call):
    """Without a reward file only GSM8K rows can be scored: training rows, validation rows and val_only's rows of
    another data source stop the run before a model loads, in one line naming the file and the row."""
    results, files = cli
    assert error_line_of_call(results[call]) == (
        f"error: data: {files['other']} row 1: data_source 'my/task' has no built-in scorer; accepted: "
        "openai/gsm8k, or a reward file in custom_reward_function.path"
    )
    assert "train prompts" not in results[call]["stdout"]  # load_data's summary: the rows were refused before it


def test_cli_bad_data_stops_with_one_line(cli):
    """(A batch that the world size does not divide: test_every_end_of_a_run_is_clean, at 2 ranks.)"""
    results, files = cli
    assert error_line_of_call(results["bad data"]) == (
        f"error: data: {files['bad']}: row 1: missing field 'answer' "
        "(accepted layouts: question/answer, or prompt/reward_model.ground_truth)"
    )


# Every documented end of a run, many times over (tests/exit_worker.py: children forked from one torchrun run, with
# a native thread busy in torch when each ends): name -> (overrides, the line the run's stderr ends with, or its start)
ENDS = {
    "config": (["actor.lr=x"], "error: config: actor.lr = 'x' has type str; expected float"),
    "hub_id": (["model.path=nobody/no-such-model"], "error: config: model.path = 'nobody/no-such-model': not a local"),
    "local_dir": (["model.path=/nonexistent/model"], "error: config: model.path = '/nonexistent/model': no such dir"),
    "data_file": (["data.train=/no/such/train.jsonl"], "error: data: /no/such/train.jsonl does not exist (accepted:"),
    "reward_file": (
        ["custom_reward_function.path=/no/such/reward.py"],
        "error: config: custom_reward_function.path = '/no/such/reward.py': no such file",
    ),
}
ENDS_2_RANKS = {
    "world_size": (
        ["data.train_batch_size=3", "actor.ppo_mini_batch_size=3"],
        "error: config: actor.ppo_mini_batch_size (3) must be a multiple of the world size (2)",
    ),
    "shared_dir": ([], "error: config: trainer.output_dir = "),  # rank 1 does not see rank 0's directory
}
STOP = ["rollout.n=2", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "data.max_response_length=8"]
STOP += ["trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0", "trainer.export_hf=false"]
STOP += ["actor.use_kl_loss=false"]


def end_cases(reps: int) -> list[dict]:
    """exit_worker.py's plan: every error end `reps` times as `python grpo.py` (world 1) and as 2 torchrun ranks,
    and a SIGTERM stop once in each (it runs a step)."""
    cases = []
    for world in (1, 2):
        ends = {**ENDS, **ENDS_2_RANKS} if world == 2 else ENDS
        for name, (overrides, _) in ends.items():
            argv = ["--config", "tiny.yaml", *overrides]
            cases.append({"name": name, "argv": argv, "world": world, "reps": reps, "blind": name == "shared_dir"})
        cases.append(
            {"name": "stop", "argv": ["--config", "tiny.yaml", *STOP], "world": world, "reps": 1, "stop": True}
        )
    for case in cases:
        case["name"] += f"-{case['world']}"
    return cases


def test_every_end_of_a_run_is_clean(tiny_build, tmp_path):
    """Each documented end of a run (bad config value, hub id with no hub, missing model directory, missing data
    file, missing reward file, world size, a node blind to the output directory, SIGTERM) as `python grpo.py` and
    as 2 torchrun ranks: exit status 1 (143 after the stop's checkpoint line) and the run's line last, however
    late a native thread is (cluster.end_process). Through the interpreter's finalization, each of these ends
    aborts after that line instead ("terminate called without an active exception", status -6)."""
    plan = end_cases(reps=4)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    cmd = [*torchrun, "tests/exit_worker.py", str(tmp_path / "plan.json"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for case in plan:
        ends = [end for results in ranks for end in results.get(case["name"], [])]
        assert len(ends) == case["reps"] * case["world"], case["name"]
        for end in ends:
            assert "terminate called" not in end["stderr"], (case["name"], end)
            if case.get("stop"):
                assert end["status"] == 143, (case["name"], end)
                checkpoint = out / f"{case['name']}-0" / "checkpoints" / "step_1"
                if end["rank"] == 0 or case["world"] == 1:
                    assert end["stdout"].splitlines()[-1] == (
                        f"stopped by SIGTERM after step 1: checkpoint {checkpoint}; run again with "
                        "trainer.resume=auto to continue"
                    )
                assert fsdp_train.list_checkpoints(str(checkpoint.parent)) == [str(checkpoint)]
            else:
                message = {**ENDS, **ENDS_2_RANKS}[case["name"].rsplit("-", 1)[0]][1]
                assert end["status"] == 1 and end["stderr"].splitlines()[-1].startswith(message), (case["name"], end)


# ------------------------------------------------------------------------------------- data
GSM = [
    {"question": "Tom has 3 apples and gets 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "Ann has 1,200 coins.", "answer": "#### 1,200"},
]
VERL = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Q? Let's think"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "my/task",
        "prompt": [{"role": "user", "content": "Spell 3"}],
        "ability": "other",
        "reward_model": {"style": "rule", "ground_truth": "three"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


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


# ------------------------------------------------------------------------------ end to end
SMALL = [
    "trainer.sync_check_every=1",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=4",
    "data.max_response_length=32",
    "data.val_max_samples=32",
    "trainer.val_every=2",
    "trainer.total_steps=3",
    "actor.lr=1e-4",
]
TIMING = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu")


def run_grpo(
    out,
    nproc: int,
    *overrides: str,
    background: bool = False,
    check: bool = True,
    env: dict | None = None,
    script: str = "grpo.py",
):
    env = {**os.environ, "OMP_NUM_THREADS": threads(nproc), **(env or {})}
    launcher = (
        [sys.executable, script]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            script,
        ]
    )
    cmd = launcher + ["--config", "tiny.yaml", *SMALL, f"trainer.output_dir={out}", *overrides]
    if background:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 or not check, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(TIMING)}


VERL_KEYS = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_loss",
    "actor/kl_coef",
    "actor/grad_norm",
    "actor/lr",
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/returns/min",
    "response_length/mean",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "prompt_length/clip_ratio",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "timing_per_token_ms/gen",
    "timing_per_token_ms/update_actor",
    "perf/throughput",
    "perf/time_per_step",
    "perf/total_num_tokens",
    "perf/mfu/actor",
    "rollout/logprob_diff_max",
    "rollout/logprob_diff_mean",
]


@pytest.fixture(scope="module")
def val_file(tiny_build, tmp_path_factory):
    """(path, expected greedy mean@1): 7 validation rows (odd, so 2 ranks get 4 and 3) in veRL's layout;
    rows 0, 2, 4 and 6 carry as ground truth what the model answers greedily (HF generate here, an
    independent decoder; read with reward.method=flexible, which takes "12." from "The answer is 12."),
    the others a wrong one. The runs' step-0 validation must give exactly the expected score."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_build["model"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_build["model"])
    with open(tiny_build["test"]) as f:
        questions = [json.loads(line)["question"] for line in f][:7]
    rows, scores = [], []
    for i, question in enumerate(questions):
        prompt = reward.make_prompt(question)
        ids = rollout.render_prompt(tokenizer, prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        answer = reward.extract_solution(text, "flexible")
        truth = str(answer) if i % 2 == 0 and answer else "-12345"
        rows.append({"prompt": prompt, "reward_model": {"ground_truth": truth}})
        scores.append(reward.compute_score(text, truth, method="flexible"))
    path = tmp_path_factory.mktemp("val") / "val.jsonl"
    write_jsonl(path, rows)
    assert 0 < sum(scores) < len(scores)
    return str(path), sum(scores) / len(scores)


@pytest.fixture(scope="module")
def hub_cache(tiny_build, tmp_path_factory) -> dict:
    """The environment of an offline machine whose Hugging Face cache holds the tiny model as the hub repo
    flatgrpo/tiny-grpo, in the layout snapshot_download writes (models--org--name, refs/main, snapshots)."""
    root = tmp_path_factory.mktemp("hub")
    repo, revision = root / "models--flatgrpo--tiny-grpo", "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_build["model"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root)}


@pytest.fixture(scope="module")
def e2e(tiny_build, val_file, hub_cache, tmp_path_factory):
    """{nproc: (out dir, the finished process)} of a 3-step tiny run at 1 and at 2 ranks, with the model
    given as a hub id (model.path=flatgrpo/tiny-grpo, resolved offline from hub_cache), dumping every
    batch to <out>/dump."""
    runs = {}
    for nproc in (1, 2):
        out = tmp_path_factory.mktemp(f"e2e{nproc}")
        proc = run_grpo(out / "run", nproc, *e2e_overrides(out, val_file), env=hub_cache)
        runs[nproc] = (out, proc)
    return runs


def e2e_overrides(out, val_file) -> list[str]:
    """The end-to-end runs' overrides (to SMALL), with their dumps in <out>/dump."""
    return [
        "trainer.save_every=2",
        f"trainer.dump_batches={out / 'dump'}",
        f"data.val={val_file[0]}",
        "reward.method=flexible",
        "model.path=flatgrpo/tiny-grpo",
    ]


LIBRARY_LINE = re.compile(r"\b(INFO|WARNING|Warning|FutureWarning)\b|Failed to load weights")


@pytest.mark.parametrize("nproc", [1, 2])
def test_end_to_end_tiny_run(e2e, val_file, nproc):
    out, proc = e2e[nproc][0] / "run", e2e[nproc][1]
    console = [
        line
        for line in (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()
        if line.strip() and not line.startswith("grpo:")
    ]  # tqdm's redraws start with "grpo:"
    assert len(console) <= 20, console  # ours: what runs, data, validation, a line per step, the summary
    assert not [line for line in console if LIBRARY_LINE.search(line)], console  # no engine chatter, no warning
    assert "metrics.jsonl" in proc.stdout and "flatgrpo: model flatgrpo/tiny-grpo" in proc.stdout
    with open(out / "engine.log") as f:
        engine_log = f.read()
    assert "vllm" in engine_log and "Failed to load weights" in engine_log  # routed there, not lost
    step_lines = [line for line in console if re.match(r"step +\d+  score ", line)]
    assert [int(line.split()[1]) for line in step_lines] == [1, 2, 3]  # one line per step, by rank 0 only
    assert [line.split(":")[0] for line in console if line.startswith("step ") and VAL_KEY in line] == [
        "step 0",
        "step 2",
        "step 3",
    ]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert set(rows[0]) == {"step", VAL_KEY}
    assert rows[0][VAL_KEY] == pytest.approx(val_file[1])  # a global mean over all 7 rows, at any world size
    for r in rows[1:]:
        assert set(VERL_KEYS) <= set(r), set(VERL_KEYS) - set(r)
        assert r["rollout/logprob_diff_max"] < 1e-3  # vLLM serves the trained weights
        assert r["rollout_corr/kl"] == pytest.approx(0, abs=1e-4) and "rollout_corr/chi2_token" in r
        assert 0 <= r["critic/score/mean"] <= 1 and r["perf/total_num_tokens"] > 8 * 8 * 40
        assert r["response_length/max"] <= 32 and r["actor/lr"] == 1e-4
    assert VAL_KEY in rows[2] and VAL_KEY in rows[3]
    assert [r["rollout/sync_check"] < 1e-3 for r in rows[1:] if "rollout/sync_check" in r] == [True] * 3
    assert os.path.getsize(os.path.join(out, "curves.png")) > 10_000
    assert os.path.exists(os.path.join(out, "hf", "model.safetensors"))
    assert [os.path.basename(p) for p in fsdp_train.list_checkpoints(os.path.join(out, "checkpoints"))] == [
        "step_2",
        "step_3",
    ]


@pytest.mark.parametrize("nproc", [1, 2])
def test_dumped_batches_hold_the_right_prompts_rewards_and_advantages(e2e, tiny_build, nproc):
    """The loop's wiring, read back from its own dump: sample k of step s answers the step's prompt
    k // n, its reward is veRL's score of its decoded response against THAT prompt's answer, and its
    advantage is its reward normalised within its group of n (computed here from the formula)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_build["model"])
    with open(tiny_build["train"]) as f:
        train = [json.loads(line) for line in f]
    batch_size, n = 8, 8
    for step in (1, 2, 3):
        d = torch.load(e2e[nproc][0] / "dump" / f"step_{step}.pt")
        width = d["response_mask"].shape[1]
        assert d["input_ids"].shape[0] == batch_size * n
        for k in range(batch_size * n):
            row = train[(step - 1) * batch_size + k // n]  # shuffle off: the step's prompts in order
            prompt = d["input_ids"][k, :-width][d["attention_mask"][k, :-width].bool()].tolist()
            assert prompt == rollout.render_prompt(tokenizer, reward.make_prompt(row["question"]))
            text = tokenizer.decode(d["input_ids"][k, -width:][d["response_mask"][k].bool()], skip_special_tokens=True)
            truth = reward.extract_ground_truth(row["answer"])
            assert d["rewards"][k].item() == reward.compute_score(text, truth, method="flexible")
        groups = d["rewards"].reshape(batch_size, n)  # [prompts, n]
        expected = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)  # [prompts, n]
        assert torch.allclose(d["advantages"], expected.reshape(-1, 1) * d["response_mask"], atol=1e-6)
    assert 0 < sum(torch.load(e2e[nproc][0] / "dump" / f"step_{s}.pt")["rewards"].sum() for s in (1, 2, 3)) < 3 * 64


def test_killed_and_resumed_run_logs_the_same_metrics(e2e, val_file, hub_cache, tmp_path):
    """The 1-rank end-to-end run again, killed (-9) once step 2 is logged (after its checkpoint) and resumed: the
    same metrics as the uninterrupted run, step by step."""
    killed = tmp_path / "killed"
    overrides = e2e_overrides(tmp_path, val_file)
    proc = run_grpo(killed, 1, *overrides, env=hub_cache, background=True)
    deadline = time.time() + 600
    while time.time() < deadline:  # kill -9 once step 2 is logged (the step-2 checkpoint is written before)
        if os.path.exists(os.path.join(killed, "metrics.jsonl")) and any(r["step"] == 2 for r in read_metrics(killed)):
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(r["step"] for r in read_metrics(killed)) == 2
    run_grpo(killed, 1, *overrides, "trainer.resume=auto", env=hub_cache)
    a, b = read_metrics(e2e[1][0] / "run"), read_metrics(killed)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    # two mini-batches per step (4 of 8 prompts): the second one's old log-probs must be those of the policy that
    # SAMPLED, not of the one the first mini-batch already moved: the on-policy shortcut must be off
    assert all(r["timing_s/old_log_prob"] > 0 and r["actor/ppo_kl"] != 0.0 for r in a[1:])
    # a resumed set-up leaves the RNGs as the checkpoint saved them, although vLLM re-seeds them at start-up
    proc = subprocess.run(
        [
            sys.executable,
            "tests/setup_worker.py",
            os.path.join(killed, "checkpoints", "step_3"),
            "--config",
            "tiny.yaml",
            *SMALL,
            *overrides,
            f"trainer.output_dir={killed}",
            "trainer.resume=auto",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **hub_cache, "OMP_NUM_THREADS": threads(1)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "start": 4,
        "engine": True,
        "torch": True,
        "python": True,
        "numpy": True,
    }


def test_dump_at_one_rank_replay_at_two(e2e, tmp_path):
    """The seed's Experiment 1: the dumped batches replayed at another world size give the same update:
    every metric both runs log (not the timings; rollout/* compares with vLLM in one, the dump in the other)."""
    run_grpo(tmp_path / "replay", 2, f"trainer.replay_batches={e2e[1][0] / 'dump'}", "trainer.export_hf=false")
    a, b = read_metrics(e2e[1][0] / "run"), read_metrics(tmp_path / "replay")
    assert [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a[1:], b, strict=True):
        keys = [k for k in comparable(x) if k in y and not k.startswith("rollout/")]
        assert len(keys) >= 30
        for key in keys:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
        assert y["rollout/logprob_diff_max"] < 1e-4  # recomputed old log-probs == the dumped ones


def test_the_on_policy_shortcut_only_where_the_sampling_policy_is_the_one_updated():
    """grpo.on_policy_shortcut: one mini-batch and one epoch, nothing that needs the old log-probs before the
    update, no dump or replay. Each condition alone turns it off (the end-to-end runs take one configuration each)."""
    import grpo

    base = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    cfg = config.load_config(None, base)
    assert grpo.on_policy_shortcut(cfg, grpo.choose_parts(cfg))
    rs = ["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=2"]
    for extra in (
        ["actor.ppo_mini_batch_size=4"],
        ["actor.ppo_epochs=2"],
        ["actor.recompute_old_log_prob=true"],
        ["algorithm.rollout_correction.rollout_is=token"],
        rs,
        ["trainer.dump_batches=dump"],
        ["trainer.replay_batches=dump"],
        ["algorithm.use_kl_in_reward=true"],
        ["actor.router_replay.mode=R2"],
    ):
        cfg = config.load_config(None, base + extra)
        assert not grpo.on_policy_shortcut(cfg, grpo.choose_parts(cfg)), extra


def test_on_policy_shortcut_equals_the_separate_old_log_prob_pass(tmp_path, tiny_build):
    """One mini-batch, one epoch: the update's own forward replaces veRL's old-log-prob pass (ratio = 1).
    In a sequence-level aggregation mode, so that every metric's aggregation is checked on both paths,
    with the recipe's entropy bonus and a sampling temperature other than 1."""
    common = [
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.export_hf=false",
        "actor.ppo_mini_batch_size=8",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.entropy_coeff=0.003",
        "rollout.temperature=0.7",
    ]
    run_grpo(str(tmp_path / "short"), 1, *common)
    run_grpo(str(tmp_path / "full"), 1, *common, "actor.recompute_old_log_prob=true")
    short, full = read_metrics(str(tmp_path / "short")), read_metrics(str(tmp_path / "full"))
    assert all(r["timing_s/old_log_prob"] == 0.0 for r in short) and all(r["timing_s/old_log_prob"] > 0 for r in full)
    for a, b in zip(short, full, strict=True):
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/entropy",
            "actor/kl_loss",
            "critic/score/mean",
            "rollout/logprob_diff_mean",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["actor/ppo_kl"] == 0.0 and abs(b["actor/ppo_kl"]) < 1e-6  # ratio exactly / nearly 1


# ------------------------------------------------------------------------------ the sync proof
def test_sync_rule_on_recorded_numbers():
    """metrics.sync_verdict(mean, max, exact, max_fp32=1e-3, warn_mean=0.1) on measured rollout/logprob_diff_*."""

    def verdict(mean, worst, exact):
        return metrics.sync_verdict(mean, worst, exact, 1e-3, 0.1)

    assert verdict(2e-6, 2e-5, exact=True) is None  # fp32, correct push (tiny demo)
    assert verdict(0.0069, 1.7, exact=True) == "stop"  # fp32, the step after a skipped push (tiny, lr 1e-4)
    assert verdict(0.03, 1.29, exact=True) == "stop"  # fp32, a Gemma-2-like soft-cap left out of the trainer
    assert verdict(0.0019, 0.2, exact=False) is None  # bf16, correct push: rare tokens off by 0.2 nats (tiny)
    for mean in (0.011, 0.031, 0.064):  # bf16 rounding noise, Qwen-size models (public measurements)
        assert verdict(mean, 5.0, exact=False) is None
    assert verdict(0.33, 8.1, exact=False) == "warn"  # bf16, one step after a skipped push (tiny, lr 1e-3)


@pytest.mark.parametrize("key", ["rollout/logprob_diff_max", "rollout/sync_check"])
@pytest.mark.parametrize("threshold, gap", [(1e-4, 5e-4), (0.05, 0.01)])
def test_the_fp32_stop_is_trainer_logprob_diff_max_fp32(key, threshold, gap):
    """metrics.judge_sync on an fp32 run with a gap between the default 1e-3 and a configured threshold, on either
    probe: it stops exactly when the gap is above trainer.logprob_diff_max_fp32, with one line naming that key's
    value, and never on a bf16 run (its rule is the mean's)."""
    cfg = config.load_config(None, [f"trainer.logprob_diff_max_fp32={threshold}"])
    gaps = {key: gap, "rollout/logprob_diff_mean": gap / 10}
    if gap > threshold:  # below the default: stops only if the configured threshold is read
        with pytest.raises(metrics.OutOfSync) as stop:
            metrics.judge_sync(cfg, 0, 3, gaps, exact=True)
        assert f"({key}) in an fp32 run, above trainer.logprob_diff_max_fp32 = {threshold:g}" in str(stop.value)
    else:  # above the default: runs on only if the configured threshold is read
        metrics.judge_sync(cfg, 0, 3, gaps, exact=True)
    metrics.judge_sync(cfg, 0, 3, gaps, exact=False)


def test_the_printed_config_reaches_a_pipe_whole():
    """`python grpo.py --print-config | ...` with PYTHONUNBUFFERED unset: stdout is a pipe, so Python buffers it,
    and the process ends with os._exit (cluster.end_process), which must flush it first: the whole config,
    parsed back equal to the merged one."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run(
        [sys.executable, "grpo.py", "--config", "tiny.yaml", "--print-config", "actor.lr=2e-5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = config.load_config(os.path.join(ROOT, "tiny.yaml"), ["actor.lr=2e-5"])
    assert yaml.safe_load(proc.stdout) == expected and len(proc.stdout) > 1000


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_skipped_push_stops_an_fp32_run_and_warns_in_bf16(tmp_path, tiny_build, dtype):
    """tests/grpo_without_push.py leaves the engine on the initial weights. The exact proof (sync.check_push) stops
    the run at step 1's push, in one line naming the step and the group (bf16 here; every engine kind in process:
    tests/test_push_proof.py). The log-prob probe alone (the proof switched off): the step after, it stops an fp32
    run with one line, once that step is logged (max rule), and warns in bf16 (mean rule). A correct bf16 run,
    whose rare tokens differ by more than the fp32 threshold, does not warn. (A correct fp32 run not stopping: the
    end-to-end runs.)"""
    common = [
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.export_hf=false",
        "trainer.plot=false",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "data.max_response_length=24",
        "actor.lr=1e-3",
        "trainer.sync_check_every=0",
        f"rollout.dtype={dtype}",
        f"model.compute_dtype={dtype}",
    ]
    probe_only = {"WITHOUT_PUSH_PROOF": "1"}
    skipped = run_grpo(
        tmp_path / "skipped", 1, *common, script="tests/grpo_without_push.py", check=False, env=probe_only
    )
    if dtype == "float32":
        line = one_error_line(skipped)
        assert line.startswith("error: step 2: vLLM's and the trainer's log-probs differ by "), line
        assert "(rollout/logprob_diff_max) in an fp32 run, above trainer.logprob_diff_max_fp32 = 0.001" in line
        logged = read_metrics(tmp_path / "skipped")
        assert [r["training/global_step"] for r in logged] == [1, 2] and logged[1]["rollout/logprob_diff_max"] > 1e-3
        return
    assert skipped.returncode == 0
    assert (
        "WARNING step 1" not in skipped.stdout
        and "WARNING step 2: vLLM's and the trainer's log-probs differ" in skipped.stdout
    )
    proven = run_grpo(tmp_path / "proven", 1, *common, script="tests/grpo_without_push.py", check=False)
    line = one_error_line(proven)
    assert line.startswith("error: step 1: the engine's ") and "is not what the trainer pushed" in line, line
    assert not os.path.exists(tmp_path / "proven" / "metrics.jsonl") or not read_metrics(tmp_path / "proven")
    correct = run_grpo(tmp_path / "correct", 1, *common)
    assert "WARNING" not in correct.stdout
    assert max(r["rollout/logprob_diff_max"] for r in read_metrics(tmp_path / "correct")) > 0.05


# ------------------------------------------------------------------ evaluation and a user's reward (issue 20)
def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("which", ["initial", "exported"])
def test_val_only_logs_what_the_training_run_validated(e2e, val_file, hub_cache, tmp_path, which):
    """trainer.val_only on the model the 1-rank run started from (its step-0 validation) and on its hf/ export
    (its last validation): the same greedy mean@1, printed and logged, and nothing else written."""
    trained = read_metrics(e2e[1][0] / "run")
    model, expected = (
        ("flatgrpo/tiny-grpo", trained[0][VAL_KEY])
        if which == "initial"
        else (str(e2e[1][0] / "run" / "hf"), trained[-1][VAL_KEY])
    )
    out = tmp_path / "eval"
    proc = run_grpo(
        out,
        1,
        "trainer.val_only=true",
        f"data.val={val_file[0]}",
        "reward.method=flexible",
        f"model.path={model}",
        env=hub_cache,
    )
    assert read_jsonl(out / "val_metrics.jsonl") == [{"step": 0, VAL_KEY: expected}]
    assert f"step 0: {VAL_KEY} = {expected:.3f}" in proc.stdout
    assert sorted(os.listdir(out)) == ["engine.log", "val_metrics.jsonl"]  # no checkpoint, export, config, curves


@pytest.fixture(scope="module")
def sampled_validation(tiny_build, val_file, tmp_path_factory) -> dict:
    """{nproc: (the samples trainer.validation_data_dir dumped, the logged metrics)} of trainer.val_only with
    rollout.val_n=4 at temperature 1 on the 7 rows of val_file, at 1 and at 2 ranks (4 + 3 rows). The TRAINING
    sampling keys are set greedy (top_k 1, top_p 0.01, temperature 0.01): validation that read any of them in
    place of its val_* key would draw 4 equal samples per prompt."""
    out = {}
    for nproc in (1, 2):
        root = tmp_path_factory.mktemp(f"sampled{nproc}")
        run_grpo(
            root / "eval",
            nproc,
            "trainer.val_only=true",
            f"data.val={val_file[0]}",
            "reward.method=flexible",
            "rollout.val_n=4",
            "rollout.val_temperature=1.0",
            "rollout.temperature=0.01",
            "rollout.top_k=1",
            "rollout.top_p=0.01",
            f"trainer.validation_data_dir={root / 'generations'}",
        )
        out[nproc] = read_jsonl(root / "generations" / "0.jsonl"), read_jsonl(root / "eval" / "val_metrics.jsonl")[0]
    return out


def test_sampled_validation_metrics_equal_verls_computation_on_the_samples(sampled_validation):
    """rollout.val_n=4 at temperature 1, 2 ranks: the logged val-core mean@4, best@4/mean and maj@4/mean (and every
    other key) equal veRL's process_validation_metrics written out literally (tests/test_val_metrics.py) on the
    dumped samples, whose rewards and votes are veRL's GSM8K scores and answers of their texts."""
    samples, logged = sampled_validation[2]
    assert sorted(s["uid"] for s in samples) == sorted(list(range(7)) * 4)
    for s in samples:
        assert s["reward"] == reward.compute_score(s["output"], s["gts"], method="flexible")
        assert s["pred"] == (reward.extract_solution(s["output"], "flexible") or "[no answer]")
    from test_val_metrics import reference

    expected = reference([{k: s[k] for k in ("data_source", "uid", "reward", "pred")} for s in samples])
    core, aux = "val-core/openai/gsm8k/reward/", "val-aux/openai/gsm8k/reward/"
    assert {core + k for k in ("mean@4", "best@4/mean", "maj@4/mean")} | {
        aux + "best@2/mean",
        aux + "maj@2/mean",
    } <= set(logged)
    assert {k: v for k, v in logged.items() if k != "step"} == pytest.approx(expected, rel=1e-12)
    assert len({s["output"] for s in samples}) > 7  # sampled, not greedy


def test_sampled_validation_is_the_same_at_one_and_two_ranks(sampled_validation):
    """Validation seeds follow the global prompt index (trainer.seed + index * val_n), not the rank's share: 1 rank
    (7 prompts) and 2 ranks (4 + 3) draw the same samples of every prompt, in the same order, and log the same
    metrics."""

    def by_prompt(samples: list[dict]) -> dict[int, list[str]]:
        outputs = {}
        for s in samples:
            outputs.setdefault(s["uid"], []).append(s["output"])
        return outputs

    (one, logged_one), (two, logged_two) = sampled_validation[1], sampled_validation[2]
    assert by_prompt(one) == by_prompt(two) and len(by_prompt(one)) == 7
    assert logged_one == logged_two


CONSTANT = 0.375  # a float32 number, as veRL's reward tensor holds it


@pytest.fixture(scope="module")
def reward_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("rewards")
    files = {
        "constant": f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    return {CONSTANT}\n",
        "nan_at_row_2": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float('nan') if extra_info['index'] == 2 else 1.0\n",
        "broken": "import no_such_module\n",
    }
    for name, text in files.items():
        (root / f"{name}.py").write_text(text)
    return {name: str(root / f"{name}.py") for name in files}


def test_a_constant_reward_file_gives_exactly_that_score(tiny_build, val_file, reward_files, tmp_path):
    """Training and validation both score with the file (val_only with a reward file: the NaN test below)."""
    train = run_grpo(
        tmp_path / "train",
        1,
        f"custom_reward_function.path={reward_files['constant']}",
        f"data.val={val_file[0]}",
        "trainer.total_steps=1",
        "trainer.val_every=1",
        "trainer.save_every=0",
    )
    rows = read_metrics(tmp_path / "train")
    assert rows[0][VAL_KEY] == CONSTANT and rows[1][VAL_KEY] == CONSTANT
    assert rows[1]["critic/score/mean"] == rows[1]["critic/score/min"] == CONSTANT and rows[1]["actor/pg_loss"] == 0.0
    assert "error" not in train.stderr


@pytest.mark.parametrize(
    "key, message",
    [
        ("path=/no/such/reward.py", "error: config: custom_reward_function.path = '/no/such/reward.py': no such file"),
        ("name=nope", "error: config: custom_reward_function.name = 'nope': {constant} defines no function nope"),
        (
            "path={broken}",
            "error: config: custom_reward_function.path = '{broken}': importing it failed (ModuleNotFoundError",
        ),
    ],
)
def test_bad_reward_files_stop_with_one_line(cli, reward_files, key, message):
    results, _ = cli
    assert error_line_of_call(results[key]).startswith(message.format(**reward_files))


def test_a_reward_of_nan_stops_the_run_with_one_line_naming_the_row(tiny_build, reward_files, tmp_path):
    """val_only with a reward file that returns NaN for the validation file's row 2 only: the run stops at that
    row, with the one line that names it."""
    nan_file = reward_files["nan_at_row_2"]
    proc = run_grpo(
        tmp_path / "run", 1, f"custom_reward_function.path={nan_file}", "trainer.val_only=true", check=False
    )
    line = one_error_line(proc)
    assert line.startswith(f"error: custom_reward_function: {nan_file}:compute_score returned nan for ")
    assert line.endswith("test.jsonl row 2; accepted: a finite number, or a dict with a numeric 'score'")


@pytest.mark.parametrize(
    "returned", ["float('nan')", "float('inf')", "-float('inf')", "{'score': float('nan')}", "'abc'"]
)
def test_a_reward_file_must_return_a_finite_number(tmp_path, returned):
    """The loop's scorer of a reward file (grpo.choose_parts' score: reward_files.load_scorer): a reward that is not
    a finite number (NaN, +-inf, a dict whose score is NaN, text) stops the run with the file, the function, what
    it returned and the row it was scoring."""
    import grpo
    import reward_files

    path = tmp_path / "reward.py"
    path.write_text(
        f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {returned}\n"
    )
    score = grpo.choose_parts(config.load_config(None, [f"custom_reward_function.path={path}"])).score
    row = {"data_source": "my/task", "ground_truth": "1", "extra_info": {}, "where": "val.jsonl row 5"}
    with pytest.raises(
        reward_files.RewardFileError,
        match=rf"^custom_reward_function: {path}:compute_score returned .+ for val.jsonl row 5; accepted",
    ):
        score(row, "text", {})


def test_the_example_reward_file_trains(tiny_build, tmp_path):
    """examples/gsm8k_partial_credit.py (veRL's format, a dict with acc and pred): 3 steps; every dumped reward is 1
    where veRL's strict GSM8K rule scores the text 1, 0.1 where it finds another "#### N", else 0; its acc becomes
    the val-core metric (veRL's rule) and is logged as a training mean. With data.shuffle on and trainer.seed 3
    (not 0, which would hide a seed left out): each step's prompts are those of the documented per-epoch
    permutation, random.Random(seed * 100_003 + epoch).shuffle(range(rows)) (docs/verl-mapping.md)."""
    run_grpo(
        tmp_path / "run",
        1,
        "custom_reward_function.path=examples/gsm8k_partial_credit.py",
        f"trainer.dump_batches={tmp_path / 'dump'}",
        "trainer.val_every=3",
        "trainer.save_every=0",
        "data.shuffle=true",
        "trainer.seed=3",
    )
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "val-core/openai/gsm8k/acc/mean@1" in rows[0] and "val-aux/openai/gsm8k/reward/mean@1" in rows[0]
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_build["model"])
    with open(tiny_build["train"]) as f:
        train = [json.loads(line) for line in f]
    order = list(range(len(train)))
    random.Random(3 * 100_003 + 0).shuffle(order)  # epoch 0: steps 1-3 of 8 prompts
    assert order[:24] != list(range(24))
    for step in (1, 2, 3):
        d = torch.load(tmp_path / "dump" / f"step_{step}.pt")
        width = d["response_mask"].shape[1]
        for k in range(d["input_ids"].shape[0]):
            row = train[order[(step - 1) * 8 + k // 8]]
            prompt = d["input_ids"][k, :-width][d["attention_mask"][k, :-width].bool()].tolist()
            assert prompt == rollout.render_prompt(tokenizer, reward.make_prompt(row["question"]))
            text = tokenizer.decode(
                d["input_ids"][k, -width:][d["attention_mask"][k, -width:].bool()], skip_special_tokens=True
            )
            truth = reward.extract_ground_truth(row["answer"])
            right, found = reward.compute_score(text, truth) == 1.0, reward.extract_solution(text) is not None
            assert d["rewards"][k].item() == pytest.approx(1.0 if right else 0.1 if found else 0.0)
        assert rows[step]["reward_extra_info/acc/mean"] == pytest.approx(
            sum(float(r == 1.0) for r in d["rewards"].tolist()) / len(d["rewards"])
        )


def test_a_ten_step_run_in_a_log_file_is_one_line_per_step(tiny_build, tmp_path):
    """In a file (SLURM output, nohup, CI: not a terminal) no progress bar redraws: one line per step.
    The run is also the loop's wiring check of the GRPO family: REINFORCE++ with the adaptive KL in the reward
    and GSPO, in one mini-batch (so the on-policy shortcut gives way to the old-log-prob pass the KL needs, and
    the reference model is loaded for the reward alone). Each step's coefficient follows veRL's
    AdaptiveKLController from the previous step's logged KL (8 rows: n_steps)."""
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        subprocess.run(
            [
                sys.executable,
                "grpo.py",
                "--config",
                "tiny.yaml",
                f"trainer.output_dir={tmp_path / 'run'}",
                "trainer.total_steps=10",
                "trainer.val_every=5",
                "data.val_max_samples=8",
                "data.train_batch_size=2",
                "actor.ppo_mini_batch_size=2",
                "rollout.n=4",
                "data.max_response_length=16",
                "trainer.save_every=0",
                "actor.lr=1e-4",
                "actor.use_kl_loss=false",
                "actor.policy_loss.loss_mode=gspo",
                "algorithm.adv_estimator=reinforce_plus_plus",
                "algorithm.use_kl_in_reward=true",
                "algorithm.kl_ctrl.type=adaptive",
                "algorithm.kl_ctrl.horizon=100",
                "algorithm.kl_ctrl.target_kl=0.001",
            ],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=900,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": threads(1)},
        )
    lines = log.read_text().splitlines()
    assert len(lines) <= 25, lines
    assert sum(line.startswith("step ") and "s/step" in line for line in lines) == 10
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert rows[0]["actor/reward_kl_penalty_coeff"] == 0.001 and rows[0]["actor/reward_kl_penalty"] == 0.0  # pi = ref
    assert all(r["timing_s/old_log_prob"] > 0 and "actor/kl_loss" not in r for r in rows)
    assert max(r["actor/reward_kl_penalty"] for r in rows) > 0
    for a, b in zip(rows, rows[1:], strict=False):
        error = min(max(a["actor/reward_kl_penalty"] / 0.001 - 1, -0.2), 0.2)  # veRL: np.clip(kl / target - 1)
        expected = a["actor/reward_kl_penalty_coeff"] * (1 + error * 8 / 100)
        assert b["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-12)
    assert rows[-1]["actor/reward_kl_penalty_coeff"] != 0.001
