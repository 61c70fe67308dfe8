"""FSDP2 training side of GRPO: the policy and reference models, log-probs, the train step,
checkpoints and HF export. Imports torch, transformers and accelerate only: copy it anywhere.

The same code runs one CPU process (`python ...`, gloo) and many GPU nodes (`torchrun ...`, NCCL):

    rank, world, device = init_distributed()
    policy = load_model(path, device=device)                     # fully_shard per layer, then root
    optimizer, scheduler = make_optimizer(policy, lr=1e-5)
    logp, entropy = compute_logprobs(policy, batch, temperature=1.0, max_tokens=16384, entropy_fn=...)
    metrics = train_step(policy, optimizer, mini_batch, loss_fn, temperature=1.0, max_tokens=16384)

Log-probs never hold a [tokens, V] tensor: the lm_head, log-softmax and entropy run over chunks of
positions, recomputed in the backward (chunked_logprobs; at Qwen2.5's V = 151,936 the plain path costs
~3.8 MB per token of a micro-batch, the chunked one ~0.1 MB: bench/memory.py). Each chunk's logits are the
model's own, whatever the family's forward does to them (logits_head; checked at load time, check_logits_fn).

Batches are dicts of tensors in veRL's layout: `input_ids` / `attention_mask` [B, P + R] with the
prompt LEFT-padded to width P and the response RIGHT-padded to width R; `response_mask` and every
other 2-D tensor (old/ref log-probs, advantages) are [B, R], aligned with the response tokens. A sample's field
aligned with its tokens (add_fields' "token" layout) travels with them into the decoder's call (token_fields).

The exact-update promise: every loss is normalised by the number of response tokens of the WHOLE
mini-batch (all micro-batches, all ranks; all-reduced), micro-batch losses are summed, and the loss
is multiplied by the world size because FSDP averages gradients over ranks. The gradient then equals
that of one process on the full batch, however unevenly tokens fall on micro-batches and ranks
(tests/test_fsdp_train.py checks it against a plain PyTorch reference).
"""

import copy
import functools
import glob
import importlib.util
import math
import os
import re
import shutil
import sys
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from accelerate import init_empty_weights
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import is_flash_attn_2_available

CORE_LAYOUTS = {"input_ids": ("token", 0), "attention_mask": ("token", 0)}  # (layout, fill); a field's: add_fields


# ------------------------------------------------------------------------------ distributed
def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world_size, device). torchrun: NCCL on GPU (gloo for CPU tensors), gloo on CPU.
    Plain `python`: a world of one over an in-memory store, so every collective below still works.
    On CPU, each process gets cores // local_world_size threads (oversubscription is ~10x slower);
    set them BEFORE creating a vLLM engine, which freezes torch's thread count."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        if "RANK" in os.environ:  # torchrun: what init_process_group(backend) does, in a key space of its own
            store, rank, world = next(dist.rendezvous("env://"))
            # torchrun's agent keeps its store, keys and all, when --max-restarts restarts the workers, and gloo
            # would then dial the dead workers' addresses ("connectFullMesh ... Connection refused",
            # pytorch#135712). Every attempt's ranks join once: the join count numbers the attempts, alike on
            # every node (torchrun's TORCHELASTIC_RESTART_COUNT is not: a node with healthy workers keeps it).
            attempt = (store.add("flatgrpo/joined", 1) - 1) // world
            dist.init_process_group(
                backend, store=dist.PrefixStore(f"attempt_{attempt}/default_pg", store), rank=rank, world_size=world
            )
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not cuda:
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def all_reduce(value: float | torch.Tensor, op=dist.ReduceOp.SUM) -> float:
    t = torch.as_tensor(value, dtype=torch.float64).reshape(1).clone()
    dist.all_reduce(t, op=op)
    return t.item()


# ------------------------------------------------------------------------------------ models
def load_model(
    path: str,
    *,
    device: torch.device,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
    trainable: bool = True,
) -> torch.nn.Module:
    """An HF causal LM sharded with FSDP2: fully_shard on each decoder layer, then on the root
    (at world size 1 with one dtype throughout, a plain module: the same code path otherwise).

    The full model is never materialised on every rank: all ranks build it on the meta device (empty_model),
    shard it and allocate only their shards (shard), and rank 0 reads the checkpoint and broadcasts it
    parameter by parameter (fill). Tied embeddings stay tied (one parameter). compute_dtype (e.g. bf16 on
    GPU, as veRL) keeps `param_dtype` master weights and casts for the forward/backward only. Its attention is
    attention_implementation(compute_dtype): one that runs a packed row (pack) exactly and on its real pairs only.
    Raises UnsupportedModel (one line) for a model it cannot train (trainer_model_class, decoder_layers).
    Then check_logits_fn(model), once the model is as it will train: the start-up proof that the log-prob path's
    logits are the model's own.
    """
    compute_dtype = compute_dtype or param_dtype
    model = empty_model(path, param_dtype, compute_dtype)  # an unsupported model stops here
    shard(model, device, compute_dtype, activation_checkpointing)
    fill(model, read_hf_weights(path, param_dtype) if dist.get_rank() == 0 else {}, trainable)
    return model


def empty_model(path: str, param_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None):
    """The model at path with its parameters on the meta device and its small buffers (RoPE) real: the trainer's
    class for it (trainer_model_class), built without dropout, with attention_implementation(compute_dtype), holding
    the checkpoint's config and the names the push uses (model.checkpoint_names, model.checkpoint_split)."""
    config = AutoConfig.from_pretrained(path)
    model_class = trainer_model_class(path, config)
    attention = attention_implementation(compute_dtype or param_dtype)  # flash_attention_2 where it runs, else ours
    with init_empty_weights(include_buffers=False):
        model = model_class._from_config(without_dropout(config), dtype=param_dtype, attn_implementation=attention)
    model.config = config  # the checkpoint's keys (export_hf writes them); the modules were built without dropout
    model.tie_weights()  # init_empty_weights re-registers parameters, which unties lm_head from embed_tokens
    model.checkpoint_names, model.checkpoint_split = checkpoint_names(model)
    return model


def shard(model, device: torch.device, compute_dtype: torch.dtype, activation_checkpointing: bool = False):
    """An empty (meta) model sharded with FSDP2 and its shards allocated on device (values undefined until fill):
    activation checkpointing first if asked, fully_shard per decoder layer, then the root, with mixed precision
    (compute_dtype for the forward and backward, fp32 gradient reduction). One rank with one dtype: nothing to
    shard, the model stays a plain module (FSDP2 would copy every parameter in and every gradient out on each
    forward/backward for nothing: ~10% here). The buffers keep their values."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    if activation_checkpointing:  # must come before fully_shard
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dist.get_world_size() > 1 or any(p.dtype != compute_dtype for p in model.parameters()):
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty re-creates a plain module's parameters: tie them again
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def fill(model, full: dict[str, torch.Tensor], trainable: bool = True) -> None:
    """A sharded model's weights from the full state dict `full`, named as the model's own parameters, on rank 0 ({}
    on the others: rank 0 broadcasts each parameter); every parameter trains if trainable (train mode), else none
    (eval mode)."""
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for p in model.parameters():  # before any forward (pytorch#186998)
        p.requires_grad_(trainable)
    model.train(trainable)


def trainer_model_class(path: str, config) -> type:
    """The family's causal-LM class (transformers' AutoModelForCausalLM choice for config), taken from the
    trainer's OWN copy of its modeling module: the same source file, executed once more under another module
    name (`<module>_trainer`), so every class in it (model, decoder, layers, attention) is one that no other
    library in the process ever sees.

    Why: the rollout engine lives in this process, and vLLM serves some families through its Transformers
    backend, which decorates transformers' decoder class for the whole process (support_torch_compile: an extra
    base class, a new __init__ and __call__). A trainer module of the shared class then fails (no attribute
    'do_not_compile') or would be compiled by vLLM. docs/running.md, "Bring your model".
    Raises UnsupportedModel (one line) for a model type with no causal-LM class in transformers."""
    auto_classes = AutoModelForCausalLM._model_mapping
    if type(config) not in auto_classes:
        raise UnsupportedModel(
            f"model {path}: model_type {config.model_type!r} has no causal-LM class in transformers "
            f"{transformers.__version__} (AutoModelForCausalLM); supported: decoder-only language models, e.g. "
            "qwen2, qwen3, llama, mistral, gemma2, gemma3_text, phi3, olmo2, gpt_neox"
        )
    shared = auto_classes[type(config)]
    name = shared.__module__ + "_trainer"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, sys.modules[shared.__module__].__file__)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look themselves up there
        spec.loader.exec_module(module)
    return getattr(sys.modules[name], shared.__name__)


def checkpoint_names(model) -> tuple[dict[str, str], Callable | None]:
    """(names, split): how the push names and cuts the parameters for the checkpoint format (what save_pretrained
    writes and every vLLM loader reads): transformers' own key conversion for the family, reversed
    (revert_weight_conversion). names: parameter name -> its checkpoint name where the two differ. split: where
    the conversion merges several checkpoint tensors into one parameter, split(name, full tensor) -> [(checkpoint
    name, tensor)], those tensors back (views, no copy); None where it merges none. Most families: ({}, None);
    the others push through in_checkpoint_format (its examples)."""
    params = {name: torch.empty_like(p, device="meta") for name, p in model.named_parameters()}
    by_tensor = {id(t): name for name, t in revert_weight_conversion(model, dict(params)).items()}
    names = {name: by_tensor[id(t)] for name, t in params.items() if by_tensor.get(id(t), name) != name}
    merged = {name for name, t in params.items() if id(t) not in by_tensor}  # reverted into new tensors
    return names, (functools.partial(_split_merged, model, merged) if merged else None)


def _split_merged(model, merged: set[str], name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A merged parameter's checkpoint tensors (transformers' conversion reversed on it alone); another as it is."""
    return list(revert_weight_conversion(model, {name: tensor}).items()) if name in merged else [(name, tensor)]


def in_checkpoint_format(model, named_tensors):
    """The push stream (name, full tensor) under the checkpoint's names and cuts (checkpoint_names), for a family
    whose checkpoint names or cuts its tensors otherwise than its parameters: a renamed parameter under its
    checkpoint name (GPT-NeoX's lm_head.weight as embed_out.weight), a merged one as the checkpoint's tensors (views:
    a Mixture-of-Experts model's experts.gate_up_proj [E, 2I, H] as E gate_proj and E up_proj tensors [I, H], its
    experts.down_proj [E, H, I] as E down_proj tensors)."""
    names, split = model.checkpoint_names, model.checkpoint_split
    for name, tensor in named_tensors:
        name = names.get(name, name)
        yield from [(name, tensor)] if split is None else split(name, tensor)


DROPOUT_KEY = re.compile(r"dropout|pdrop")  # attention_dropout, hidden_dropout, resid_pdrop, embd_pdrop, ...


def without_dropout(config):
    """A copy of config with every dropout probability 0 (float keys matching DROPOUT_KEY, in the text config
    too). vLLM applies no dropout: a training pass with it would differentiate another policy than the one
    that sampled, and the old log-probs would not match vLLM's (TRL's disable_dropout, on by default)."""
    config = copy.deepcopy(config)
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in part.to_dict().items():
            if DROPOUT_KEY.search(key) and type(value) is float and value > 0:
                setattr(part, key, 0.0)
    return config


def decoder_layers(model) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one: the modules of the classes transformers names in the model's
    _no_split_modules (its decoder layers: Qwen2DecoderLayer, ...), as accelerate's device maps."""
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    if not layers:
        raise UnsupportedModel(
            f"model {model.config.name_or_path}: {type(model).__name__} names no decoder layer "
            f"in _no_split_modules ({sorted(blocks)}): nothing for FSDP2 to shard per block"
        )
    return layers


def read_hf_weights(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint at path as transformers itself loads it for the trainer's class (from_pretrained: its key
    conversion for the family, its tied weights), named as the model's own parameters, in dtype, on CPU (rank 0
    only). A weight the checkpoint lacks is an error, not a random initialisation."""
    model_class = trainer_model_class(path, AutoConfig.from_pretrained(path))
    loaded, info = model_class.from_pretrained(path, dtype=dtype, output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise UnsupportedModel(
            f"model {path}: the checkpoint lacks or mis-shapes weights the model needs "
            f"(missing {sorted(info['missing_keys'])[:4]}, mismatched {sorted(info['mismatched_keys'])[:4]})"
        )
    return loaded.state_dict()


def make_optimizer(
    model,
    *,
    lr: float,
    betas=(0.9, 0.999),
    weight_decay: float = 0.01,
    warmup_steps: int = 0,
    total_steps: int = 1,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
):
    """AdamW (veRL's defaults) over the trainable parameters (trainable_params) and veRL 0.9.1's
    per-global-step LR schedule (lr_factor); call scheduler.step() once per global step, after its optimizer steps."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"make_optimizer: schedule={schedule!r}; accepted: constant, cosine")
    if hasattr(model, "reshard"):  # FSDP2: after a forward the root is unsharded, and parameters() would list
        model.reshard()  # its temporary full tensors, freed at the next reshard (AdamW: a crash)
    optimizer = torch.optim.AdamW(trainable_params(model), lr=lr, betas=betas, weight_decay=weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, schedule, min_lr_ratio)
    )


def trainable_params(model) -> list[torch.nn.Parameter]:
    """The parameters that train (requires_grad): all of them, unless some were frozen."""
    return [p for p in model.parameters() if p.requires_grad]


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float = 0.0) -> float:
    """lr / peak lr after `step` schedule steps (verl/utils/torch_functional.py,
    get_constant_schedule_with_warmup and get_cosine_schedule_with_warmup, veRL 0.9.1):

        warmup (step < W):  step / W            the FIRST update runs at lr 0 (Adam's moments still move)
        constant:           1
        cosine:             max(m, m + (1 - m) * (1 + cos(pi * p)) / 2),  p = (step - W) / max(1, total - W)

    m = min_lr_ratio. E.g. W = 2: factors 0, 0.5, 1, 1, ... for the updates of steps 1, 2, 3, ...
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    return 1.0 if schedule == "constant" else _cosine(step, warmup_steps, total_steps, min_lr_ratio)


def _cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """lr_factor's cosine decay after the warmup."""
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(min_lr_ratio, min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------- batches
def make_batch(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, fields: list[dict] | None = None
) -> dict[str, torch.Tensor]:
    """veRL's layout: prompts left-padded to P, responses right-padded to R.
    prompts [[5, 6], [7]], responses [[8], [9, 10]] -> input_ids [[5, 6, 8, pad], [pad, 7, 9, 10]].
    Every entry lines up with the rows in one of three layouts (select trims by it): "token"
    [B, P + R, ...] with input_ids (input_ids, attention_mask), "response" [B, R, ...] with the response tokens
    (every other 2-D tensor), "row" [B, ...] or a list of B objects. fields: each row's extra fields (a sample's),
    added by add_fields, which names their layouts in batch["layouts"] (name -> (layout, padding value))."""
    p_width, r_width = max(map(len, prompts)), max(1, max(map(len, responses)))
    ids, attn, rmask = [], [], []
    for p, r in zip(prompts, responses, strict=True):
        left, right = p_width - len(p), r_width - len(r)
        ids.append([pad_id] * left + p + r + [pad_id] * right)
        attn.append([0] * left + [1] * (len(p) + len(r)) + [0] * right)
        rmask.append([1] * len(r) + [0] * right)
    batch = {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(attn),  # [B, P + R]
        "response_mask": torch.tensor(rmask, dtype=torch.float32),  # [B, R]
    }
    if fields and fields[0]:
        add_fields(batch, fields)
    return batch


def add_fields(batch: dict, fields: list[dict]) -> None:
    """Each row's extra fields, name -> (layout, value) or (layout, value, fill), into the batch by layout, padded
    with fill (0 unless given): "token" values [T, ...] for the row's first T tokens, placed after its left padding
    -> [B, P + R, ...]; "response" values [r, ...] for its first r response tokens -> [B, R, ...]; "row" a number
    -> [B], anything else -> a list. A field named as an entry the batch has narrows it (times): a sample's own
    response_mask, 0 on tokens it did not sample. E.g. a token field [[7, 8]] (fill -1) on the row of prompt
    [5] and response [6] in a batch with P = 2, R = 1: [[-1, 7, 8]]."""
    r_width = batch["response_mask"].shape[1]
    p_width = batch["input_ids"].shape[1] - r_width
    first_token = (p_width - batch["attention_mask"][:, :p_width].sum(-1)).tolist()  # [B]
    starts = {"token": first_token, "response": [0] * len(fields)}
    widths = {"token": p_width + r_width, "response": r_width}
    for name, (layout, _, *fill) in fields[0].items():
        values, fill = [row[name][1] for row in fields], fill[0] if fill else 0
        value = _row_values(values) if layout == "row" else _padded(values, starts[layout], widths[layout], fill)
        batch[name] = batch[name] * value if name in batch else value
        batch.setdefault("layouts", {})[name] = (layout, fill)


def _padded(values: list, starts: list[int], width: int, fill) -> torch.Tensor:
    """Rows of values [T_i, ...] -> [B, width, ...]: row i's from column starts[i] on, fill elsewhere."""
    first = torch.as_tensor(values[0])
    out = torch.full((len(values), width, *first.shape[1:]), fill, dtype=first.dtype)  # [B, width, ...]
    for row, (value, start) in enumerate(zip(values, starts, strict=True)):
        value = torch.as_tensor(value)
        if start + len(value) > width:
            raise ValueError(f"add_fields: row {row} has {len(value)} values from column {start} of {width}")
        out[row, start : start + len(value)] = value
    return out


def _row_values(values: list):
    """A row field's values: numbers as a tensor [B], anything else as the list."""
    return torch.tensor(values) if all(isinstance(v, (int, float)) for v in values) else values


def layout_of(batch: dict, key: str) -> str:
    """How batch[key] lines up with the rows: as batch["layouts"] names it, else "response" for a tensor of 2 or
    more dimensions, "row" for the rest (make_batch)."""
    value, declared = batch[key], {**CORE_LAYOUTS, **batch.get("layouts", {})}
    if key in declared:
        return declared[key][0]
    return "response" if torch.is_tensor(value) and value.dim() >= 2 else "row"


def select(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """Rows of a batch, with the padding columns that only those rows share trimmed away: each entry by its layout
    (layout_of), "token" trimmed on both sides, "response" on the right, "row" (a tensor or a list) rows only."""
    r_width = batch["response_mask"].shape[1]
    p_width = batch["input_ids"].shape[1] - r_width
    attention = batch["attention_mask"][rows]  # [b, P + R]
    p_len = int(attention[:, :p_width].sum(-1).max())
    r_len = max(1, int(attention[:, p_width:].sum(-1).max()))  # not response_mask: it may have holes
    sub = {}
    for k, v in batch.items():
        if k == "layouts":
            sub[k] = v
            continue
        v = v[rows] if torch.is_tensor(v) else [v[r] for r in rows]
        layout = layout_of(batch, k)
        if layout == "token":
            v = v[:, p_width - p_len : p_width + r_len]
        elif layout == "response":
            v = v[:, :r_len]
        sub[k] = v
    return sub


def micro_batches(batch: dict[str, torch.Tensor], max_tokens: int, num_groups: int = 0) -> list[list[int]]:
    """Row groups of at most `max_tokens` REAL tokens each (veRL's dynamic batch size: ppo_max_token_len_per_gpu
    counts the tokens a packed micro-batch computes on; a longer row gets a group of its own). Rows are taken
    longest first, so a group's rows are of similar lengths: where attention pads each sequence to its group's
    longest (varlen_attention), little is padded. With num_groups, the largest groups are split (then empty
    groups [] added) to reach exactly that many. E.g. rows of 5, 9, 3, 7 tokens, max_tokens 12: [[1], [3, 0], [2]]."""
    lengths = batch["attention_mask"].sum(-1).tolist()  # every token, also those a mask leaves out
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, total = [], 0
    for i in order:
        if groups and total + lengths[i] <= max_tokens:
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    while len(groups) < num_groups and max(map(len, groups), default=0) > 1:
        big = max(groups, key=len)
        groups.remove(big)
        groups += [big[: len(big) // 2], big[len(big) // 2 :]]
    return groups + [[] for _ in range(num_groups - len(groups))]


def _synced_micro_batches(batch, max_tokens: int) -> list[list[int]]:
    """micro_batches with the SAME count on every rank: FSDP's all-gathers and reduce-scatters are
    collectives, so a rank with fewer rows runs extra (empty, masked-out) micro-batches."""
    target = int(all_reduce(len(micro_batches(batch, max_tokens)), op=dist.ReduceOp.MAX))
    return micro_batches(batch, max_tokens, target)


LOGPROB_CHUNK = 512  # response positions per lm_head chunk (veRL's FusedLinearForPPO default): [512, V] fp32 is 0.3 GB


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_fn=None, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """THE DEFINITION: log-softmax of logits / temperature, in fp32, at the targets; and entropy_fn of the
    same scaled logits (veRL's logprobs_from_logits and entropy_from_logits). logits [n, V], targets [n]
    -> logp [n], entropy [n] or None. entropy_grad=False: entropy without autograd graph (a metric)."""
    logits = logits.float() / temperature  # [n, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]  # [n]
    if entropy_fn is None:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, entropy_fn(logits)  # [n]


# ------------------------------------------------------------------------- packed micro-batches
# Every trainer forward computes on real tokens only (veRL's use_remove_padding): a micro-batch's rows are packed
# into one row of T = sum of their lengths tokens; positions restart at 0 for each row; attention stays within a
# row (varlen); the head runs only where a response token is predicted. One micro-batch of 3 rows (P prompt,
# R response, . padding; ^ where the head runs: each position predicts the next token of its row):
#
#   padded [3, 9]:  . . P P | R R R . .        packed [1, 16]:  P P R R R | P P P P R R R R | P R R
#                   P P P P | R R R R .        positions:       0 1 2 3 4 | 0 1 2 3 4 5 6 7 | 0 1 2
#                   . . . P | R R . . .        head at:           ^ ^ ^   |       ^ ^ ^ ^   | ^ ^
VARLEN_ATTENTION = "flatgrpo_varlen"  # varlen_attention's name in transformers' AttentionInterface
FLASH_VARLEN = ("flash_attention_2", "flash_attention_3")  # transformers' FlashAttention: varlen through cu_seq_lens


def pack(mb: dict[str, torch.Tensor], packs_sequences: bool = True) -> dict:
    """A micro-batch's real tokens as ONE row, as veRL's use_remove_padding feeds its model (response_logprobs
    reads it). mb: input_ids, attention_mask [b, P + R] (prompt left-padded, response right-padded), response_mask
    [b, R]. Returns:
        input_ids, position_ids [1, T]   the T real tokens, row after row; positions restart at 0 in each row
        attention_mask None
        varlen                           where the rows start: cu_seq_lens_q/k [b + 1] (int32: 0, the cumulative
                                         lengths), max_length_q/k (the longest), transformers' varlen arguments
        predict [N], targets [N]         the positions (in input_ids flattened) that predict a token of the
                                         response mask, and that token (the position before it in its row)
        scored [b, R] (bool)             where those N tokens sit among the micro-batch's response columns
        fields                           the micro-batch's other "token" entries (token_fields), each laid out as
                                         input_ids: [1, T, ...], each real token's value at its place
    E.g. input_ids [[0, 5, 6, 8, 0], [7, 8, 9, 10, 11]] (P = 3, R = 2), attention_mask [[0, 1, 1, 1, 0], [1] * 5],
    response_mask [[1, 0], [1, 1]] -> input_ids [[5, 6, 8, 7, 8, 9, 10, 11]], position_ids [[0, 1, 2, 0, 1, 2, 3,
    4]], cu_seq_lens_q [0, 3, 8], max_length_q 5, predict [1, 5, 6], targets [8, 10, 11].
    packs_sequences=False (a model whose layers carry state along a row, packs_exactly): the rows right-padded
    instead, [b, L] (L the longest row) with their attention_mask and no varlen: [[5, 6, 8, 0, 0], [7, 8, 9, 10,
    11]], predict [1, 7, 8], each token field [b, L, ...] with its fill at the padding. Raises ValueError for a
    response token that is its row's first (an empty prompt)."""
    real = mb["attention_mask"].bool()  # [b, P + R]
    lengths = real.sum(-1)  # [b]
    position = real.cumsum(-1) - 1  # [b, P + R]: each real token's position in its row, as vLLM numbers them
    rows, length = real.shape[0], int(lengths.max())
    if packs_sequences:  # each real token's index in the packed row [1, T]
        place, shape = real.flatten().cumsum(0).view_as(real) - 1, (1, int(lengths.sum()))
    else:  # in the right-padded rows [b, L], flattened
        place, shape = torch.arange(rows)[:, None] * length + position, (rows, length)
    r_width = mb["response_mask"].shape[1]
    scored = (mb["response_mask"] > 0) & real[:, -r_width:]  # [b, R]
    if (position[:, -r_width:][scored] < 1).any():
        raise ValueError("pack: a response token is the first token of its row (an empty prompt): nothing predicts it")

    def laid_out(values, fill=0):  # [b, P + R, ...] -> [*shape, ...]: each real token's value at its place
        out = values.new_full((shape[0] * shape[1], *values.shape[2:]), fill)  # fill where no token is
        out[place[real]] = values[real]
        return out.view(*shape, *values.shape[2:])

    cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # [b + 1]
    return {
        "input_ids": laid_out(mb["input_ids"]),
        "position_ids": laid_out(position),
        "attention_mask": None if packs_sequences else laid_out(mb["attention_mask"]),
        "varlen": dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=length, max_length_k=length)
        if packs_sequences
        else {},
        "predict": place[:, -r_width:][scored] - 1,  # [N]
        "targets": mb["input_ids"][:, -r_width:][scored],  # [N]
        "scored": scored,  # [b, R]
        "fields": {name: laid_out(mb[name], fill) for name, fill in token_fields(mb).items()},
    }


def token_fields(batch: dict) -> dict:
    """The batch's extra "token" entries, name -> fill: those batch["layouts"] names "token" (add_fields), input_ids
    and attention_mask aside. Each travels with its tokens: select trims it, pack lays it out as it lays out
    input_ids, and response_logprobs hands it to the decoder's call as a keyword argument, where a forward pre-hook
    of the decoder (register_forward_pre_hook(hook, with_kwargs=True)) takes it: it must pop it, since transformers
    passes unknown keyword arguments on to its layers. E.g. a sample field {"x": ("token", values, -1)}: {"x": -1}."""
    declared = batch.get("layouts", {}).items()
    return {k: fill for k, (layout, fill) in declared if layout == "token" and k in batch and k not in CORE_LAYOUTS}


@torch.no_grad()
def packs_exactly(model) -> bool:
    """Start-up probe: do two sequences packed into one row stay apart in this model? The logits of a sequence
    packed after another must not move when that other one's tokens change (to 8 roundings; attention-only models:
    bit for bit). A layer that carries state along the row (a state-space or linear-attention recurrence) carries
    the first sequence into the second; such a model runs its micro-batches as
    right-padded rows instead (pack). Collective under FSDP2 (the verdict all-reduced)."""
    vocab = model.config.get_text_config().vocab_size
    second = [(3 + 11 * i) % vocab for i in range(6)]
    firsts = [(7 + 13 * i) % vocab for i in range(5)], [(5 + 17 * i) % vocab for i in range(5)]
    was_training = model.training
    model.eval()
    try:  # [6, V] each: the second sequence's logits
        logits = [_packed_logits(model, [first, second])[0, 5:].double() for first in firsts]
    finally:
        model.train(was_training)
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2 keeps the root unsharded after a no-grad forward
    moved = (logits[0] - logits[1]).abs().max().item()
    if dist.is_initialized():  # every rank the same verdict (a model used outside a process group: its own)
        moved = all_reduce(moved, op=dist.ReduceOp.MAX)
    return moved <= 8 * torch.finfo(torch.float32).eps * logits[0].abs().max().item()


def _packed_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    """trainer_logits [1, T, V] of the token sequences packed into one row (pack)."""
    device = next(model.parameters()).device
    packed = pack(make_batch(sequences, [[]] * len(sequences), pad_id=0))
    varlen = {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed["varlen"].items()}
    return model.trainer_logits(packed["input_ids"].to(device), packed["position_ids"].to(device), **varlen)


def attention_implementation(compute_dtype: torch.dtype) -> str:
    """The attention a trainer model is built with: FlashAttention 2 (transformers' flash_attention_2, varlen through
    cu_seq_lens) on a GPU where flash-attn is installed and the compute is 16-bit; else varlen_attention (CPU, a GPU
    without flash-attn, fp32 runs: FlashAttention computes in 16 bits only)."""
    flash = torch.cuda.is_available() and is_flash_attn_2_available()
    return "flash_attention_2" if flash and compute_dtype in (torch.bfloat16, torch.float16) else VARLEN_ATTENTION


def use_varlen_attention(model) -> None:
    """Give a model whose attention cannot take a packed row's varlen arguments varlen_attention. load_model builds
    its models so; one built elsewhere (transformers' from_pretrained: sdpa) is switched on its first packed
    forward (sdpa and eager would be exact too, through transformers' packed mask, but at T^2 pairs per layer)."""
    decoder = model.get_decoder()
    name = decoder.config._attn_implementation
    if not (name.startswith(VARLEN_ATTENTION) or name in FLASH_VARLEN):  # ours, or a family's built on rows_attention
        decoder.set_attn_implementation(VARLEN_ATTENTION)


def varlen_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function (AttentionInterface) for packed rows where FlashAttention does not run:
    everything else of the model runs on the T packed tokens; only attention pads, each sequence to the longest.

    query [1, H, T, d], key and value [1, K, T, d] (K key-value heads), cu_seq_lens_q [n + 1], max_length_q L
    -> [1, T, H, d]: rows_attention with causal_attention (PyTorch's SDPA, causal within each sequence, and within
    the sliding window where the model has one, as FlashAttention honours it). Without cu_seq_lens_q (a plain
    forward: check_logits_fn's probe, a padded batch with transformers' 4-D mask, varlen_mask) each row is one
    sequence. Scores transformed before the softmax are another attention: UnsupportedModel."""
    if kwargs.get("softcap") is not None:
        keys = ", ".join(logit_rule_keys(module.config))
        raise UnsupportedModel(
            f"varlen_attention: {type(module).__name__} transforms its attention scores before the softmax (config "
            f"keys that may set it: {keys}); build the model with an attention that does (FlashAttention 2, or its "
            "family's own)"
        )

    def attend(q, k, v, mask):  # [n, H, L, d], keys and values [n, K, L, d] -> [n, H, L, d]
        return causal_attention(module, q, k, v, mask, dropout, scaling, sliding_window)

    position_ids = kwargs.get("position_ids")
    return rows_attention(attend, query, key, value, attention_mask, cu_seq_lens_q, max_length_q, position_ids), None


def rows_attention(attend, query, key, value, attention_mask, cu_seq_lens_q, max_length_q, position_ids=None):
    """Attention over the sequences of a packed row: the n sequences are scattered into right-padded [n, H, L, d],
    attend(q, k, v, None) runs on those rows (keys and values [n, K, L, d]), and the real positions are gathered
    back. query [1, H, T, d], key and value [1, K, T, d], cu_seq_lens_q [n + 1], max_length_q L -> [1, T, H, d].
    A real query at position p sees keys 0..p of its own sequence only (every padded key comes after its real ones);
    padded queries are dropped, so they get no gradient. Cost: about n * L^2 / 2 (query, key) pairs per head, against
    T^2 for a packed row under transformers' SDPA mask (its kernels visit every masked tile) and b * W^2 for the
    padded batch [b, W] (W = longest prompt + longest response). Sequences of one length (T = n * L) need no copy.
    Without cu_seq_lens_q: attend(query, key, value, attention_mask) on the batch as it is -> [b, s, H, d]."""
    if cu_seq_lens_q is None:
        _refuse_unmarked_packing(attention_mask, position_ids)
        return attend(query, key, value, attention_mask).transpose(1, 2)  # [b, s, H, d]
    heads, tokens, d = query.shape[1:]
    n, length = cu_seq_lens_q.numel() - 1, max_length_q
    if tokens == n * length:  # every sequence of one length: [1, h, n * L, d] is already [n, h, L, d]
        q, k, v = (x[0].unflatten(1, (n, length)).transpose(0, 1) for x in (query, key, value))
        return attend(q, k, v, None).transpose(0, 1).flatten(1, 2)[None].transpose(1, 2)  # [1, T, H, d]
    sequence = torch.repeat_interleave(
        torch.arange(n, device=query.device), cu_seq_lens_q.diff(), output_size=tokens
    )  # [T]: each token's sequence
    slot = sequence * length + torch.arange(tokens, device=query.device) - cu_seq_lens_q[sequence]  # [T]

    def padded(x):  # [1, h, T, d] -> [n, h, L, d]
        out = x.new_zeros(n * length, x.shape[1], d)  # [n * L, h, d]
        out[slot] = x[0].transpose(0, 1)
        return out.view(n, length, -1, d).transpose(1, 2)

    out = attend(padded(query), padded(key), padded(value), None)  # [n, H, L, d]
    return out.transpose(1, 2).reshape(n * length, heads, d)[slot][None]  # [1, T, H, d]


def causal_attention(module, q, k, v, mask, dropout: float, scaling, sliding_window) -> torch.Tensor:
    """PyTorch's SDPA on rows [n, H, L, d] (keys and values [n, K, L, d]) -> [n, H, L, d]: within each row, causal
    and within the sliding window (causal_mask), or as the 4-D mask says (mask [n or 1, 1, L, L], True: attend)."""
    length, groups = q.shape[2], q.shape[1] // k.shape[1]
    scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
    if mask is None and sliding_window is not None and length > sliding_window:
        mask = causal_mask(length, sliding_window, q.device)
    if mask is not None and groups > 1:  # SDPA's grouped-query path takes no mask on every device
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None, enable_gqa=groups > 1
    )


def causal_mask(length: int, window: int | None, device) -> torch.Tensor:
    """[L, L], True where query p attends key k: k <= p, and p - window < k within a sliding window (transformers'
    convention). E.g. L = 3, window 2: [[1, 0, 0], [1, 1, 0], [0, 1, 1]]."""
    i = torch.arange(length, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - (window or length))


def _refuse_unmarked_packing(attention_mask, position_ids) -> None:
    """A row whose positions restart (packed) reaching varlen_attention without cu_seq_lens would attend across its
    sequences: stop it (ValueError)."""
    if attention_mask is None and position_ids is not None and (position_ids.diff(dim=-1) != 1).any():
        raise ValueError(
            "varlen_attention: a packed row (restarting position_ids) without cu_seq_lens_q/k and max_length_q/k "
            "would attend across its sequences; pass them (fsdp_train.pack)"
        )


def varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask transformers builds for varlen_attention (AttentionMaskInterface): none without a 2-D padding mask
    (a packed row: cu_seq_lens delimit its sequences; a plain batch: causal), else SDPA's 4-D one."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_mask)


# ------------------------------------------------------------------------------ log-probs
def final_hidden(model, input_ids: torch.Tensor, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
    """The decoder's final hidden states [b, s, h] (after its last norm); the decoder is transformers'
    get_decoder(). input_ids, attention_mask, position_ids [b, s]; kwargs: a packed row's cu_seq_lens_q/k and
    max_length_q/k (pack's varlen), which transformers hands to the attention function, and the micro-batch's token
    fields [b, s, ...] (pack's fields), which a forward pre-hook of the decoder takes (token_fields)."""
    decoder = model.get_decoder()
    return decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
    ).last_hidden_state


def chunked_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head,
    temperature: float,
    chunk_size: int,
    entropy_fn=None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs(head(hidden), targets, ...) without ever holding a [n, V] tensor.

    hidden [n, h] (final hidden states, after the last norm), targets [n] -> logp [n], entropy [n] or None;
    head: hidden [c, h] -> logits [c, V] (logits_head).
    The n positions are cut into chunks of chunk_size; each chunk runs head -> logits -> log-softmax ->
    gather (+ entropy) and keeps only its [chunk] outputs. With autograd on, every chunk is wrapped in
    torch.utils.checkpoint: the forward keeps just the chunk's inputs, the backward recomputes the chunk's
    logits and frees them before the next chunk. Cost: one extra lm_head matmul per token in the training
    forward; memory: a few [chunk, V] tensors at a time instead of several [n, V] ones, whatever n is.
    (veRL: FusedLinearForPPOFunction in verl/utils/experimental/torch_functional.py, the same idea with a
    hand-written backward; TRL's selective_log_softmax; Liger's fused linear cross-entropy.)
    chunk_size <= 0: one piece, no recompute (the plain path: [n, V] logits kept for the backward); so is
    n <= chunk_size, where keeping one chunk's logits costs what recomputing it at the start of the backward
    would.
    The chunks are of equal size (n = 1025, chunk_size 1024: 513 + 512), because a chunk of a few rows makes
    the CPU's BLAS sum the backward's V-long products (grad_logits [c, V] @ W [V, h]) less accurately: about
    1e-5 relative for c < 16, against 1e-7 for the plain path.
    """

    def piece(h, t):  # [c, h], [c] -> [c], [c]
        return token_logprobs(head(h), t, temperature, entropy_fn, entropy_grad)

    if chunk_size <= 0 or hidden.shape[0] <= chunk_size:  # one chunk: recomputing it would not lower the peak
        return piece(hidden, targets)
    chunks = math.ceil(hidden.shape[0] / chunk_size)  # of equal size: no tiny last chunk (see above)
    logps, entropies = [], []
    for h, t in zip(
        hidden.tensor_split(chunks), targets.tensor_split(chunks), strict=True
    ):  # [c, h], [c], c <= chunk_size
        logp, entropy = checkpoint(piece, h, t, use_reentrant=False) if torch.is_grad_enabled() else piece(h, t)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), (torch.cat(entropies) if entropy_fn is not None else None)


def response_logprobs(
    model,
    packed: dict,
    temperature: float,
    entropy_fn=None,
    entropy_grad: bool = True,
    chunk_size: int = LOGPROB_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [b, R] of a packed micro-batch's response tokens (pack) and their entropy [b, R] or None, 0
    outside the response mask: the decoder on the packed row's T real tokens (each sequence attends to its own
    tokens only: the varlen arguments reach the attention function), then chunked_logprobs with the model's head
    (logits_head: the output embedding, or a family's rule for its logits) at the N positions that predict a
    response token only (nothing on the prompt, nothing on padding). The micro-batch's token fields (pack's
    "fields", token_fields) go to the decoder's call with its tokens, in the same layout.

    Under FSDP2 this must run as a forward of the ROOT module: the root's pre-forward unshards the
    parameters it owns (embed_tokens, the final norm, lm_head) and its backward hooks reduce-scatter their
    gradients. Calling the decoder and the head directly would skip both. _forward therefore makes it a
    method of the model on first use, registered with FSDP2 (add_logprob_forward); call it as
    model.response_logprobs(...).
    """
    hidden = final_hidden(
        model,
        packed["input_ids"],
        packed["attention_mask"],
        packed["position_ids"],
        **packed["varlen"],
        **packed["fields"],
    )  # [1, T, h] (right-padded rows: [b, L, h])
    logp, entropy = chunked_logprobs(
        hidden.flatten(0, 1)[packed["predict"]],  # [N, h]: the positions that predict the response tokens
        packed["targets"],
        logits_head(model),
        temperature,
        chunk_size,
        entropy_fn,
        entropy_grad,
    )  # [N]
    return unpack(logp, packed["scored"]), (unpack(entropy, packed["scored"]) if entropy is not None else None)


def unpack(values: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """values [N] at the True entries of scored [b, R] (row by row), 0 elsewhere -> [b, R]. A new tensor (FSDP2
    hooks a forward's outputs for its backward; a view would invite in-place edits)."""
    return torch.zeros(scored.shape, dtype=values.dtype, device=values.device).masked_scatter(scored, values)


def trainer_logits(model, input_ids: torch.Tensor, position_ids=None, **varlen) -> torch.Tensor:
    """The logits [b, s, V] of the log-prob path, unchunked: final_hidden, then logits_head (input_ids
    [b, s], no padding; or a packed row, its position_ids and varlen arguments: pack). For check_logits_fn,
    packs_exactly and the tests; a forward method of the model like response_logprobs."""
    return logits_head(model)(final_hidden(model, input_ids, position_ids=position_ids, **varlen))


def logits_head(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [n, h] -> logits [n, V] as the model's own forward computes them: transformers' output embedding
    (get_output_embeddings()), or the head use_logits_head gave it."""
    return getattr(model, "logits_head", None) or model.get_output_embeddings()


def use_logits_head(model, rule: str, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The log-prob path computes the model's logits with head (hidden [n, h] -> logits [n, V]) instead of the output
    embedding alone: for a family whose forward does more to its logits (rule: what, for the messages); check_logits_fn
    then proves it the forward's."""
    model.logits_rule, model.logits_head = rule, head


def add_logprob_forward(model) -> None:
    """Give the model its response_logprobs and trainer_logits methods; FSDP2 then runs them like forward
    (for a plain module the registration does nothing). Its attention becomes varlen if it is not
    (use_varlen_attention), and model.packs_sequences says whether packed rows stay apart in it (packs_exactly).
    load_model does this at load (check_logits_fn); _forward on first use for a model built elsewhere."""
    use_varlen_attention(model)
    for name, fn in (("response_logprobs", response_logprobs), ("trainer_logits", trainer_logits)):
        setattr(model, name, types.MethodType(fn, model))
        register_fsdp_forward_method(model, name)
    model.packs_sequences = packs_exactly(model)


PROBE_LOGIT = 1000.0  # check_logits_fn scales the output embedding's logits to this size


class UnsupportedModel(ValueError):
    """A model whose logits the log-prob path does not reproduce; the message is one line."""


@torch.no_grad()
def check_logits_fn(model) -> None:
    """Start-up proof that logits_head is the model's own: the model's forward and trainer_logits on one probe
    must give the same logits, else UnsupportedModel names the class, what its forward did and the config
    keys that may be the rule. A forward hook scales the output embedding's logits to at most PROBE_LOGIT
    in both passes (by the first pass's gain), so that a rule shows even on a random tiny model whose
    logits are ~0.1: an unknown cap at 30 turns 1000 into 30; a scale s multiplies 1000 by s; a change
    of the hidden states before the head changes the head's input; a vocabulary cut changes the width.
    Allowed: 8 roundings of PROBE_LOGIT in the logits' dtype (both passes run the same operations). Every
    rank gets the same verdict (all-reduced): collective under FSDP2."""
    config = model.config.get_text_config()
    name = f"model {model.config.name_or_path}: {type(model).__name__.removeprefix('FSDP')}"
    rule_keys = ", ".join(logit_rule_keys(config)) or "none"
    if model.get_output_embeddings() is None:
        raise UnsupportedModel(f"{name}: no output embedding (get_output_embeddings() is None)")
    if not hasattr(model, "trainer_logits"):
        add_logprob_forward(model)
    ids = torch.tensor([[(7 + 13 * i) % config.vocab_size for i in range(8)]])  # [1, 8]
    own, ours = _probe_logits(model, ids.to(next(model.parameters()).device))  # [1, 8, V'], [1, 8, V]
    if own.shape != ours.shape:
        raise UnsupportedModel(
            f"{name}: its forward returns {own.shape[-1]} logits per position, the output embedding gives "
            f"{ours.shape[-1]} (config keys that may set it: {rule_keys})"
        )
    error = all_reduce((own.double() - ours.double()).abs().max(), op=dist.ReduceOp.MAX)
    if error > 8 * torch.finfo(own.dtype).eps * PROBE_LOGIT:
        raise UnsupportedModel(
            f"{name}: its forward post-processes the logits in a way the log-prob path does not reproduce "
            f"(output-embedding logits scaled to at most {PROBE_LOGIT:g} come out at most "
            f"{own.abs().max().item():.4g}, the log-prob path's {ours.abs().max().item():.4g}; config keys "
            f"that may set it: {rule_keys}); training would follow another policy than vLLM samples"
        )


def _probe_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the forward's logits, trainer_logits) [1, s, V] on ids [1, s], both with the output embedding's logits
    scaled by the gain that makes the first pass's at most PROBE_LOGIT; in eval mode (no dropout)."""
    gain = []

    def amplify(module, args, logits):  # [1, s, V]
        if not gain:
            gain.append(PROBE_LOGIT / logits.abs().max().item())
        return logits * gain[0]

    was_training = model.training
    model.eval()
    hook = model.get_output_embeddings().register_forward_hook(amplify)
    try:
        own = model(input_ids=ids, use_cache=False).logits  # [1, s, V']
        ours = model.trainer_logits(ids)  # [1, s, V]
    finally:
        hook.remove()
        model.train(was_training)
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2 keeps the root unsharded after a no-grad forward
    return own, ours


def logit_rule_keys(config) -> list[str]:
    """The config's numbers (keys, and properties) whose names suggest a rule for the logits: caps, scalings,
    multipliers ("logit_scale=0.5", ...); [] for most families."""
    config = config.get_text_config()
    properties = [k for k in dir(type(config)) if isinstance(getattr(type(config), k), property)]
    names = sorted(k for k in {*config.to_dict(), *properties} if re.search(r"logit|soft_?cap|scal|multiplier", k))
    return [f"{key}={getattr(config, key)}" for key in names if type(getattr(config, key, None)) in (int, float)]


def _forward(
    model,
    mb: dict[str, torch.Tensor],
    temperature: float,
    entropy_fn=None,
    entropy_grad: bool = True,
    chunk_size: int = LOGPROB_CHUNK,
):
    """Response log-probs [b, R] (and entropy [b, R] or None) of a micro-batch, 0 outside its response mask: its
    real tokens packed into one row (pack), through the model's packed forward (response_logprobs)."""
    if not hasattr(model, "response_logprobs"):  # first use: attach it, FSDP2-registered
        add_logprob_forward(model)
    return model.response_logprobs(pack(mb, model.packs_sequences), temperature, entropy_fn, entropy_grad, chunk_size)


def _device_batch(batch, rows, device):
    """The micro-batch `rows` of the batch on the device (its tensors, and the layouts pack reads), and its row
    indices ([0] for an empty one: it still runs a forward, masked out, for FSDP's collectives, without row 0's
    token fields: token_fields)."""
    sub = select(batch, rows or [0])
    dropped = set() if rows else set(token_fields(sub))
    mb = {k: v.to(device) for k, v in sub.items() if torch.is_tensor(v) and k not in dropped}
    return {**mb, "layouts": sub.get("layouts", {})}, rows or [0]


@torch.no_grad()
def compute_logprobs(
    model,
    batch: dict[str, torch.Tensor],
    *,
    temperature: float,
    max_tokens: int,
    entropy_fn=None,
    chunk_size: int = LOGPROB_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, R] (and entropy [B, R] if entropy_fn) of the batch's responses, in
    token-budgeted micro-batches. Used for the old (policy) and reference log-probs."""
    device = next(model.parameters()).device
    shape = batch["response_mask"].shape
    logp_all, ent_all = torch.zeros(shape), torch.zeros(shape) if entropy_fn else None
    for rows in _synced_micro_batches(batch, max_tokens):
        mb, idx = _device_batch(batch, rows, device)
        logp, ent = _forward(model, mb, temperature, entropy_fn, chunk_size=chunk_size)
        if rows:
            width = logp.shape[1]
            logp_all[idx, :width] = logp.cpu() * mb["response_mask"].cpu()
            if ent_all is not None:
                ent_all[idx, :width] = ent.cpu() * mb["response_mask"].cpu()
    if hasattr(model, "reshard"):
        model.reshard()  # FSDP2 keeps the root (embed_tokens, norm, lm_head) unsharded after a forward: free it
    return logp_all, ent_all


def sequence_logprobs(
    model, prompt: list[int], response: list[int], temperature: float, chunk_size: int = LOGPROB_CHUNK
) -> torch.Tensor:
    """Log-probs [K] of one response's K tokens after its prompt, through compute_logprobs: the trainer's
    own path (sync.check_sync's trainer side). Collective under FSDP2."""
    batch = make_batch([prompt], [response], pad_id=0)  # one row: no padding
    logp, _ = compute_logprobs(
        model, batch, temperature=temperature, max_tokens=len(prompt) + len(response), chunk_size=chunk_size
    )
    return logp[0]


def train_step(
    model,
    optimizer,
    batch: dict[str, torch.Tensor],
    loss_fn,
    *,
    temperature: float,
    max_tokens: int,
    grad_clip: float = 1.0,
    entropy_fn=None,
    entropy_grad: bool = True,
    chunk_size: int = LOGPROB_CHUNK,
    keep_logprobs: bool = False,
) -> dict:
    """One optimizer step on this rank's share of ONE mini-batch (veRL's update_policy inner loop).

    loss_fn(logp [b, R], entropy [b, R] | None, mb, counts) -> (loss, metrics), where counts are the
    GLOBAL mini-batch totals (all micro-batches, all ranks): num_tokens = response tokens, num_seqs =
    rows, empty responses included (veRL's global_batch_size). loss_fn normalises by them, so the
    micro-batch losses and metric shares SUM to the mini-batch values (metrics are all-reduced here;
    keys ending in "_max" are maxima instead). entropy_fn with entropy_grad=False: entropy for metrics.
    Skips the step (zeroing the gradients) when the pre-clip gradient norm is not finite.
    keep_logprobs: the forward's log-probs and entropy [B, R] (0 past each response) come back too, under
    "logprobs" and "entropy" (the on-policy shortcut takes them as the old log-probs).
    """
    device = next(model.parameters()).device
    world = dist.get_world_size()
    counts = {
        "num_tokens": all_reduce(batch["response_mask"].sum()),  # veRL's batch_num_tokens
        "num_seqs": all_reduce(batch["response_mask"].shape[0]),  # veRL's global_batch_size: ALL rows
    }
    sums: dict[str, float] = {}
    shape = batch["response_mask"].shape
    kept = {"logprobs": torch.zeros(shape), "entropy": torch.zeros(shape)} if keep_logprobs else {}  # [B, R]
    optimizer.zero_grad(set_to_none=True)
    for rows in _synced_micro_batches(batch, max_tokens):
        mb, _ = _device_batch(batch, rows, device)
        if not rows:
            mb["response_mask"] = torch.zeros_like(mb["response_mask"])
        logp, entropy = _forward(model, mb, temperature, entropy_fn, entropy_grad, chunk_size)
        loss, metrics = loss_fn(logp, entropy, mb, counts)
        (loss * world).backward()  # FSDP averages gradients over ranks: * world makes it the global sum
        _accumulate(sums, metrics)
        if keep_logprobs and rows:
            kept["logprobs"][rows, : logp.shape[1]] = (logp.detach() * mb["response_mask"]).cpu()  # [b, R]
            if entropy is not None:
                kept["entropy"][rows, : entropy.shape[1]] = (entropy.detach() * mb["response_mask"]).cpu()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable_params(model), max_norm=grad_clip)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
    skipped = not math.isfinite(grad_norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # free the gradients now, not after the next generation
    return {**_step_metrics(sums, grad_norm, skipped), **kept}


def _step_metrics(sums: dict, grad_norm: float, skipped: bool) -> dict:
    """train_step's metrics, the same on every rank: the micro-batches' shares all-reduced (summed; keys ending in
    "_max": the maximum), the pre-clip gradient norm, whether the step was skipped, and on GPU the trainer's own peak
    memory."""
    reduced = {}
    for k, v in sorted(sums.items()):  # the same keys, in the same order, on every rank
        reduced[k] = all_reduce(v, op=dist.ReduceOp.MAX if k.endswith("_max") else dist.ReduceOp.SUM)
    out = {**reduced, "actor/grad_norm": grad_norm, "actor/skipped_steps": float(skipped)}
    if torch.cuda.is_available():  # the trainer's own peak: without other memory pools (a sleeping vLLM's)
        out["perf/max_memory_allocated_gb"] = (torch.cuda.max_memory_allocated() - other_pools_bytes()) / 1024**3
    return out


def _accumulate(sums: dict[str, float], metrics: dict) -> None:
    """Add one micro-batch's metric shares into sums; keys ending in "_max" keep the maximum instead."""
    for k, v in metrics.items():
        if k.endswith("_max"):
            sums[k] = max(sums.get(k, -math.inf), float(v))
        else:
            sums[k] = sums.get(k, 0.0) + float(v)


def other_pools_bytes(snapshot: list[dict] | None = None) -> int:
    """Bytes allocated in CUDA memory pools other than the default one (segment_pool_id (0, 0)), e.g. vLLM's
    sleep-mode pool, which torch's max_memory_allocated() counts too, even while that engine sleeps."""
    snapshot = torch.cuda.memory_snapshot() if snapshot is None else snapshot
    return sum(s["allocated_size"] for s in snapshot if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


# ------------------------------------------------------------------------------- performance
PEAK_BF16_FLOPS = {"H100": 989e12, "H800": 989e12, "H200": 989e12, "A100": 312e12, "A800": 312e12}


def peak_flops() -> float:
    """Dense bf16 peak of this device, 0 when unknown (e.g. CPU): MFU is then reported as 0."""
    if not torch.cuda.is_available():
        return 0.0
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), 0.0)


def estimate_flops(config, seqlens: list[int]) -> float:
    """veRL's FlopsCounter for dense decoders, forward + backward of sequences of these lengths: decoder_flops with
    the MLP's 3*h*I parameters per layer (gate, up, down)."""
    return decoder_flops(config, seqlens, mlp=3 * config.hidden_size * config.intermediate_size)


def decoder_flops(config, seqlens: list[int], mlp: int) -> float:
    """6*N*sum(s) + 6*sum(s^2)*d*H*L, N = L*(M + h*(H*d + 2*K*d + H*d)) + 2*V*h (no biases), M = mlp: a layer's
    MLP parameters that each token computes with. A config without num_key_value_heads has multi-head
    attention: K = H."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    kv_heads, vocab = getattr(config, "num_key_value_heads", None) or heads, config.vocab_size
    d = getattr(config, "head_dim", None) or h // heads
    n = layers * (mlp + h * (heads * d + 2 * kv_heads * d + heads * d)) + 2 * vocab * h
    return 6 * n * sum(seqlens) + 6 * sum(s * s for s in seqlens) * d * heads * layers


def mfu(flops: float, seconds: float, world_size: int, peak: float) -> float:
    """Model FLOPs utilisation, veRL's perf/mfu/actor: FLOPs of all ranks / seconds / peak / world."""
    return flops / seconds / peak / world_size if peak > 0 and seconds > 0 else 0.0


# ------------------------------------------------------------------------------- checkpoints
def save_checkpoint(root: str, step: int, model, optimizer, scheduler, extra: dict | None = None, keep: int = 2) -> str:
    """Write <root>/step_<N> atomically: DCP shards (model + optimizer) and the loop's state go into
    step_<N>.tmp, a COMPLETE marker is written last, then the directory is renamed. A crash at any
    point leaves either the previous checkpoints or a *.tmp that nothing loads. `extra` is saved per
    rank (RNG states differ by rank). Keeps the newest `keep` checkpoints. With frozen parameters only the
    trainable ones and their optimizer state are saved (the frozen ones come from the model's path)."""
    rank = dist.get_rank()
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f"step_{step}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = _checkpoint_state(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    state = {"scheduler": scheduler.state_dict(), "extra": extra or {}, "world_size": dist.get_world_size()}
    torch.save(state, os.path.join(tmp, f"state_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "COMPLETE"), "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints under root, oldest first (step_<N> only: a step_<N>.tmp left by a crash between
    its COMPLETE marker and the rename is not one)."""
    found = [
        p
        for p in glob.glob(os.path.join(root, "step_*"))
        if os.path.basename(p)[5:].isdigit() and os.path.exists(os.path.join(p, "COMPLETE"))
    ]
    return sorted(found, key=lambda p: int(os.path.basename(p).split("_")[1]))


def saved_state(path: str) -> dict:
    """The loop's state a checkpoint holds for this rank (rank 0's when this rank did not exist in the saving run):
    {"scheduler", "extra", "world_size", ...}, tensors unread."""
    if not os.path.exists(os.path.join(path, "COMPLETE")):
        raise FileNotFoundError(f"load_checkpoint: {path} is not a complete checkpoint (no COMPLETE marker)")
    own = os.path.join(path, f"state_rank{dist.get_rank()}.pt")
    return torch.load(own if os.path.exists(own) else os.path.join(path, "state_rank0.pt"), weights_only=False)


def load_checkpoint(path: str, model, optimizer, scheduler) -> dict:
    """Load a checkpoint written at ANY world size (DCP reshards). Returns this rank's `extra` (rank 0's when this
    rank did not exist in the saving run) and saved_world_size. A checkpoint that does not hold exactly the model's
    trained weights (another model, or other parameters frozen) stops in one line before anything loads
    (CheckpointError)."""
    saved = saved_state(path)
    model_sd, optim_sd = _checkpoint_state(model, optimizer)
    stored = {key.removeprefix("model.") for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata}
    if missing := sorted(set(model_sd) - stored):
        raise CheckpointError(
            f"trainer.resume: {path} lacks {len(missing)} of the weights this model trains ({missing[0]}, ...): it "
            "was written by another model, or with other parameters frozen"
        )
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    options = StateDictOptions(strict=not _frozen(model))  # frozen weights come from the model's path
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    scheduler.load_state_dict(saved["scheduler"])
    return {**saved["extra"], "saved_world_size": saved["world_size"]}


class CheckpointError(ValueError):
    """A checkpoint this model cannot resume from; the message is one line."""


def _checkpoint_state(model, optimizer) -> tuple[dict, dict]:
    """What a checkpoint holds: the model's and the optimizer's state dicts; with frozen parameters (they come from
    the model's path, a tied lm_head included), of the trainable ones only."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return (_trainable_only(model, model_sd) if _frozen(model) else model_sd), optim_sd


def _trainable_only(model, model_sd: dict) -> dict:
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trainable}


def _frozen(model) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def export_hf(model, out_dir: str, tokenizer=None) -> str:
    """Write a safetensors HF model (config, generation config, tokenizer) that transformers and vLLM
    load directly: write_hf of the full state dict (full_state_dict)."""
    return write_hf(model, full_state_dict(model), out_dir, tokenizer)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's full state dict on rank 0 (CPU-offloaded), {} on the others; every rank calls it (collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def write_hf(model, full: dict[str, torch.Tensor], out_dir: str, tokenizer=None) -> str:
    """Rank 0 writes `full` (a state dict of the model's HF class) as an HF model directory, atomically (a .tmp
    directory renamed); every rank waits for it."""
    if dist.get_rank() == 0:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with torch.device("meta"):  # a plain (un-FSDP'd) model, so config.architectures stays the HF class
            plain = trainer_model_class(out_dir, model.config)._from_config(model.config)
        plain.generation_config = model.generation_config
        plain.save_pretrained(tmp, state_dict=full, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(tmp, out_dir)
    dist.barrier()
    return out_dir
