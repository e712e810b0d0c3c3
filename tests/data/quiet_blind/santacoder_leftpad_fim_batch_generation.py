# Follows huggingface/transformers generation (GenerationMixin._update_model_kwargs_for_generation, GPTBigCode
# prepare_inputs_for_generation: position_ids = attention_mask.cumsum(-1) - 1, masked_fill(mask==0, 1)) for batched
# SantaCoder FIM prompts LEFT-padded: pad key columns masked (True = keep for SDPA), pad query rows see nothing and are discarded.
import torch, torch.nn.functional as F
torch.manual_seed(8)
D, H, V, NEW = 32, 4, 40, 4
emb = torch.randn(V, D, dtype=torch.float64); pemb = torch.randn(32, D, dtype=torch.float64)
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / D**0.5 for _ in range(3)); Wo = torch.randn(D, V, dtype=torch.float64)
def heads(t): return t.view(t.shape[0], -1, H, D // H).transpose(1, 2)
def step(ids, pos, keep, cache):  # keep: [b, q, k] bool, True = may attend
    x = emb[ids] + pemb[pos]
    k, v = heads(x @ Wk), heads(x @ Wv)
    if cache is not None: k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
    o = F.scaled_dot_product_attention(heads(x @ Wq), k, v, attn_mask=keep[:, None])
    o = torch.nan_to_num(o)  # fully masked pad query rows -> NaN under SDPA; they are discarded anyway
    return o.transpose(1, 2).reshape(ids.shape[0], -1, D) @ Wo, (k, v)
def generate(prompts):
    L = max(map(len, prompts)); b = len(prompts)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts]); am = (ids != 0).long()
    pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
    keep = torch.tril(torch.ones(L, L, dtype=torch.bool))[None] & am.bool()[:, None, :] & am.bool()[:, :, None]
    logits, cache = step(ids, pos, keep, None); outs = []
    for _ in range(NEW):
        nxt = logits[:, -1].argmax(-1, keepdim=True); outs.append(nxt); am = torch.cat([am, torch.ones(b, 1, dtype=torch.long)], 1)
        logits, cache = step(nxt, am.sum(-1, keepdim=True) - 1, am.bool()[:, None, :], cache)
        last_logits = logits
    return torch.cat(outs, 1), last_logits[:, -1]
prompts = [[1, 5, 6, 7, 2, 9, 3], [1, 11, 2, 3], [1, 20, 21, 22, 23, 24, 2, 25, 3]]  # <pre> .. <suf> .. <mid>
toks, lg = generate(prompts)
diff = 0.0
for i, p in enumerate(prompts):
    t1, l1 = generate([p])
    assert torch.equal(t1[0], toks[i]); diff = max(diff, (l1[0] - lg[i]).abs().max().item())
print("left-padded batch generation vs each prompt alone max logit diff", diff)
assert diff < 1e-10
