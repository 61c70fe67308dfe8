"""logit_rules.logits_head: the trainer's chunked log-probs are the model's own, for every family whose forward
post-processes its logits (soft-capping, scaling, a scaled head input); fsdp_train.check_logits_fn stops a
family whose rule it does not know at start-up, in one line.

Each rule gets a tiny random model of a family that has it (tiny.save_random_family_model, untied head),
at the tiny shape (logits ~0.1-1) and with the output embedding scaled up until its logits reach 100, where
every rule changes the log-probs by whole nats. The chunked path (ft._forward, as compute_logprobs and
train_step run it: one piece, and chunks of 16 with recompute) must give the log-probs, entropy, loss and
every gradient of the plain path: log_softmax(model(...).logits / T) from HF's full forward, in float64, and
compute_logprobs' no-grad pass its log-probs and entropy,
within fp32_noise.FACTOR x the fp32 noise measured at test time (tests/helpers/fp32_noise.py). Each test also
shows that the bare output embedding (fsdp_train's default head) misses the reference by far more than
that bound, so the test fails when its rule breaks. World size 2 (FSDP2: the rule runs inside the root's
registered forward): the large-logit Gemma 2 through tests/helpers/logprob_worker.py.
Measured (2 x86 cores): code error / noise 0.2-1.1 for every rule and scale; the bare head misses by
70x-4e8x the bound."""

import pytest
import torch
import transformers
from test_logprobs import TEMPERATURE, batch, check_all, plain_path, weighted_loss
from trainer_models import load_as_a_run
from transformers import AutoModelForCausalLM

import fp32_noise
import fsdp_train as ft
import logit_rules
import losses
import tiny
from conftest import run_torchrun
from grpo_runs import one_error_line, read_metrics, run_grpo

MINICPM3_MLA = dict(
    num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32
)
FALCON_H1_SMALL = dict(  # one layer, small Mamba-2 dims: its PyTorch Mamba scan is slow on CPU
    num_hidden_layers=1, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16
)
# rule -> (config class, the family's keys, how logit_rules.logits_head names the rule)
RULES = {
    "softcap": (transformers.Gemma2Config, dict(final_logit_softcapping=30.0), "final_logit_softcapping: 30.0 * "),
    "logit_scale": (transformers.CohereConfig, dict(logit_scale=0.0625), "logit_scale: logits * 0.0625"),
    "granite": (transformers.GraniteConfig, dict(logits_scaling=8.0), "logits_scaling: logits / 8.0"),
    "hyperclovax": (transformers.HyperCLOVAXConfig, dict(logits_scaling=4.0), "logits_scaling: logits * 4.0"),
    "falcon_h1": (
        transformers.FalconH1Config,
        dict(lm_head_multiplier=0.5, **FALCON_H1_SMALL),
        "lm_head_multiplier: logits * 0.5",
    ),
    "minicpm3": (
        transformers.MiniCPM3Config,
        dict(dim_model_base=32, **MINICPM3_MLA),
        "logits_scaling: head(hidden / 4.0)",
    ),
}
LARGE = 100.0  # the output embedding's largest logit on the test batch, at the "large" scale
CHUNKS = [0, 16]  # one piece; 8 chunks of the 126 response positions, recomputed in the backward


@pytest.fixture(scope="module")
def family_models(tiny_tokenizer, tmp_path_factory):
    """rule -> path of its tiny random model (fp32, untied head), built on first use."""
    root, paths = tmp_path_factory.mktemp("families"), {}

    def get(rule):
        if rule not in paths:
            config_class, keys, _ = RULES[rule]
            paths[rule] = tiny.save_random_family_model(
                str(root / rule), tiny_tokenizer, config_class, seed=2, tie_word_embeddings=False, **keys
            )
        return paths[rule]

    return get


def load(path: str, scale: str, largest: float = LARGE):
    """The model in fp32 with its family's rule, as logit_rules.loader gives it (logit_rules.use_rule);
    at scale "large" its output embedding multiplied until its largest logit on the test batch is `largest`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logit_rules.use_rule(model)
    if scale == "large":
        b = batch(model.config.vocab_size)
        with torch.no_grad():
            head = model.get_output_embeddings()
            biggest = head(ft.final_hidden(model, b["input_ids"], b["attention_mask"])).abs().max()
            head.weight.mul_(largest / biggest)
    return model


def chunked(model, b: dict, chunk: int) -> dict:
    """What the trainer computes: ft._forward's log-probs and entropy, the loss and its gradients."""
    mask = b["response_mask"]
    model.zero_grad(set_to_none=True)
    logp, entropy = ft._forward(model, b, TEMPERATURE, losses.entropy_from_logits, chunk_size=chunk)
    loss, _ = weighted_loss(logp, entropy, b, {"num_tokens": mask.sum()})
    loss.backward()
    out = {
        "logp": (logp * mask).detach(),
        "entropy": (entropy * mask).detach(),
        "loss": loss.item(),
        "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
    }
    model.zero_grad(set_to_none=True)
    return out


def no_grad_pass(model, b: dict, reference: tuple[dict, dict], what: str) -> None:
    """ft.compute_logprobs, the old and reference log-prob pass (no autograd, token-budget micro-batches of
    several widths, chunks of 16), in this process: the log-probs and entropy of the plain path."""
    ft.init_distributed()
    logp, entropy = ft.compute_logprobs(
        model, b, temperature=TEMPERATURE, max_tokens=40, entropy_fn=losses.entropy_from_logits, chunk_size=16
    )
    ref, noise = reference
    for key, value in (("logp", logp), ("entropy", entropy)):
        fp32_noise.check(value, ref[key], noise[key], f"{what} compute_logprobs {key}")


@pytest.mark.parametrize("scale", ["tiny", "large"])
@pytest.mark.parametrize("rule", list(RULES))
def test_chunked_logprobs_and_gradients_are_the_models_own(family_models, monkeypatch, rule, scale):
    model = load(family_models(rule), scale)
    assert model.logits_rule.startswith(RULES[rule][2])
    b = batch(model.config.vocab_size)
    ref, noise = fp32_noise.measure(
        lambda dtype: plain_path(fp32_noise.float64_copy(model) if dtype == torch.float64 else model, b)
    )
    for chunk in CHUNKS:
        check_all(chunked(model, b, chunk), (ref, noise), f"{rule} {scale} chunk {chunk}")
    no_grad_pass(model, b, (ref, noise), f"{rule} {scale}")
    # The rule matters here: the bare output embedding misses the reference by more than the bound.
    monkeypatch.setattr(model, "logits_head", None)  # fsdp_train's default: the bare output embedding
    bare = chunked(model, b, CHUNKS[-1])["logp"]
    missed = fp32_noise.error(bare, ref["logp"]) / (fp32_noise.FACTOR * noise["logp"])
    print(f"{rule} {scale}: without the rule, log-probs off by {missed:.3g} x the bound")
    assert missed > 1


def test_large_softcapped_logits_at_world_size_2(family_models, tmp_path):
    """FSDP2 at 2 ranks (tests/helpers/logprob_worker.py): compute_logprobs and train_step with the soft-cap inside the
    root's registered forward; the ranks' rows joined, and rank 0's full gradients, against the float64 plain
    path. load_model's start-up check runs there too (collective)."""
    model = load(family_models("softcap"), "large")
    path = str(tmp_path / "model")
    model.save_pretrained(path)
    b = batch(model.config.vocab_size)
    ref, noise = fp32_noise.measure(
        lambda dtype: plain_path(fp32_noise.float64_copy(model) if dtype == torch.float64 else model, b)
    )
    reports = run_torchrun("logprob_worker.py", 2, path, str(tmp_path), "--chunk-sizes", ",".join(map(str, CHUNKS)))
    for chunk in CHUNKS:
        logp, entropy = torch.zeros_like(ref["logp"]), torch.zeros_like(ref["entropy"])
        for rank in range(2):
            part = torch.load(tmp_path / f"logp_c{chunk}_rank{rank}.pt")
            width = part["logp"].shape[1]
            logp[part["rows"], :width], entropy[part["rows"], :width] = part["logp"].double(), part["entropy"].double()
        got = {
            "logp": logp,
            "entropy": entropy,
            "loss": reports[0]["state"][str(chunk)]["loss"],
            "grads": torch.load(tmp_path / f"grads_c{chunk}.pt"),
        }
        check_all(got, (ref, noise), f"world 2 chunk {chunk}")


@pytest.mark.parametrize("rule", list(RULES))
def test_the_start_up_check_sees_a_missing_rule_even_at_the_tiny_shape(family_models, monkeypatch, rule):
    """Without the family's rule (fsdp_train.load_model alone, logit_rules.loader not used), the start-up check
    (check_logits_fn) stops with one line naming the rule's config key, on the random tiny model whose own logits
    are ~0.1 (the check scales the head's logits to PROBE_LOGIT)."""
    path = family_models(rule)
    ft.init_distributed()
    load_as_a_run(path, device=torch.device("cpu"))  # the rule known: no error
    with pytest.raises(ft.UnsupportedModel) as e:
        ft.check_logits_fn(ft.load_model(path, device=torch.device("cpu")))
    key = RULES[rule][2].split(":")[0]
    assert "\n" not in str(e.value) and f"{key}=" in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "config_class, keys, named",
    [
        (transformers.xLSTMConfig, dict(num_heads=4), "output_logit_soft_cap=30.0"),
        (
            transformers.RecurrentGemmaConfig,
            dict(lru_width=128, block_types=["recurrent", "attention"]),
            "logits_soft_cap=30.0",
        ),
    ],
)
def test_a_family_with_an_unknown_rule_stops_at_start_up(tiny_tokenizer, tmp_path, config_class, keys, named):
    """xLSTM and RecurrentGemma soft-cap their logits under keys logit_rules does not know (vLLM serves neither):
    load_model stops with one line that names the class and the key."""
    path = tiny.save_random_family_model(str(tmp_path / "m"), tiny_tokenizer, config_class, **keys)
    ft.init_distributed()
    with pytest.raises(ft.UnsupportedModel) as e:
        load_as_a_run(path, device=torch.device("cpu"))
    message = str(e.value)
    assert "\n" not in message and named in message, message
    assert message.startswith(f"model {path}: {config_class.__name__[:-6]}"), message


def test_grpo_stops_an_unknown_rule_at_start_up_in_one_line(tiny_tokenizer, tiny_build, tmp_path):
    """The same through grpo.py: the model loads before the engine starts, and the run ends in one line."""
    path = tiny.save_random_family_model(str(tmp_path / "xlstm"), tiny_tokenizer, transformers.xLSTMConfig, num_heads=4)
    line = one_error_line(run_grpo(tmp_path / "run", 1, f"model.path={path}", check=False))
    assert line.startswith(f"error: model {path}: xLSTMForCausalLM: its forward post-processes the logits "), line
    assert "output_logit_soft_cap=30.0" in line


@pytest.fixture(scope="module")
def capped_gemma2(tiny_tokenizer, tmp_path_factory):
    """A tiny Gemma 2, tied as the released models are (vLLM's Gemma 2 has no separate lm_head), its embedding
    scaled to logits of about 60 before the cap at 30 (the released models' cap). The cap matters there:
    tokens drawn from the capped distribution have log-probs that move by more than a nat without it."""
    root = tmp_path_factory.mktemp("capped-gemma2")
    built = tiny.save_random_family_model(
        str(root / "built"), tiny_tokenizer, transformers.Gemma2Config, seed=2, final_logit_softcapping=30.0
    )
    model = load(built, "large", largest=60.0)
    path = str(root / "scaled")
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    b = batch(model.config.vocab_size)
    with torch.no_grad():
        real = b["attention_mask"].bool()  # [B, S]
        capped = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[real]  # [n, V]
        bare = model.get_output_embeddings()(ft.final_hidden(model, b["input_ids"], b["attention_mask"]))[real]
        drawn = torch.multinomial(torch.softmax(capped, -1), 1, generator=torch.Generator().manual_seed(0))  # [n, 1]
        moved = (torch.log_softmax(capped, -1) - torch.log_softmax(bare, -1)).gather(-1, drawn).abs().max()
    assert moved > 1.0, moved
    return path


GEMMA2_RUN = [
    "trainer.total_steps=2",
    "trainer.val_every=0",
    "trainer.export_hf=false",
    "trainer.plot=false",
    "actor.entropy_coeff=0.01",  # random rewards are all 0: the entropy bonus moves the weights, the push matters
    "actor.lr=1e-3",
]


def test_a_gemma2_like_model_trains_with_its_soft_cap_at_fp32_noise(capped_gemma2, tiny_build, tmp_path):
    """grpo.py, 1 rank, engine and trainer in fp32: two steps with the start-up and per-step sync checks
    keep vLLM's log-probs and the trainer's at fp32 noise, so the run does not stop."""
    run_grpo(tmp_path / "run", 1, f"model.path={capped_gemma2}", *GEMMA2_RUN)
    logged = read_metrics(tmp_path / "run")
    assert [r["training/global_step"] for r in logged] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in logged)
    worst = max(max(r["rollout/logprob_diff_max"], r["rollout/sync_check"]) for r in logged)
    print(f"Gemma 2, soft-cap 30, logits 60: vLLM vs trainer {worst:.3g} nats at most")
    assert worst <= 1e-4  # docs/cpu-notes.md: vLLM against an HF forward after a push, fp32


def test_a_trainer_without_the_soft_cap_stops_at_start_up(capped_gemma2, tiny_build, tmp_path):
    """The issue's bug put back (tests/helpers/grpo_without_logit_rule.py: the chunked path without the soft-cap, the
    load-time check off): sync.check_sync measures the trainer's own path, so the start-up check (step 0)
    sees vLLM's log-probs nats away from the trainer's and stops the run in one line."""
    proc = run_grpo(
        tmp_path / "run",
        1,
        f"model.path={capped_gemma2}",
        *GEMMA2_RUN,
        script="tests/helpers/grpo_without_logit_rule.py",
        check=False,
    )
    line = one_error_line(proc)
    print(line)
    assert line.startswith("error: step 0: vLLM's and the trainer's log-probs differ by "), line
    assert "(rollout/sync_check) in an fp32 run" in line
    assert float(line.split("differ by ")[1].split()[0]) > 0.1
