"""Emulate the index math of day014's GPU kernels in numpy (no GPU needed, ~10 s).

The GPU kernels (gemm_v*.mojo) compile here but cannot run: this ports their index
arithmetic line by line and checks it against A @ B for tails, every transpose pair and
both load paths (VEC on/off):
  * the tensor-core kernel: shared layouts, ldmatrix lane addresses (.trans or not),
    mma.sync m16n8k16 fragment layouts (PTX ISA), epilogue rows/cols;
  * tc_load_tile: the shared tile equals op(A)[m0:, k0:] with zero padding;
  * the SIMT kernel: tile_coords, operand_offset, fetch/stash thread mapping, the
    per-thread 4-row/4-col groups, epilogue masks.
  * the wgmma kernel: wg_load_tile's thread mapping into the core-matrix layout,
    wg_desc's start/LBO/SBO read through the PTX ISA's canonical no-swizzle
    layouts (K-major and MN-major), the m64nNk16 accumulator layout, the epilogue.
It checks the arithmetic, not Mojo's semantics: the CUDA cases of
test_day014_gemm.py on the H100 are the real test.

    python days/day014/emulate_kernels.py
"""

import itertools

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


def off(kc, mn, kk, ld):
    """stored_offset: (mn, kk) of op(X) in stored rows of ld elements."""
    return mn * ld + kk if kc else kk * ld + mn


def vector_slots(NT, LV, per_row, VW):
    """(tid, i, row, col) of every vector of a tile: thread tid copies vectors tid + i*NT,
    laid out per_row vectors of VW elements to a stored row."""
    for tid in range(NT):
        for i in range(LV):
            v = tid + i * NT
            yield tid, i, v // per_row, (v % per_row) * VW


def read_vector(src, kc, vec, mn, kk, MN, K, ld, VW):
    """The VW elements from (mn, kk) along the stored contiguous dim, zero outside the
    matrix: one vector load (vec) or VW element loads with their own bounds checks."""
    out = np.zeros(VW)
    if vec:
        if mn < MN and kk < K:
            o = off(kc, mn, kk, ld)
            out[:] = src[o : o + VW]
        return out
    for e in range(VW):
        emn = mn + (0 if kc else e)
        ek = kk + (e if kc else 0)
        if emn < MN and ek < K:
            out[e] = src[off(kc, emn, ek, ld)]
    return out


def fetch(src, kc, vec, BMN, BK, VW, LV, mn0, k0, MN, K, ld, NT):
    per_row = BK // VW if kc else BMN // VW
    regs = np.zeros((NT, LV, VW))
    for tid, i, row, col in vector_slots(NT, LV, per_row, VW):
        mn = mn0 + (row if kc else col)
        kk = k0 + (col if kc else row)
        regs[tid, i] = read_vector(src, kc, vec, mn, kk, MN, K, ld, VW)
    return regs


def stash(regs, kc, BMN, BK, LD, VW, LV, NT):
    sm = np.full(BK * LD, np.nan)
    per_row = BK // VW if kc else BMN // VW
    for tid, i, row, col in vector_slots(NT, LV, per_row, VW):
        if kc:
            for e in range(VW):
                sm[(col + e) * LD + row] = regs[tid, i, e]
        else:
            sm[row * LD + col : row * LD + col + VW] = regs[tid, i]
    return sm


def simt(TA, TB, vec, M, N, K, BM, BK, TT, VW, rng, pieces=1):
    """The SIMT kernel on packed operands, or (pieces > 1) its split-K launch: batch entry
    s reads K / pieces of K from s * K / pieces on, in the rows of the whole operands
    (a_ld, b_ld), into a workspace that the sum kernel adds up (alpha, beta applied there)."""
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
    KS = K // pieces
    a_ld, b_ld = (M if TA else K), (K if TB else N)
    a_bs, b_bs = (KS * M if TA else KS), (KS if TB else KS * N)
    al, be = (alpha, beta) if pieces == 1 else (1.0, 0.0)
    out = np.full((pieces, M * N), np.nan)
    num_m, num_n = ceildiv(M, BM), ceildiv(N, BN)
    for z, pid in itertools.product(range(pieces), range(num_m * num_n)):
        a_t, b_t = a[z * a_bs :], b[z * b_bs :]
        tm, tn = tile_coords(pid, num_m, num_n)
        m0, n0 = tm * BM, tn * BN
        acc = np.zeros((NT, TM * GN, 4))
        for kt in range(ceildiv(KS, BK)):
            ra = fetch(a_t, not TA, vec, BM, BK, VW, LVA, m0, kt * BK, M, KS, a_ld, NT)
            rb = fetch(b_t, TB, vec, BN, BK, VW, LVB, n0, kt * BK, N, KS, b_ld, NT)
            sa = stash(ra, not TA, BM, BK, LDA, VW, LVA, NT)
            sb = stash(rb, TB, BN, BK, LDB, VW, LVB, NT)
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
                                    out[z, row * N + col + e] = (
                                        al * acc[tid, (g * 4 + r) * GN + h, e] + be * C[row, col + e]
                                    )
    result = out[0] if pieces == 1 else alpha * out.sum(0) + beta * C.ravel()
    err = np.nanmax(np.abs(result.reshape(M, N) - (alpha * A @ B + beta * C)))
    assert not np.isnan(out).any() and err < 1e-9, err
    split = f" in {pieces} pieces of K" if pieces > 1 else ""
    print(f"simt TA={TA} TB={TB} vec={vec} M={M} N={N} K={K} BM={BM}{split}: ok ({err:.1e})")


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
            for _tid, _i, row, col in vector_slots(NT, LV, per_row, VW):
                mn = m0 + (row if kc else col)
                kk = k0 + (col if kc else row)
                d = row * LD + col
                sm[d : d + VW] = read_vector(a, kc, vec, mn, kk, M, K, K if kc else M, VW)  # packed rows
            want = np.zeros((BM, BK))
            blk = A[m0 : m0 + BM, k0 : k0 + BK]
            want[: blk.shape[0], : blk.shape[1]] = blk
            got = sm.reshape(-1, LD)[:, : (BK if kc else BM)]
            got = got if kc else got.T
            assert np.array_equal(got, want)
    print(f"tc tile TA={TA} vec={vec} M={M} K={K} BM={BM}: ok")


# ---- the wgmma kernel (gemm_wgmma_kernel) ----
WG_BK = 64


def wg_load(src, kc, BMN, NT, mn0, k0, MN, K):  # noqa: N803
    """wg_load_tile: one BMN x 64 tile into the core-matrix layout (elements)."""
    rows = BMN if kc else WG_BK
    vecs = WG_BK // 8 if kc else BMN // 8
    rg = rows // 8
    sm = np.full(rows * vecs * 8, np.nan)
    written = np.zeros(rows * vecs, dtype=int)
    for tid in range(NT):
        for i in range(rows * vecs // NT):
            v = tid + i * NT
            q, lane = v // 32, v % 32
            row = lane % 8 + 8 * (q % rg)
            vec = lane // 8 + 4 * (q // rg)
            mn = mn0 + (row if kc else vec * 8)
            kk = k0 + (vec * 8 if kc else row)
            inside = mn < MN and kk < K
            o = off(kc, mn, kk, K if kc else MN) if inside else 0  # operand_offset: packed rows
            d = (vec * rows + row) * 8
            sm[d : d + 8] = src[o : o + 8] if inside else 0
            written[vec * rows + row] += 1
    assert (written == 1).all(), "every 16-byte vector copied exactly once"
    return sm


def wg_desc(kc, BMN, mn, ks):  # noqa: N803
    """wg_desc: (start element, SBO, LBO in 16-byte units)."""
    if kc:
        return (2 * ks * BMN + mn) * 8, 128 // 16, BMN
    return (mn // 8) * WG_BK * 8 + 16 * ks * 8, WG_BK, 128 // 16


def wgmma_read(sm, desc, kc, rows):
    """The operand a wgmma reads: rows x 16 (mn, k), from the PTX ISA canonical
    no-swizzle layouts, with T = 8 two-byte elements per 16 bytes:
    K-major ((8,m),(T,2)):((1T,SBO),(1,LBO)); MN-major ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)).
    """
    start, sbo, lbo = desc
    sbo, lbo = sbo * 8, lbo * 8  # 16-byte units -> elements
    out = np.zeros((rows, 16))
    for mn in range(rows):
        for k in range(16):
            if kc:
                a = start + (mn % 8) * 8 + (mn // 8) * sbo + (k % 8) + (k // 8) * lbo
            else:
                a = start + (mn % 8) + (mn // 8) * sbo + (k % 8) * 8 + (k // 8) * lbo
            out[mn, k] = sm[a]
    return out


def wgmma_kernel(TA, TB, M, N, K, BM, BN, rng):  # noqa: N803
    """Every tile of the wgmma kernel, stage by stage, against A @ B."""
    A = rng.standard_normal((M, K))
    B = rng.standard_normal((K, N))
    a = (A.T if TA else A).copy().ravel()
    b = (B if not TB else B.T).copy().ravel()
    a_kc, b_kc = not TA, TB
    nt = BM // 64 * 128
    out = np.full((M, N), np.nan)
    num_m, num_n = ceildiv(M, BM), ceildiv(N, BN)
    seen = set()
    for pid in range(num_m * num_n):
        tm, tn = tile_coords(pid, num_m, num_n)
        seen.add((tm, tn))
        m0, n0 = tm * BM, tn * BN
        acc = np.zeros((BM // 64, 128, BN // 2))  # [warpgroup][thread][register]
        for kt in range(ceildiv(K, WG_BK)):
            sa = wg_load(a, a_kc, BM, nt, m0, kt * WG_BK, M, K)
            sb = wg_load(b, b_kc, BN, nt, n0, kt * WG_BK, N, K)
            for wg in range(BM // 64):
                d = np.zeros((64, BN))
                for ks in range(WG_BK // 16):
                    opa = wgmma_read(sa, wg_desc(a_kc, BM, wg * 64, ks), a_kc, 64)
                    opb = wgmma_read(sb, wg_desc(b_kc, BN, 0, ks), b_kc, BN)
                    d += opa @ opb.T
                # PTX D fragment of m64nNk16: thread t (warp w, lane l), register i
                for t in range(128):
                    w, lane = t // 32, t % 32
                    for i in range(BN // 2):
                        r = 16 * w + lane // 4 + 8 * ((i // 2) % 2)
                        c = 8 * (i // 4) + 2 * (lane % 4) + i % 2
                        acc[wg, t, i] += d[r, c]
        # the kernel's epilogue
        for wg in range(BM // 64):
            for t in range(128):
                w, lane = t // 32, t % 32
                g, q = lane // 4, lane % 4
                for half in range(2):
                    row = m0 + wg * 64 + (w % 4) * 16 + g + half * 8
                    if row >= M:
                        continue
                    for j in range(BN // 8):
                        col = n0 + j * 8 + 2 * q
                        if col < N:
                            out[row, col : col + 2] = acc[wg, t, 4 * j + 2 * half : 4 * j + 2 * half + 2]
    assert len(seen) == num_m * num_n
    err = np.abs(out - A @ B).max()
    assert err < 1e-9, err
    print(f"wgmma TA={TA} TB={TB} M={M} N={N} K={K} BM={BM} BN={BN}: ok ({err:.1e})")


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
    for ta, tb in itertools.product((False, True), repeat=2):  # split-K: pieces in the whole rows
        simt(ta, tb, True, 68, 72, 120, 64, 16, 4, 4, rng, pieces=3)  # 40: a tail
    for ta in (False, True):
        tc_tile(ta, False, 70, 45, 64, rng)
        tc_tile(ta, True, 136, 72, 128, rng)
        tc_tile(ta, True, 72, 40, 64, rng)
    for ta in (False, True):
        for tb in (False, True):
            wgmma_kernel(ta, tb, 136, 264, 72, 128, 128, rng)
    wgmma_kernel(False, False, 72, 136, 136, 64, 128, rng)
    wgmma_kernel(True, False, 136, 264, 80, 128, 256, rng)
    print("all index math OK")


if __name__ == "__main__":
    import argparse

    # no options: --help shows the docstring instead of running the checks
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
