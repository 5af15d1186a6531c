"""One benchmark harness for every day: `python -m benchmark` (or `nox -s bench`).

harness.py   Case + run_case: validate against float64, then time interleaved
timing.py    CUDA-event / wall-clock timers, profiler kernel time, copy bandwidth
cases/       one module per day registering its Case(s)
gpt_block.py       a GPT-2-style block built from gpu-days' ops or torch's (day 016's model benchmark)
model_sweep.py     part of that benchmark (cases/day016.py), e.g. one shape
model_profile.py   per-op host and device time of one training step of the block (torch.profiler)
store.py     append-only results/<device>/<day>.csv, stamped by environment.py
plots.py     PNGs for the site, from the store
overhead.py  host cost per call of every op and module, next to torch (day 016)
host_profile.py      cProfile of one op's or module's calls: where the host time goes (day 016)
autograd_overhead.py what a Python autograd node costs in backward, next to a native one
max_overhead.py  where one call's time went through MAX's execute path (day 010)
"""
