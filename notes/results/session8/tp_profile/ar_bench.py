"""All-reduce options for small messages inside a CUDA graph (2 ranks): NCCL vs symm_mem one-shot (copy)."""
import os, time, torch, torch.distributed as dist
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
rank = dist.get_rank()
group_name = dist.group.WORLD.group_name
import torch.distributed._symmetric_memory as symm_mem
try:
    symm_mem.enable_symm_mem_for_group(group_name)
except Exception as e:
    print("enable_symm_mem_for_group:", e)
dt = torch.bfloat16
buf = symm_mem.empty(256 * 8192, dtype=dt, device="cuda")
hdl = symm_mem.rendezvous(buf, group_name)
print(rank, "rendezvous ok", type(hdl).__name__, flush=True)

def bench(fn, reps=64, iters=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    dist.barrier(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters / reps * 1e6

for rows in (1, 8, 32, 128, 256):
    x = torch.randn(rows, 4096, device="cuda", dtype=dt) * (rank + 1)
    ref = x.clone(); dist.all_reduce(ref)
    n = x.numel()
    out = torch.empty_like(x)
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:n], x.view(-1), "sum", group_name, out.view(-1))
    ok1 = torch.equal(out, ref)
    y = x.clone()
    def nccl():
        dist.all_reduce(y)
    def one_shot():
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:n], x.view(-1), "sum", group_name, out.view(-1))
    def two_shot():
        b = buf[:n]
        b.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", group_name)
    t_nccl = bench(nccl)
    try:
        t_one = bench(one_shot)
    except Exception as e:
        t_one = f"err {e}"
    try:
        t_two = bench(two_shot) if n * 2 <= buf.numel() * 2 else None
    except Exception as e:
        t_two = f"err {e}"
    if rank == 0:
        print(f"rows={rows} bytes={n*2}: nccl {t_nccl} us, one_shot {t_one} us, two_shot {t_two} us, one_shot==nccl {ok1}", flush=True)

# many back-to-back one-shots with distinct inputs in one graph: every output right (no buffer reuse race)
xs = [torch.randn(4, 4096, device="cuda", dtype=dt) * (rank + 1) + i for i in range(64)]
outs = [torch.empty_like(v) for v in xs]
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for v, o in zip(xs, outs):
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[: v.numel()], v.view(-1), "sum", group_name, o.view(-1))
bad = 0
for it in range(20):
    for v in xs:
        v.add_(1.0 / 64)
    g.replay()
    torch.cuda.synchronize()
    for v, o in zip(xs, outs):
        r = v.clone(); dist.all_reduce(r)
        bad += int(not torch.equal(r, o))
print(rank, "graph one-shot mismatches:", bad, flush=True)
dist.barrier()
os._exit(0)
