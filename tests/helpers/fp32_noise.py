"""fp32 tolerances measured on the machine that runs the test, instead of constants.

Every fp32 check compares the code under test (chunked log-probs, FSDP2 at 1 and 2 ranks, train_step,
the loop's update) with a REFERENCE: the plain computation (one process, whole batch, nothing chunked
or sharded) in float64. How far float32 lands from it is measured at test time (measure): the same
plain computation in float32 with 1 and with 2 torch threads (kernels and summation orders change with
the thread count and the CPU), each compared with the reference; the noise is the larger error (cost:
one float64 and two float32 runs of the plain computation). The code under test runs the same math in
float32 in another order, so its error is of the same size: a check allows FACTOR x the noise (check).

The error of a quantity (error):
  a number (a loss, a metric)          |x - ref|
  a tensor (log-probs, entropy)        max |x - ref|; weights and SGD steps read back from weights are
                                       compared as ONE tensor (Flat): their rounding is set by the weights'
                                       size (|w| * 2^-24 in every element), and so is the noise
  named tensors (gradients)            per name ||x - ref|| / ||ref||, and ONE noise for all names: the max
                                       over names. A tiny gradient (a k_proj bias, which attention nearly
                                       ignores) has a relative noise 4x the others' from summation order;
                                       measured per name, the others' noise would be luck of one CPU.
The noise is never taken below one fp32 rounding of the reference (EPS32 * |ref|; gradients: EPS32): a
quantity both precisions get exactly (a clip fraction) still goes through fp32 arithmetic in the code.
FLOOR: an absolute allowance, for quantities that are exactly 0 (an on-policy clip fraction).

The reference model is HF's model in float64 (float64_copy) with one fix: HF's norms (Qwen2RMSNorm,
Gemma2RMSNorm, CohereLayerNorm, ...) cast their input to float32, so in a float64 model they would round
every norm to fp32; in the copy those casts keep float64 (KeepFloat64), whatever the family's formula. The
rotary cos/sin table stays as HF computes it (in fp32, then cast): the same table as the fp32 model's, an
input of the computation rather than a result.
"""

import contextlib
import copy
import types

import torch
from torch.overrides import TorchFunctionMode

EPS32 = torch.finfo(torch.float32).eps
FLOOR = 1e-12
THREADS = (1, 2)
# The code's error / the measured noise, measured on 2 x86-64 cores with AVX-512 (torch 2.13.0+cpu), in
# process at 1 and 2 threads and under torchrun at world sizes 1 and 2 (per test file, in its docstring):
#   log-probs <= 1.0, entropy <= 0.81, losses <= 1.82, gradients (each parameter against the max noise)
#   <= 1.06, weights after AdamW steps <= 0.92, SGD steps read back from weights <= 1.01, metrics <= 1.68,
#   vLLM's log-probs <= 0.74, advantages and batch metrics <= 0.11.
# Here the code's fp32 numbers are often the plain path's bit for bit (ratio 1.0). On another CPU they need
# not be: the report behind this file had a k_proj bias gradient 1.4e-6 (relative) away from the plain
# fp32 path, and two fp32 errors of one size can differ by a few x. FACTOR = 16 is 9x the largest ratio
# seen. The deliberate bugs checked (a chunk's log-probs or gradient dropped, an off-by-one slice, no
# world-size factor, per-micro-batch normalisation, an over-budget row dropped, holes trimmed away) gave
# 600x to 5e7x the noise: 37x above the bound at the least.
FACTOR = 16.0


@contextlib.contextmanager
def num_threads(n: int):
    """torch's intra-op thread count set to n, then restored. Through torch._C: once an in-process vLLM
    engine has started, torch.set_num_threads is a no-op (vllm/v1/worker/cpu_worker.py replaces it)."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(n)
    assert torch.get_num_threads() == n, f"could not set {n} threads"
    try:
        yield
    finally:
        torch._C.set_num_threads(before)


class KeepFloat64(TorchFunctionMode):
    """While active, a float64 tensor's casts to float32 (`x.to(torch.float32)`, `x.float()`) return it as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.float) and args[0].dtype == torch.float64:
            if func is torch.Tensor.float or torch.float32 in (*args[1:], *kwargs.values()):
                return args[0]
        return func(*args, **kwargs)


def _forward_in_float64(module, *args, **kwargs):
    with KeepFloat64():
        return type(module).forward(module, *args, **kwargs)


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of an HF model whose norms (*RMSNorm, *LayerNorm) compute in float64: their casts to
    float32 keep float64 (KeepFloat64)."""
    model = copy.deepcopy(model).double()
    for module in model.modules():
        if type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
            module.forward = types.MethodType(_forward_in_float64, module)
    return model


class Flat(dict):
    """Named tensors compared as ONE tensor, max |x - ref| over all their elements (weights, SGD steps)."""


def flat(named: dict, names) -> torch.Tensor:
    """The tensors `names` of `named` as one float64 vector (sorted names)."""
    return torch.cat([named[k].detach().double().flatten() for k in sorted(names)])


def error(value, ref):
    """The error of one quantity (see above); named tensors: {name: relative error}."""
    if isinstance(ref, Flat):
        return error(flat(value, ref), flat(ref, ref))
    if isinstance(ref, dict):
        return {
            k: (
                torch.linalg.norm(value[k].double() - ref[k].double())
                / torch.linalg.norm(ref[k].double()).clamp(min=1e-300)
            ).item()
            for k in ref
        }
    if isinstance(ref, torch.Tensor):
        return (value.double() - ref.double()).abs().max().item()
    return abs(float(value) - float(ref))


def _rounding(ref) -> float:
    """One fp32 rounding of the quantity: EPS32 x its magnitude (relative errors: EPS32)."""
    if isinstance(ref, Flat):
        return _rounding(flat(ref, ref))
    if isinstance(ref, dict):
        return EPS32
    if isinstance(ref, torch.Tensor):
        return EPS32 * ref.double().abs().max().item()
    return EPS32 * abs(float(ref))


def measure(compute, threads=THREADS) -> tuple[dict, dict]:
    """compute(dtype) -> {quantity: number | tensor | {name: tensor}}, the plain computation in that dtype.
    Returns (reference, noise): reference = compute(float64); noise[quantity] = the largest error of
    compute(float32) at each thread count (named tensors: over all names too), never below one rounding.
    The thread counts: 1, 2, and the process's own count if it is another (a machine with more cores: the
    in-process code under test runs at that count)."""
    ref = compute(torch.float64)
    noise = {q: _rounding(v) for q, v in ref.items()}
    for n in sorted({*threads, torch.get_num_threads()}):
        with num_threads(n):
            out = compute(torch.float32)
        for q in ref:
            e = error(out[q], ref[q])
            noise[q] = max(noise[q], max(e.values()) if isinstance(e, dict) else e)
    return ref, noise


def check(value, ref, noise: float, what: str = "", factor: float = FACTOR) -> None:
    """Asserts error(value, ref) <= factor * noise + FLOOR (named tensors: each name, FLOOR on its norm)."""
    e = error(value, ref)
    if isinstance(e, dict):  # relative errors per name
        for k, rel in e.items():
            allowed = factor * noise + FLOOR / max(torch.linalg.norm(ref[k].double()).item(), 1e-300)
            assert rel <= allowed, (
                f"{what} {k}: relative error {rel:.3g} > {factor:g} x fp32 noise {noise:.3g} "
                f"({rel / noise:.3g} x the noise)"
            )
    else:
        assert e <= factor * noise + FLOOR, (
            f"{what}: error {e:.3g} > {factor:g} x fp32 noise {noise:.3g} ({e / max(noise, 1e-300):.3g} x the noise)"
        )
