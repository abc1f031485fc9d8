"""verify's ops, one module per op of SPEC.md (the names follow reference/): each holds its
cases (draw, make_case), its comparison, its bad inputs (the CallSpec), and ends with its
`ENTRIES`, the OpInfo records that verify/registry.py puts in the table.

    route.py          route
    permute.py        permute, unpermute
    router_gemm.py    router_gemm
    gate_gemm.py      skinny_gemm, unquantized_gemm, fused_gate_gemm
    fused_experts.py  fused_experts
    moe.py            moe_forward
    common.py         the shared machinery (Case, CaseResult, OpInfo, CallSpec, helpers)
"""
