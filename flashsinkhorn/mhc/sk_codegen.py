"""Source generator of the small-path (n ≤ 4) projection kernels.

Triton has no register arrays, so the forward and backward kernels of the small path are
written out as Python source for each (n, n_iters, variant, options, block): every matrix entry
and every scaling vector of every round is a named [BLOCK] register tensor, and the backward
replays the iterations in reverse from those names without any HBM scratch. :func:`gen_small`
returns that source; :mod:`.sk_triton` compiles it (with the ``_rcp``/``_rcp_nc`` helpers in
scope), caches the kernels and launches them.

The generator options trade registers against recomputation and instruction-cache pressure;
they are described in :func:`gen_small`. The default, ``TUNING.mhc_small_bwd``
(:mod:`flashsinkhorn.tuning`), unrolls the last 10 rounds of the log backward in registers and
loops the first 10 over shared memory: 1.81 ms against 2.07 ms for the fully unrolled
backward in the same run (H200, B = 2^24, n = 4, 20 iterations). This module only builds
strings; it does not import Triton.
"""

from __future__ import annotations

import itertools

from .._triton_launch import next_pow2

__all__ = ["LOG2E", "LOOP_MAX", "SH_BYTES_MAX", "gen_small"]

LOG2E = 1.4426950408889634
# Most rounds of the small log backward that run as a loop over shared memory (32 bytes per
# round and lane; static shared memory is limited to 48 KB per program).
LOOP_MAX = 22
SH_BYTES_MAX = 44 * 1024


class _Src:
    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "", indent: int = 1):
        self.lines.append("    " * indent + line)


def _emit_load(s: _Src, n: int, ptr: str, prefix: str):
    """Loads the n×n matrices of this program into registers {prefix}{i}{j} (fp32)."""
    nn = n * n
    if n in (2, 4):
        # One [BLOCK, n] tile per matrix row: each lane reads its row as one 8/16-byte vector
        # and the entries are peeled off with tl.split inside the lane (no layout conversion
        # through shared memory, no barrier).
        bits = n.bit_length() - 1
        for i in range(n):
            t = f"t_{prefix}{i}"
            s(
                f"{t} = tl.load({ptr} + o_b[:, None] * {nn} + {i * n} + "
                f"tl.arange(0, {n})[None, :], mask=m_b[:, None], other=0.0).to(tl.float32)"
            )
            if bits > 1:
                s(f"{t} = tl.reshape({t}, (BLOCK, {', '.join(['2'] * bits)}))")
            # split peels index bits from the least significant one.
            level = {"": t}
            for _depth in range(bits):
                new = {}
                for key, name in level.items():
                    lo, hi = f"{name}_0", f"{name}_1"
                    s(f"{lo}, {hi} = tl.split({name})")
                    new[key + "0"], new[key + "1"] = lo, hi
                level = new
            for key, name in level.items():
                j = sum(int(c) << k for k, c in enumerate(key))
                s(f"{prefix}{i}{j} = {name}")
    else:
        for i, j in itertools.product(range(n), range(n)):
            s(
                f"{prefix}{i}{j} = tl.load({ptr} + o_b * {nn} + {i * n + j}, mask=m_b, "
                "other=0.0).to(tl.float32)"
            )


def _emit_store(s: _Src, n: int, ptr: str, prefix: str):
    nn = n * n
    if n in (2, 4):
        bits = n.bit_length() - 1
        for i in range(n):
            # join from the most significant bit so that the last dim ends up being bit 0.
            cur = {j: f"{prefix}{i}{j}" for j in range(n)}
            for bit in reversed(range(bits)):
                new = {}
                for j, name in cur.items():
                    if j & (1 << bit):
                        continue
                    out = f"j{bit}_{i}_{j}"
                    s(f"{out} = tl.join({name}, {cur[j | (1 << bit)]})")
                    new[j] = out
                cur = new
            (root,) = cur.values()
            if bits > 1:
                s(f"{root} = tl.reshape({root}, (BLOCK, {n}))")
            s(
                f"tl.store({ptr} + o_b[:, None] * {nn} + {i * n} + tl.arange(0, {n})[None, :], "
                f"{root}.to({ptr}.dtype.element_ty), mask=m_b[:, None])"
            )
    else:
        for i, j in itertools.product(range(n), range(n)):
            s(
                f"tl.store({ptr} + o_b * {nn} + {i * n + j}, "
                f"{prefix}{i}{j}.to({ptr}.dtype.element_ty), mask=m_b)"
            )


def _emit_setup(s: _Src, n: int, log: bool, check: bool = False):
    """A (x{i}{j}), a{i}, b{j} from the logits m{i}{j}; with check, the value check of
    :func:`_emit_check` on the row maxima f{i} first."""
    R = range(n)
    if check:
        s("if CHECK:")
        for i in R:
            s(f"f{i} = " + _nest("_max_nan", [f"m{i}{j}" for j in R]), 2)
        _emit_check(s, n)
        s("else:")
        for i in R:
            s(f"f{i} = " + _nest("tl.maximum", [f"m{i}{j}" for j in R]), 2)
    else:
        for i in R:
            s(f"f{i} = " + _nest("tl.maximum", [f"m{i}{j}" for j in R]))
    if log:
        for i, j in itertools.product(R, R):
            s(f"l{i}{j} = m{i}{j} - f{i}")
        for j in R:
            s(f"g{j} = " + _nest("tl.maximum", [f"l{i}{j}" for i in R]))
        for i, j in itertools.product(R, R):
            s(f"x{i}{j} = tl.exp2((l{i}{j} - g{j}) * {LOG2E})")
        for j in R:
            s(f"b{j} = tl.exp2(g{j} * {LOG2E})")
        for i in R:
            s(f"a{i} = tl.full((BLOCK,), 1.0, tl.float32)")
    else:
        for i, j in itertools.product(R, R):
            s(f"e{i}{j} = tl.exp2((m{i}{j} - f{i}) * {LOG2E})")
        for i in R:
            s(f"q{i} = _rcp(" + " + ".join(f"e{i}{j}" for j in R) + ", FAST)")
        for i, j in itertools.product(R, R):
            s(f"x{i}{j} = e{i}{j} * q{i} + eps")
        for i in R:
            s(f"a{i} = tl.full((BLOCK,), 1.0, tl.float32)")
            s(f"b{i} = tl.full((BLOCK,), 1.0, tl.float32)")


def _emit_check(s: _Src, n: int):
    """Sets the bytes of p_flag for this program's logits that have no projection (the
    conditions of :func:`.value_check.check_logit_values`, per matrix): byte 0 for a NaN or
    +inf (a row maximum f{i} that propagates NaN is NaN or +inf), byte 1 for a row of -inf
    only (f{i} = -inf), byte 2 for a column of -inf only (column maximum -inf). Every writer
    of a byte writes 1 (plain stores: no atomics, no lost bits); lanes past n_mat read zeros
    and write nothing, and so does every lane of a good program (masked stores)."""
    R = range(n)
    for j in R:
        s(f"c{j} = " + _nest("_max_nan", [f"m{i}{j}" for i in R]), 2)
    # tl.minimum ignores NaN: the minimum is -inf exactly when one of its arguments is
    s("k_hi = " + _nest("_max_nan", [f"f{i}" for i in R]), 2)
    s("k_rlo = " + _nest("tl.minimum", [f"f{i}" for i in R]), 2)
    s("k_clo = " + _nest("tl.minimum", [f"c{j}" for j in R]), 2)
    s("k_ptr = p_flag + o_b * 0", 2)
    conds = (
        '(k_hi != k_hi) | (k_hi == float("inf"))',
        'k_rlo == -float("inf")',
        'k_clo == -float("inf")',
    )
    for k, cond in enumerate(conds):
        s(f"k_bad = {cond}", 2)
        s(f"tl.store(k_ptr + {k}, k_bad.to(tl.int8), mask=k_bad)", 2)


def _nest(fn: str, args: list[str]) -> str:
    out = args[0]
    for a in args[1:]:
        out = f"{fn}({out}, {a})"
    return out


def _emit_rcps(s: _Src, dens: list, outs: list, indent: int, rcp: str, pair: bool, scale=None):
    """outs[i] = (scale[i] ·) 1/dens[i]. With pair, two reciprocals share one MUFU operation:
    q = 1/(d0·d1), 1/d0 = d1·q, 1/d1 = d0·q (3 multiplies instead of a second rcp; the MUFU
    unit, 16 results per clock per SM, is what bounds the forward). The d's are row/column
    sums of A ⊙ (scaling vector) with A's entries in (0, 1] and a 1 in every row and column,
    so their products stay far inside the fp32 range."""
    n = len(dens)
    t = [f"{o}d" for o in outs]
    for ti, d in zip(t, dens, strict=True):
        s(f"{ti} = {d}", indent)
    inv = [None] * n
    i = 0
    while i < n:
        if pair and i + 1 < n:
            q = f"{outs[i]}q"
            s(f"{q} = {rcp}({t[i]} * {t[i + 1]}, FAST)", indent)
            inv[i], inv[i + 1] = f"{t[i + 1]} * {q}", f"{t[i]} * {q}"
            i += 2
        else:
            inv[i] = f"{rcp}({t[i]}, FAST)"
            i += 1
    for k, o in enumerate(outs):
        s(f"{o} = {inv[k]}" if scale is None else f"{o} = {scale[k]} * ({inv[k]})", indent)


def _emit_row(
    s: _Src,
    n: int,
    log: bool,
    a: str,
    b: str,
    out: str,
    indent: int = 1,
    rcp: str = "_rcp",
    pair: bool = False,
):
    """out{i} = new a after a row half-step from (a, b)."""
    R = range(n)
    dens = []
    for i in R:
        # the recompute (rcp="_rcp_nc") sums in the opposite order: the compiler cannot prove
        # it equal to the forward's value and merge the two (which would keep every A_k live).
        order = R if rcp == "_rcp" else reversed(R)
        r = " + ".join(f"x{i}{j} * {b}{j}" for j in order)
        dens.append(r if log else f"{a}{i} * ({r}) + eps")
    outs = [f"{out}{i}" for i in R]
    _emit_rcps(s, dens, outs, indent, rcp, pair, None if log else [f"{a}{i}" for i in R])


def _emit_col(
    s: _Src, n: int, log: bool, a: str, b: str, out: str, indent: int = 1, pair: bool = False
):
    R = range(n)
    dens = []
    for j in R:
        c = " + ".join(f"x{i}{j} * {a}{i}" for i in R)
        dens.append(c if log else f"{b}{j} * ({c}) + eps")
    outs = [f"{out}{j}" for j in R]
    _emit_rcps(s, dens, outs, indent, "_rcp", pair, None if log else [f"{b}{j}" for j in R])


def gen_small(
    n: int,
    n_iters: int,
    variant: str,
    keep_a: int = 0,
    prefetch: bool = True,
    pair: bool = False,
    ckpt: int = 1,
    ahead: bool = False,
    rowsum: bool = False,
    colsum: bool = False,
    unrolled: int | None = None,
    *,
    block: int = 64,
) -> str:
    """Kernel source for (n, n_iters, variant).

    keep_a: the backward keeps the row scalings of the last keep_a rounds live since the forward
    instead of recomputing them from the column scalings (n more registers per round kept, 16
    FMA and n reciprocals fewer). pair: reciprocals two at a time (see _emit_rcps), forward and
    backward. prefetch: load the upstream gradient at the start
    (its latency hides behind the forward recompute) instead of after the forward.
    ckpt (log variant): keep only every ckpt-th column scaling B_k live since the forward and
    recompute the others in the reverse pass (n·(T − T/ckpt) registers fewer for one extra
    column half-step per recomputed B_k). ahead: emit the next reverse round's recomputation before
    the current round's math. rowsum (log variant): accumulate n·(n−1) entries of the
    gradient instead of n² and recover the last column from the zero row sums of dM.
    colsum (log variant, with rowsum): also drop the last row; dM's column sums are
    B_0 ⊙ (adjoint of B_0), known after the reverse pass (docs/mhc.md, "Backward"), so
    (n−1)² entries are accumulated.
    unrolled (log variant): when not None, only the last `unrolled` rounds (at least 1) of the
    backward are unrolled with their scaling vectors in registers as above (keep_a and ckpt
    apply to them); rounds 1..L before them run as two rolled loops (forward, then reverse)
    whose vectors A_k, B_k go through per-lane shared memory (32·L bytes per lane, L at most
    LOOP_MAX and by the 44 KB of static shared memory that a program of `block` matrices may
    declare). This removes the instruction-cache stalls of the ~2,800-instruction straight-line
    kernel and the recomputation, for shared memory.

    The forward takes the value check as a compile-time switch: with ``CHECK`` it computes the
    row maxima with NaN propagated and sets the bytes of ``p_flag`` (:func:`_emit_check`);
    without, ``p_flag`` is never touched.
    """
    log = variant == "log"
    R = range(n)
    s = _Src()
    s("@triton.jit", 0)
    s(
        "def _sk_small_fwd_kernel(p_x, p_out, p_flag, n_mat, eps, BLOCK: tl.constexpr, "
        "FAST: tl.constexpr, CHECK: tl.constexpr):",
        0,
    )
    s("i_p = tl.program_id(0)")
    s("o_b = i_p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)")
    s("m_b = o_b < n_mat")
    _emit_load(s, n, "p_x", "m")
    _emit_setup(s, n, log, check=True)
    if not log:
        _emit_col(s, n, log, "a", "b", "b", pair=pair)
    rounds = n_iters if log else n_iters - 1
    if rounds > 0:
        s(f"for _ in range({rounds}):")
        _emit_row(s, n, log, "a", "b", "a", 2, pair=pair)
        _emit_col(s, n, log, "a", "b", "b", 2, pair=pair)
    for i, j in itertools.product(R, R):
        s(f"p{i}{j} = a{i} * x{i}{j} * b{j}")
    _emit_store(s, n, "p_out", "p")
    s("", 0)
    s("", 0)

    # Backward: unrolled forward keeping the scaling vectors of every round in registers.
    s("@triton.jit", 0)
    s(
        "def _sk_small_bwd_kernel(p_x, p_g, p_out, n_mat, eps, BLOCK: tl.constexpr, "
        "FAST: tl.constexpr):",
        0,
    )
    s("i_p = tl.program_id(0)")
    s("o_b = i_p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)")
    s("m_b = o_b < n_mat")
    _emit_load(s, n, "p_x", "m")
    if prefetch:
        _emit_load(s, n, "p_g", "d")
    _emit_setup(s, n, log)
    # rowsum: the log variant's dM has zero row sums (adding a constant to a row of M leaves
    # P unchanged), so the last column of the accumulator is not kept: z_{i,n-1} = −Σ_{j<n-1} z_ij.
    cols = range(n - 1) if (log and rowsum and n > 1) else R
    rows = range(n - 1) if (log and rowsum and colsum and n > 1) else R
    rev = dict(keep_a=keep_a, ckpt=ckpt if log else 1, ahead=ahead, pair=pair, cols=cols, rows=rows)
    for i in R:
        s(f"B0_{i} = b{i}")
        s(f"A0_{i} = a{i}")
    n_loop = 0
    if log and unrolled is not None:
        n_loop = max(0, min(n_iters - max(unrolled, 1), LOOP_MAX, SH_BYTES_MAX // (32 * block)))
    if n_loop > 0:
        _emit_sh_decl(s, 2 * n_loop, block)
        _emit_fwd_loop(s, n, n_loop)
    _emit_fwd_rounds(s, n, log, n_iters, pair, start=n_loop + 1)
    if not prefetch:
        _emit_load(s, n, "p_g", "d")
    _emit_bwd_init(s, n, n_iters, cols, rows)
    _emit_reverse(s, n, log, n_iters, stop=n_loop + 1, **rev)
    if n_loop > 0:
        _emit_rev_loop(s, n, n_loop, rows, cols)
    if log:
        # A = exp(M − f − g) with the shifts held constant (P does not depend on them).
        for i, j in itertools.product(rows, cols):
            s(f"z{i}{j} = y{i}{j} * x{i}{j}")
        if len(cols) < n:
            for i in rows:
                s(f"z{i}{n - 1} = -(" + " + ".join(f"z{i}{j}" for j in cols) + ")")
        if len(rows) < n:
            # column sums of dM: B_0 ⊙ (adjoint of B_0), which db holds after round 1
            for j in R:
                b0 = "Bk_" if n_loop > 0 else "B0_"
                s(f"z{n - 1}{j} = {b0}{j} * db{j} - (" + " + ".join(f"z{i}{j}" for i in rows) + ")")
    else:
        # A = softmax(M) + eps: softmax backward.
        for i in R:
            s(f"w{i} = " + " + ".join(f"y{i}{j} * (x{i}{j} - eps)" for j in R))
        for i, j in itertools.product(R, R):
            s(f"z{i}{j} = (x{i}{j} - eps) * (y{i}{j} - w{i})")
    _emit_store(s, n, "p_out", "z")
    return "\n".join(s.lines) + "\n"


def _emit_fwd_rounds(s: _Src, n: int, log: bool, T: int, pair: bool, start: int = 1):
    """Rounds start..T from (A{start-1}_, B{start-1}_), keeping A{k}_, B{k}_ as named
    registers."""
    R = range(n)
    if log:
        for k in range(start, T + 1):
            _emit_row(s, n, log, f"A{k - 1}_", f"B{k - 1}_", f"A{k}_", pair=pair)
            _emit_col(s, n, log, f"A{k}_", f"B{k - 1}_", f"B{k}_", pair=pair)
    else:
        # round 1 is the column step alone (a stays 1)
        for i in R:
            s(f"A1_{i} = A0_{i}")
        _emit_col(s, n, log, "A1_", "B0_", "B1_", pair=pair)
        for k in range(2, T + 1):
            _emit_row(s, n, log, f"A{k - 1}_", f"B{k - 1}_", f"A{k}_", pair=pair)
            _emit_col(s, n, log, f"A{k}_", f"B{k - 1}_", f"B{k}_", pair=pair)


def _emit_fwd_loop(s: _Src, n: int, L: int):
    """Rounds 1..L of the log forward as a rolled loop storing B_{k-1} in slot k − 1 and A_k in
    slot L + k − 1; leaves A{L}_, B{L}_."""
    R = range(n)
    for i in R:
        s(f"Af_{i} = a{i}")
        s(f"Bf_{i} = b{i}")
    s(f"for k in tl.range(0, {L}, loop_unroll_factor=1):")
    _emit_sh_put(s, n, "Bf_", "k")
    _emit_row(s, n, True, "", "Bf_", "Af_", 2)
    _emit_sh_put(s, n, "Af_", f"{L} + k")
    _emit_col(s, n, True, "Af_", "", "Bf_", 2)
    for i in R:
        s(f"A{L}_{i} = Af_{i}")
        s(f"B{L}_{i} = Bf_{i}")


def _emit_rev_loop(s: _Src, n: int, L: int, rows, cols):
    """Reverse rounds L..1 as a rolled loop over the vectors stored by _emit_fwd_loop. The
    adjoint of A is zero on entry (the unrolled rounds above end with a row step), so the loop
    assigns it instead of accumulating (x + 0.0 is not foldable, x·0 chains are). Two rounds
    per iteration when L is even, so that B_k → B_{k−1} is a renaming, not a copy. Leaves
    B_0 in Bk_."""
    R = range(n)
    for i in R:
        s(f"Bk_{i} = B{L}_{i}")
    two = L % 2 == 0
    s(f"for r in tl.range(0, {L}, {2 if two else 1}, loop_unroll_factor=1):")
    # round k = L − r needs A_k (slot L + k − 1), B_k (carried) and B_{k−1} (slot k − 1)
    _emit_sh_get(s, n, "Bp_", f"{L - 1} - r")
    _emit_sh_get(s, n, "Ak_", f"{2 * L - 1} - r")
    _emit_rev_round_log(s, n, "Ak_", "Bk_", "Bp_", rows, cols, 2)
    if two:
        _emit_sh_get(s, n, "Bk_", f"{L - 2} - r")
        _emit_sh_get(s, n, "Ak_", f"{2 * L - 2} - r")
        _emit_rev_round_log(s, n, "Ak_", "Bp_", "Bk_", rows, cols, 2)
    else:
        for i in R:
            s(f"Bk_{i} = Bp_{i}", 2)


def _emit_rev_round_log(
    s: _Src, n: int, ak: str, bk: str, bp: str, rows, cols, indent: int, da_live: bool = False
):
    """One reverse round of the log variant: adjoints of B_k = 1/(Aᵀ A_k) and
    A_k = 1/(A B_{k−1}) from db (and da when da_live, else the adjoint of A_k is zero on
    entry: it is then not added, since x + 0.0 does not fold), accumulating y; leaves the
    adjoint of B_{k−1} in db."""
    R = range(n)
    for j in R:
        s(f"dc{j} = -db{j} * {bk}{j} * {bk}{j}", indent)
    for i, j in itertools.product(rows, cols):
        s(f"y{i}{j} += {ak}{i} * dc{j}", indent)
    for i in R:
        da = (f"da{i} + " if da_live else "") + " + ".join(f"x{i}{j} * dc{j}" for j in R)
        s(f"dr{i} = -({da}) * {ak}{i} * {ak}{i}", indent)
    for i, j in itertools.product(rows, cols):
        s(f"y{i}{j} += dr{i} * {bp}{j}", indent)
    for j in R:
        s(f"db{j} = " + " + ".join(f"x{i}{j} * dr{i}" for i in R), indent)


def _vec_pieces(n: int):
    """(first entry, width) of the vector accesses that cover n floats of a 16-byte slot."""
    return [(0, 4)] if n == 4 else [(0, 2)] if n == 2 else [(0, 2), (2, 1)] if n == 3 else [(0, 1)]


# Per-lane shared memory for the looped backward, declared in inline PTX (Triton gives a kernel
# no addressable shared memory). Lane t's slot q is at fs_sh + 16·(q·BLOCK + t): a warp's
# 16-byte accesses to one slot are contiguous (no bank conflicts). Volatile, so that ptxas
# keeps every access. The interpreter keeps the slots in [BLOCK, S] tiles instead.
def _emit_sh_decl(s: _Src, n_slots: int, block: int):
    # the asm text is a literal: the array is sized for the BLOCK the source is generated for
    s("if FAST:")
    s(f"tl.static_assert(BLOCK == {block})", 2)
    s(
        f'sh = tl.inline_asm_elementwise(".shared .align 16 .b8 fs_sh[{16 * n_slots * block}];'
        "\\n{ .reg .u32 t; mov.u32 t, %tid.x; shl.b32 t, t, 4; mov.u32 $0, fs_sh; "
        'add.u32 $0, $0, t; }", "=r,r", [m_b.to(tl.int32)], dtype=tl.int32, '
        "is_pure=False, pack=1)",
        2,
    )
    s("else:")
    s(f"o_h = tl.arange(0, {next_pow2(n_slots)})", 2)
    for t in range(4):
        s(f"h{t} = tl.zeros((BLOCK, {next_pow2(n_slots)}), tl.float32)", 2)


def _emit_sh_put(s: _Src, n: int, vec: str, slot: str):
    s("if FAST:", 2)
    for j0, w in _vec_pieces(n):
        v = "" if w == 1 else f".v{w}"
        regs = ", ".join(f"${t + 2}" for t in range(w))
        regs = regs if w == 1 else "{" + regs + "}"
        args = ", ".join(f"{vec}{j0 + t}" for t in range(w))
        s(
            f'tl.inline_asm_elementwise("st.volatile.shared{v}.f32 [$1+{4 * j0}], {regs};\\n'
            f'mov.b32 $0, 0;", "=r,r{",f" * w}", [sh + ({slot}) * (16 * BLOCK), {args}], '
            "dtype=tl.int32, is_pure=False, pack=1)",
            3,
        )
    s("else:", 2)
    s(f"sel = (o_h == ({slot}))[None, :]", 3)
    for j in range(n):
        s(f"h{j} = tl.where(sel, {vec}{j}[:, None], h{j})", 3)


def _emit_sh_get(s: _Src, n: int, vec: str, slot: str):
    s("if FAST:", 2)
    for j0, w in _vec_pieces(n):
        v = "" if w == 1 else f".v{w}"
        regs = ", ".join(f"${t}" for t in range(w))
        regs = regs if w == 1 else "{" + regs + "}"
        outs = ", ".join(f"{vec}{j0 + t}" for t in range(w))
        dt = "tl.float32" if w == 1 else f"({', '.join(['tl.float32'] * w)})"
        s(
            f'{outs} = tl.inline_asm_elementwise("ld.volatile.shared{v}.f32 {regs}, '
            f'[${w}+{4 * j0}];", "{",".join(["=f"] * w)},r", [sh + ({slot}) * (16 * BLOCK)], '
            f"dtype={dt}, is_pure=False, pack=1)",
            3,
        )
    s("else:", 2)
    s(f"sel = (o_h == ({slot}))[None, :]", 3)
    for j in range(n):
        s(f"{vec}{j} = tl.sum(tl.where(sel, h{j}, 0.0), 1)", 3)


def _emit_bwd_init(s: _Src, n: int, T: int, cols, rows):
    """Adjoints of the output P = diag(A_T) A diag(B_T) from the upstream gradient d."""
    R = range(n)
    for i, j in itertools.product(rows, cols):
        s(f"y{i}{j} = d{i}{j} * A{T}_{i} * B{T}_{j}")
    for i in R:
        s(f"da{i} = " + " + ".join(f"d{i}{j} * x{i}{j} * B{T}_{j}" for j in R))
    for j in R:
        s(f"db{j} = " + " + ".join(f"d{i}{j} * x{i}{j} * A{T}_{i}" for i in R))


def _emit_reverse(
    s: _Src,
    n: int,
    log: bool,
    T: int,
    keep_a: int,
    ckpt: int,
    ahead: bool,
    pair: bool,
    cols,
    rows,
    stop: int = 1,
):
    """Reverse pass through rounds T..1 of _emit_fwd_rounds, accumulating y (the adjoint of A)
    and carrying da, db. Round k needs A_k, B_k and B_{k-1}. With ckpt > 1 (log variant) only
    every ckpt-th B_k stays live since the forward (and B_0, B_T); the others are recomputed
    from A_k (itself recomputed from the B below, or kept) by one column half-step."""
    R = range(n)
    last = 1 if log else 2
    # stop > 1: rounds below stop run in the rolled loop; B_{stop-1} comes from it
    keep_b = {k for k in range(T + 1) if k % ckpt == 0 or k == T or k == stop - 1}
    have_a = {k for k in range(1, T + 1) if not log or k >= T - keep_a}
    have_b = set(keep_b)
    bname = {k: f"B{k}_" for k in keep_b}

    def ensure_a(k):
        if k in have_a:
            return
        ensure_b(k - 1)
        # Recompute A_k = 1/(A B_{k-1}) rather than keeping it live since the forward.
        _emit_row(s, n, log, "", bname[k - 1], f"A{k}_", rcp="_rcp_nc", pair=pair)
        have_a.add(k)

    def ensure_b(k):
        if k in have_b:
            return
        ensure_a(k)
        # (log variant only: the column step does not read the previous B)
        _emit_col(s, n, log, f"A{k}_", "", f"R{k}_", pair=pair)
        bname[k] = f"R{k}_"
        have_b.add(k)

    for k in range(T, stop - 1, -1):
        ensure_a(k)
        ensure_b(k)
        ensure_b(k - 1)
        if ahead and k > stop:
            # the next round's recomputation, issued before this round's dependent chain
            ensure_a(k - 1)
            ensure_b(k - 2)
        bk, bp = bname[k], bname[k - 1]
        if log:
            # the adjoint of A_k is nonzero only from the output (round T)
            _emit_rev_round_log(s, n, f"A{k}_", bk, bp, rows, cols, 1, da_live=k == T)
            continue
        # deepseek: column half-step of round k, B_k from (A_k, B_{k-1})
        for j in R:
            s(f"dc{j} = -db{j} * {bk}{j} * {bk}{j}")
            s(
                f"db{j} = db{j} * eps * ({bk}{j} * _rcp({bp}{j}, FAST)) * "
                f"({bk}{j} * _rcp({bp}{j}, FAST))"
            )
        for i, j in itertools.product(rows, cols):
            s(f"y{i}{j} += A{k}_{i} * dc{j}")
        for i in R:
            s(f"da{i} += " + " + ".join(f"x{i}{j} * dc{j}" for j in R))
        if k < last:
            continue
        # row half-step of round k: A_k from (A_{k-1}, B_{k-1})
        for i in R:
            s(f"dr{i} = -da{i} * A{k}_{i} * A{k}_{i}")
            s(
                f"da{i} = da{i} * eps * (A{k}_{i} * _rcp(A{k - 1}_{i}, FAST)) * "
                f"(A{k}_{i} * _rcp(A{k - 1}_{i}, FAST))"
            )
        for i, j in itertools.product(rows, cols):
            s(f"y{i}{j} += dr{i} * {bp}{j}")
        for j in R:
            s(f"db{j} += " + " + ".join(f"x{i}{j} * dr{i}" for i in R))
