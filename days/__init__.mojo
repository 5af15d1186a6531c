# `days/` is one Mojo package: every day's kernels compile into a single library
# (pytorch_custom_ops builds it), and a later day imports an earlier one as
# `from days.day009.online_softmax import ...`.
