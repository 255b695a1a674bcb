"""TP profile: batch-1 ms/token, chat tok/s, kernel table of a batch-1 decode (graph replay). torchrun N procs."""
import os, sys, time, json
sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
import torch, torch.distributed as dist
from benchmark import batch1_latency, run_hfpaged, workload
from bench_tp import checkpoint
from transformers import AutoModelForCausalLM
import hfpaged

out = sys.argv[1]
opts = dict(a.split("=") for a in sys.argv[2:])
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
rank, world = dist.get_rank(), dist.get_world_size()
path = checkpoint("llama-3.1-8b", rank)
if world > 1:
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16)
else:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
model.eval()
patch_opts = {k: (v == "1") for k, v in opts.items()}
hfpaged.patch(model, max_num_seqs=256, **patch_opts)
res = {"world": world, "opts": opts}
run_hfpaged(model, [list(range(100, 300))] * 4, [8] * 4)
res["b1_ms"] = batch1_latency(model)
res["b1_ms_2"] = batch1_latency(model)
prompts, out_lens = workload("chat", 256, model.config.vocab_size)
run_hfpaged(model, prompts[:32], [8] * 32)
tokens, dt, usage, engine = run_hfpaged(model, prompts, out_lens, track_usage=True)
res["chat_tok_s"] = tokens / dt
res["graph_eager"] = [engine.runner.num_graph_steps, engine.runner.num_eager_steps]
from torch.profiler import profile, ProfilerActivity
eng = hfpaged.Engine(model)
eng.add_request(list(range(100, 228)), max_new_tokens=40, do_sample=False, eos_token_id=None)
eng.step(); eng.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
if rank == 0:
    print(json.dumps(res), flush=True)
    tag = "_".join(f"{k}{v}" for k, v in opts.items())
    with open(os.path.join(out, f"prof_tp{world}{tag}.txt"), "w") as f:
        f.write(json.dumps(res) + "\n" + table)
    print(table[:6000], flush=True)
hfpaged.unpatch(model)
del eng, engine
sys.stdout.flush()
os._exit(0)
