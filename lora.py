"""LoRA (model.lora_rank > 0 or model.lora_adapter_path): the base model frozen, a trainable low-rank update on
its linear layers, the reference the policy with its adapters off, and PEFT's adapter files both ways. PEFT's
plain LoRA (peft/tuners/lora, 0.21) written out; tests/test_lora.py holds it against PEFT itself. veRL 0.9.1
applies PEFT's get_peft_model before FSDP (verl/workers/engine/fsdp/transformer_impl.py, _build_lora_module), so
names, shapes, scaling and the adapter files are PEFT's and move freely between PEFT, veRL, vLLM and flatgrpo.
Imports torch, transformers and fsdp_train.py, the component it extends: copy both files.

Entry points, each grpo.py's set-up's call for its parts:
  reference_part  the step's reference pass with the policy's adapters off: the policy IS the base (veRL's
                  ref_in_actor; adapters_off)
  model_parts     the model's: the loader (fsdp_train's empty model, LoraLinear layers before sharding, their initial
                  values, only the adapters train; asked for a frozen reference, the policy itself), the push stream
                  (merged_params: each LoraLinear's merged weight under the base model's names, the adapters not
                  sent), the checkpoints (the LoRA settings saved with them and checked on resume: check_resume) and
                  the export (the merged weights, and the adapter in PEFT's format)
"""

import contextlib
import json
import math
import os
import re

import torch
import torch.distributed as dist
from transformers.modeling_utils import load_state_dict, safe_save_file  # safetensors' reader and writer

import fsdp_train

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_PREFIX = "base_model.model."  # PEFT's key prefix in adapter files: base_model.model.<module>.lora_A.weight
# adapter_config.json entries flatgrpo's LoRA needs at these values: PEFT's plain LoRA, as veRL's lora_rank builds it
PLAIN_LORA = {
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "lora_dropout": 0.0,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "target_parameters": None,
    "trainable_token_indices": None,
}


class LoraError(ValueError):
    """A LoRA setting or adapter file this code cannot use: one line, "config: " and the key or file and what is
    accepted."""


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update: PEFT's lora.Linear (forward, vanilla LoRA, no dropout)

        y = base_layer(x) + lora_B(lora_A(x)) * scaling,   scaling = alpha / r

    base_layer is the model's own nn.Linear (weight [out, in], bias), lora_A.weight [r, in], lora_B.weight [out, r]:
    PEFT's module names, so that the keys read `<module>.base_layer.weight`, `<module>.lora_A.weight`, ... x is cast
    to the adapters' dtype and the sum back to the base output's dtype, as PEFT does. enabled=False computes the
    base layer alone (PEFT's disable_adapter(): veRL's reference model in a LoRA run, see adapters_off).
    Initial values come from load_model: A Kaiming-uniform (a = sqrt(5)), B = 0, so B A x = 0 and the layer starts
    as the base layer bit for bit. E.g. r = 32, alpha = 16: scaling 0.5.
    """

    def __init__(self, base_layer: torch.nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base_layer = base_layer
        device = base_layer.weight.device
        self.lora_A = torch.nn.Linear(base_layer.in_features, r, bias=False, device=device, dtype=torch.float32)
        self.lora_B = torch.nn.Linear(r, base_layer.out_features, bias=False, device=device, dtype=torch.float32)
        self.scaling = alpha / r
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        result = self.base_layer(x)
        if not self.enabled:
            return result
        update = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype)))  # [..., out]
        return (result + update * self.scaling).to(result.dtype)

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full merged weight [out, in] (merge_lora) cast to dtype (default: the base weight's); the layer is
        not modified. Under FSDP2 each of the three gathers is a collective: every rank must call it."""
        w, a, b = (_full_tensor(p) for p in (self.base_layer.weight, self.lora_A.weight, self.lora_B.weight))
        return merge_lora(w, a, b, self.scaling).to(dtype or self.base_layer.weight.dtype)


def merged_params(model, dtype: torch.dtype | None = None):
    """The push stream of a model with LoraLinear layers (sync.full_params' for the dense model): each LoraLinear's
    merged weight (W + (B @ A) * scaling in fp32 from the full tensors, then cast to dtype) under the base model's
    name `<module>.weight`, its bias as it is under `<module>.bias`, its adapters not sent (inside the merged
    weight); every other parameter gathered and cast as it is. Every rank consumes it in step (the gathers are
    collectives); the trainer's weights are never modified."""
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2: a no_grad forward can leave the root unsharded
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    for name, param in model.named_parameters():
        module = name.rsplit(".", 2)[0]  # "<module>.base_layer.weight" -> "<module>"
        if module not in layers:
            yield _hf_name(name), _full_tensor(param if dtype is None else param.detach().to(dtype))
        elif name.endswith(".base_layer.weight"):
            yield _hf_name(f"{module}.weight"), layers[module].merged_weight(dtype)
        elif name.endswith(".base_layer.bias"):
            yield _hf_name(f"{module}.bias"), _full_tensor(param if dtype is None else param.detach().to(dtype))


WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")  # in module names, not in HF's


def _hf_name(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    param = param.detach()
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def merge_lora(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + (B @ A) * scaling in fp32, a NEW tensor [out, in]: PEFT's merge (get_delta_weight: (B @ A) * scaling, added
    to W), the weight vLLM and the hf/ export receive. weight [out, in], lora_A [r, in], lora_B [out, r]."""
    return weight.float() + (lora_B.float() @ lora_A.float()) * scaling


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Within the block every LoraLinear computes its base layer alone: the model IS the base model (veRL 0.9.1's
    reference in a LoRA run, ref_in_actor: the actor under disable_adapter(); no second copy). No-op without LoRA
    or without a model (None)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)] if model is not None else []
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.enabled = True


def lora_targets(model: torch.nn.Module, target_modules: str | list[str], exclude_modules=None) -> list[str]:
    """Names of the linear layers LoRA adapts, matched as PEFT matches them (tuners_utils.check_target_module_exists,
    _maybe_include_all_linear_layers): "all-linear" = every nn.Linear but the output head (Qwen2: q, k, v, o, gate,
    up and down_proj of every layer); another string = a regex that must match the whole module name; a list =
    names equal to an entry or ending in "." + entry. exclude_modules (a regex string or a list) removes names
    the same way. Every list entry must match a linear layer, and the output head is never adapted.
    E.g. ["q_proj", "v_proj"] -> model.layers.0.self_attn.q_proj, model.layers.0.self_attn.v_proj, ..."""
    head = model.get_output_embeddings()
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
    if target_modules == "all-linear":
        chosen = linear
    elif isinstance(target_modules, str):
        chosen = [n for n in linear if re.fullmatch(target_modules, n)]
    else:
        chosen = [n for n in linear if _listed(n, target_modules)]
        for entry in target_modules:
            if head_name and _listed(head_name, [entry]):
                raise LoraError(
                    f"config: model.target_modules: {entry!r} is the output head ({head_name}); flatgrpo adapts the "
                    f"decoder's linear layers only: {', '.join(leaves)}"
                )
            if not any(_listed(n, [entry]) for n in linear):
                raise LoraError(
                    f"config: model.target_modules: {entry!r} matches no linear layer of the model; its linear layers: "
                    f"{', '.join(leaves)} (or all-linear)"
                )
    if exclude_modules:
        chosen = [n for n in chosen if not _excluded(n, exclude_modules)]
    if not chosen:
        raise LoraError(
            f"config: model.target_modules = {target_modules!r} with model.exclude_modules = {exclude_modules!r} "
            f"leaves no linear layer to adapt; the model's linear layers: {', '.join(leaves)} (or all-linear)"
        )
    return chosen


def _listed(name: str, entries) -> bool:
    return any(name == e or name.endswith("." + e) for e in entries)


def _excluded(name: str, exclude_modules) -> bool:
    return (
        bool(re.fullmatch(exclude_modules, name))
        if isinstance(exclude_modules, str)
        else _listed(name, exclude_modules)
    )


def add_lora(model: torch.nn.Module, lora: dict) -> dict:
    """Replace the targeted nn.Linear modules of a (meta) model by LoraLinear; returns the LoRA settings
    {"r", "lora_alpha", "target_modules": [adapted module names]} (kept as model.lora_config, written into
    checkpoints and the exported adapter). lora: {"rank", "alpha", "target_modules", "exclude_modules"} or
    {"adapter_path"}: then rank, alpha and targets are the adapter's (PeftModel.from_pretrained, as veRL's
    lora_adapter_path), and its tensors must have the model's shapes."""
    if lora.get("adapter_path"):
        config = read_adapter_config(lora["adapter_path"])
        r, alpha = config["r"], config["lora_alpha"]
        if lora.get("rank") and lora["rank"] != r:
            raise LoraError(
                f"config: model.lora_rank = {lora['rank']}, but the adapter in model.lora_adapter_path = "
                f"{lora['adapter_path']!r} has rank {r}; accepted: {r}, or 0 (the adapter's rank)"
            )
        names = lora_targets(model, config["target_modules"], config.get("exclude_modules"))
        _check_adapter_shapes(model, lora["adapter_path"], names, r)
    else:
        r, alpha = lora["rank"], lora["alpha"]
        names = lora_targets(model, lora["target_modules"], lora.get("exclude_modules"))
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, LoraLinear(getattr(owner, child), r, alpha))
    return {"r": r, "lora_alpha": alpha, "target_modules": names}


def read_adapter_config(path: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter directory, checked: the weights file is there, peft_type is LORA and
    every entry of PLAIN_LORA has its plain value (no rsLoRA, DoRA, dropout, bias, extra modules or patterns)."""
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file) or not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        raise LoraError(
            f"config: model.lora_adapter_path = {path!r}: no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} there; "
            "accepted: a PEFT LoRA adapter directory (PeftModel.save_pretrained, or a run's hf/lora_adapter)"
        )
    with open(file) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise LoraError(
            f"config: model.lora_adapter_path: {file} has peft_type {config.get('peft_type')!r}; accepted: LORA"
        )
    for key, plain in PLAIN_LORA.items():
        value = config.get(key, plain)
        if value != plain and (value or plain):  # None, [] and {} all mean "none"
            raise LoraError(
                f"config: model.lora_adapter_path: {file} has {key} = {value!r}; accepted: {plain!r} (flatgrpo "
                "trains plain LoRA, as veRL's lora_rank path builds it)"
            )
    return config


def _safetensors_shapes(file: str) -> dict[str, list[int]]:
    """{key: shape} from a safetensors file's header (8-byte little-endian length, then JSON), tensors unread."""
    with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _check_adapter_shapes(model: torch.nn.Module, path: str, names: list[str], r: int) -> None:
    """The adapter file holds exactly lora_A [r, in] and lora_B [out, r] of every targeted layer of THIS model."""
    shapes = _safetensors_shapes(os.path.join(path, ADAPTER_WEIGHTS))
    expected = {}
    for name in names:
        layer = model.get_submodule(name)
        expected[f"{ADAPTER_PREFIX}{name}.lora_A.weight"] = [r, layer.in_features]
        expected[f"{ADAPTER_PREFIX}{name}.lora_B.weight"] = [layer.out_features, r]
    for key in sorted(expected.keys() | shapes.keys()):
        if shapes.get(key) != expected.get(key):
            raise LoraError(
                f"config: model.lora_adapter_path: {os.path.join(path, ADAPTER_WEIGHTS)}: {key} has shape "
                f"{shapes.get(key)}, the model needs {expected.get(key)} (rank {r}): an adapter of another base "
                "model or rank"
            )


def _with_adapters(full: dict[str, torch.Tensor], lora_config: dict, lora: dict) -> dict[str, torch.Tensor]:
    """The HF state dict renamed for the LoraLinear layers (<module>.weight -> <module>.base_layer.weight, bias alike)
    plus their adapters (fp32): the adapter file's, or PEFT's initialisation, A Kaiming-uniform (a = sqrt(5), bound
    1 / sqrt(in)) and B = 0, drawn layer by layer in model order from a generator seeded with lora["seed"] (the same
    adapters at any world size: rank 0 draws them and broadcasts them with the weights)."""
    full = dict(full)
    adapter = {}
    if lora.get("adapter_path"):
        stored = load_state_dict(os.path.join(lora["adapter_path"], ADAPTER_WEIGHTS))
        adapter = {k.removeprefix(ADAPTER_PREFIX): v.float() for k, v in stored.items()}
    g = torch.Generator().manual_seed(lora.get("seed", 0))
    for name in lora_config["target_modules"]:
        for kind in ("weight", "bias"):
            if f"{name}.{kind}" in full:
                full[f"{name}.base_layer.{kind}"] = full.pop(f"{name}.{kind}")
        if adapter:
            full[f"{name}.lora_A.weight"] = adapter[f"{name}.lora_A.weight"]
            full[f"{name}.lora_B.weight"] = adapter[f"{name}.lora_B.weight"]
            continue
        out_features, in_features = full[f"{name}.base_layer.weight"].shape
        a = torch.empty(lora_config["r"], in_features)  # [r, in]
        full[f"{name}.lora_A.weight"] = torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
        full[f"{name}.lora_B.weight"] = torch.zeros(out_features, lora_config["r"])  # [out, r]
    return full


def split_merged(full: dict[str, torch.Tensor], lora_config: dict) -> tuple[dict, dict]:
    """A full state dict of a LoRA model -> (the merged plain HF state dict: W + (B @ A) * scaling in fp32 under
    the base names, the adapter tensors under PEFT's file keys base_model.model.<module>.lora_A.weight)."""
    merged, adapter = dict(full), {}
    scaling = lora_config["lora_alpha"] / lora_config["r"]
    for name in lora_config["target_modules"]:
        a, b = merged.pop(f"{name}.lora_A.weight"), merged.pop(f"{name}.lora_B.weight")
        adapter[f"{ADAPTER_PREFIX}{name}.lora_A.weight"] = a.contiguous()
        adapter[f"{ADAPTER_PREFIX}{name}.lora_B.weight"] = b.contiguous()
        merged[f"{name}.weight"] = merge_lora(merged.pop(f"{name}.base_layer.weight"), a, b, scaling)
        if f"{name}.base_layer.bias" in merged:
            merged[f"{name}.bias"] = merged.pop(f"{name}.base_layer.bias")
    return merged, adapter


def write_adapter(out_dir: str, adapter: dict[str, torch.Tensor], lora_config: dict, base_model: str) -> None:
    """A PEFT adapter directory: adapter_model.safetensors (split_merged's keys) and adapter_config.json with
    PEFT's LoraConfig fields (target_modules: the adapted modules' full names, as PEFT 0.21 saves all-linear),
    which PeftModel.from_pretrained, vLLM's LoRARequest and veRL's lora_adapter_path read."""
    os.makedirs(out_dir, exist_ok=True)
    safe_save_file(adapter, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora_config["r"],
        "lora_alpha": lora_config["lora_alpha"],
        "target_modules": lora_config["target_modules"],
        "exclude_modules": None,
        "init_lora_weights": True,
        "inference_mode": True,
        **PLAIN_LORA,
    }
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def loader(lora: dict, built: dict):
    """The model record's load for LoRA (fsdp_train.load_model's signature): fsdp_train's empty model, the targeted
    linear layers made LoraLinear (add_lora), sharded, filled with the base weights renamed for them and the adapters
    (PEFT's initialisation from lora["seed"], or the adapter directory's: _with_adapters), only the adapters
    training. lora: {"rank", "alpha", "target_modules", "exclude_modules", "seed"} or {"adapter_path"}. The trained
    model and its settings ({"r", "lora_alpha", "target_modules"}) are kept in built: asked then for a frozen model
    (the reference), it hands back that model, whose adapters the reference's pass turns off (veRL's ref_in_actor:
    no second copy)."""

    def load_model(path, *, device, param_dtype=torch.float32, compute_dtype=None, activation_checkpointing=False,
                   trainable=True):  # fmt: skip
        if not trainable and "policy" in built:
            return built["policy"]
        compute_dtype = compute_dtype or param_dtype
        model = fsdp_train.empty_model(path, param_dtype, compute_dtype)
        settings = add_lora(model, lora)
        fsdp_train.shard(model, device, compute_dtype, activation_checkpointing)
        full = fsdp_train.read_hf_weights(path, param_dtype) if dist.get_rank() == 0 else {}
        fsdp_train.fill(model, _with_adapters(full, settings, lora) if full else {}, trainable)
        for name, p in model.named_parameters():  # before any forward (pytorch#186998)
            p.requires_grad_(trainable and is_adapter(name))
        built.update(settings=settings, **({"policy": model} if trainable else {}))
        return model

    return load_model


def model_parts(cfg: dict, model_path: str, model) -> None:
    """The model record's parts for LoRA (grpo.choose_model_parts): load (loader, of the model.lora_* keys and
    trainer.seed's adapters), weights (merged_params), save and resume (the settings saved with each checkpoint and
    checked on resume), export (the merged model and the adapter: export)."""
    built = {}
    model.load = loader(settings(cfg["model"], model_path, cfg["trainer"]["seed"]), built)
    model.weights = merged_params
    save, resume = model.save, model.resume

    def save_with_settings(root, step, policy, optimizer, scheduler, extra=None, keep=2):
        return save(
            root, step, policy, optimizer, scheduler, extra={**(extra or {}), "lora": built["settings"]}, keep=keep
        )

    def resume_checked(path, model, optimizer, scheduler):
        check_resume(path, saved_settings(fsdp_train.saved_state(path)), built["settings"])
        return resume(path, model, optimizer, scheduler)

    model.save, model.resume = save_with_settings, resume_checked
    model.export = lambda policy, out_dir, tokenizer=None: export(policy, out_dir, tokenizer, built["settings"])


def saved_settings(state: dict) -> dict | None:
    """The LoRA settings a checkpoint's loop state holds (None: full fine-tuning): under extra["lora"]; in the
    checkpoints written before, under "adapt" or, earlier still, "lora"."""
    return state["extra"].get("lora", state.get("adapt", state.get("lora")))


# ------------------------------------------------------------------------------ the loop's settings
def check_settings(m: dict) -> None:
    """The LoRA keys (model.*), before anything loads (LoraError, one line): an adapter directory is a PEFT LoRA
    adapter flatgrpo can train (read_adapter_config) of the rank asked for (0: the adapter's)."""
    if not m["lora_adapter_path"]:
        return
    adapter_config = read_adapter_config(m["lora_adapter_path"])
    if m["lora_rank"] and m["lora_rank"] != adapter_config["r"]:
        raise LoraError(
            f"config: model.lora_rank = {m['lora_rank']}, but the adapter in model.lora_adapter_path = "
            f"{m['lora_adapter_path']!r} has rank {adapter_config['r']}; accepted: {adapter_config['r']}, or 0 "
            "(the adapter's)"
        )


def reference_part(cfg: dict, reference):
    """The loop's reference part for LoRA (grpo.choose_parts), the model.lora_* keys checked first (check_settings):
    the reference's pass (reference) with the policy's adapters off (adapters_off: the reference IS the policy, see
    loader)."""
    check_settings(cfg["model"])

    def reference_without_adapters(run, batch: dict, t: dict) -> None:
        with adapters_off(run.ref):
            reference(run, batch, t)

    return reference_without_adapters


def settings(m: dict, model_path: str, seed: int) -> dict:
    """adapter's settings from the model.lora_* keys (m) and the run's seed (trainer.seed: the adapters'
    initialisation). An adapter directory must belong to model.path's model (check_adapter_base)."""
    if m["lora_adapter_path"]:
        check_adapter_base(m, model_path)
    return {
        "rank": m["lora_rank"],
        "alpha": m["lora_alpha"],
        "target_modules": m["target_modules"],
        "exclude_modules": m["exclude_modules"],
        "adapter_path": m["lora_adapter_path"],
        "seed": seed,
    }


def check_adapter_base(m: dict, model_path: str) -> None:
    """model.lora_adapter_path was trained on model.path: its base_model_name_or_path names the same model, as
    written (a hub id), as the same directory, or by its last path component ("Qwen/Qwen2.5-0.5B-Instruct" and
    "/models/Qwen2.5-0.5B-Instruct"). Another base with the same shapes would load and train without error."""
    base = read_adapter_config(m["lora_adapter_path"]).get("base_model_name_or_path")
    if not base:
        return
    names = {m["path"], os.path.realpath(model_path), os.path.basename(m["path"].rstrip("/"))}
    if not names & {base, os.path.realpath(base), os.path.basename(base.rstrip("/"))}:
        raise LoraError(
            f"config: model.lora_adapter_path = {m['lora_adapter_path']!r} was trained on {base!r}, not on "
            f"model.path = {m['path']!r} ({model_path}); accepted: an adapter of model.path's model"
        )


def check_resume(path: str, saved: dict | None, current: dict | None) -> None:
    """The checkpoint at `path` was written with these LoRA settings (saved; None: full fine-tuning), the same as the
    model's (current), else one line naming both (LoraError)."""

    def describe(c):
        if not c:
            return "full fine-tuning (model.lora_rank 0)"
        return f"LoRA rank {c['r']}, alpha {c['lora_alpha']:g} on {len(c['target_modules'])} modules"

    if saved != current:
        raise LoraError(
            f"trainer.resume: {path} was written by {describe(saved)}, this run has {describe(current)}; resume "
            "with the checkpoint's model.lora_rank / lora_alpha / target_modules / exclude_modules, or start afresh"
        )


def is_adapter(name: str) -> bool:
    """Does this parameter train in a LoRA model (lora_A / lora_B: the adapters), rather than the frozen base?"""
    return ".lora_" in name


def export(model, out_dir: str, tokenizer, settings: dict) -> str:
    """The model record's export for LoRA: the MERGED model (W + (B @ A) * scaling, fp32: fsdp_train.write_hf), and
    the adapter in PEFT's format in <out_dir>/lora_adapter."""
    full = fsdp_train.full_state_dict(model)  # rank 0's; {} on the others
    merged, adapter_tensors = split_merged(full, settings) if full else ({}, {})
    fsdp_train.write_hf(model, merged, out_dir, tokenizer)
    if dist.get_rank() == 0:
        write_adapter(os.path.join(out_dir, "lora_adapter"), adapter_tensors, settings, model.config.name_or_path)
    dist.barrier()
    return out_dir
