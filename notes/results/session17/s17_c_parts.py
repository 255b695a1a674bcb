import sys, time, torch, functools, collections
from transformers import LlamaConfig, AutoModelForCausalLM
import hfpaged
from hfpaged.core import scheduler as S
from hfpaged.model import input_batch as IB, runner as R
from hfpaged.sampling import sampler as SM
from hfpaged import engine as E
acc = collections.defaultdict(float)
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter() - t
    setattr(obj, name, g)
wrap(S.Scheduler, "schedule", "schedule")
wrap(S.Scheduler, "update_from_output", "update_from_output")
wrap(IB.InputBatch, "update", "batch.update")
wrap(IB.InputBatch, "pack", "pack")
wrap(R.ModelRunner, "forward", "forward(model)")
wrap(R.ModelRunner, "execute", "execute")
wrap(SM.Sampler, "sample", "sampler.sample")
wrap(SM.StepResult, "result", "result()")
wrap(SM.StepResult, "__init__", "StepResult.__init__")
wrap(E.EngineCore, "step_for_clients", "step_for_clients")
wrap(E.Engine, "step", "Engine.step")
from hfpaged.core import kv_manager as KV
wrap(KV.KVCacheManager if hasattr(KV,"KVCacheManager") else KV.KVManager, "allocate", "kv.allocate")
wrap(S.Scheduler, "_commit", "_commit")
wrap(S, "check_stops", "check_stops")
wrap(S, "make_request_output", "make_request_output")
wrap(SM.StepResult, "_unpack", "_unpack")
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
model = AutoModelForCausalLM.from_config(cfg).eval()
hfpaged.patch(model, num_blocks=40000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)
gen = torch.Generator().manual_seed(0)
n = int(sys.argv[1]); kind = sys.argv[2]
if kind == "chat":
    in_lens = torch.randint(32, 513, (n,), generator=gen).tolist(); out_lens = [128] * n
else:
    in_lens = torch.randint(16, 65, (n,), generator=gen).tolist(); out_lens = torch.randint(16, 65, (n,), generator=gen).tolist()
prompts = [torch.randint(10, 990, (k,), generator=gen).tolist() for k in in_lens]
def run():
    engine = hfpaged.Engine(model)
    for p, m in zip(prompts, out_lens):
        engine.add_request(p, max_new_tokens=m, do_sample=False, eos_token_id=None)
    acc.clear(); t = time.perf_counter(); steps = 0
    while engine.has_unfinished():
        engine.step(); steps += 1
    return time.perf_counter() - t, steps
run()
for _ in range(2):
    dt, steps = run()
    print(f"{kind} {dt:.3f}s {steps} steps; per step ms:", " ".join(f"{k}={v/steps*1e3:.3f}" for k, v in sorted(acc.items(), key=lambda x: -x[1])))
