"""Emulate the index math of day014's GPU kernels in numpy (no GPU needed, ~10 s).

The GPU branches of gemm.mojo compile here but cannot run: this ports their index
arithmetic line by line and checks it against A @ B for tails, every transpose pair and
both load paths (VEC on/off):
  * the tensor-core kernel: shared layouts, ldmatrix lane addresses (.trans or not),
    mma.sync m16n8k16 fragment layouts (PTX ISA), epilogue rows/cols;
  * tc_load_tile: the shared tile equals op(A)[m0:, k0:] with zero padding;
  * the SIMT kernel: tile_coords, operand_offset, fetch/stash thread mapping, the
    per-thread 4-row/4-col groups, epilogue masks.
It checks the arithmetic, not Mojo's semantics: the H100 run of
tests/mojo/day014_gemm_gpu_check.mojo is the real test.

    python days/day014/emulate_kernels.py
"""

import numpy as np

BK, PAD, BN, TC_WN, NI = 32, 8, 128, 32, 4


def ld(kc, bmn):
    return (BK if kc else bmn) + PAD


def ldmatrix(smem, addrs, trans):
    regs = np.zeros((32, 4, 2))
    for j in range(4):
        mat = np.stack([smem[addrs[8 * j + r] : addrs[8 * j + r] + 8] for r in range(8)])
        for t in range(32):
            g, q = t // 4, t % 4
            regs[t, j] = (mat[2 * q, g], mat[2 * q + 1, g]) if trans else (mat[g, 2 * q], mat[g, 2 * q + 1])
    return regs.reshape(32, 8)


def a_frag(smem, kc, BM, m_base, kk):
    LD = ld(kc, BM)
    addrs = []
    for lane in range(32):
        if kc:
            addrs.append((m_base + lane % 16) * LD + kk + (lane // 16) * 8)
        else:
            j = lane // 8
            addrs.append((kk + lane % 8 + (j // 2) * 8) * LD + m_base + (j % 2) * 8)
    return ldmatrix(smem, addrs, trans=not kc)


def b_frags(smem, kc, n_base, kk):
    LD = ld(kc, BN)
    addrs = []
    for lane in range(32):
        j, r = lane // 8, lane % 8
        if kc:
            addrs.append((n_base + (j // 2) * 8 + r) * LD + kk + (j % 2) * 8)
        else:
            addrs.append((kk + (j % 2) * 8 + r) * LD + n_base + (j // 2) * 8)
    return ldmatrix(smem, addrs, trans=not kc)


def mma(a, b, c):
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        A[g, 2 * q : 2 * q + 2] = a[t, 0:2]
        A[g + 8, 2 * q : 2 * q + 2] = a[t, 2:4]
        A[g, 2 * q + 8 : 2 * q + 10] = a[t, 4:6]
        A[g + 8, 2 * q + 8 : 2 * q + 10] = a[t, 6:8]
        B[2 * q : 2 * q + 2, g] = b[t, 0:2]
        B[2 * q + 8 : 2 * q + 10, g] = b[t, 2:4]
        C[g, 2 * q : 2 * q + 2] = c[t, 0:2]
        C[g + 8, 2 * q : 2 * q + 2] = c[t, 2:4]
    D = A @ B + C
    d = np.zeros((32, 4))
    for t in range(32):
        g, q = t // 4, t % 4
        d[t, 0:2] = D[g, 2 * q : 2 * q + 2]
        d[t, 2:4] = D[g + 8, 2 * q : 2 * q + 2]
    return d


def run(BM, a_kc, b_kc, rng):  # noqa: N803
    WM = BM // 2
    MI = WM // 16
    opA = rng.standard_normal((BM, BK))
    opB = rng.standard_normal((BK, BN))
    # shared tiles as tc_load_tile stores them: [mn][k] when k-contiguous, else [k][mn]
    LDA, LDB = ld(a_kc, BM), ld(b_kc, BN)
    sa = np.zeros((BM if a_kc else BK) * LDA)
    sb = np.zeros((BN if b_kc else BK) * LDB)
    for m in range(BM):
        for k in range(BK):
            sa[(m * LDA + k) if a_kc else (k * LDA + m)] = opA[m, k]
    for n in range(BN):
        for k in range(BK):
            sb[(n * LDB + k) if b_kc else (k * LDB + n)] = opB[k, n]
    out = np.full((BM, BN), np.nan)
    for wid in range(8):
        wm = (wid // (BN // TC_WN)) * WM
        wn = (wid % (BN // TC_WN)) * TC_WN
        accs = np.zeros((MI * NI, 32, 4))
        for kk in range(0, BK, 16):
            fa = [a_frag(sa, a_kc, BM, wm + i * 16, kk) for i in range(MI)]
            fb = [b_frags(sb, b_kc, wn + p * 16, kk) for p in range(NI // 2)]
            for i in range(MI):
                for j in range(NI):
                    bj = fb[j // 2][:, (j % 2) * 4 : (j % 2) * 4 + 4]
                    accs[i * NI + j] = mma(fa[i], bj, accs[i * NI + j])
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for i in range(MI):
                for half in range(2):
                    row = wm + i * 16 + g + half * 8
                    for j in range(NI):
                        col = wn + j * 8 + 2 * t
                        out[row, col : col + 2] = accs[i * NI + j, lane, half * 2 : half * 2 + 2]
    err = np.abs(out - opA @ opB).max()
    print(f"BM={BM} A k-contig={a_kc} B k-contig={b_kc}: max err {err:.2e}")
    assert err < 1e-9


def ceildiv(a, b):
    return -(-a // b)


def tile_coords(pid, num_m, num_n):
    G = 8
    per = G * num_n
    first = (pid // per) * G
    rows = min(num_m - first, G)
    loc = pid % per
    return first + loc % rows, loc // rows


def off(kc, mn, kk, MN, K):
    return mn * K + kk if kc else kk * MN + mn


def fetch(src, kc, vec, BMN, BK, VW, LV, mn0, k0, MN, K, NT):
    per_row = BK // VW if kc else BMN // VW
    regs = np.zeros((NT, LV, VW))
    for tid in range(NT):
        for i in range(LV):
            v = tid + i * NT
            row = v // per_row
            col = (v % per_row) * VW
            mn = mn0 + (row if kc else col)
            kk = k0 + (col if kc else row)
            if vec:
                if mn < MN and kk < K:
                    o = off(kc, mn, kk, MN, K)
                    regs[tid, i] = src[o : o + VW]
            else:
                for e in range(VW):
                    emn = mn + (0 if kc else e)
                    ek = kk + (e if kc else 0)
                    if emn < MN and ek < K:
                        regs[tid, i, e] = src[off(kc, emn, ek, MN, K)]
    return regs


def stash(regs, kc, BMN, BK, LD, VW, LV, NT):
    sm = np.full(BK * LD, np.nan)
    per_row = BK // VW if kc else BMN // VW
    for tid in range(NT):
        for i in range(LV):
            v = tid + i * NT
            row = v // per_row
            col = (v % per_row) * VW
            if kc:
                for e in range(VW):
                    sm[(col + e) * LD + row] = regs[tid, i, e]
            else:
                sm[row * LD + col : row * LD + col + VW] = regs[tid, i]
    return sm


def simt(TA, TB, vec, M, N, K, BM, BK, TT, VW, rng):
    BN, TM, TN, NT = BM, TT, TT, 256
    A = rng.standard_normal((M, K))
    B = rng.standard_normal((K, N))
    C = rng.standard_normal((M, N))
    a = (A.T if TA else A).copy().ravel()
    b = (B.T if TB else B).copy().ravel()
    alpha, beta = 1.5, -0.5
    TX = BN // TN
    GM, GN = TM // 4, TN // 4
    LDA, LDB = BM + 4, BN + 4
    LVA = BM * BK // VW // NT
    LVB = BN * BK // VW // NT
    assert LVA * VW * NT == BM * BK
    out = np.full(M * N, np.nan)
    num_m, num_n = ceildiv(M, BM), ceildiv(N, BN)
    for pid in range(num_m * num_n):
        tm, tn = tile_coords(pid, num_m, num_n)
        m0, n0 = tm * BM, tn * BN
        acc = np.zeros((NT, TM * GN, 4))
        for kt in range(ceildiv(K, BK)):
            sa = stash(fetch(a, not TA, vec, BM, BK, VW, LVA, m0, kt * BK, M, K, NT), not TA, BM, BK, LDA, VW, LVA, NT)
            sb = stash(fetch(b, TB, vec, BN, BK, VW, LVB, n0, kt * BK, N, K, NT), TB, BN, BK, LDB, VW, LVB, NT)
            assert not np.isnan(sa).reshape(BK, LDA)[:, :BM].any() and not np.isnan(sb).reshape(BK, LDB)[:, :BN].any()
            for tid in range(NT):
                tx, ty = tid % TX, tid // TX
                for kk in range(BK):
                    fa = [
                        sa[kk * LDA + g * (BM // GM) + ty * 4 : kk * LDA + g * (BM // GM) + ty * 4 + 4]
                        for g in range(GM)
                    ]
                    fb = [
                        sb[kk * LDB + h * (BN // GN) + tx * 4 : kk * LDB + h * (BN // GN) + tx * 4 + 4]
                        for h in range(GN)
                    ]
                    for g in range(GM):
                        for r in range(4):
                            for h in range(GN):
                                acc[tid, (g * 4 + r) * GN + h] += fa[g][r] * fb[h]
        for tid in range(NT):
            tx, ty = tid % TX, tid // TX
            for g in range(GM):
                for r in range(4):
                    row = m0 + g * (BM // GM) + ty * 4 + r
                    if row < M:
                        for h in range(GN):
                            col = n0 + h * (BN // GN) + tx * 4
                            for e in range(4):
                                if col + e < N:
                                    out[row * N + col + e] = (
                                        alpha * acc[tid, (g * 4 + r) * GN + h, e] + beta * C[row, col + e]
                                    )
    err = np.nanmax(np.abs(out.reshape(M, N) - (alpha * A @ B + beta * C)))
    assert not np.isnan(out).any() and err < 1e-9, err
    print(f"simt TA={TA} TB={TB} vec={vec} M={M} N={N} K={K} BM={BM}: ok ({err:.1e})")


def tc_tile(TA, vec, M, K, BM, rng):
    """tc_load_tile for A: the shared tile must equal op(A)[m0:m0+BM, k0:k0+32], zero-padded."""
    BK, PAD, NT, VW = 32, 8, 256, 8
    A = rng.standard_normal((M, K))
    a = (A.T if TA else A).copy().ravel()
    kc = not TA
    LD = (BK if kc else BM) + PAD
    for m0 in range(0, M, BM):
        for k0 in range(0, K, BK):
            sm = np.full(((BM if kc else BK) * LD), np.nan)
            per_row = BK // VW if kc else BM // VW
            LV = BM * BK // VW // NT
            for tid in range(NT):
                for i in range(LV):
                    v = tid + i * NT
                    row = v // per_row
                    col = (v % per_row) * VW
                    mn = m0 + (row if kc else col)
                    kk = k0 + (col if kc else row)
                    d = row * LD + col
                    if vec:
                        inside = mn < M and kk < K
                        o = off(kc, mn, kk, M, K) if inside else 0
                        sm[d : d + VW] = a[o : o + VW] if inside else 0
                    else:
                        for e in range(VW):
                            emn = mn + (0 if kc else e)
                            ek = kk + (e if kc else 0)
                            sm[d + e] = a[off(kc, emn, ek, M, K)] if emn < M and ek < K else 0
            want = np.zeros((BM, BK))
            blk = A[m0 : m0 + BM, k0 : k0 + BK]
            want[: blk.shape[0], : blk.shape[1]] = blk
            got = sm.reshape(-1, LD)[:, : (BK if kc else BM)]
            got = got if kc else got.T
            assert np.array_equal(got, want)
    print(f"tc tile TA={TA} vec={vec} M={M} K={K} BM={BM}: ok")


def main():
    rng = np.random.default_rng(1)
    for bm in (128, 64):
        for a_kc in (True, False):
            for b_kc in (True, False):
                run(bm, a_kc, b_kc, rng)
    for ta in (False, True):
        for tb in (False, True):
            simt(ta, tb, False, 70, 45, 37, 64, 16, 4, 4, rng)
            simt(ta, tb, True, 72, 136, 40, 64, 16, 4, 4, rng)
    simt(False, False, True, 136, 132, 20, 128, 16, 8, 4, rng)
    simt(True, True, False, 130, 129, 17, 128, 16, 8, 4, rng)
    simt(False, True, True, 66, 66, 10, 64, 8, 4, 2, rng)  # the float64 configuration
    for ta in (False, True):
        tc_tile(ta, False, 70, 45, 64, rng)
        tc_tile(ta, True, 136, 72, 128, rng)
        tc_tile(ta, True, 72, 40, 64, rng)
    print("all index math OK")


if __name__ == "__main__":
    main()
