# Follows openai/whisper whisper/model.py (MultiHeadAttention with kv_cache, TextDecoder mask =
# triu(-inf, 1) sliced [:n_ctx, :n_ctx] and offset positional_embedding[offset:offset+T]): incremental decoding
# with a self-attn cache and cross-attn to audio encoder output; causal bias is float -inf above diagonal.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H, NCTX, V, A = 32, 4, 16, 30, 10
emb = torch.randn(V, D); pos = torch.randn(NCTX, D) * 0.1
mask = torch.empty(NCTX, NCTX).fill_(float("-inf")).triu_(1)
W = {n: torch.randn(D, D) / D**.5 for n in ["q", "k", "v", "cq", "ck", "cv"]}
audio = torch.randn(1, A, D)
def sp(t): return t.view(t.shape[0], -1, H, D // H).transpose(1, 2)
def decode(tokens, cache):
    offset = cache["k"].shape[2] if cache else 0
    x = emb[tokens] + pos[offset:offset + tokens.shape[-1]]
    k, v = sp(x @ W["k"]), sp(x @ W["v"])
    if cache: k = torch.cat([cache["k"], k], 2); v = torch.cat([cache["v"], v], 2)
    n = tokens.shape[-1]
    # whisper only passes mask when no cache; with a cache the query step(s) are the newest rows
    m = mask[offset:offset + n, :offset + n]
    a = F.scaled_dot_product_attention(sp(x @ W["q"]), k, v, attn_mask=m)
    x = x + a.transpose(1, 2).reshape(1, n, D)
    c = F.scaled_dot_product_attention(sp(x @ W["cq"]), sp(audio @ W["ck"]), sp(audio @ W["cv"]))  # no mask: audio unpadded (30 s)
    x = x + c.transpose(1, 2).reshape(1, n, D)
    return x @ emb.T, {"k": k, "v": v}
prompt = torch.tensor([[1, 4, 7]]); toks = prompt
logits, cache = decode(prompt, None); steps = [logits[:, -1]]
for _ in range(8):
    nxt = steps[-1].argmax(-1, keepdim=True); toks = torch.cat([toks, nxt], 1)
    logits, cache = decode(nxt, cache); steps.append(logits[:, -1])
full, _ = decode(toks, None)
diff = (torch.stack(steps, 1) - full[:, prompt.shape[1] - 1:]).abs().max().item()
print("tokens", toks.tolist(), "max diff cached vs full", diff); assert diff < 1e-10
