"""grpo.py's configuration and command line: config.load_config and its errors (each naming the key and the
accepted values), the printed configuration against the docs and the shipped configs, one-line errors before anything
loads (bad data, a bad reward file, a wrong model path), and every end of a run clean (exits and signals)."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

import config
import dapo
import data
import fsdp_train
from conftest import ROOT, cli_calls, free_port
from grpo_runs import (
    GSM,
    SMALL,
    VERL,
    error_line_of_call,
    write_jsonl,
)

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
    """The command lines of these tests that stop before a model loads, run in ONE process (tests/helpers/cli_calls.py:
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


# Every documented end of a run, many times over (tests/helpers/exit_worker.py: children forked from one torchrun run,
# with a native thread busy in torch when each ends): name -> (overrides, the line the run's stderr ends with, or its
# start)
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
    cmd = [*torchrun, "tests/helpers/exit_worker.py", str(tmp_path / "plan.json"), str(out)]
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
