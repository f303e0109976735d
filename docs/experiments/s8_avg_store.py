"""EXPERIMENT: a store whose KV is the mean of two stores' KV for the same facts (same token ids)."""
import dataclasses, shutil, sys
from pathlib import Path
import torch
from kvmem.store import Store
a_root, b_root, out_root, wa = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
shutil.rmtree(out_root, ignore_errors=True)
Path(out_root).parent.mkdir(parents=True, exist_ok=True)
shutil.copytree(b_root, out_root)
A, B, C = Store.open(a_root), Store.open(b_root), Store.open(out_root)
for user in C.users() if hasattr(C, "users") else [Path(out_root).parts[-5]]:
    ua, ub = A.snapshot(user), B.snapshot(user)
    ia = {f.fact_id: i for i, f in enumerate(ua.facts)}
    keys, values, recs = [], [], []
    for i, f in enumerate(ub.facts):
        j = ia[f.fact_id]
        assert ua.facts[j].token_ids == f.token_ids
        ka, va = ua.fact_kv(j); kb, vb = ub.fact_kv(i)
        keys.append((wa * ka.float() + (1 - wa) * kb.float()).to(kb.dtype))
        values.append((wa * va.float() + (1 - wa) * vb.float()).to(vb.dtype))
        recs.append(f)
    info = C.user_info(user)
    C.commit(user, recs, keys, values, ub.embeddings, replace=True, window=0, history=True)
    print(user, len(recs), "facts averaged", C.user_info(user))
