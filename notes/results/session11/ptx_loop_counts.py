import re, sys, collections
sys.path.insert(0, ".probe")
import ptx_decode as P

def loops(ptx):
    lines = ptx.splitlines()
    labels = {}
    for i, l in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", l.strip())
        if m: labels[m.group(1)] = i
    out = []
    for i, l in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i + 1]
            out.append(body)
    return out

def cat(op):
    for key, name in (("mma", "mma"), ("ldmatrix", "ldmatrix"), ("ld.shared", "ld.shared"), ("st.shared", "st.shared"),
                      ("cp.async", "cp.async"), ("ld.global", "ld.global"), ("cvt.rn.f16x2.e4m3", "cvt.fp8"), ("cvt", "cvt.other"),
                      ("ex2", "ex2"), ("shfl", "shfl"), ("bar", "bar"), ("fma", "fma"), ("mul", "mul"), ("add", "add"),
                      ("max", "max"), ("setp", "setp"), ("selp", "selp"), ("mov", "mov"), ("prmt", "prmt"), ("shl", "int"),
                      ("shr", "int"), ("and", "int"), ("or", "int"), ("mad", "int"), ("sub", "sub")):
        if op.startswith(key): return name
    return "other:" + op.split(".")[0]

for kv, tile in (("bf16", (64, 4, 2)), ("fp8e4nv", (128, 4, 3)), ("fp8e4nv", (64, 4, 2))):
    k = P.build(False, kv=kv, tile_n=tile[0], warps=tile[1], stages=tile[2])
    ls = loops(k.asm["ptx"])
    for body in ls:
        ops = [re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", l) for l in body]
        ops = [m.group(1) for m in ops if m and not m.group(1).startswith("$")]
        if not any(o.startswith("mma") for o in ops):
            continue
        c = collections.Counter(cat(o) for o in ops)
        print(kv, tile, "loop body instrs", len(ops), "per key", round(len(ops) / tile[0], 2))
        print("   ", dict(sorted(c.items(), key=lambda x: -x[1])[:22]))
        break  # first mma loop (masked); print the unmasked one too
    mm = [b for b in ls if any("mma" in l for l in b)]
    if len(mm) > 1:
        body = mm[1]
        ops = [re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", l) for l in body]
        ops = [m.group(1) for m in ops if m and not m.group(1).startswith("$")]
        c = collections.Counter(cat(o) for o in ops)
        print("  unmasked loop instrs", len(ops), "per key", round(len(ops) / tile[0], 2))
        print("   ", dict(sorted(c.items(), key=lambda x: -x[1])[:22]))

print("---- slot-minor V (+V_3D), head-major K")
for kv, tile in (("fp8e4nv", (128, 4, 3)), ("fp8e4nv", (32, 1, 2)), ("fp8e4nv", (64, 4, 2))):
    k = P.build(True, kv=kv, tile_n=tile[0], warps=tile[1], stages=tile[2], extra={"V_3D": True})
    ls = [b for b in loops(k.asm["ptx"]) if any("mma" in l for l in b)]
    for body in ls[:2]:
        ops = [re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", l) for l in body]
        ops = [m.group(1) for m in ops if m and not m.group(1).startswith("$")]
        c = collections.Counter(cat(o) for o in ops)
        print(kv, tile, "loop instrs", len(ops), "per key per thread", round(len(ops) / tile[0], 2), "per key per warp-thread x warps", round(len(ops) * tile[1] / tile[0], 2))
        print("   ", dict(sorted(c.items(), key=lambda x: -x[1])[:16]))
