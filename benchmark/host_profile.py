"""Where the host time of one op call goes: cProfile over many calls (day 016).

    python -m benchmark.host_profile [NAME ...] [--calls N] [--top K]

NAME is a `benchmark.overhead` op (`host_call`, no autograd) or module (`fwd:Module` for
its forward in grad mode, `bwd:Module` for forward + backward). The GPU idles: what is
listed is Python and the launches. cProfile's own cost inflates every function by a
similar amount, so read the ranking, not the absolute microseconds.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch

from .overhead import _rand, module_pairs, op_calls


def calls() -> dict:
    found = {name: mojo for name, (_shape, mojo, _ref) in op_calls().items()}
    for name, (_shape, mojo, _ref, in_shape) in module_pairs().items():
        x = _rand(*in_shape, grad=True)
        grad = torch.randn_like(mojo(x))
        found[f"fwd:{name}"] = lambda m=mojo, x=x: m(x)
        found[f"bwd:{name}"] = lambda m=mojo, x=x, g=grad: m(x).backward(g)
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=18)
    args = p.parse_args(argv)
    known = calls()
    for name in args.names or list(known):
        if name not in known:
            p.error(f"unknown name {name!r}; known: {', '.join(known)}")
        fn = known[name]
        grad_mode = name.startswith(("fwd:", "bwd:"))
        with torch.set_grad_enabled(grad_mode):
            for _ in range(50):
                fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                fn()
            profile.disable()
        print(f"\n=== {name}: {args.calls} calls ===")
        stats = pstats.Stats(profile).strip_dirs().sort_stats("tottime")
        stats.print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
