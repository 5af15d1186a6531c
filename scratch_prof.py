import cProfile, pstats, time, torch
import pytorch_custom_ops as pco
from benchmark.timing import host_overhead_us
ln = pco.MojoLayerNorm(128).cuda(); tl = torch.nn.LayerNorm(128).cuda()
sm = pco.MojoSoftmax(-1)
x = torch.randn(8, 128, device="cuda", requires_grad=True); g = torch.randn(8, 128, device="cuda")
def fb(m): return lambda: m(x).backward(g)
for mt in (True, False):
    torch.autograd.set_multithreading_enabled(mt)
    for name, f in (("MojoLayerNorm", fb(ln)), ("nn.LayerNorm", fb(tl)), ("MojoSoftmax", fb(sm)), ("fwd only LN", lambda: ln(x))):
        f(); torch.cuda.synchronize()
        print(f"multithreading={mt} {name:14s} {sorted(host_overhead_us(f, 300) for _ in range(3))[1]:7.1f} us", flush=True)
torch.autograd.set_multithreading_enabled(False)
pr = cProfile.Profile(); pr.enable()
for _ in range(500): ln(x).backward(g)
torch.cuda.synchronize(); pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(22)
