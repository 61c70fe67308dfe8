"""LoRA (lora.LoraLinear and friends) against PEFT itself, a test-only dependency: the layer's output and
gradients, which modules a target list adapts, the adapter files; then the training side under torchrun
(tests/helpers/train_worker.py --lora): the policy at step 0 is the base bit for bit and its KL 0, world sizes 1 and 2
equal the float64 plain run, kill and resume is bitwise with only the adapters in the checkpoint, the exported
adapter reloads in PEFT with the trainer's log-probs; and the push: vLLM serves the MERGED policy.

fp32 bounds are fp32_noise.FACTOR x the fp32 noise measured at test time (tests/helpers/fp32_noise.py).
"""

import copy
import functools
import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLinear
from test_fsdp_train import check_run, reference_run
from train_worker import lora_settings
from transformers import AutoModelForCausalLM

import fp32_noise
import fsdp_train as ft
import lora
import rollout
import sync
from conftest import ROOT, cli_calls, run_torchrun
from grpo_runs import VAL_KEY, one_error_line, read_jsonl, read_metrics, run_grpo

RANK, ALPHA = 4, 8  # scaling 2: a broken scaling cannot hide behind 1


class Wrapper(torch.nn.Module):
    def __init__(self, proj: torch.nn.Linear):
        super().__init__()
        self.proj = proj

    def forward(self, x):
        return self.proj(x)


def layer_pair(base_dtype=torch.float32, seed=0):
    """(ours, PEFT's) on the same base Linear [12, 16] (+ bias) and the same nonzero A [4, 16], B [12, 4]."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(16, 12).to(base_dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(12, 16, generator=g))
        base.bias.copy_(torch.randn(12, generator=g))
    ours = lora.LoraLinear(copy.deepcopy(base), RANK, ALPHA)
    peft = get_peft_model(Wrapper(copy.deepcopy(base)), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["proj"]))
    peft = peft.base_model.model.proj  # PEFT's lora.Linear
    assert isinstance(peft, PeftLinear) and peft.lora_A.default.weight.dtype == torch.float32
    a, b = torch.randn(RANK, 16, generator=g), torch.randn(12, RANK, generator=g)
    with torch.no_grad():
        for layer, (la, lb) in ((ours, (ours.lora_A, ours.lora_B)), (peft, (peft.lora_A.default, peft.lora_B.default))):
            la.weight.copy_(a)
            lb.weight.copy_(b)
            layer.base_layer.requires_grad_(False)
    return ours, peft


def forward_backward(layer, x, grad_out, a, b):
    """Output and (grad A, grad B) of sum(y * grad_out)."""
    y = layer(x)
    (y.float() * grad_out).sum().backward()
    return y.detach(), a.weight.grad.clone(), b.weight.grad.clone()


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_layer_output_and_gradients_equal_pefts(base_dtype):
    """Bit for bit PEFT's lora.Linear on the same weights (a bf16 base with fp32 adapters included), and the
    gradients the analytic ones in float64: y = x W^T + b + s (x A^T) B^T, G = dL/dy ->
    grad_B = s G^T (x A^T), grad_A = s (G B)^T x."""
    ours, peft = layer_pair(base_dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, generator=g).to(base_dtype)  # [b, s, in]
    grad_out = torch.randn(3, 5, 12, generator=g)  # [b, s, out]
    y1, ga1, gb1 = forward_backward(ours, x, grad_out, ours.lora_A, ours.lora_B)
    y2, ga2, gb2 = forward_backward(peft, x, grad_out, peft.lora_A.default, peft.lora_B.default)
    assert y1.dtype == y2.dtype == base_dtype
    assert torch.equal(y1, y2) and torch.equal(ga1, ga2) and torch.equal(gb1, gb2)
    if base_dtype != torch.float32:
        return
    s = ALPHA / RANK
    xd, gd = x.double().reshape(-1, 16), grad_out.double().reshape(-1, 12)  # [n, in], [n, out]
    a, b = ours.lora_A.weight.double(), ours.lora_B.weight.double()
    assert torch.allclose(gb1.double(), s * gd.T @ (xd @ a.T), rtol=1e-5, atol=1e-5)
    assert torch.allclose(ga1.double(), s * (gd @ b).T @ xd, rtol=1e-5, atol=1e-5)
    expected = xd @ ours.base_layer.weight.double().T + ours.base_layer.bias.double() + s * (xd @ a.T) @ b.T
    assert torch.allclose(y1.double().reshape(-1, 12), expected, rtol=1e-5, atol=1e-5)


def test_disabled_layer_is_the_base_and_the_merge_is_pefts():
    ours, peft = layer_pair()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), lora.adapters_off(ours):
        assert torch.equal(ours(x), ours.base_layer(x))
    assert ours.enabled  # switched back on
    before = ours.base_layer.weight.clone()
    merged = ours.merged_weight()
    assert torch.equal(ours.base_layer.weight, before)  # out of place: the layer is not modified
    peft.merge()  # W += (B @ A) * scaling in place
    assert torch.equal(merged, peft.base_layer.weight)
    with torch.no_grad():
        assert torch.allclose(x @ merged.T + ours.base_layer.bias, ours(x), rtol=1e-5, atol=1e-5)


def test_untrained_adapters_leave_the_layer_the_base_bit_for_bit():
    ours, _ = layer_pair()
    with torch.no_grad():
        ours.lora_B.weight.zero_()  # PEFT's initialisation: B = 0
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ours(x), ours.base_layer(x))


# ------------------------------------------------------------------ which modules
@pytest.mark.parametrize(
    "targets, exclude",
    [
        ("all-linear", None),
        (["q_proj", "v_proj"], None),
        (r".*\.mlp\.(gate|up)_proj", None),
        ("all-linear", ["down_proj", "model.layers.0.self_attn.o_proj"]),
        (["q_proj", "k_proj", "v_proj", "o_proj"], r"model\.layers\.1\..*"),
    ],
)
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_targets_are_the_modules_peft_adapts(random_models, targets, exclude, kind):
    model = AutoModelForCausalLM.from_pretrained(random_models[kind])
    ours = lora.lora_targets(model, targets, exclude)
    peft = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, exclude_modules=exclude)
    )
    theirs = [n.removeprefix("base_model.model.") for n, m in peft.named_modules() if isinstance(m, PeftLinear)]
    assert ours == theirs and len(ours) > 0
    assert "lm_head" not in ours


@pytest.mark.parametrize(
    "targets, exclude, message",
    [
        (["qproj"], None, "'qproj' matches no linear layer of the model; its linear layers: down_proj, gate_proj, k_"),
        (["q_proj", "mlp"], None, "'mlp' matches no linear layer of the model"),
        (["lm_head"], None, "'lm_head' is the output head (lm_head); flatgrpo adapts the decoder's linear layers"),
        ("all-linear", r".*", "leaves no linear layer to adapt; the model's linear layers: down_proj"),
        (r"nothing_\d+", None, "leaves no linear layer to adapt"),
    ],
)
def test_targets_that_match_nothing_name_the_layers_there_are(random_models, targets, exclude, message):
    model = AutoModelForCausalLM.from_pretrained(random_models["tied"])
    with pytest.raises(lora.LoraError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lora.lora_targets(model, targets, exclude)


# ------------------------------------------------------------------ LoRA as the trainer builds it
def trainer_lora_parts(path: str, *overrides: str):
    """The model's parts a LoRA run chooses (grpo.choose_model_parts: lora.model_parts, from the config's model.* and
    trainer.seed), in this process (world size 1)."""
    import config
    import grpo

    ft.init_distributed()
    return grpo.choose_model_parts(
        config.load_config(None, ["model.lora_rank=4", "model.lora_alpha=8", *overrides]), path
    )


def trainer_lora_model(path: str, *overrides: str) -> torch.nn.Module:
    """The policy as grpo.py loads it (its model parts' load: lora.loader)."""
    return trainer_lora_parts(path, *overrides).load(path, device=torch.device("cpu"))


def adapted(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, lora.LoraLinear)]


@pytest.mark.parametrize(
    "targets, exclude",
    [("all-linear", "[down_proj, model.layers.0.self_attn.o_proj]"), ("[q_proj, v_proj]", r"'model\.layers\.1\..*'")],
)
def test_the_loaded_policy_adapts_what_peft_adapts_excludes_included(random_models, targets, exclude):
    """model.target_modules and model.exclude_modules through load_model: the LoraLinear modules of the policy
    are PEFT's choice for the same LoraConfig, and the excluded ones are plain layers."""
    import yaml

    model = trainer_lora_model(
        random_models["untied"], f"model.target_modules={targets}", f"model.exclude_modules={exclude}"
    )
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=yaml.safe_load(targets), exclude_modules=yaml.safe_load(exclude)
    )
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(random_models["untied"]), config)
    theirs = [n.removeprefix("base_model.model.") for n, m in peft.named_modules() if isinstance(m, PeftLinear)]
    without = trainer_lora_model(random_models["untied"], f"model.target_modules={targets}")
    assert adapted(model) == theirs and len(adapted(without)) > len(theirs) > 0


@pytest.mark.parametrize("seed", [0, 3])
def test_the_adapters_are_drawn_from_trainer_seed(random_models, seed):
    """PEFT's initialisation (lora_A Kaiming-uniform with a = sqrt(5): uniform in +-1/sqrt(in_features); lora_B 0),
    drawn layer by layer in module order from a generator seeded with trainer.seed, written out here."""
    model = trainer_lora_model(random_models["tied"], f"trainer.seed={seed}")
    g = torch.Generator().manual_seed(seed)
    for name in adapted(model):
        layer = model.get_submodule(name)
        bound = 1 / layer.base_layer.in_features**0.5
        expected = torch.empty(4, layer.base_layer.in_features).uniform_(-bound, bound, generator=g)
        assert torch.equal(layer.lora_A.weight.detach(), expected), name
        assert not layer.lora_B.weight.any()
    other = trainer_lora_model(random_models["tied"], f"trainer.seed={seed + 1}")
    name = adapted(model)[0]
    assert not torch.equal(model.get_submodule(name).lora_A.weight, other.get_submodule(name).lora_A.weight)


def test_a_bf16_engine_receives_the_merged_weights(random_models):
    """The push stream for a bf16 engine (the model parts' weights, lora.merged_params; no engine): every adapted
    layer's weight is PEFT's merged weight W + (B @ A) * alpha / r cast to bf16 (to one bf16 rounding), not the base;
    the rest is the base cast to bf16."""
    parts = trainer_lora_parts(random_models["tied"])
    model = parts.load(random_models["tied"], device=torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in adapted(model):
            model.get_submodule(name).lora_B.weight.copy_(
                torch.randn(model.get_submodule(name).lora_B.weight.shape, generator=g)
            )
    pushed = dict(parts.weights(model, torch.bfloat16))
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(random_models["tied"], dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    with torch.no_grad():
        for name in adapted(model):
            layer = peft.base_model.model.get_submodule(name)
            layer.lora_A.default.weight.copy_(model.get_submodule(name).lora_A.weight)
            layer.lora_B.default.weight.copy_(model.get_submodule(name).lora_B.weight)
    merged = peft.merge_and_unload().state_dict()
    assert set(pushed) == set(merged) - {"lm_head.weight"}  # tied: the head is embed_tokens
    bf16_step = torch.finfo(torch.bfloat16).eps
    for key, tensor in pushed.items():
        assert tensor.dtype == torch.bfloat16, key
        expected = merged[key].double()
        assert ((tensor.double() - expected).abs() <= bf16_step * expected.abs()).all(), key
    base = AutoModelForCausalLM.from_pretrained(random_models["tied"], dtype=torch.float32).state_dict()
    key = f"{adapted(model)[0]}.weight"
    assert (pushed[key].double() - base[key].double()).abs().max() > 100 * bf16_step * base[key].abs().max()


@pytest.mark.parametrize("written", ["now", "adapt", "lora"])
def test_a_lora_checkpoint_written_before_resumes_or_is_refused(random_models, tmp_path, written):
    """A LoRA checkpoint whose loop state holds its settings where an earlier flatgrpo wrote them (now: the saved
    loop state's "lora"; before issue 60: a top-level "adapt"; before that rename: a top-level "lora"), resumed
    with the model parts' resume (grpo.setup's): the same settings resume, the adapters exactly as saved; other
    settings stop in one line naming both; a plain model (no LoRA) stops in one line too."""
    import cluster
    import config
    import grpo

    path_model = random_models["tied"]
    parts = trainer_lora_parts(path_model)
    model = parts.load(path_model, device=torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    optimizer = torch.optim.AdamW(ft.trainable_params(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    path = parts.save(str(tmp_path), 1, model, optimizer, scheduler, extra={"step": 1})
    if written != "now":  # the state file as the earlier code wrote it
        state_file = os.path.join(path, "state_rank0.pt")
        state = torch.load(state_file, weights_only=False)
        state[written] = state["extra"].pop("lora")
        torch.save(state, state_file)
    cfg = config.load_config(None, [f"trainer.resume={path}"])

    def resume(*overrides: str, lora: bool = True):
        other_parts = trainer_lora_parts(path_model, *overrides) if lora else grpo.ModelParts()
        other = other_parts.load(path_model, device=torch.device("cpu"))
        opt = torch.optim.AdamW(ft.trainable_params(other))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        load = functools.partial(other_parts.resume, model=other, optimizer=opt, scheduler=sched)
        return other, cluster.resume(cfg, load, 0, 1)

    other, (start, _) = resume()
    assert start == 2
    saved = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in saved.items()) and saved
    with pytest.raises(lora.LoraError) as error:
        resume("model.lora_rank=2")
    assert str(error.value).startswith(f"trainer.resume: {path} was written by LoRA rank 4, alpha 8 on 28 modules")
    with pytest.raises(ft.CheckpointError) as error:
        resume(lora=False)
    assert grpo.one_line(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ("model.lora_alpha=16", "this run has LoRA rank 4, alpha 16 on 28 modules"),
        ("model.target_modules=[q_proj, v_proj]", "this run has LoRA rank 4, alpha 8 on 8 modules"),
        ("model.exclude_modules=[down_proj]", "this run has LoRA rank 4, alpha 8 on 24 modules"),
        ("model.lora_rank=2", "this run has LoRA rank 2, alpha 8 on 28 modules"),
    ],
)
def test_resume_refuses_another_alpha_or_other_targets(random_models, tmp_path, change, message):
    """A checkpoint of rank 4, alpha 8 on every linear layer, resumed (cluster.resume with the model parts' resume, as
    grpo.setup resumes) with one LoRA key changed: one line naming both settings, before anything loads."""
    import cluster
    import config

    parts = trainer_lora_parts(random_models["tied"])
    model = parts.load(random_models["tied"], device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(ft.trainable_params(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    path = parts.save(str(tmp_path), 1, model, optimizer, scheduler, extra={"step": 1})
    other_parts = trainer_lora_parts(random_models["tied"], change)
    other = other_parts.load(random_models["tied"], device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(ft.trainable_params(other))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    cfg = config.load_config(None, [f"trainer.resume={path}"])
    resume = functools.partial(other_parts.resume, model=other, optimizer=optimizer, scheduler=scheduler)
    with pytest.raises(lora.LoraError) as error:
        cluster.resume(cfg, resume, 0, 1)  # grpo.setup's for a LoRA policy
    assert str(error.value).startswith(
        f"trainer.resume: {path} was written by LoRA rank 4, alpha 8 on 28 modules, {message}"
    )


def plain_lora_model(path: str, settings: dict) -> torch.nn.Module:
    """The HF model (fp32, one process, no FSDP) with LoRA added and initialised exactly as load_model does
    (lora._with_adapters from the same seed), the base frozen: the plain computation for the references."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = model.state_dict()
    model.adapt_settings = lora.add_lora(model, settings)
    model.load_state_dict(lora._with_adapters(state, model.adapt_settings, settings))
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def test_adapter_files_are_pefts_and_peft_adapters_load(random_models, tmp_path):
    """write_adapter's directory loads in PeftModel.from_pretrained with the same logits; a PEFT-written adapter
    (get_peft_model + save_pretrained) is read back by add_lora / _with_adapters into the same tensors."""
    path = random_models["untied"]
    settings = {"rank": RANK, "alpha": ALPHA, "target_modules": ["q_proj", "down_proj"], "seed": 3}
    ours = plain_lora_model(path, settings)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    merged, adapter = lora.split_merged(ours.state_dict(), ours.adapt_settings)
    lora.write_adapter(str(tmp_path / "ours"), adapter, ours.adapt_settings, path)
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(tmp_path / "ours")).eval()
    plain = AutoModelForCausalLM.from_pretrained(path)
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 17, 33, 8, 91, 4]])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, ours.eval()(input_ids=ids).logits)
        assert torch.allclose(plain(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # the other way: PEFT writes, flatgrpo reads
    theirs = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=2, lora_alpha=5, target_modules="all-linear")
    )
    theirs.save_pretrained(str(tmp_path / "peft"))
    model = AutoModelForCausalLM.from_pretrained(path)
    state = model.state_dict()
    config = lora.add_lora(model, {"adapter_path": str(tmp_path / "peft")})
    assert config["r"] == 2 and config["lora_alpha"] == 5
    assert len(config["target_modules"]) == 7 * model.config.num_hidden_layers
    full = lora._with_adapters(state, config, {"adapter_path": str(tmp_path / "peft")})
    for name, p in theirs.named_parameters():
        if ".lora_" in name:
            key = name.removeprefix("base_model.model.").replace(".default", "")
            assert torch.equal(full[key], p.detach())


def write_peft_adapter(path: str, out: str, **kw) -> str:
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**kw)).save_pretrained(out)
    return out


def test_bad_adapter_directories_raise_one_line(random_models, tmp_path):
    with pytest.raises(lora.LoraError, match="no adapter_config.json and adapter_model.safetensors there; accepted"):
        lora.read_adapter_config(str(tmp_path / "missing"))
    dropout = write_peft_adapter(
        random_models["tied"], str(tmp_path / "d"), r=2, target_modules="all-linear", lora_dropout=0.1
    )
    with pytest.raises(lora.LoraError, match="has lora_dropout = 0.1; accepted: 0.0"):
        lora.read_adapter_config(dropout)
    rs = write_peft_adapter(
        random_models["tied"], str(tmp_path / "rs"), r=2, target_modules="all-linear", use_rslora=True
    )
    with pytest.raises(lora.LoraError, match="has use_rslora = True; accepted: False"):
        lora.read_adapter_config(rs)
    # an adapter of a wider model: the shapes say so
    wide = AutoModelForCausalLM.from_config(
        AutoModelForCausalLM.from_pretrained(random_models["tied"]).config.__class__(
            **{**AutoModelForCausalLM.from_pretrained(random_models["tied"]).config.to_dict(), "intermediate_size": 640}
        )
    )
    get_peft_model(wide, LoraConfig(r=2, target_modules="all-linear")).save_pretrained(str(tmp_path / "wide"))
    model = AutoModelForCausalLM.from_pretrained(random_models["tied"])
    with pytest.raises(
        lora.LoraError, match=r"has shape \[2, 640\], the model needs \[2, 512\] \(rank 2\): an adapter of"
    ):
        lora.add_lora(model, {"adapter_path": str(tmp_path / "wide")})
    with pytest.raises(lora.LoraError, match="model.lora_rank = 8, but the adapter in model.lora_adapter_path"):
        lora.add_lora(model, {"adapter_path": str(tmp_path / "wide"), "rank": 8})


# ------------------------------------------------------------------ training under torchrun
STEPS = 4


@pytest.fixture(scope="module")
def lora_reference(random_models):
    """(reference, noise): test_fsdp_train's plain run (the same batches, loss and AdamW) on the LoRA model, in
    float64, and how far fp32 lands from it at 1 and 2 threads."""
    model = plain_lora_model(random_models["tied"], lora_settings(RANK))
    return fp32_noise.measure(
        lambda dtype: reference_run(
            fp32_noise.float64_copy(model) if dtype == torch.float64 else copy.deepcopy(model), steps=STEPS
        )
    )


@pytest.fixture(scope="module")
def trained(random_models, tmp_path_factory):
    """{world: (reports, out dir)}: train_worker --lora at 1 rank and at 2 (token budget 40: rows over it, several
    micro-batches), 4 steps; the 2-rank run exports hf/ at the end."""
    out = {}
    for world, extra in ((1, []), (2, ["--max-tokens", "40", "--export"])):
        folder = tmp_path_factory.mktemp(f"lora_ws{world}")
        args = ["--steps", str(STEPS), "--lora", str(RANK), *extra]
        out[world] = (run_torchrun("train_worker.py", world, random_models["tied"], str(folder), *args), folder)
    return out


def test_step_zero_is_the_base_its_kl_zero_and_the_reference_stays_the_base(trained):
    """Bit for bit, at 1 and 2 ranks: at step 0 (B = 0) the policy and its reference are the base model and the KL is
    exactly 0; after training the reference (adapters off) is still the base, the policy is not."""
    for world, (reports, _) in trained.items():
        for r in reports:
            assert r["step0"]["policy_equals_base"] and r["step0"]["reference_equals_base"], world
            assert r["step0"]["kl_max"] == 0.0 and r["step0"]["tokens"] > 0, world
            assert r["trained"]["reference_equals_base"] and not r["trained"]["policy_equals_base"], world
            assert r["trained"]["kl_max"] > 1e-6, world  # low_var_kl is second order in the change


@pytest.mark.parametrize("world", [1, 2])
def test_world_sizes_one_and_two_train_the_plain_runs_adapters(trained, lora_reference, random_models, world):
    """Every step's metrics and the final weights equal the float64 plain LoRA run within FACTOR x the fp32 noise;
    the base is untouched bit for bit; the adapters really moved."""
    reports, folder = trained[world]
    check_run(torch.load(folder / f"final_ws{world}.pt"), reports[0]["history"], lora_reference, f"LoRA world {world}")
    final = torch.load(folder / f"final_ws{world}.pt")
    start = plain_lora_model(random_models["tied"], lora_settings(RANK)).state_dict()
    assert all(torch.equal(final[k], start[k]) for k in start if ".lora_" not in k)  # the frozen base
    for kind in ("lora_A", "lora_B"):
        assert max((final[k] - start[k]).abs().max().item() for k in start if f".{kind}." in k) > 1e-3, kind


def test_kill_and_resume_is_bitwise_and_the_checkpoint_holds_only_the_adapters(trained, random_models, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path, straight = random_models["tied"], trained[2][0][0]["history"]
    common = ["--steps", str(STEPS), "--lora", str(RANK), "--max-tokens", "40"]
    run_torchrun("train_worker.py", 2, path, str(tmp_path), *common, "--save-at", "2", "--kill-after-save", killed=True)
    checkpoint = ft.list_checkpoints(str(tmp_path / "ckpt"))[-1]
    keys = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and not [k for k in model_keys if ".lora_A." not in k and ".lora_B." not in k]
    resumed = run_torchrun("train_worker.py", 2, path, str(tmp_path), *common, "--resume")[0]["history"]
    assert [h["step"] for h in resumed] == [3, 4]
    assert resumed == straight[2:]  # bitwise: every metric of steps 3 and 4
    run_torchrun("train_worker.py", 1, path, str(tmp_path), "--steps", "2", "--lora", str(RANK), "--resume")
    saved, loaded = torch.load(tmp_path / "saved_step2.pt"), torch.load(tmp_path / "loaded_ws1.pt")
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)  # written by 2 ranks, loaded by 1


def merged_logprobs(model, samples, batch, dtype):
    """The model's log-probs of the probe batch's masked responses and of each vLLM sample, in dtype (float64:
    a float64 copy, the reference; float32: the fp32 noise)."""
    m = fp32_noise.float64_copy(model) if dtype == torch.float64 else model
    r = batch["response_mask"].shape[1]
    out = {}
    with torch.no_grad():
        pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=pos).logits
        logp = torch.log_softmax(logits[:, -r - 1 : -1], -1).gather(-1, batch["input_ids"][:, -r:, None])[..., 0]
        out["probe"] = logp * batch["response_mask"].to(dtype)
        for i, s in enumerate(samples):
            lg = m(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
            out[f"sample{i}"] = torch.log_softmax(lg, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
    return out


PROMPT = [[{"role": "user", "content": "Tom has 3 apples."}]]


def test_the_exported_adapter_reloads_in_peft_with_the_trainers_logprobs(trained, random_models):
    """hf/lora_adapter in PeftModel.from_pretrained(base) gives the trainer's (FSDP2, 2 ranks) log-probs, and the
    merged hf/ in vLLM samples with them: both against PEFT's forward in float64, within FACTOR x its fp32 noise."""
    folder = trained[2][1]
    adapter = folder / "hf" / "lora_adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == RANK
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(random_models["tied"]), str(adapter)).eval()
    probe = torch.load(folder / "probe.pt")
    b, r = probe["batch"], probe["batch"]["response_mask"].shape[1]
    llm = rollout.make_engine(str(folder / "hf"), dtype="float32", max_model_len=256, gpu_memory_utilization=0.2)
    samples = rollout.generate(llm, PROMPT, n=3, temperature=1.0, max_tokens=12, seed=0)
    del llm
    ref, noise = fp32_noise.measure(lambda dtype: merged_logprobs(peft, samples, b, dtype))
    fp32_noise.check(probe["logprobs"][:, :r] * b["response_mask"], ref["probe"], noise["probe"], "trainer")
    assert (probe["logprobs"][:, :r] - ref["probe"]).abs().max() > 0  # a real comparison, not the same forward
    for i, s in enumerate(samples):
        fp32_noise.check(torch.tensor(s.logprobs), ref[f"sample{i}"], noise[f"sample{i}"], f"vLLM (hf/) sample {i}")


def test_vllm_serves_the_merged_policy_after_a_push(trained, random_models, monkeypatch):
    """The engine starts on the base; the trained LoRA model's push stream (merged: lora.merged_params) is pushed:
    vLLM's samples carry the merged model's log-probs within FACTOR x the fp32 noise, check_sync agrees, the trainer's
    weights are untouched by the push. Pushing the UNMERGED base instead is what check_sync catches."""
    path = random_models["tied"]
    settings = {"adapter_path": str(trained[2][1] / "hf" / "lora_adapter")}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state = model.state_dict()
    model.adapt_settings = lora.add_lora(model, settings)
    model.load_state_dict(lora._with_adapters(state, model.adapt_settings, settings))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    llm = rollout.make_engine(path, dtype="float32", max_model_len=256, gpu_memory_utilization=0.2, seed=0)
    trainer_logprobs = functools.partial(ft.sequence_logprobs, model)  # the trainer's own log-prob path
    assert sync.check_sync(llm, trainer_logprobs) > 1e-2  # the engine serves the base: the adapters matter
    pushed = [name for name, _ in lora.merged_params(model)]  # the merged weights, as grpo pushes them
    assert sync.push_weights(llm, lora.merged_params(model)) == len(pushed)
    assert not [n for n in pushed if "lora_" in n or "base_layer" in n]  # the base model's own names
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # out of place
    assert sync.check_sync(llm, trainer_logprobs) <= 1e-4
    samples = rollout.generate(llm, PROMPT, n=3, temperature=1.0, max_tokens=12, seed=1)
    probe = torch.load(trained[2][1] / "probe.pt")["batch"]
    ref, noise = fp32_noise.measure(lambda dtype: merged_logprobs(model, samples, probe, dtype))
    for i, s in enumerate(samples):
        fp32_noise.check(torch.tensor(s.logprobs), ref[f"sample{i}"], noise[f"sample{i}"], f"pushed sample {i}")
    # the classic bug: the adapters left out of the push (the base weights sent as they are)
    monkeypatch.setattr(
        lora.LoraLinear, "merged_weight", lambda self, dtype=None: self.base_layer.weight.detach().clone()
    )
    sync.push_weights(llm, lora.merged_params(model))
    monkeypatch.undo()
    assert sync.check_sync(llm, trainer_logprobs) > 1e-2
    del llm


# ------------------------------------------------------------------ the keys and the loop
@pytest.fixture(scope="module")
def peft_adapter(random_models, tmp_path_factory) -> str:
    """A PEFT-written rank-2 adapter (all-linear) of the tied random model."""
    out = str(tmp_path_factory.mktemp("peft") / "adapter")
    return write_peft_adapter(random_models["tied"], out, r=2, lora_alpha=4, target_modules="all-linear")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora_rank=-1"], "config: model.lora_rank = -1; accepted: >= 0 (0: full fine-tuning)"),
        (["model.lora_rank=8", "model.lora_alpha=0"], "config: model.lora_alpha = 0; accepted: > 0"),
        (
            ["model.target_modules=[q_proj]"],
            "model.target_modules = ['q_proj'], model.exclude_modules = None with LoRA",
        ),
        (["model.lora_rank=8", "model.target_modules=[q_proj, 3]"], "model.target_modules = ['q_proj', 3]; accepted"),
        (
            ["model.lora_adapter_path=/no/adapter"],
            "'/no/adapter': no adapter_config.json and adapter_model.safetensors",
        ),
        (["model.lora_rank=8", "model.lora_adapter_path={adapter}"], "model.lora_rank = 8, but the adapter in model.l"),
    ],
)
def test_lora_keys_stop_with_one_line(peft_adapter, overrides, message):
    """By config (the keys' values) or by lora.check_settings (the adapter directory), which grpo.choose_parts calls
    with LoRA on: one line, before anything loads."""
    import config
    import grpo

    with pytest.raises((config.ConfigError, lora.LoraError)) as error:
        grpo.choose_parts(config.load_config(None, [o.format(adapter=peft_adapter) for o in overrides]))
    assert message.format(adapter=peft_adapter) in str(error.value) and grpo.one_line(error.value)
    ok = config.load_config(None, ["model.lora_adapter_path=" + peft_adapter])  # rank 0: the adapter's
    grpo.choose_parts(ok)
    assert ok["model"]["lora_rank"] == 0
    for path in ("gsm8k.yaml", "gsm8k_lora.yaml"):
        assert config.load_config(os.path.join(ROOT, path), [])["model"]["lora_rank"] == (32 if "lora" in path else 0)


def test_an_adapter_of_another_base_stops(peft_adapter, random_models):
    m = {"path": random_models["tied"], "lora_adapter_path": peft_adapter}
    lora.check_adapter_base(m, random_models["tied"])  # its own base: by path
    with pytest.raises(lora.LoraError, match="was trained on .*tied.*, not on model.path = .*untied"):
        lora.check_adapter_base({**m, "path": random_models["untied"]}, random_models["untied"])


@pytest.fixture(scope="module")
def lora_run(tiny_build, tmp_path_factory):
    """(out dir, metrics) of a 3-step LoRA run at 2 ranks, one mini-batch per step (the step-1 KL is exactly 0),
    validating and saving at steps 2 and 3, exporting hf/ and hf/lora_adapter."""
    out = tmp_path_factory.mktemp("lora_e2e") / "run"
    keys = ["model.lora_rank=4", "model.lora_alpha=8", "actor.lr=2e-3", "actor.ppo_mini_batch_size=8"]
    run_grpo(out, 2, *keys, "trainer.save_every=2")
    return out, read_metrics(out)


def test_the_loop_trains_lora_against_the_base_and_vllm_serves_it(lora_run):
    out, rows = lora_run
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["actor/kl_loss"] == 0.0  # the policy IS the base at step 1 (B = 0)
    assert rows[2]["actor/kl_loss"] > 0 and rows[3]["actor/kl_loss"] > 0  # the reference stays the base
    for r in rows[1:]:
        assert r["rollout/sync_check"] < 1e-3 and r["rollout/logprob_diff_max"] < 1e-3  # vLLM serves the merged policy
    assert os.path.exists(out / "hf" / "model.safetensors")
    assert json.loads((out / "hf" / "lora_adapter" / "adapter_config.json").read_text())["r"] == 4
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(out / "checkpoints" / "step_3")).read_metadata().state_dict_metadata
    assert not [k for k in keys if k.startswith("model.") and ".lora_" not in k]  # the adapters only


def test_resume_with_other_lora_settings_and_unknown_targets_stop_with_one_line(lora_run, tiny_build):
    out, _ = lora_run
    proc = run_grpo(out, 1, "model.lora_rank=8", "trainer.total_steps=4", "trainer.resume=auto", check=False)
    assert one_error_line(proc).startswith(
        f"error: trainer.resume: {out / 'checkpoints' / 'step_3'} was written by LoRA rank 4, alpha 8 on 28 modules, "
        "this run has LoRA rank 8, alpha 16 on 28 modules"
    )
    proc = run_grpo(out.parent / "bad", 1, "model.lora_rank=4", "model.target_modules=[qproj]", check=False)
    assert one_error_line(proc) == (
        "error: config: model.target_modules: 'qproj' matches no linear layer of the model; its linear layers: "
        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or all-linear)"
    )


def test_val_only_evaluates_the_base_with_the_adapter(lora_run, tmp_path):
    """trainer.val_only with model.lora_adapter_path = the run's exported adapter validates what the run validated
    after its last step (the same merged weights in the engine: the same greedy samples)."""
    out, rows = lora_run
    run_grpo(tmp_path / "eval", 1, "trainer.val_only=true", f"model.lora_adapter_path={out / 'hf' / 'lora_adapter'}")
    assert read_jsonl(tmp_path / "eval" / "val_metrics.jsonl") == [{"step": 0, VAL_KEY: rows[-1][VAL_KEY]}]


def test_training_from_an_adapter_samples_with_it_and_keeps_the_base_as_reference(lora_run, tmp_path):
    """model.lora_adapter_path (veRL's): the engine serves base + adapter from the first step on (vLLM's sampling
    log-probs match the trainer's), and the KL is against the base (veRL's reference), so not 0 at step 1."""
    out, _ = lora_run
    adapter = f"model.lora_adapter_path={out / 'hf' / 'lora_adapter'}"
    run_grpo(
        tmp_path / "more", 1, adapter, "trainer.total_steps=1", "actor.ppo_mini_batch_size=8", "trainer.val_every=0"
    )
    step1 = read_metrics(tmp_path / "more")[-1]
    assert step1["rollout/logprob_diff_max"] < 1e-3 and step1["actor/kl_loss"] > 0


# an adapter whose lora_B is drawn (PEFT starts it at 0: the base), large enough to change the greedy samples
ADAPTER_B_STD = 0.2


@pytest.fixture(scope="module")
def adapter_and_merged(tiny_build, tmp_path_factory) -> tuple[str, str]:
    """(a PEFT adapter directory on the tiny model, lora_B drawn with ADAPTER_B_STD; the same adapter merged by PEFT
    (merge_and_unload) and saved as a plain HF model with the tiny tokenizer)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("val_only_adapter")
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_build["model"], dtype=torch.float32),
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"),
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * ADAPTER_B_STD)
    peft_model.save_pretrained(str(root / "adapter"))
    peft_model.merge_and_unload().save_pretrained(str(root / "merged"))
    AutoTokenizer.from_pretrained(tiny_build["model"]).save_pretrained(str(root / "merged"))
    return str(root / "adapter"), str(root / "merged")


def test_val_only_of_an_adapter_directory_validates_the_base_with_the_adapter(adapter_and_merged, tmp_path):
    """trainer.val_only with model.lora_adapter_path (model.lora_rank 0: the adapter's) validates the base with the
    adapter: its greedy generations and metrics are those of val_only on PEFT's merge of the same adapter, saved as a
    plain HF model, and not the base's (the adapter changes most of them). Three val_only calls of grpo.main in one
    process (tests/helpers/cli_calls.py: vLLM imported once)."""
    adapter, merged = adapter_and_merged
    models = {
        "adapter": ["model.path=tiny", f"model.lora_adapter_path={adapter}"],
        "merged": [f"model.path={merged}"],
        "base": ["model.path=tiny"],
    }
    calls = {
        name: [
            "--config",
            "tiny.yaml",
            "trainer.val_only=true",
            "data.val_max_samples=16",
            "data.max_response_length=32",
        ]
        + [f"trainer.output_dir={tmp_path / name}", f"trainer.validation_data_dir={tmp_path / name / 'gen'}", *keys]
        for name, keys in models.items()
    }
    results = cli_calls(calls, tmp_path)
    assert all(r["exit"] == 0 for r in results.values()), results
    samples = {
        name: [(s["input"], s["output"]) for s in read_jsonl(tmp_path / name / "gen" / "0.jsonl")] for name in calls
    }
    metrics = {name: read_jsonl(tmp_path / name / "val_metrics.jsonl") for name in calls}
    assert len(samples["adapter"]) == 16 and samples["adapter"] == samples["merged"]
    assert metrics["adapter"] == metrics["merged"]
    changed = sum(a != b for a, b in zip(samples["adapter"], samples["base"], strict=True))
    assert changed > len(samples["base"]) // 2, changed  # the adapter matters: the base alone validates otherwise
