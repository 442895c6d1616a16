"""Compiles every variant of the mHC layer's kernels and the projection's forwards for sm_90
without a GPU; prints {"ok": true}, or {"skip": …} where this Triton's compile API differs.
Run by tests/mhc/test_layer_ops.py in a fresh process (without TRITON_INTERPRET)."""

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashsinkhorn.mhc import layer_kernels as K
from flashsinkhorn.mhc import sk_triton

P, B, I, F = "*fp32", "*bf16", "i32", "fp32"


def comp(fn, sig, consts, warps=4):
    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    try:  # older Triton releases key ASTSource's constants differently
        k = triton.compile(
            ASTSource(fn, sig, consts),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "enable_fp_fusion": True},
        )
    except (TypeError, KeyError, AttributeError) as err:
        print(json.dumps({"skip": repr(err)}))
        raise SystemExit(0) from None
    assert k.asm["cubin"]


def names(spec, **types):
    """Signature from 'a b c' with one type, updated by per-name types."""
    return {**dict.fromkeys(spec.split(), P), **types}


def main():
    fin = names("p_y p_ss p_alpha_pre p_alpha_post p_alpha_res p_bias p_yraw p_r p_coef p_res")
    fin.update(dict.fromkeys(("T", "K", "N", "n", "n_split"), I), rms_eps=F)
    for sm in (False, True):
        comp(K._hc_finalize_kernel, fin, {"BM": 32, "NP": 32, "SOFTMAX": sm})
    for X in (P, B):
        ints = dict.fromkeys(("n", "C"), I)
        res = {**names("p_coef p_hres"), "p_x": X, "p_f": X, "p_out": X, **ints}
        for mix in (True, False):
            comp(K._hc_residual_kernel, res, {"NS": 4, "BC": 512, "MIX": mix})
        rb = {**names("p_coef p_hres p_dpost p_dhres"), **ints}
        rb.update(dict.fromkeys(("p_do", "p_x", "p_f", "p_dx", "p_df"), X))
        for wd, mix in ((True, True), (False, True), (False, False)):
            comp(K._hc_residual_bwd_kernel, rb, {"NS": 4, "BC": 512, "WRITE_DX": wd, "MIX": mix})
        dx = {**names("p_coef p_hres p_dy p_rcoef p_phi")}
        dx.update(dict.fromkeys(("p_x", "p_dout", "p_du", "p_dx"), X))
        dx.update(dict.fromkeys(("T", "K", "N", "n", "C", "m_base"), I))
        for hd, hu in ((True, True), (False, False)):
            c = {"BM": 16, "BC": 32, "NS": 4, "NP": 32, "PREC": "tf32"}
            comp(K._hc_dx_kernel, dx, {**c, "HAS_DOUT": hd, "HAS_DU": hu}, 2)
        mx = {**names("p_hpre p_hres"), "s_hp": I, "p_x": X, "p_u": X, "p_r": X, **ints}
        for wr in (True, False):
            comp(K._hc_stream_mix_kernel, mx, {"NS": 4, "BC": 512, "WRITE_R": wr})
        mb = {**names("p_hpre p_hres p_dpre p_dhres"), "s_hp": I, **ints}
        mb.update(dict.fromkeys(("p_du", "p_dr", "p_x", "p_dx"), X))
        for dh in (True, False):
            c = {"NS": 4, "BC": 512, "HAS_DU": True, "HAS_DR": True, "DHRES": dh}
            comp(K._hc_stream_mix_bwd_kernel, mb, c)
        gm = {**names("p_phi p_y p_ss"), "p_x": X}
        gm.update(dict.fromkeys(("T", "K", "N", "k_split", "s_wk", "s_wn"), I))
        comp(K._hc_gemm_rms_kernel, gm, {"BM": 64, "BK": 64, "NP": 32, "PREC": "tf32"})
    for pair in (False, True):
        fwd, _ = sk_triton._small_kernels(4, 20, "log", (20, True, pair, 1, False, True, True, 10))
        for X in (P, B):
            # with the value check, p_flag is the int8 flag; without, the output stands in
            for check in (False, True):
                sig = {"p_x": X, "p_out": X, "p_flag": "*i8" if check else X, "n_mat": I, "eps": F}
                comp(fwd, sig, {"BLOCK": 256, "FAST": True, "CHECK": check}, 8)
    for check in (False, True):
        sig = {"p_x": P, "p_out": P, "p_flag": "*i8" if check else P, "n": I, "n_half": I}
        consts = {"FIRST": 0, "NP": 8, "LOG": True, "CHECK": check}
        comp(sk_triton._sk_gen_fwd_kernel, {**sig, "eps": F}, consts, 1)
    print(json.dumps({"ok": True}))


if __name__ == "__main__":
    main()
