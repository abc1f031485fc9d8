"""moelab.reference: pure-PyTorch ground truth for every op in SPEC.md.

Written to be read: each module states its op's math, shapes, dtypes and errors. Arithmetic
is float64 rounded once at exactly the points SPEC names (route: keys exactly rounded to f32,
then f32 as SPEC says). Inputs are validated by `reference.validate`, which `optimized`
reuses, so both raise the same errors.
"""
from .fused_experts import fused_experts
from .gate_gemm import FusedGate, fused_gate_gemm, skinny_gemm, unquantized_gemm
from .moe import moe_forward
from .permute import Permuted, PermuteScratch, permute, unpermute
from .quant import dequantize_fp8_block, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4
from .route import route
from .router_gemm import router_gemm

__all__ = [
    "route", "permute", "unpermute", "PermuteScratch", "Permuted",
    "router_gemm", "skinny_gemm", "unquantized_gemm", "fused_gate_gemm", "FusedGate",
    "fused_experts", "quantize_fp8_block", "dequantize_fp8_block", "quantize_mxfp4",
    "dequantize_mxfp4", "moe_forward",
]
