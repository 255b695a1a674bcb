import sys, time, os, io
sys.path.insert(0, "/work/main/tests")
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from models import make_model, random_prompts, reference_generate
from test_compiled import compiled_decode
from hfpaged.model import custom_ops

t = time.perf_counter()
with open("/tmp/aot37/block.bin", "rb") as f:
    aot = torch.compiler.load_compiled_function(f, f_globals=custom_ops._call_block.__globals__)
print("load s", time.perf_counter() - t)
g = aot._artifacts.guard_manager


captured = []
orig_init = custom_ops.CompiledStepForward.__init__
def init(self, *a, **k):
    orig_init(self, *a, **k)
    bf = self.block_forward
    def rec(module, *args, **kwargs):
        out = bf(module, *args, **kwargs)
        with custom_ops._distinct_size_symbols():
            t = time.perf_counter()
            with torch.inference_mode(False):
                cl = lambda v: v.clone() if isinstance(v, torch.Tensor) else (tuple(cl(x) for x in v) if isinstance(v, tuple) else v)
                args = tuple(cl(a) for a in args); kwargs = {k: cl(v) for k, v in kwargs.items()}
            ok = aot.guard_check(module, *args, **kwargs)
            if not ok: print('WHY', str(aot._artifacts.guard_manager.check_verbose(aot.prepare_f_locals(module, *args, **kwargs)))[:1500])
            tg = time.perf_counter() - t
            out2 = aot(module, *args, **kwargs) if ok else None
        captured.append((ok, tg, None if out2 is None else torch.equal(out2 if isinstance(out2, torch.Tensor) else out2[0], out if isinstance(out, torch.Tensor) else out[0])))
        return out
    self.block_forward = rec
custom_ops.CompiledStepForward.__init__ = init

model = make_model("qwen3", num_hidden_layers=2)
prompts = random_prompts([5, 9, 3, 7], seed=1)
expected = reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
gen, runner = compiled_decode(model, prompts, max_new_tokens=4)
print("exact", gen == expected)
print(captured)
