"""Sweep decoder-only causal LM archs a..l: stock greedy vs hfpaged generate_many."""
import json, os, sys, signal, traceback, time, collections
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
torch.set_num_threads(1)
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as M
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
import hfpaged
from hfpaged.model import attention as hfatt

VOCAB = 128
NEW = 24
LOG = os.environ.get("LOG", "/tmp/probe_arch1/results.jsonl")

# ---- record attention kwargs passed to the hfpaged attention function
KW = collections.defaultdict(set)
CUR = {"arch": None}
_orig = hfatt.paged_attention_forward
def recording(module, query, key, value, attention_mask, *args, **kwargs):
    s = KW[CUR["arch"]]
    s.add(("mask", attention_mask is not None))
    for k, v in kwargs.items():
        if k == "hfpaged":
            continue
        s.add((k, "None" if v is None else (type(v).__name__ if not isinstance(v, (int, float, bool, str)) else repr(v))))
    if len(args):
        s.add(("positional_extra", len(args)))
    s.add(("qkdim/vdim", f"{query.shape[-1]}/{key.shape[-1]}/{value.shape[-1]}"))
    s.add(("module", type(module).__name__))
    return _orig(module, query, key, value, attention_mask, *args, **kwargs)
AttentionInterface.register("hfpaged", recording)

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.25,
    # moe
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    n_shared_experts=1, n_group=1, topk_group=1, moe_topk=2, shared_expert_intermediate_size=64,
    # windows
    sliding_window=8, attention_chunk_size=8, local_window_size=8, window_size=8, chunk_size=8,
    # token ids
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
    # misc
    is_decoder=True, tie_word_embeddings=False,
    # gpt2-style
    n_positions=512,
)
EXTRA = {}  # per-arch overrides, filled from argv json file optionally

def timeout_handler(signum, frame):
    raise TimeoutError("per-arch timeout")

def build_config(key):
    mt = key.split("@")[0]
    ex = dict(EXTRA.get(key, {}))
    cls = getattr(transformers, ex.pop("__config_class__")) if "__config_class__" in ex else CONFIG_MAPPING[mt]
    base = cls(**ex.pop("__base__", {}))
    kw = {}
    drop = set(ex.pop("__drop__", []))
    ex.pop("__model_class__", None)
    for k, v in COMMON.items():
        if k in drop:
            continue
        if isinstance(getattr(type(base), k, None), property) and getattr(type(base), k).fset is None:
            continue
        try:
            ok = hasattr(base, k)
        except Exception:
            ok = False
        if ok:
            kw[k] = v
    # gpt2-ish aliases that aren't attribute-mapped on this instance
    for k in ("n_embd", "n_layer", "n_head", "d_model"):
        if hasattr(base, k) and k not in ("d_model",):
            pass
    kw.update(ex)
    # layer types: keep each distinct type once
    lt = getattr(base, "layer_types", None)
    ro = isinstance(getattr(type(base), "layer_types", None), property) and getattr(type(base), "layer_types").fset is None
    if not ro and isinstance(lt, (list, tuple)) and len(lt) > 0 and "layer_types" not in ex and "layer_types" not in drop:
        uniq = []
        for t in lt:
            if t not in uniq:
                uniq.append(t)
        if len(uniq) == 1:
            uniq = uniq * 2
        kw["layer_types"] = uniq
        kw["num_hidden_layers"] = len(uniq)
    cfg = cls(**kw)
    return cfg

def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 13, 30)]
    if os.environ.get("STRESS"):
        ps += [ps[2][:20] + torch.randint(3, VOCAB, (9,), generator=g).tolist(), list(ps[1]), [7], ps[2][:17]]
    return ps

def run_arch(mt):
    rec = {"model_type": mt}
    t0 = time.time()
    try:
        cfg = build_config(mt)
        torch.manual_seed(0)
        mc = EXTRA.get(mt, {}).get("__model_class__")
        if mc:
            model = getattr(transformers, mc)._from_config(cfg, dtype=torch.float32).eval()
        else:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        rec["class"] = type(model).__name__
        rec["nparams"] = sum(p.numel() for p in model.parameters())
        def ga(k):
            try:
                return getattr(cfg, k, None)
            except Exception as e:
                return "ERR " + type(e).__name__
        rec["cfg_text"] = {k: ga(k) for k in ("num_hidden_layers", "layer_types", "sliding_window", "attention_chunk_size", "head_dim", "hidden_size", "vocab_size")}
    except Exception as e:
        rec["outcome"] = "build-failed"
        rec["detail"] = f"{type(e).__name__}: {str(e)[:300]}"
        return rec
    P = prompts()
    try:
        exp = []
        with torch.no_grad():
            for p in P:
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
                exp.append(out[0, len(p):].tolist())
        rec["expected"] = exp
        rec["varied"] = [len(set(e)) for e in exp]
    except Exception as e:
        rec["outcome"] = "stock-failed"
        rec["detail"] = f"{type(e).__name__}: {str(e)[:300]}"
        rec["tb"] = traceback.format_exc()[-1500:]
        return rec
    try:
        with torch.no_grad():
            ids = torch.tensor([P[1]])
            n = ids.shape[1]
            a = model(ids, position_ids=torch.arange(n)[None]).logits
            b = model(ids, position_ids=torch.arange(n)[None] + 37).logits
        rec["pos_ignored"] = bool(torch.equal(a, b))
    except Exception as e:
        rec["pos_ignored"] = "ERR " + type(e).__name__ + ": " + str(e)[:100]
    try:
        hfpaged.patch(model, **json.loads(os.environ.get("PATCH_KW", '{"num_blocks": 64, "block_size": 8}')))
    except Exception as e:
        rec["outcome"] = "refused"
        rec["detail"] = f"{type(e).__name__}: {str(e)[:200]}"
        return rec
    try:
        res = model.generate_many(P, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        got = [r.token_ids for r in res]
    except Exception as e:
        rec["outcome"] = "paged-failed"
        rec["detail"] = f"{type(e).__name__}: {str(e)[:300]}"
        rec["tb"] = traceback.format_exc()[-1500:]
        return rec
    rec["got"] = got
    diffs = []
    for i, (a, b) in enumerate(zip(exp, got)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append((i, len(P[i]), pos))
    rec["outcome"] = "exact" if not diffs else "WRONG"
    rec["diffs"] = diffs
    rec["secs"] = round(time.time() - t0, 1)
    return rec

if __name__ == "__main__":
    archs = sys.argv[1].split(",")
    if len(sys.argv) > 2:
        EXTRA.update(json.load(open(sys.argv[2])))
    signal.signal(signal.SIGALRM, timeout_handler)
    for mt in archs:
        CUR["arch"] = mt
        signal.alarm(120)
        try:
            rec = run_arch(mt)
        except BaseException as e:
            rec = {"model_type": mt, "outcome": "harness-error", "detail": f"{type(e).__name__}: {str(e)[:300]}"}
        signal.alarm(0)
        rec["attn_kwargs"] = sorted(map(list, KW.get(mt, set())), key=str)
        with open(LOG, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print(mt, rec["outcome"], rec.get("detail", ""), rec.get("diffs", ""), rec.get("varied", ""), "pos_ignored=%s" % rec.get("pos_ignored"), flush=True)
