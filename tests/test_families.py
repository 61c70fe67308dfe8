"""Bring your model: every dense family in FAMILIES trains through grpo.py (1 rank, fp32), and the quirks of real
checkpoints are handled. One tiny random model per family (tiny.save_random_family_model, ~1 s each), two runs per
family in one module fixture, all in one process (tests/helpers/families_worker.py): 2 steps (the exact proof of every
push and the sync checks: vLLM serves what the trainer trains), then resumed from its step-2 checkpoint for a third
step; run 1's export (hf/, written at step 2)
reloads in transformers' own from_pretrained with the log-probs the resumed trainer computed at step 3 (its old
log-probs, dumped), within fp32_noise.FACTOR x the fp32 noise measured here.

OLMo 2 and GPT-NeoX are served by vLLM 0.32 through its Transformers backend, which changes transformers' decoder
class for the whole process: without fsdp_train.trainer_model_class (the trainer's own copy of the modeling module)
both stop at step 0 (`'Olmo2Model' object has no attribute 'do_not_compile'`). GPT-NeoX's weights are not named as
Llama's (gpt_neox.embed_in, embed_out): the trainer's reading through transformers' from_pretrained is what loads
them. The tied Qwen2 is the default tiny model of every other test (test_end_to_end: resume, export, 2 ranks); here
an untied one, as Qwen2.5-7B.

The quirky checkpoint (one run, tests below): a Qwen2 whose config, tokenizer and generation config carry the
quirks real checkpoints have (docs/running.md, "Bring your model")."""

import copy
import itertools
import json
import os

import pytest
import safetensors
import torch
import transformers
from test_logit_rules import GEMMA2_RUN
from tokenizers import processors
from trainer_models import load_as_a_run
from transformers import AutoModelForCausalLM, GenerationConfig

import fp32_noise
import tiny
from conftest import run_python
from grpo_runs import SMALL, one_error_line, read_metrics, run_grpo

# family -> (config class, its keys on top of tiny.TINY). Untied heads where the released models have them.
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False, use_sliding_window=False)),  # Qwen2.5-7B's
    "qwen3": (transformers.Qwen3Config, {}),
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),  # Llama 3 8B: an untied head
    "mistral": (transformers.MistralConfig, dict(tie_word_embeddings=False)),
    "gemma2": (transformers.Gemma2Config, {}),  # tied, soft-capped logits (logit_rules)
    "gemma3": (transformers.Gemma3TextConfig, dict(sliding_window=16)),  # local and global layers
    "phi3": (transformers.Phi3Config, dict(tie_word_embeddings=False)),
    "olmo2": (transformers.Olmo2Config, dict(tie_word_embeddings=False)),  # vLLM: Transformers backend
    "gpt_neox": (transformers.GPTNeoXConfig, dict(tie_word_embeddings=False)),  # idem; MHA (no num_key_value_heads)
    # Apertus-8B: xIELU, whose parameters and buffers vLLM keeps in bf16 in an fp32 engine (engine_dtypes.py) and
    # whose buffers beta and eps its reload resets unless pushed (sync.full_buffers); rope llama3 at 65536 positions
    "apertus": (transformers.ApertusConfig, dict(tie_word_embeddings=False, max_position_embeddings=65536)),
}
# family -> the keys of its released config.json (the model named) that its config class's defaults lack:
# transformers 4's rope keys, Gemma's cache_implementation, Phi-3's remote-code auto_map, Pythia's rotary keys. A tiny
# config may hold these, its class's keys and SERIALISED, nothing else: a key no real checkpoint holds hides what real
# checkpoints lack (GPT-NeoX's num_key_value_heads: fsdp_train.estimate_flops read it, so Pythia could not train).
PUBLISHED = {
    "qwen2": {"rope_theta"},  # Qwen2.5-7B-Instruct
    "qwen3": {"rope_scaling", "rope_theta"},  # Qwen3-0.6B
    "llama": {"rope_scaling", "rope_theta"},  # Llama-3.1-8B
    "mistral": {"rope_theta"},  # Mistral-7B-v0.3
    "gemma2": {"cache_implementation", "hidden_act", "rope_theta"},  # gemma-2-2b
    # gemma-3-1b-it
    "gemma3": {"cache_implementation", "rope_local_base_freq", "rope_scaling", "rope_theta", "sliding_window_pattern"},
    "phi3": {"attention_bias", "auto_map", "rope_scaling", "rope_theta"},  # Phi-3-mini-4k-instruct
    "olmo2": {"rope_scaling", "rope_theta"},  # OLMo-2-0425-1B
    "gpt_neox": {"rotary_emb_base", "rotary_pct"},  # pythia-160m
    "apertus": {"rope_scaling", "rope_theta"},  # Apertus-8B-Instruct-2509
}
SERIALISED = {"architectures", "dtype", "torch_dtype", "transformers_version", "model_type"}  # save_pretrained's
# test_logit_rules' Gemma 2 run (2 steps, the entropy bonus moving the weights), exported, with a checkpoint at step 2
RUN = [o for o in GEMMA2_RUN if o != "trainer.export_hf=false"] + ["trainer.save_every=2"]
RESUMED = ["trainer.total_steps=3", "trainer.resume=auto", "trainer.export_hf=false"]
SYNC = 1e-4  # vLLM against the trainer after a push, fp32 (docs/cpu-notes.md), as test_logit_rules
BF16 = ["rollout.dtype=bfloat16", "model.compute_dtype=bfloat16"]  # a family's run in bf16 too (FAMILIES_IN_BF16)
FAMILIES_IN_BF16 = ("apertus",)


@pytest.fixture(scope="module")
def family_models(tiny_tokenizer, tmp_path_factory):
    """family -> the path of its tiny random model (the tiny tokenizer), built on first use (~1 s)."""
    root, paths = tmp_path_factory.mktemp("family-models"), {}

    def get(family):
        if family not in paths:
            config_class, keys = FAMILIES[family]
            paths[family] = tiny.save_random_family_model(
                str(root / family), tiny_tokenizer, config_class, seed=1, **keys
            )
        return paths[family]

    return get


@pytest.fixture(scope="module")
def family_runs(family_models, tiny_build, tmp_path_factory):
    """family -> (model path, run directory, run 1's result, the resumed run's result: {"returncode", "stderr"}),
    every family's two runs made on first use, one after another in one process (tests/helpers/families_worker.py:
    grpo.main in process, the libraries imported once)."""
    root = tmp_path_factory.mktemp("families")
    argvs = {}
    for family in FAMILIES:
        path, out = family_models(family), root / family / "run"
        first = ["--config", "tiny.yaml", *SMALL, f"trainer.output_dir={out}", f"model.path={path}", *RUN]
        argvs[family] = {"first": first, "resumed": [*first, *RESUMED, f"trainer.dump_batches={out / 'dump'}"]}
    for family in FAMILIES_IN_BF16:  # 2 steps, no resume
        out = root / f"{family}_bf16" / "run"
        bf16 = [*argvs[family]["first"], f"trainer.output_dir={out}", "trainer.export_hf=false", *BF16]
        argvs[f"{family}_bf16"] = {"first": bf16}
    (root / "runs.json").write_text(json.dumps(argvs))
    proc = run_python(
        "tests/helpers/families_worker.py",
        str(root / "runs.json"),
        str(root / "results.json"),
        timeout=1500,
        check=False,
    )
    results = json.loads((root / "results.json").read_text()) if (root / "results.json").exists() else {}
    assert results, proc.stderr[-3000:]

    def get(family):  # family: a key of FAMILIES, or "<family>_bf16" for FAMILIES_IN_BF16
        assert family in results, f"{family}: the worker ended before its runs: {proc.stderr[-3000:]}"
        first, resumed = results[family]["first"], results[family]["resumed"]
        return family_models(family.removesuffix("_bf16")), root / family / "run", first, resumed

    return get


def plain_logprobs(model, b: dict) -> dict:
    """log_softmax of transformers' own forward (no chunks), at the response tokens: {"logp": [B, R]}."""
    r = b["response_mask"].shape[1]
    pos = (b["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=pos).logits
        logp = torch.log_softmax(logits[:, -r - 1 : -1], -1).gather(-1, b["input_ids"][:, -r:, None])[..., 0]
    return {"logp": logp * b["response_mask"]}  # [B, R]


def as_vllm_computes(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' model computing as vLLM does, where the two differ in every dtype: vLLM builds Apertus's xIELU
    activation with bf16 parameters and buffers (its softplus taken in bf16), transformers with the config's dtype;
    in fp32 the two are 1e-4 nats apart. flatgrpo trains the policy vLLM samples from (engine_dtypes.py)."""
    for module in model.modules():
        if type(module).__name__ == "XIELUActivation":
            module.to(torch.bfloat16)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_trains_pushes_resumes_and_exports(family_runs, family):
    path, out, first, resumed = family_runs(family)
    assert first["returncode"] == 0, first["stderr"][-3000:]
    assert resumed["returncode"] == 0, resumed["stderr"][-3000:]
    logged = [r for r in read_metrics(out) if "training/global_step" in r]
    assert [r["training/global_step"] for r in logged] == [1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in logged)
    worst = max(max(r["rollout/logprob_diff_max"], r["rollout/sync_check"]) for r in logged)
    print(f"{family}: vLLM vs trainer {worst:.3g} nats at most over 3 steps (one resumed)")
    assert worst <= SYNC
    # run 1's export = the weights the resumed run trained from: its step-3 old log-probs
    b = torch.load(out / "dump" / "step_3.pt")
    export = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    assert type(export).__module__.startswith("transformers.models.")  # transformers' class, not the trainer's
    export = as_vllm_computes(export)
    ref, noise = fp32_noise.measure(
        lambda dtype: plain_logprobs(
            as_vllm_computes(fp32_noise.float64_copy(export)) if dtype == torch.float64 else export, b
        )
    )
    fp32_noise.check(b["old_logprobs"] * b["response_mask"], ref["logp"], noise["logp"], f"{family} export")
    saved = json.loads((out / "hf" / "config.json").read_text())
    assert saved["architectures"] == json.loads(open(os.path.join(path, "config.json")).read())["architectures"]


@pytest.mark.parametrize("family", FAMILIES_IN_BF16)
def test_a_family_trains_pushes_and_serves_in_bf16(family_runs, family):
    """The family's run in bf16 (engine and trainer, 2 steps; Apertus's xIELU is then in the run's dtype): every push
    proven (a mismatch, or a buffer the reload reset, would have stopped the run: Apertus's beta and eps are pushed
    with the weights), the weights moving, vLLM's log-probs near the trainer's (bf16: the mean, as the run watches)."""
    _, out, first, _ = family_runs(f"{family}_bf16")
    assert first["returncode"] == 0, first["stderr"][-3000:]
    logged = [r for r in read_metrics(out) if "training/global_step" in r]
    assert [r["training/global_step"] for r in logged] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 and r["timing_s/push_proof"] > 0 for r in logged)
    print(f"{family} bf16: vLLM vs trainer mean {max(r['rollout/logprob_diff_mean'] for r in logged):.3g} nats")
    assert all(r["rollout/logprob_diff_mean"] < 0.1 for r in logged)  # trainer.logprob_diff_warn_mean


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_trainer_loads_what_transformers_loads_and_pushes_the_checkpoints_names(family_models, family):
    """fsdp_train.load_model (weights through transformers' from_pretrained, in the trainer's own class): the logits
    of transformers' AutoModelForCausalLM.from_pretrained; sync.full_params with the model's checkpoint_names: the
    checkpoint's own tensor names (what vLLM's loaders read; GPT-NeoX's head is embed_out there, lm_head in the
    module), a tied head left out as vLLM skips it; the blocks FSDP2 shards one by one: one per decoder layer."""
    import fsdp_train as ft
    import sync

    path = family_models(family)
    ft.init_distributed()
    model = load_as_a_run(path, device=torch.device("cpu"))
    # with the trainer's attention (transformers' sdpa drops Gemma 2's attention soft-cap; tests/test_packing.py)
    attention = model.get_decoder().config._attn_implementation  # varlen_attention, or a family's (logit_rules)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    reference.eval()
    ids = torch.tensor([[(3 + 11 * i) % 400 for i in range(20)]])
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert len(ft.decoder_layers(model)) == reference.config.get_text_config().num_hidden_layers  # FSDP2's blocks
    params = ft.in_checkpoint_format(model, sync.full_params(model, None))  # what grpo.push sends
    pushed = dict(itertools.chain(params, ft.in_checkpoint_format(model, sync.full_buffers(model, None))))
    with safetensors.safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    if reference.config.get_text_config().tie_word_embeddings:
        stored.pop("lm_head.weight", None)
    assert sorted(pushed) == sorted(stored)
    assert all(torch.equal(pushed[name], stored[name]) for name in stored)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_config_holds_only_keys_a_released_one_holds(family_models, family):
    """tiny.save_random_family_model's config.json: its class's keys, the keys of the family's released config.json
    and transformers' serialisation keys; no num_key_value_heads for GPT-NeoX, no head_dim for Qwen2, Phi-3, OLMo 2
    or GPT-NeoX (none of their classes or released configs has them)."""
    config_class, _ = FAMILIES[family]
    saved = json.loads(open(os.path.join(family_models(family), "config.json")).read())
    foreign = set(saved) - set(config_class().to_dict()) - PUBLISHED[family] - SERIALISED
    assert not foreign, f"{family}: config.json holds {sorted(foreign)}, which no released {family} config holds"


def test_the_flops_of_a_gpt_neox_config_count_every_head_as_a_key_value_head():
    """GPT-NeoX's config has no num_key_value_heads (multi-head attention): fsdp_train.estimate_flops counts K = H.
    veRL's formula (test_fsdp_train) written out for pythia-160m's shape."""
    import fsdp_train as ft

    shape = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    config = transformers.GPTNeoXConfig(vocab_size=50304, **shape)
    assert not hasattr(config, "num_key_value_heads")
    h, i, layers, heads, v = 768, 3072, 12, 12, 50304
    d = h // heads
    n = layers * (3 * h * i + h * (heads * d + 2 * heads * d + heads * d)) + 2 * v * h
    assert ft.estimate_flops(config, [300, 500]) == 6 * n * 800 + 6 * (300**2 + 500**2) * d * heads * layers


def test_an_unsupported_model_stops_before_anything_loads(tiny_tokenizer, tiny_build, tmp_path):
    """One line, before the trainer or the engine loads, naming the model, what fails and what is supported: T5 has
    no causal-LM class in transformers (fsdp_train.trainer_model_class); RWKV has one, but vLLM cannot serve it
    (rollout.check_servable; vLLM itself would say so after the trainer loaded, listing ~400 architectures); a
    model type transformers does not know stops there too."""
    t5 = str(tmp_path / "t5")
    config = transformers.T5Config(vocab_size=len(tiny_tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=1)
    transformers.T5ForConditionalGeneration(config).save_pretrained(t5)
    tiny_tokenizer.save_pretrained(t5)
    line = one_error_line(run_grpo(tmp_path / "t5-run", 1, f"model.path={t5}", check=False))
    assert line.startswith(f"error: model {t5}: model_type 't5' has no causal-LM class in transformers "), line
    assert "supported: decoder-only language models" in line
    rwkv = tiny.save_random_family_model(
        str(tmp_path / "rwkv"), tiny_tokenizer, transformers.RwkvConfig, num_hidden_layers=2, attention_hidden_size=128
    )
    line = one_error_line(run_grpo(tmp_path / "rwkv-run", 1, f"model.path={rwkv}", check=False))
    assert line.startswith(f"error: model {rwkv}: vLLM 0.32.0 cannot serve ['RwkvForCausalLM']: "), line
    assert "supported: vllm.ModelRegistry.get_supported_archs()" in line
    assert not os.path.exists(tmp_path / "rwkv-run" / "checkpoints")
    import rollout  # a model type transformers does not know: the first line of its message, in process

    unknown, remote = tmp_path / "unknown", tmp_path / "remote"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    remote.mkdir()  # remote code: refused without asking on stdin (trust_remote_code=False)
    auto_map = {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyForCausalLM"}
    (remote / "config.json").write_text(json.dumps({"model_type": "my_custom", "auto_map": auto_map}))
    for path, says in (
        (unknown, "The checkpoint you are trying"),
        (remote, f"The repository {remote} contains custom"),
    ):
        with pytest.raises(rollout.UnservableModel) as e:
            rollout.check_servable(str(path))
        assert str(e.value).startswith(f"model {path}: transformers cannot read its config: {says}"), str(e.value)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ quirks
BOS = "<|begin_of_text|>"
THINK = "<think>\n\n</think>\n\n"  # what Qwen3's template writes after the generation prompt when thinking is off
QUIRKY_TEMPLATE = (  # writes the BOS itself, as Llama 3's and Gemma's do; reads enable_thinking, as Qwen3's
    "{{- bos_token }}" + tiny.CHAT_TEMPLATE + "{%- if add_generation_prompt and enable_thinking is defined and "
    "not enable_thinking %}{{- '" + THINK.replace("\n", "\\n") + "' }}{%- endif %}"
)
STOP = "<|endoftext|>"  # in generation_config's eos_token_id list, not the tokenizer's eos (<|im_end|>)


def quirky_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with a BOS that tokenising with special tokens adds (Llama 3's post-processor), a chat
    template that writes it too, pad == eos (<|im_end|>) and Qwen3's enable_thinking."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"bos_token": BOS})
    bos = tok.convert_tokens_to_ids(BOS)
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    tok.pad_token = tok.eos_token
    tok.chat_template = QUIRKY_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def quirky_run(tiny_tokenizer, tiny_build, tmp_path_factory):
    """A tiny Qwen2 with the quirks of real checkpoints, trained 2 steps at 1 rank in fp32 with validation:
    attention_dropout 0.3; pad == eos; a BOS the template writes and the tokenizer would add again; a vocabulary
    padded past the tokenizer's; generation_config.json with an eos list (<|im_end|>, <|endoftext|>) and sampling
    defaults that would make every sample the same (temperature 0.01, top_k 1, top_p 0.1, repetition_penalty 1.5).
    Its head makes both eos ids likely (most responses end with one of them within 32 tokens); the run passes
    data.apply_chat_template_kwargs={enable_thinking: false}. Returns (tokenizer, run directory)."""
    root = tmp_path_factory.mktemp("quirky")
    tok, path = quirky_tokenizer(tiny_tokenizer), str(root / "model")
    tiny.save_random_family_model(
        path,
        tok,
        transformers.Qwen2Config,
        seed=3,
        tie_word_embeddings=False,
        attention_dropout=0.3,
        vocab_size=len(tok) + 15,
        bos_token_id=tok.bos_token_id,
        use_sliding_window=False,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([prompt["input_ids"]])).last_hidden_state[0]  # [s, h]
        mean = hidden.mean(0)  # [h]
        for token in (tok.eos_token_id, tok.convert_tokens_to_ids(STOP)):
            model.lm_head.weight[token] = 2.5 * mean / mean.dot(mean)  # a logit of ~2.5 where the others are ~0
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(STOP)],
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        do_sample=True,
        temperature=0.01,
        top_k=1,
        top_p=0.1,
        repetition_penalty=1.5,
    )
    model.save_pretrained(path)
    out = root / "run"
    overrides = [
        "trainer.val_every=2",
        "data.val_max_samples=8",
        f"trainer.validation_data_dir={out / 'generations'}",
        f"trainer.dump_batches={out / 'dump'}",
        "data.apply_chat_template_kwargs={enable_thinking: false}",
    ]
    run_grpo(out, 1, f"model.path={path}", *RUN, *overrides)
    return tok, out


def quirky_dumps(out) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, response ids, response mask) of every sample the quirky run trained on, both steps."""
    rows = []
    for step in (1, 2):
        b = torch.load(out / "dump" / f"step_{step}.pt")
        width = b["response_mask"].shape[1]
        for ids, seen, mask in zip(b["input_ids"], b["attention_mask"], b["response_mask"], strict=True):
            prompt = ids[:-width][seen[:-width].bool()].tolist()
            response = ids[-width:][seen[-width:].bool()].tolist()
            rows.append((prompt, response, mask.tolist()))
    return rows


def test_no_training_pass_applies_dropout_and_vllm_agrees(quirky_run):
    """attention_dropout 0.3 in the config: the trainer builds its modules without dropout (fsdp_train.without_dropout),
    so its log-probs are vLLM's at fp32 noise on every step; the export keeps the checkpoint's keys."""
    _, out = quirky_run
    logged = [r for r in read_metrics(out) if "training/global_step" in r]
    worst = max(max(r["rollout/logprob_diff_max"], r["rollout/sync_check"]) for r in logged)
    assert worst <= SYNC, worst
    assert json.loads((out / "hf" / "config.json").read_text())["attention_dropout"] == 0.3


def test_the_trainer_builds_no_dropout_whatever_the_config(quirky_run):
    """In process: load_model's policy, in training mode, gives the same logits twice and those of transformers'
    model in eval mode; its modules hold no dropout probability above 0."""
    import fsdp_train as ft

    _, out = quirky_run
    path = str(out / "hf")
    ft.init_distributed()
    policy = ft.load_model(path, device=torch.device("cpu"))
    assert policy.training
    ids = torch.tensor([[(5 + 7 * i) % 400 for i in range(24)]])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        once, twice, plain = policy(input_ids=ids).logits, policy(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.equal(once, twice)
    assert torch.allclose(once, plain, rtol=0, atol=1e-5)
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in policy.modules())


# family -> every dropout probability its config class defines, however spelled: Phi-3's *_pdrop, GPT-NeoX's; the
# other families' classes define attention_dropout alone, as Qwen3's (and the quirky Qwen2's above)
DROPOUTS = {
    "phi3": ("attention_dropout", "resid_pdrop", "embd_pdrop"),
    "gpt_neox": ("attention_dropout", "hidden_dropout", "classifier_dropout"),
    "qwen3": ("attention_dropout",),
}


def test_the_trainer_reads_the_tensors_the_engine_keeps_in_bf16_in_bf16(family_models):
    """engine_dtypes.fit on the trainer's Apertus, with what an fp32 engine reports (sync.engine_dtypes, checked
    against a real engine in test_push_proof), as its run fits it (the model's parts grpo.choose_model_parts
    chooses): its logits are transformers' with the xIELU layers in bf16 (vLLM's arithmetic) bit for bit, not
    transformers' fp32 ones; the gradient reaches the fp32 master weights; the push (the model's weights and
    persistent buffers) sends those tensors in bf16; a tensor the trainer does not have stops in one line naming it
    and what to set."""
    import types

    import config
    import engine_dtypes
    import fsdp_train as ft
    import grpo

    path = family_models("apertus")
    ft.init_distributed()
    parts = grpo.choose_model_parts(config.load_config(["tiny.yaml"], []), path)
    model = parts.load(path, device=torch.device("cpu"))
    act = [f"model.layers.{k}.mlp.act_fn.{name}" for k in range(4) for name in ("alpha_p", "alpha_n", "beta", "eps")]
    run = types.SimpleNamespace(policy=model, ref=None, engine_dtype=torch.float32, model=parts)
    assert "the engine keeps 16 tensors in torch.bfloat16" in engine_dtypes.fit(run, dict.fromkeys(act, torch.bfloat16))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[(3 + 11 * i) % 400 for i in range(20)]])
    logits = model.eval()(input_ids=ids).logits
    with torch.no_grad():
        in_fp32 = reference(input_ids=ids).logits
        assert torch.equal(logits, as_vllm_computes(reference)(input_ids=ids).logits)
    assert (logits - in_fp32).abs().max() > 1e-5  # the two arithmetics differ: the match is what makes them agree
    logits.logsumexp(-1).sum().backward()
    alpha = model.model.layers[0].mlp.act_fn._parameters["alpha_p"]  # the fp32 master (a read gives bf16)
    assert alpha.dtype == torch.float32 and alpha.grad.dtype == torch.float32 and alpha.grad.abs().item() > 0
    pushed = {**dict(parts.weights(model, torch.float32)), **dict(parts.buffers(model, torch.float32))}
    assert {name for name, t in pushed.items() if t.dtype == torch.bfloat16} == set(act)
    with pytest.raises(engine_dtypes.EngineDtypeError) as e:
        engine_dtypes.match(model, {"model.layers.0.mlp.act_fn.gamma": torch.bfloat16}, torch.float32)
    assert str(e.value) == (
        "the engine keeps model.layers.0.mlp.act_fn.gamma in torch.bfloat16, the run in torch.float32, and the "
        "trainer has no tensor of that name to compute with its values: set rollout.dtype and model.compute_dtype "
        "to bfloat16"
    )


@pytest.mark.parametrize("family", list(DROPOUTS))
def test_the_trainer_builds_no_dropout_of_any_spelling(tiny_tokenizer, tmp_path, family):
    """Every dropout key of the family's config at 0.3 (transformers' own model, in training mode, samples other
    logits on every forward): fsdp_train.load_model's policy, in training mode, gives the same logits twice, and
    those of transformers' model in eval mode (without_dropout zeroes every spelling: DROPOUT_KEY)."""
    import fsdp_train as ft

    config_class, keys = FAMILIES[family]
    assert set(DROPOUTS[family]) == {key for key in config_class().to_dict() if "drop" in key}
    path = tiny.save_random_family_model(
        str(tmp_path / family), tiny_tokenizer, config_class, seed=1, **keys, **dict.fromkeys(DROPOUTS[family], 0.3)
    )
    ft.init_distributed()
    policy = load_as_a_run(path, device=torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[(5 + 7 * i) % 400 for i in range(24)]])
    with torch.no_grad():
        assert not torch.equal(reference.train()(input_ids=ids).logits, reference(input_ids=ids).logits)
        plain = reference.eval()(input_ids=ids).logits
        assert policy.training
        once, twice = policy(input_ids=ids).logits, policy(input_ids=ids).logits
    assert torch.equal(once, twice), f"{family}: the training pass applies dropout: {(once - twice).abs().max()}"
    assert torch.equal(once, plain), (once - plain).abs().max()


def test_every_eos_id_in_generation_config_stops_and_is_trained(quirky_run):
    """<|endoftext|> is in generation_config's eos list, not the tokenizer's eos: vLLM stops there (nothing is
    sampled after it) and the response mask trains it, as it trains the final <|im_end|>."""
    tok, out = quirky_run
    stop, eos = tok.convert_tokens_to_ids(STOP), tok.eos_token_id
    rows = quirky_dumps(out)
    ended = [r for _, r, _ in rows if r[-1] == stop]
    assert len(ended) >= len(rows) // 8, (len(ended), len(rows))
    for _, response, mask in rows:
        assert stop not in response[:-1] and eos not in response[:-1]
        assert mask == [1] * len(response) + [0] * (len(mask) - len(response))


def test_the_final_eos_is_trained_when_pad_is_eos(quirky_run):
    """pad == eos (<|im_end|>): padding never hides the final EOS from the loss. The dumps' response masks cover
    every sampled token, the final EOS included (a mask taken as `ids != pad` would drop it)."""
    tok, out = quirky_run
    assert tok.pad_token_id == tok.eos_token_id
    rows = quirky_dumps(out)
    ended = [(r, m) for _, r, m in rows if r[-1] == tok.eos_token_id]
    assert len(ended) >= len(rows) // 8, (len(ended), len(rows))
    assert all(m[len(r) - 1] == 1 for r, m in ended)


def test_one_bos_and_the_template_kwargs_in_training_and_validation(quirky_run):
    """The template writes the BOS and tokenising adds none (rollout.render_prompt): every prompt trained on
    starts with exactly one BOS, and vLLM saw the same ids (its log-probs are the trainer's, first test). The
    think block that enable_thinking=false writes is in every training prompt and every validation input."""
    tok, out = quirky_run
    think = tok(THINK, add_special_tokens=False)["input_ids"]
    for prompt, _, _ in quirky_dumps(out):
        assert prompt[0] == tok.bos_token_id and prompt.count(tok.bos_token_id) == 1
        assert prompt[-len(think) :] == think
    generations = [json.loads(line) for line in open(out / "generations" / "2.jsonl")]
    assert generations and all(g["input"].endswith(THINK) for g in generations)


def test_prompts_are_measured_with_the_template_kwargs(tiny_tokenizer, tmp_path):
    """data.apply_chat_template_kwargs={enable_thinking: false} makes the quirky template write a think block: with
    data.max_prompt_length the longest prompt's length without it, grpo.load_data (in process) drops the prompts
    the block pushes over it, those counted here by rendering each with the tokenizer; without filtering the run
    stops in one line naming the keys."""
    import config
    import fsdp_train
    import grpo

    tok, model = quirky_tokenizer(tiny_tokenizer), str(tmp_path / "model")
    tiny.save_random_family_model(model, tok, transformers.Qwen2Config, bos_token_id=tok.bos_token_id)
    questions = [f"Tom has {k} apples" + " and one more" * k + "." for k in range(8)]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"question": q, "answer": f"{k} apples\n#### {k}"}) + "\n" for k, q in enumerate(questions))
    )

    def length(question: str, **kwargs) -> int:  # the prompt as vLLM gets it: template rendered, no special added
        messages = [{"role": "user", "content": question + " " + tiny.INSTRUCTION}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    limit = max(length(q) for q in questions)  # every prompt fits without the think block
    fits = [q for q in questions if length(q, enable_thinking=False) <= limit]
    assert 0 < len(fits) < len(questions), (limit, len(fits))
    print(f"max_prompt_length {limit}: {len(fits)} of {len(questions)} prompts fit with the think block")
    overrides = [f"model.path={model}", f"data.train={rows}", f"data.val={rows}", f"data.max_prompt_length={limit}"]
    overrides += ["data.apply_chat_template_kwargs={enable_thinking: false}", "data.train_batch_size=1"]
    overrides += ["actor.ppo_mini_batch_size=1"]
    fsdp_train.init_distributed()
    cfg = config.load_config("tiny.yaml", overrides)
    _, _, train_rows, val_rows, _ = grpo.load_data(cfg, grpo.choose_parts(cfg), 0, 1)
    assert [r["extra_info"]["question"] for r in train_rows] == fits
    assert [r["extra_info"]["question"] for r in val_rows] == fits
    with pytest.raises(config.ConfigError) as e:
        cfg = config.load_config("tiny.yaml", [*overrides, "data.filter_overlong_prompts=false"])
        grpo.load_data(cfg, grpo.choose_parts(cfg), 0, 1)
    message = str(e.value)
    assert message.startswith(f"data: {len(questions) - len(fits)} prompts exceed data.max_prompt_length={limit} ")
    assert "data.filter_overlong_prompts=true" in message and "\n" not in message, message


def test_vllm_samples_with_the_runs_keys_not_generation_configs(quirky_run):
    """generation_config.json asks for near-greedy sampling (temperature 0.01, top_k 1, top_p 0.1) and a
    repetition penalty; the run's keys (temperature 1, whole softmax) decide: the samples of a prompt differ,
    and their log-probs are the trainer's plain softmax at fp32 noise (first test)."""
    _, out = quirky_run
    b = torch.load(out / "dump" / "step_1.pt")
    n = 8  # tiny.yaml's rollout.n
    groups = b["input_ids"].view(-1, n, b["input_ids"].shape[1])  # [prompts, n, S]
    distinct = [len({tuple(row.tolist()) for row in group}) for group in groups]
    assert min(distinct) > 1, distinct
