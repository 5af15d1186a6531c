# Day 015: softmax of vectors far longer than a block (up to 2^28 elements), with
# many blocks per row: a generic multi-pass reduction (multiblock_reduce.mojo), the
# 4-stage pipeline built on it and a fused 2-kernel pipeline (long_softmax.mojo).
