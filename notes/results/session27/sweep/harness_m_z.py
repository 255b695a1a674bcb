"""Sweep harness: tiny model per model_type, stock greedy vs hfpaged generate_many."""
import sys, os, json, signal, traceback, collections, importlib
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M
import hfpaged
from hfpaged.model import attention as hatt
from transformers.modeling_utils import AttentionInterface

VOCAB = 128
LENS = [5, 13, 30]
NEW = 24

# ---- kwarg recorder on the hfpaged attention function
SEEN = collections.defaultdict(set)  # kwarg name -> model types
SEEN_VALS = {}
CUR = {"mt": None}
_orig = hatt.paged_attention_forward
def recorder(module, query, key, value, attention_mask, *args, **kwargs):
    for k, v in kwargs.items():
        if k.startswith("hfpaged"):
            continue
        SEEN[k].add(CUR["mt"])
        SEEN_VALS[(CUR["mt"], k)] = repr(v)[:60] if not torch.is_tensor(v) else f"tensor{tuple(v.shape)}"
    if args:
        SEEN["<positional>"].add(CUR["mt"])
    if attention_mask is not None:
        SEEN["attention_mask!=None"].add(CUR["mt"])
    if query.shape[-1] != value.shape[-1]:
        SEEN["head_dim_v!=head_dim"].add(CUR["mt"])
    return _orig(module, query, key, value, attention_mask, *args, **kwargs)
AttentionInterface.register("hfpaged", recorder)

BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.25,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    # moe
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
    # windows
    sliding_window=8, attention_chunk_size=8, window_size=8, local_window_size=8, attention_window_size=8,
    # alt names
    d_model=64, n_embd=64, n_head=4, n_heads=4, n_layer=2, n_layers=2, num_layers=2, n_positions=512,
    decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2,
    encoder_attention_heads=4, encoder_ffn_dim=128, ffn_dim=128, attention_heads=4, n_inner=128,
    is_decoder=True, use_cache=True,
)
OVERRIDES = json.load(open("/tmp/s27/sweep/overrides.json")) if os.path.exists("/tmp/probe_arch2/overrides.json") else {}

def make_config(mt, extra=None):
    kw = dict(BASE)
    kw.update(OVERRIDES.get(mt, {}))
    if extra:
        kw.update(extra)
    drop = [k for k, v in kw.items() if v == "__drop__"]
    for k in drop:
        kw.pop(k)
    default = AutoConfig.for_model(mt)
    always = {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "is_decoder", "use_cache"}
    kw = {k: v for k, v in kw.items() if k in always or k in OVERRIDES.get(mt, {}) or (extra and k in extra) or hasattr(default, k)}
    if hasattr(default, "init_std") and "init_std" not in kw:
        kw["init_std"] = kw.get("initializer_range", 0.25)
    cfg = AutoConfig.for_model(mt, **kw)
    return cfg

def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENS]

class Timeout(Exception):
    pass
def _alarm(*a):
    raise Timeout()

def run_one(mt, extra=None, seed=0, verbose=False):
    CUR["mt"] = mt
    res = {"mt": mt}
    try:
        cfg = make_config(mt, extra)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        res["cls"] = type(model).__name__
        lt = getattr(model.config.get_text_config(), "layer_types", None)
        res["layer_types"] = lt
        res["impl"] = model.config._attn_implementation
    except Exception as e:
        res["outcome"] = "build-failed"
        res["why"] = f"{type(e).__name__}: {str(e)[:200]}"
        if verbose: traceback.print_exc()
        return res
    ps = prompts(seed)
    ref = []
    try:
        with torch.no_grad():
            for p in ps:
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
                ref.append(out[0, len(p):].tolist())
    except Exception as e:
        res["outcome"] = "stock-failed"
        res["why"] = f"{type(e).__name__}: {str(e)[:200]}"
        if verbose: traceback.print_exc()
        return res
    res["ref"] = ref
    try:
        hfpaged.patch(model)
    except Exception as e:
        res["outcome"] = "refused"
        res["why"] = f"{type(e).__name__}: {str(e)[:150]}"
        if verbose: traceback.print_exc()
        return res
    try:
        got = [r.token_ids for r in model.generate_many(ps, max_new_tokens=NEW, do_sample=False)]
    except Exception as e:
        res["outcome"] = "paged-error"
        res["why"] = f"{type(e).__name__}: {str(e)[:200]}"
        if verbose: traceback.print_exc()
        return res
    res["got"] = got
    bad = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if list(a) != list(b):
            pos = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
            bad.append(f"p{i}(len{LENS[i]})@{pos}")
    distinct = len({t for r in ref for t in r})
    res["distinct_ref_tokens"] = distinct
    res["outcome"] = "exact" if not bad else "WRONG"
    if bad:
        res["why"] = " ".join(bad)
    return res

def main():
    args = sys.argv[1:]
    out = "/tmp/s27/sweep/r2.jsonl"
    signal.signal(signal.SIGALRM, _alarm)
    for mt in args:
        signal.alarm(180)
        try:
            r = run_one(mt, verbose=os.environ.get("VERBOSE") == "1")
        except Timeout:
            r = {"mt": mt, "outcome": "timeout"}
        except BaseException as e:
            r = {"mt": mt, "outcome": "harness-error", "why": f"{type(e).__name__}: {str(e)[:200]}"}
        signal.alarm(0)
        r["kwargs_seen"] = sorted(k for k, v in SEEN.items() if mt in v)
        r["kwarg_vals"] = {k: v for (m, k), v in SEEN_VALS.items() if m == mt}
        line = json.dumps(r, default=str)
        print(mt, r.get("outcome"), r.get("why", ""), "distinct=", r.get("distinct_ref_tokens"), "lt=", r.get("layer_types"), "kw=", r["kwargs_seen"], flush=True)
        with open(out, "a") as f:
            f.write(line + "\n")

if __name__ == "__main__":
    main()
