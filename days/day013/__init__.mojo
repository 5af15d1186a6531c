# Day 013: LayerNorm forward and backward (layer_norm.mojo).
