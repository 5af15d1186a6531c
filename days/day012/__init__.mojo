# Day 012: the softmax family (softmax, log_softmax and their backwards).
