"""Writes .exp/fwd_stack.py for xstack.py: src/flashjvp/_fwd.py where, with tq only (no tK), S and
tS come from ONE matrix product [Q; tQ] . K^T (a (2 BLOCK_M, D) operand), split in registers.
Triton 3.6 waits for each non-accumulating dot right after issuing it, so S and tS as two dots
cost two waits per key block; one dot costs one. Run from the repo root before xstack.py."""
from pathlib import Path

src = Path("src/flashjvp/_fwd.py").read_text()


def sub(old: str, new: str) -> None:
    global src
    assert src.count(old) == 1, old
    src = src.replace(old, new)


# the key loop: one product for S and tS when q holds [Q; tQ] (STACK: tq only)
sub("""        s = tl.dot(q, k, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N), unscaled logits
        if HAS_TS and EARLY_TS:""",
    """        if STACK:
            st = tl.dot(q, k, input_precision=DOT_PREC)  # (2 BLOCK_M, BLOCK_N): [S; tS]
            s, ts = tl.split(tl.permute(tl.reshape(st, [2, q.shape[0] // 2, BLOCK_N]), [1, 2, 0]))
        else:
            s = tl.dot(q, k, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N), unscaled logits
        if HAS_TS and EARLY_TS and not STACK:""")
sub("""    HAS_TS: tl.constexpr = HAS_TQ or HAS_TK
""", """    HAS_TS: tl.constexpr = HAS_TQ or HAS_TK
    STACK: tl.constexpr = HAS_TQ and not HAS_TK and not TMA
""")
sub("""            if not EARLY_TS:
                ts = _tangent_logits(""", """            if not EARLY_TS and not STACK:
                ts = _tangent_logits(""")
# the prologue: one (2 BLOCK_M, D) tile, rows [0, BLOCK_M) from Q and [BLOCK_M, 2 BLOCK_M) from tQ
sub("""        tq = q
        if HAS_TQ:
            tq = tl.load(TQ""", """        tq = q
        if HAS_TQ and not HAS_TK:
            r2 = tl.arange(0, 2 * BLOCK_M)  # (2 BLOCK_M,)
            rr = m0 + r2 % BLOCK_M
            upper = (r2 < BLOCK_M)[:, None]
            qq_ptr = tl.where(upper, Q + b * s_qb + h * s_qh + rr[:, None] * s_qn + offs_dqk[None, :] * s_qd,
                              TQ + b * s_tqb + h * s_tqh + rr[:, None] * s_tqn + offs_dqk[None, :] * s_tqd)
            q = tl.load(qq_ptr, mask=(rr < N_Q)[:, None] & mask_dqk[None, :], other=0.0)  # (2 BLOCK_M, D)
            tq = q
        if HAS_TQ and HAS_TK:
            tq = tl.load(TQ""")
Path(".exp").mkdir(exist_ok=True)
Path(".exp/fwd_stack.py").write_text(src)
