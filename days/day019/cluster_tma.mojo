# Day 019: the two thread-block-cluster primitives version 4's cluster option needs, as
# PTX: a TMA copy multicast to several CTAs of the cluster, and an mbarrier arrive on
# another CTA's barrier. (The standard library's multicast copy takes rank 1-2 tensor
# maps; day 014's maps are rank 3: (col, row, batch).)

from std.sys._assembly import inlined_assembly


@always_inline
def tma_multicast_box[
    dtype: DType
](
    tma_map: OpaquePointer[mut=False, _],
    dst: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    c0: Int,
    c1: Int,
    c2: Int,
    cta_mask: UInt16,
):
    """Copy one box at (c0, c1, c2) (innermost first) into `dst` of every CTA whose bit
    is set in `cta_mask`; each destination's mbarrier at `bar`'s offset counts the bytes.
    """
    inlined_assembly[
        (
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile"
            ".mbarrier::complete_tx::bytes.multicast::cluster"
            " [$0], [$1, {$3, $4, $5}], [$2], $6;"
        ),
        NoneType,
        constraints="r,l,r,r,r,r,h",
    ](
        Int32(Int(dst)),
        tma_map,
        Int32(Int(bar)),
        Int32(c0),
        Int32(c1),
        Int32(c2),
        cta_mask,
    )


# --8<-- [start:arrive]
@always_inline
def mbar_arrive_cta(
    bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    cta: Int,
):
    """Arrive on the mbarrier at `bar`'s offset in CTA `cta` of this cluster (this CTA
    included): mapa turns the local shared address into the peer's.

    The arrive keeps PTX's default semantics (release at CTA scope): the consumer only
    says "I have read this stage". `.release.cluster` made every arrive wait until the
    warp's earlier global stores (the previous tile's epilogue) were visible cluster-wide,
    and the kernel ran at a third of its speed (H100)."""
    inlined_assembly[
        """{
        .reg .b32 remote;
        mapa.shared::cluster.u32 remote, $0, $1;
        mbarrier.arrive.shared::cluster.b64 _, [remote];
        }""",
        NoneType,
        constraints="r,r",
    ](Int32(Int(bar)), Int32(cta))


# --8<-- [end:arrive]
