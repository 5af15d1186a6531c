"""The SASS k-loop counter (sass_kloop.py) on a made-up listing: no cuobjdump needed."""

import pytest

from days.day018.sass_kloop import count, hot_path, innermost_loop, parse

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                          /* 0x000000 */
        /*0010*/                   UIADD3 UR4, UR4, 0x1, URZ ;                     /* 0x000000 */
        /*0020*/                   R2UR UR8, R2 ;                                  /* 0x000000 */
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ; /* 0x000000 */
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ; /* 0x000000 */
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                 /* 0x000000 */
        /*0060*/              @!P0 BRA 0x90 ;                                      /* 0x000000 */
        /*0070*/                   LOP3.LUT R3, R3, 0x1, RZ, 0xc0, !PT ;           /* 0x000000 */
        /*0080*/                   STL [R1], R3 ;                                  /* 0x000000 */
        /*0090*/                   IMAD R4, R4, 0x2, RZ ;                          /* 0x000000 */
        /*00a0*/               @P1 BRA 0x10 ;                                      /* 0x000000 */
        /*00b0*/                   EXIT ;                                          /* 0x000000 */
"""


def test_parse_drops_guards():
    ins = parse(LISTING)
    assert ins[0] == (0x0, "MOV R1, c[0x0][0x28]")
    assert (0x60, "BRA 0x90") in ins and (0xA0, "BRA 0x10") in ins


def test_loop_and_hot_path_counts():
    body = innermost_loop(parse(LISTING), min_wgmma=2)
    assert [a for a, _ in body] == list(range(0x10, 0xB0, 0x10))
    whole = count(body)
    assert (whole.instructions, whole.wgmma, whole.uniform, whole.r2ur) == (10, 2, 1, 1)
    assert (whole.lop3, whole.imad, whole.spills) == (1, 1, 1)
    hot = count(hot_path(body))  # the branch at 0x60 skips 0x70 and 0x80
    assert (hot.instructions, hot.lop3, hot.spills) == (8, 0, 0)


def test_no_loop_with_enough_wgmma():
    with pytest.raises(ValueError, match="3 HGMMA"):
        innermost_loop(parse(LISTING), min_wgmma=3)
