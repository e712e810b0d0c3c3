"""FlexGen's OPT attention (prefill `mha` + decode `mha_gen`) on a left-padded batch.

Port of FMInference/FlexGen @19753bc062d47cc34e73efb27824e97ff5216a68:
  flexgen/pytorch_backend.py  gen_attention_mask, extend_attention_mask,
                              opt_input_embed, mha, mha_gen,
                              _attention_weights, _attention_value
  flexgen/flex_opt.py         SelfAttention.store_cache, OptLM.update_attention_mask
Prompts are left-padded (the tokenizer is loaded with padding_side="left");
the mask is `ids != pad_token_id`, extended with a column of ones every decode step.
Prefill combines it with `idx <= idx.view(s, 1)` and fills with the finite -1e4
(pad query rows become uniform, not NaN, and are never read).
Positions follow OPT: cumsum(mask) * mask + 1 (pads sit at position 1).
The cache is preallocated (prompt_len + gen_len - 1, b * n_head, head_dim),
prefill writes [0:s], decode step i writes slot prompt_len + i - 1 and reads [:src_s].
Checked against each prompt run alone, unpadded, with no cache.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)

VOCAB, H, N_HEAD, N_LAYER, FFN = 50, 32, 4, 2, 64
PAD = 1  # OPT's pad_token_id
MAX_POS = 64


def make_weights():
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2
    w = {"tok": r(VOCAB, H), "pos": r(MAX_POS + 2, H), "ln_f_w": 1 + r(H), "ln_f_b": r(H), "layers": []}
    for _ in range(N_LAYER):
        w["layers"].append(dict(
            w_q=r(H, H), b_q=r(H), w_k=r(H, H), b_k=r(H), w_v=r(H, H), b_v=r(H),
            w_out=r(H, H), b_out=r(H), w_ln=1 + r(H), b_ln=r(H),
            w_ln2=1 + r(H), b_ln2=r(H), w_fc1=r(FFN, H), b_fc1=r(FFN), w_fc2=r(H, FFN), b_fc2=r(H)))
    return w


W = make_weights()


# ---------------- FlexGen TorchDevice methods (plain tensors) ----------------
def gen_attention_mask(token_ids, pad_token_id):
    return token_ids.ne(pad_token_id)


def extend_attention_mask(attention_mask):
    bs = attention_mask.shape[0]
    return torch.concat((attention_mask, torch.ones((bs, 1), dtype=attention_mask.dtype)), dim=1)


def opt_input_embed(token_ids, mask, w_token, w_pos, pad_token_id):
    token_embed = F.embedding(token_ids, w_token, pad_token_id)
    positions = torch.cumsum(mask, dim=1).int() * mask + 1
    past_key_values_length = mask.shape[1] - token_ids.shape[1]
    positions = positions[:, past_key_values_length:]
    pos_embed = F.embedding(positions, w_pos)
    return token_embed + pos_embed


def mha(inputs, attention_mask, p, n_head):
    """Multi-head attention (prefill phase)."""
    b, s, h = inputs.shape
    head_dim = h // n_head
    scaling = head_dim ** -0.5
    hidden = F.layer_norm(inputs, (h,), weight=p["w_ln"], bias=p["b_ln"])
    q = F.linear(hidden, p["w_q"], bias=p["b_q"]) * scaling
    k = F.linear(hidden, p["w_k"], bias=p["b_k"])
    v = F.linear(hidden, p["w_v"], bias=p["b_v"])
    q = q.view(b, s, n_head, head_dim)
    k = k.view(b, s, n_head, head_dim)
    v = v.view(b, s, n_head, head_dim)
    q = q.permute(0, 2, 1, 3).reshape(b * n_head, s, head_dim)
    k = k.permute(0, 2, 3, 1).reshape(b * n_head, head_dim, s)
    v = v.permute(0, 2, 1, 3).reshape(b * n_head, s, head_dim)
    attn_weights = torch.bmm(q, k)
    idx = torch.arange(s)
    causal_mask = (idx <= idx.view(s, 1)).view(1, 1, s, s)
    mask = attention_mask.view(b, 1, 1, s) & causal_mask
    attn_weights = attn_weights.view(b, n_head, s, s)
    attn_weights = torch.where(mask, attn_weights, -1e4)
    attn_weights = attn_weights.view(b * n_head, s, s)
    attn_weights = F.softmax(attn_weights, dim=2)
    value = torch.bmm(attn_weights, v).view(b, n_head, s, head_dim)
    value = value.transpose(1, 2).reshape(b, s, h)
    value = F.linear(value, p["w_out"], bias=p["b_out"])
    value.add_(inputs)
    k = k.permute(2, 0, 1)  # (s, b * n_head, head_dim)
    v = v.permute(1, 0, 2)
    return value, k, v


def _attention_weights(q, k, mask, b, src_s, n_head):
    attn_weights = torch.bmm(q, k)
    mask = mask.view(b, 1, 1, src_s)
    attn_weights = attn_weights.view(b, n_head, 1, src_s)
    attn_weights = torch.where(mask, attn_weights, -1e4)
    attn_weights = attn_weights.view(b * n_head, 1, src_s)
    return F.softmax(attn_weights, dim=2)


def _attention_value(q, k, v, mask, b, src_s, tgt_s, n_head, head_dim):
    attn_weights = _attention_weights(q, k, mask, b, src_s, n_head)
    return torch.bmm(attn_weights, v).view(b, n_head, tgt_s, head_dim)


def mha_gen(inputs, attention_mask, p, n_head, k_cache, v_cache):
    """Multi-head attention (decoding phase), dense path."""
    b, tgt_s, h = inputs.shape
    src_s = attention_mask.shape[1]
    head_dim = h // n_head
    scaling = head_dim ** -0.5
    hidden = F.layer_norm(inputs, (h,), weight=p["w_ln"], bias=p["b_ln"])
    q = F.linear(hidden, p["w_q"], bias=p["b_q"]) * scaling
    k = F.linear(hidden, p["w_k"], bias=p["b_k"])
    v = F.linear(hidden, p["w_v"], bias=p["b_v"])
    q = q.view(b, tgt_s, n_head, head_dim)
    k = k.view(b, tgt_s, n_head, head_dim)
    v = v.view(b, tgt_s, n_head, head_dim)
    q = q.permute(0, 2, 1, 3).reshape(b * n_head, tgt_s, head_dim)
    k_new = k.permute(1, 0, 2, 3).reshape(tgt_s, b * n_head, head_dim)
    v_new = v.permute(1, 0, 2, 3).reshape(tgt_s, b * n_head, head_dim)
    k = k_cache[:src_s].clone()
    v = v_cache[:src_s].clone()
    k[src_s - 1:src_s] = k_new
    v[src_s - 1:src_s] = v_new
    k = k.permute(1, 2, 0).reshape(b * n_head, head_dim, src_s)
    v = v.permute(1, 0, 2).reshape(b * n_head, src_s, head_dim)
    value = _attention_value(q, k, v, attention_mask, b, src_s, tgt_s, n_head, head_dim)
    value = value.transpose(1, 2).reshape(b, tgt_s, h)
    value = F.linear(value, p["w_out"], bias=p["b_out"])
    value.add_(inputs)
    return value, k_new, v_new


def mlp(inputs, p):
    h = inputs.shape[-1]
    out = F.layer_norm(inputs, (h,), weight=p["w_ln2"], bias=p["b_ln2"])
    out = F.relu(F.linear(out, p["w_fc1"], bias=p["b_fc1"]))
    out = F.linear(out, p["w_fc2"], bias=p["b_fc2"])
    return out + inputs


def output_logits(hidden):
    hidden = F.layer_norm(hidden, (H,), weight=W["ln_f_w"], bias=W["ln_f_b"])
    return F.linear(hidden, W["tok"])[:, -1, :]


def store_cache(k_home, v_home, k_new, v_new, i, prompt_len, gen_len):
    """flex_opt.SelfAttention.store_cache."""
    if i == gen_len - 1:  # last token, no need to store cache
        return
    if i == 0:
        k_home[0:k_new.shape[0], 0:k_new.shape[1]] = k_new
        v_home[0:v_new.shape[0], 0:v_new.shape[1]] = v_new
    else:
        pos = prompt_len + i
        k_home[pos - k_new.shape[0]:pos, 0:k_new.shape[1]] = k_new
        v_home[pos - v_new.shape[0]:pos, 0:v_new.shape[1]] = v_new


def flexgen_generate(input_ids, gen_len):
    b, prompt_len = input_ids.shape
    head_dim = H // N_HEAD
    shape = (prompt_len + gen_len - 1, b * N_HEAD, head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(N_LAYER)]
    output_ids = torch.full((b, prompt_len + gen_len), PAD, dtype=torch.long)
    output_ids[:, :prompt_len] = input_ids
    all_logits = []
    mask = None
    for i in range(gen_len):
        if i == 0:
            mask = gen_attention_mask(output_ids[:, :prompt_len], PAD)
            ids = output_ids[:, :prompt_len]
        else:
            mask = extend_attention_mask(mask)
            ids = output_ids[:, prompt_len + i - 1:prompt_len + i]
        h = opt_input_embed(ids, mask, W["tok"], W["pos"], PAD)
        for j, p in enumerate(W["layers"]):
            k_home, v_home = caches[j]
            if i == 0:
                h, k_new, v_new = mha(h, mask, p, N_HEAD)
            else:
                h, k_new, v_new = mha_gen(h, mask, p, N_HEAD, k_home, v_home)
            store_cache(k_home, v_home, k_new, v_new, i, prompt_len, gen_len)
            h = mlp(h, p)
        logits = output_logits(h)
        all_logits.append(logits)
        output_ids[:, prompt_len + i] = logits.argmax(dim=1)
    return output_ids, torch.stack(all_logits, 1)


# ---------------- independent reference: one unpadded sequence, no cache ----------------
def reference_logits(seq):
    """Plain causal OPT forward over one unpadded sequence; logits at every position."""
    s = seq.shape[0]
    x = W["tok"][seq] + W["pos"][torch.arange(s) + 2]
    hd = H // N_HEAD
    for p in W["layers"]:
        hn = F.layer_norm(x, (H,), p["w_ln"], p["b_ln"])
        q = (hn @ p["w_q"].T + p["b_q"]).view(s, N_HEAD, hd)
        k = (hn @ p["w_k"].T + p["b_k"]).view(s, N_HEAD, hd)
        v = (hn @ p["w_v"].T + p["b_v"]).view(s, N_HEAD, hd)
        out = torch.zeros(s, N_HEAD, hd)
        for t in range(s):
            sc = torch.einsum("hd,jhd->hj", q[t], k[:t + 1]) / hd ** 0.5
            out[t] = torch.einsum("hj,jhd->hd", sc.softmax(-1), v[:t + 1])
        x = x + out.reshape(s, H) @ p["w_out"].T + p["b_out"]
        x = mlp(x, p)
    x = F.layer_norm(x, (H,), W["ln_f_w"], W["ln_f_b"])
    return x @ W["tok"].T


def main():
    prompts = [[5, 9, 12, 7, 3, 22], [8, 14, 30], [41, 2, 17, 6]]
    prompt_len = max(len(p) for p in prompts)
    gen_len = 5
    input_ids = torch.full((len(prompts), prompt_len), PAD, dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, prompt_len - len(p):] = torch.tensor(p)  # left padding
    with torch.no_grad():
        out_ids, logits = flexgen_generate(input_ids, gen_len)
        ok = True
        for r, p in enumerate(prompts):
            gen = out_ids[r, prompt_len:]
            full = torch.cat([torch.tensor(p), gen])
            ref = reference_logits(full)[len(p) - 1:len(p) - 1 + gen_len]
            err = (ref - logits[r]).abs().max().item()
            ok &= err < 1e-4
            print(f"row {r}: prompt len {len(p)}, generated {gen.tolist()}, max |diff| vs unpadded = {err:.2e}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
