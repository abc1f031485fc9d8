"""permute and unpermute (SPEC 2): token regrouping by expert. Every permute output is exact
(offsets, padded hidden rows, src_row, dst_pos), also through a preallocated PermuteScratch
whose buffers are poisoned first and must be the outputs' storage; unpermute is bitwise (SPEC
fixes its f32 order)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from reference.permute import PermuteScratch as RefPermuteScratch
from reference.permute import permute as ref_permute
from reference.permute import unpermute as ref_unpermute
from reference.validate import capacity

from .. import distributions as D
from .common import (DTYPE_NAMES, NO_NAN, CallSpec, Case, CaseResult, OpInfo, Picker, TensorRule, _bits_equal,
                     _cap_tokens, _common, _shape_check, _tokens, import_optimized, to_device)

_ALIGNS = (1, 1, 2, 3, 4, 8, 16, 32, 64, 128)


def _draw_permute(draw, dist, fixed, unpermute=False):
    p = Picker(draw, fixed)
    E = p("E", st.sampled_from((1, 2, 3, 4, 7, 8, 16, 32, 64, 128, 256)))
    kmax = min(E, 16)
    if dist == "empty_experts":
        kmax = min(kmax, E - E // 2)
    hs = (1, 3, 8, 16, 33, 64, 128, 256) if unpermute else (0, 1, 3, 8, 16, 33, 64, 128, 256)
    s = {"E": E, "K": p("K", st.integers(1, kmax)), "H": p("H", st.sampled_from(hs)),
         "dtype": p("dtype", st.sampled_from(DTYPE_NAMES)), "align": p("align", st.sampled_from(_ALIGNS)),
         "T": _tokens(p)}
    if not unpermute:
        s["ids_dtype"] = p("ids_dtype", st.sampled_from(("int32", "int64")))
        s["scratch"] = bool(p("scratch", st.booleans()))
        s["extra_tokens"] = p("extra_tokens", st.sampled_from((0, 1, 5)))
    s["T"] = _cap_tokens(s["T"], s["K"] * max(1, s["H"]), 3e6)
    s.update(_common(p, dist))
    return s


def _permute_routing(s):
    r = D.make_routing(s["dist"], s["T"], s["E"], s["K"], s["seed"], D.dist_params(s["dist"], s["dchoice"]))
    return r


def _make_permute(s):
    r = _permute_routing(s)
    g = D.generator(s["seed"] + 1)
    hidden = torch.randn(s["T"], s["H"], generator=g).to(D.DTYPES[s["dtype"]])
    ids = r.ids.to(torch.int64 if s["ids_dtype"] == "int64" else torch.int32)
    kwargs = {"expert_map": r.expert_map, "n_local_experts": r.n_local if r.expert_map is not None else None,
              "align": s["align"]}
    return Case("permute", s, (hidden, ids, s["E"]), kwargs)


def _poison_scratch(scratch) -> None:
    if scratch.hidden.numel():
        scratch.hidden.fill_(float("nan"))
    scratch.offsets.fill_(0x5A5A5A5A5A)
    scratch.src_row.fill_(0x5A5A5A5A)
    scratch.dst_pos.fill_(0x5A5A5A5A)


def _call_permute(fn, case: Case, device):
    args, kwargs = to_device((case.args, case.kwargs), device)
    s = case.structure
    if s.get("scratch"):
        ops = import_optimized()
        # optimized's scratch class when optimized has permute (a mutant wraps that one)
        cls = None
        if ops is not None and callable(getattr(ops, "permute", None)):
            cls = getattr(ops, "PermuteScratch", None)
        cls = cls or RefPermuteScratch
        hidden, ids, n_experts = args
        n_local = kwargs["n_local_experts"] if kwargs["expert_map"] is not None else None
        scratch = cls(s["T"] + s["extra_tokens"], ids.shape[1], n_experts, hidden.shape[1], hidden.dtype, device,
                      n_local_experts=n_local, align=kwargs["align"])
        _poison_scratch(scratch)
        kwargs = dict(kwargs, scratch=scratch)
        out = fn(*args, **kwargs)
        names = ("offsets", "hidden", "src_row", "dst_pos")
        try:
            not_views = [nm for nm, o in zip(names, tuple(out)) if isinstance(o, torch.Tensor) and o.numel()
                         and _storage_of(o) != _storage_of(getattr(scratch, nm))]
        except TypeError:
            not_views = []
        return out, not_views
    return fn(*args, **kwargs), None


def _storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _compare_permute(out_pair, ref, case, ctx):
    out, scratch = out_pair       # scratch: names of outputs that are not scratch views
    names = ("offsets", "hidden", "src_row", "dst_pos")
    try:
        out = tuple(out)
    except TypeError:
        return CaseResult(False, "mismatch", message=f"permute returned {type(out).__name__}, not a Permuted")
    bad = _shape_check(out, tuple(ref), names)
    if bad:
        return bad
    for nm, o, r in zip(names, out, ref):
        if not _bits_equal(o, r):
            diff = (o != r) if not o.is_floating_point() else ~((o == r) | (o.isnan() & r.isnan()))
            if o.is_floating_point():
                diff = diff | (o.view(torch.int16 if o.element_size() == 2 else torch.int32)
                               != r.view(torch.int16 if r.element_size() == 2 else torch.int32))
            where = torch.nonzero(diff)[:3].tolist() if diff.numel() else []
            return CaseResult(False, "mismatch", message=f"{nm} differs from the reference (exact op) at {where}; "
                                                         f"got {o.reshape(-1)[:12].tolist()}..., "
                                                         f"expected {r.reshape(-1)[:12].tolist()}...")
    if scratch is not None and scratch:
        return CaseResult(False, "aliasing", message=f"with a scratch, {', '.join(scratch)} not views of the "
                                                     f"scratch's buffers (SPEC: permute allocates nothing)")
    return CaseResult(True, "ok")


def _permute_errors(seed):
    g = D.generator(seed)
    hidden = torch.randn(4, 8, generator=g)
    ids = torch.randint(0, 6, (4, 2), generator=g, dtype=torch.int32)
    emap = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    sc = RefPermuteScratch(4, 2, 6, 8, torch.float32, "cpu")
    sc_small = RefPermuteScratch(3, 2, 6, 8, torch.float32, "cpu")
    sc_k = RefPermuteScratch(4, 3, 6, 8, torch.float32, "cpu")
    sc_dt = RefPermuteScratch(4, 2, 6, 8, torch.bfloat16, "cpu")
    sc_al = RefPermuteScratch(4, 2, 6, 8, torch.float32, "cpu", align=4)
    bad_ids = ids.clone()
    bad_ids[1, 1] = 6
    neg_ids = ids.clone()
    neg_ids[0, 0] = -2
    explicit = [
        ("id = n_experts", {"ids": bad_ids}, ("ids",)),
        ("id = -2", {"ids": neg_ids}, ("ids",)),
        ("n_experts = 0", {"n_experts": 0}, ("n_experts",)),
        ("align = 0", {"align": 0}, ("align",)),
        ("ids rows != T", {"ids": ids[:3]}, ("ids",)),
        ("ids with no columns", {"ids": ids[:, :0]}, ("ids",)),
        ("expert_map int64", {"expert_map": emap.long(), "n_local_experts": 4}, ("expert_map",)),
        ("expert_map without n_local_experts", {"expert_map": emap}, ("n_local_experts",)),
        ("expert_map entry >= n_local_experts", {"expert_map": emap, "n_local_experts": 3}, ("expert_map",)),
        ("expert_map wrong length", {"expert_map": emap[:5], "n_local_experts": 4}, ("expert_map",)),
        ("n_local_experts without a map", {"n_local_experts": 3}, ("n_local_experts",)),
        ("scratch for fewer tokens", {"scratch": sc_small}, ("scratch",)),
        ("scratch for another K", {"scratch": sc_k}, ("scratch",)),
        ("scratch of another dtype", {"scratch": sc_dt}, ("scratch",)),
        ("scratch of another align", {"scratch": sc_al}, ("scratch",)),
        ("scratch not a PermuteScratch", {"scratch": {"hidden": sc.hidden}}, ("scratch",)),
        ("hidden f64", {"hidden": hidden.double()}, ("hidden",)),
    ]
    rules = {"hidden": TensorRule((torch.float64, torch.int32), device_ref=True),
             "ids": TensorRule((torch.float32, torch.int16, torch.uint8), dims=(0,), dim_names=("ids",), index=(-1, 6))}
    params = {"hidden": hidden, "ids": ids, "n_experts": 6, "expert_map": None, "n_local_experts": None,
              "align": 1, "scratch": None}
    return CallSpec(params, ("hidden", "ids", "n_experts"), rules, explicit)


# ============================================================================ unpermute
def _make_unpermute(s):
    r = _permute_routing(s)
    T, K, H = s["T"], s["K"], s["H"]
    dt = D.DTYPES[s["dtype"]]
    ph = torch.zeros(T, 0)
    pm = ref_permute(ph, r.ids, s["E"], expert_map=r.expert_map,
                     n_local_experts=r.n_local if r.expert_map is not None else None, align=s["align"])
    cap = capacity(T, K, r.n_local if r.expert_map is not None else s["E"], s["align"])
    g = D.generator(s["seed"] + 2)
    expert_out = (torch.randn(cap, H, generator=g) * 4).to(dt)
    used = torch.zeros(cap, dtype=torch.bool)
    valid = pm.dst_pos[pm.dst_pos >= 0].long()
    used[valid] = True
    expert_out[~used] = float("nan")              # poison: rows nobody references
    weights = torch.randn(T, K, generator=g)
    if s["dist"] == "exact_ties":
        weights = torch.randint(-2, 3, (T, K), generator=g).float() * 0.5
    return Case("unpermute", s, (expert_out, weights, pm.dst_pos.clone()), {})


def _compare_unpermute(out, ref, case, ctx):
    bad = _shape_check(out, ref)
    if bad:
        return bad
    if _bits_equal(out, ref):
        return CaseResult(True, "ok")
    o64, r64 = out.double(), ref.double()
    diff = ~((o64 == r64) | (o64.isnan() & r64.isnan()))
    idx = torch.nonzero(diff)
    first = idx[0].tolist() if idx.numel() else None
    msg = (f"not bitwise equal to the reference (SPEC fixes unpermute's f32 order: increasing j, no FMA); "
           f"{int(diff.sum())} elements differ, first at {first}")
    if first is not None:
        msg += f": got {float(o64[tuple(first)]):.9g}, expected {float(r64[tuple(first)]):.9g}"
    return CaseResult(False, "mismatch", message=msg)


def _unpermute_gather(case: Case, rows) -> Case:
    """Token t owns weights[t] and dst_pos[t*K:(t+1)*K]; expert_out is shared."""
    eo, w, dp = case.args
    K = w.shape[1]
    return Case(case.op, case.structure, (eo, w[rows].contiguous(), dp.view(-1, K)[rows].reshape(-1)), {})


def _unpermute_errors(seed):
    g = D.generator(seed)
    eo = torch.randn(8, 4, generator=g)
    w = torch.rand(3, 2, generator=g)
    dp = torch.tensor([0, 1, 2, -1, 3, 4], dtype=torch.int32)
    bad = dp.clone()
    bad[2] = 8
    neg = dp.clone()
    neg[0] = -2
    explicit = [
        ("dst_pos >= rows of expert_out", {"dst_pos": bad}, ("dst_pos",)),
        ("dst_pos = -2", {"dst_pos": neg}, ("dst_pos",)),
        ("dst_pos wrong length", {"dst_pos": dp[:5]}, ("dst_pos",)),
        ("dst_pos int64", {"dst_pos": dp.long()}, ("dst_pos",)),
        ("weights f16", {"weights": w.half()}, ("weights",)),
        ("weights 1-D", {"weights": w.reshape(-1)}, ("weights",)),
    ]
    rules = {"expert_out": TensorRule((torch.float64, torch.int32), device_ref=True),
             "weights": TensorRule((torch.float64, torch.bfloat16), dims=(1,), dim_names=("weights", "dst_pos")),
             "dst_pos": TensorRule((torch.int64, torch.float32), dims=(0,), dim_names=("dst_pos",), index=(-1, 8))}
    return CallSpec({"expert_out": eo, "weights": w, "dst_pos": dp}, ("expert_out", "weights", "dst_pos"),
                    rules, explicit)


ENTRIES = (
    OpInfo("permute", ref_permute, _draw_permute, _make_permute, _compare_permute, _permute_errors,
           dists=NO_NAN, call=_call_permute, weight=0.8,
           notes="every output exact; scratch poisoned and aliasing checked"),
    OpInfo("unpermute", ref_unpermute, lambda d, dist, f: _draw_permute(d, dist, f, unpermute=True),
           _make_unpermute, _compare_unpermute, _unpermute_errors, dists=NO_NAN,
           token_gather=_unpermute_gather,
           invariant_always=("cpu", "cuda"), weight=0.8, notes="bitwise (SPEC's f32 order)"),
)
