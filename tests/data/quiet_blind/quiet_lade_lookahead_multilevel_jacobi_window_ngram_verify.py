"""Lookahead decoding (hao-ai-lab/LookaheadDecoding, `lade`) one decode step, ported small.

Follows lade/models/llama.py (j_make_causal_mask_multilevel, j_prepare_decoder_attention_mask,
LlamaModeljforward, jforward_multilevel). A single sequence: a prompt is prefilled into the KV
cache with the plain causal mask (is_prefill branch); then one lookahead step feeds, in one pass,

    [cur] + past_tokens[0] (W tokens) + past_tokens[1] (W+1 tokens) + guess n-grams

The 2-D lookahead window (Jacobi trajectories) and the n-gram verification branch share one
additive float mask (finfo.min fill) with the cache columns all visible, and custom position ids.
Each query must see exactly one consistent chain of tokens at consecutive positions; checked by
running every such chain alone, from scratch, with a plain causal mask.
"""
import math

import torch
import torch.nn as nn

torch.manual_seed(0)
DTYPE = torch.float32
V, D, NH, NL = 61, 32, 4, 2
HD = D // NH


# ---------------------------------------------------------------- tiny Llama (HF eager style)
class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim, base=10000.0, max_pos=128):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_pos).float()
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, position_ids):
        return self.cos_cached[position_ids], self.sin_cached[position_ids]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.rotary = Rotary(HD)

    def forward(self, x, attention_mask, position_ids, past):
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, NH, HD).transpose(1, 2)
        k = self.k_proj(x).view(b, q_len, NH, HD).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, NH, HD).transpose(1, 2)
        cos, sin = self.rotary(position_ids)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HD)
        if attention_mask is not None:
            assert attention_mask.size() == (b, 1, q_len, k.shape[2])
            w = w + attention_mask
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(w, v).transpose(1, 2).reshape(b, q_len, D)
        return self.o_proj(o), present


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(D), RMSNorm(D)
        self.attn = Attention()
        self.gate, self.up, self.down = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)

    def forward(self, x, mask, pos, past):
        h, present = self.attn(self.ln1(x), mask, pos, past)
        x = x + h
        x = x + self.down(nn.functional.silu(self.gate(self.ln2(x))) * self.up(self.ln2(x)))
        return x, present


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Layer() for _ in range(NL)])
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def run(self, input_ids, mask4d, position_ids, past_key_values=None):
        x = self.embed_tokens(input_ids)
        new_past = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, mask4d, position_ids, None if past_key_values is None else past_key_values[i])
            new_past.append(present)
        return self.lm_head(self.norm(x)).float(), new_past


# ---------------------------------------------------------------- lade mask code
def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def j_make_causal_mask_multilevel(level_sizes, is_prefill, WINDOW_SIZE, guess, guess_size, not_seq, continue_all,
                                  input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)

    if is_prefill:
        mask_cond = torch.arange(mask.size(-1), device=device)
        mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
        mask = mask.to(dtype)
        assert past_key_values_length == 0
        assert guess is None
        return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)

    tiny_mask_size = level_sizes[0] + 1
    mask_cond = torch.arange(tiny_mask_size, device=device)
    hm = mask_cond < (mask_cond + 1).view(tiny_mask_size, 1)

    if guess is not None:
        mask[:, 0] = 0
        lguess = len(guess)
        if guess_size == 2:
            small_m = torch.tensor([0, torch.finfo(dtype).min]).repeat(lguess // 2)[:-1]
            mask[-lguess:, -lguess:] = mask[-lguess:, -lguess:].fill_diagonal_(0).diagonal_scatter(small_m, -1)
        else:
            mask[-lguess:, -lguess:] = mask[-lguess:, -lguess:].fill_diagonal_(0)
            for i in range(guess_size - 1):
                small_l = [0] * (guess_size - i - 1) + [torch.finfo(dtype).min] * (i + 1)
                small_m = torch.tensor(small_l).repeat(lguess // guess_size)[:-1 - i]
                mask[-lguess:, -lguess:] = mask[-lguess:, -lguess:].diagonal_scatter(small_m, -1 - i)
    else:
        assert tgt_len == sum(level_sizes) + 1

    for ll in range(len(level_sizes)):
        if ll > 0:
            assert level_sizes[ll] == tiny_mask_size
        mask[tiny_mask_size * ll:tiny_mask_size * (ll + 1), :tiny_mask_size].masked_fill_(hm, 0)
        for row in range(1, ll + 1):
            mask[tiny_mask_size * ll:tiny_mask_size * (ll + 1), tiny_mask_size * row:tiny_mask_size * (row + 1)].fill_diagonal_(0)

    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def j_prepare_decoder_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length, others):
    WINDOW_SIZE, is_prefill, guess, guess_size, not_seq, continue_all, level_sizes = others
    combined_attention_mask = None
    if input_shape[-1] > 1:
        combined_attention_mask = j_make_causal_mask_multilevel(
            level_sizes, is_prefill, WINDOW_SIZE, guess, guess_size, not_seq, continue_all,
            input_shape, inputs_embeds.dtype, device=inputs_embeds.device,
            past_key_values_length=past_key_values_length)
    if attention_mask is not None:
        expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1])
        combined_attention_mask = (expanded_attn_mask if combined_attention_mask is None
                                   else expanded_attn_mask + combined_attention_mask)
    return combined_attention_mask


def LlamaModeljforward(model, input_ids, attention_mask, position_ids, past_key_values, WINDOWS_SIZE, is_prefill,
                       level_sizes, guess_size, not_seq, guess):
    batch_size, seq_length = input_ids.shape
    past_key_values_length = 0 if past_key_values is None else past_key_values[0][0].shape[2]
    position_ids = position_ids.view(-1, seq_length).long()
    inputs_embeds = model.embed_tokens.weight[:1].new_zeros(batch_size, seq_length, D)  # dtype/device carrier
    mask4d = j_prepare_decoder_attention_mask(
        attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length,
        (WINDOWS_SIZE, is_prefill, guess, guess_size, not_seq, False, level_sizes))
    return model.run(input_ids, mask4d, position_ids, past_key_values)


def jforward_multilevel(model, input_ids, past_tokens, guess_tokens, guess_size, level, fill_level, WINDOWS_SIZE,
                        attention_mask, position_ids, past_key_values):
    assert input_ids.size(0) == 1, " single batch only "
    assert level == len(past_tokens) + 1
    assert guess_size == level - 1
    prefill_size = input_ids.size(1)
    level_sizes = []
    lst_id = position_ids[0][-1].item()
    all_past, ids_list, attn_size = [], [], 0
    for ll in range(fill_level + 1):
        all_past += past_tokens[ll]
        attn_size += len(past_tokens[ll])
        level_sizes.append(len(past_tokens[ll]))
        if ll == 0:
            ids_list += list(range(lst_id + 1, lst_id + 1 + len(past_tokens[ll])))
        else:
            ids_list += list(range(lst_id + ll, lst_id + ll + len(past_tokens[ll])))
    if guess_tokens is not None:
        input_ids = torch.cat((input_ids, torch.tensor(all_past + guess_tokens, dtype=input_ids.dtype).unsqueeze(0)), dim=1)
        guess_ids = list(range(lst_id + 1, lst_id + 1 + guess_size)) * (len(guess_tokens) // guess_size)
        position_ids = torch.cat((position_ids, torch.tensor(ids_list + guess_ids, dtype=input_ids.dtype).unsqueeze(0)), dim=1)
        attention_mask = torch.cat((attention_mask, torch.ones(1, attn_size + len(guess_tokens), dtype=input_ids.dtype)), dim=1)
    else:
        input_ids = torch.cat((input_ids, torch.tensor(all_past, dtype=input_ids.dtype).unsqueeze(0)), dim=1)
        position_ids = torch.cat((position_ids, torch.tensor(ids_list, dtype=input_ids.dtype).unsqueeze(0)), dim=1)
        attention_mask = torch.cat((attention_mask, torch.ones(1, attn_size, dtype=input_ids.dtype)), dim=1)
    logits, new_past = LlamaModeljforward(model, input_ids, attention_mask, position_ids, past_key_values,
                                          WINDOWS_SIZE, past_tokens[1] is None, level_sizes, guess_size, False,
                                          guess_tokens)
    lguess = 0 if guess_tokens is None else len(guess_tokens)
    out_logits = logits[:, prefill_size - 1, :]
    if lguess > 0:
        inp_logits = logits[:, -len(past_tokens[fill_level]) - lguess:-lguess, :]
        guess_logits = logits[:, -lguess:, :]
    else:
        inp_logits, guess_logits = logits[:, -len(past_tokens[fill_level]):, :], None
    return logits, out_logits, inp_logits, guess_logits, new_past, input_ids, position_ids


# ---------------------------------------------------------------- run
@torch.no_grad()
def main():
    model = TinyLlama().eval()
    W, LEVEL, GUESS = 3, 3, 2  # window, n-gram level, guess set size
    prompt = torch.randint(3, V, (1, 6))
    P = prompt.shape[1]

    # prefill (is_prefill: plain causal mask, no past)
    am = torch.ones(1, P, dtype=torch.long)
    pos = torch.arange(P)[None]
    logits_pf, past = LlamaModeljforward(model, prompt, am, pos, None, W, True, [], GUESS, False, None)
    cur = int(logits_pf[0, -1].argmax())

    # one lookahead step: window levels 0..LEVEL-2 filled, plus GUESS candidate n-grams
    g = torch.Generator().manual_seed(1)
    past_tokens = [torch.randint(3, V, (W,), generator=g).tolist(),
                   torch.randint(3, V, (W + 1,), generator=g).tolist()]
    guess_tokens = torch.randint(3, V, (GUESS * (LEVEL - 1),), generator=g).tolist()
    step_mask = torch.ones(1, P + 1, dtype=torch.long)
    logits, out_logits, inp_logits, guess_logits, new_past, ids, posids = jforward_multilevel(
        model, torch.tensor([[cur]]), past_tokens, guess_tokens, LEVEL - 1, LEVEL, LEVEL - 2, W,
        step_mask, torch.tensor([[P]]), past)
    assert new_past[0][0].shape[2] == P + ids.shape[1]

    # independent reference: every query's own chain, run from scratch with a causal mask
    def alone(chain):
        seq = torch.cat([prompt[0], torch.tensor(chain)])[None]
        n = seq.shape[1]
        causal = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lg, _ = model.run(seq, causal[None, None], torch.arange(n)[None])
        return lg[0, -1]

    chains = [[cur]]
    for j in range(W):                         # level 0: cur, p0[0..j]
        chains.append([cur] + past_tokens[0][:j + 1])
    for j in range(W + 1):                     # level 1 token j: cur, p0[:j], p1[j]
        chains.append([cur] + past_tokens[0][:j] + [past_tokens[1][j]])
    for gi in range(GUESS):                    # guess n-gram gi: cur, its own prefix
        ng = guess_tokens[gi * (LEVEL - 1):(gi + 1) * (LEVEL - 1)]
        for k in range(LEVEL - 1):
            chains.append([cur] + ng[:k + 1])
    assert len(chains) == ids.shape[1]
    worst = 0.0
    for qi, chain in enumerate(chains):
        assert posids[0, qi].item() == P + len(chain) - 1
        worst = max(worst, (alone(chain) - logits[0, qi]).abs().max().item())
    ok_logits = worst < 1e-4
    ok_slices = torch.equal(out_logits, logits[:, 0]) and inp_logits.shape[1] == W + 1 and guess_logits.shape[1] == 4

    # lade's n-gram verification: accept guess tokens while they match the greedy outputs
    best = []
    for gi in range(GUESS):
        ng = guess_tokens[gi * (LEVEL - 1):(gi + 1) * (LEVEL - 1)]
        hits = [cur]
        acc = [int(out_logits[0].argmax())]
        for k in range(LEVEL - 1):
            if ng[k] != acc[-1]:
                break
            acc.append(int(guess_logits[0, gi * (LEVEL - 1) + k].argmax()))
        best.append(acc)
    greedy = [cur]
    for _ in range(3):
        greedy.append(int(alone(greedy).argmax()))
    ok_accept = all(a == greedy[1:1 + len(a)] for a in best)

    match = ok_logits and ok_slices and ok_accept
    print(f"lade lookahead step: max |logit diff| vs per-chain reference = {worst:.2e}; matches reference: {match}")
    assert match


if __name__ == "__main__":
    main()
