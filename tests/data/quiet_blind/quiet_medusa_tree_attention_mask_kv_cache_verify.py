# Citation: FasterDecoding/Medusa medusa/model/utils.py @e2a5d20 (generate_medusa_buffers, generate_candidates,
#   tree_decoding, evaluate_posterior, update_inference_inputs) and medusa/model/modeling_llama_kv.py
#   (_make_causal_mask, _expand_mask, LlamaModel._prepare_decoder_attention_mask "[MODIFIED] add medusa mask").
# Masking: the candidate tree (root + topk continuations of 3 medusa heads) is verified in one forward over the KV
#   cache: the causal mask offset by the cache length, then inside the last tree_len x tree_len block every entry
#   where medusa_attn_mask == 0 is set to the mask min, so each node sees the cache, the root and its ancestors only;
#   position ids are prefix length + depth. Accepted KV rows are copied back contiguously. Greedy, so the result is
#   checked against plain greedy decoding of the base model.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
TOPK = 10  # topk for sparse tree


def pad_path(path, length, pad_value=-2):
    return path + [pad_value] * (length - len(path))


def generate_medusa_buffers(medusa_choices, device="cpu"):
    sorted_medusa_choices = sorted(medusa_choices, key=lambda x: (len(x), x))
    medusa_len = len(sorted_medusa_choices) + 1
    depth_counts = []
    prev_depth = 0
    for path in sorted_medusa_choices:
        depth = len(path)
        if depth != prev_depth:
            depth_counts.append(0)
        depth_counts[depth - 1] += 1
        prev_depth = depth
    medusa_attn_mask = torch.eye(medusa_len, medusa_len)
    medusa_attn_mask[:, 0] = 1
    start = 0
    for i in range(len(depth_counts)):
        for j in range(depth_counts[i]):
            cur_medusa_choice = sorted_medusa_choices[start + j]
            if len(cur_medusa_choice) == 1:
                continue
            ancestor_idx = []
            for c in range(len(cur_medusa_choice) - 1):
                ancestor_idx.append(sorted_medusa_choices.index(cur_medusa_choice[:c + 1]) + 1)
            medusa_attn_mask[j + start + 1, ancestor_idx] = 1
        start += depth_counts[i]
    medusa_tree_indices = torch.zeros(medusa_len, dtype=torch.long)
    start = 0
    for i in range(len(depth_counts)):
        for j in range(depth_counts[i]):
            cur_medusa_choice = sorted_medusa_choices[start + j]
            medusa_tree_indices[start + j + 1] = cur_medusa_choice[-1] + TOPK * i + 1
        start += depth_counts[i]
    medusa_position_ids = torch.zeros(medusa_len, dtype=torch.long)
    start = 0
    for i in range(len(depth_counts)):
        medusa_position_ids[start + 1: start + depth_counts[i] + 1] = i + 1
        start += depth_counts[i]
    retrieve_indices_nest = []
    retrieve_paths = []
    for i in range(len(sorted_medusa_choices)):
        cur_medusa_choice = sorted_medusa_choices[-i - 1]
        retrieve_indice = []
        if cur_medusa_choice in retrieve_paths:
            continue
        else:
            for c in range(len(cur_medusa_choice)):
                retrieve_indice.append(sorted_medusa_choices.index(cur_medusa_choice[:c + 1]))
                retrieve_paths.append(cur_medusa_choice[:c + 1])
        retrieve_indices_nest.append(retrieve_indice)
    max_length = max([len(x) for x in retrieve_indices_nest])
    retrieve_indices = [pad_path(path, max_length) for path in retrieve_indices_nest]
    retrieve_indices = torch.tensor(retrieve_indices, dtype=torch.long)
    retrieve_indices = retrieve_indices + 1
    retrieve_indices = torch.cat([torch.zeros((retrieve_indices.shape[0], 1), dtype=torch.long), retrieve_indices], dim=1)
    return {"medusa_attn_mask": medusa_attn_mask.unsqueeze(0).unsqueeze(0), "tree_indices": medusa_tree_indices,
            "medusa_position_ids": medusa_position_ids, "retrieve_indices": retrieve_indices}


def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, self.d, 2).float() / self.d))

    def forward(self, x, position_ids, attention_mask, kv, layer):
        b, L, _ = x.shape
        q, k, v = (p(x).view(b, L, self.h, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        q = q * emb.cos() + rotate_half(q) * emb.sin()
        k = k * emb.cos() + rotate_half(k) * emb.sin()
        cur = kv["len"]
        kv["data"][layer, 0, :, :, cur:cur + L] = k
        kv["data"][layer, 1, :, :, cur:cur + L] = v
        k = kv["data"][layer, 0, :, :, :cur + L]
        v = kv["data"][layer, 1, :, :, :cur + L]
        attn_weights = q @ k.transpose(2, 3) / math.sqrt(self.d)
        attn_weights = attn_weights + attention_mask
        attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
        attn_weights = F.softmax(attn_weights, dim=-1)
        out = (attn_weights @ v).transpose(1, 2).reshape(b, L, -1)
        return self.o_proj(out)


class LlamaModel(nn.Module):
    def __init__(self, vocab, dim, heads, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList([LlamaAttention(dim, heads) for _ in range(layers)])
        self.mlp = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim)) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(2 * layers + 1)])
        self.medusa_mask = None

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, inputs_embeds.dtype, device=inputs_embeds.device,
                                                        past_key_values_length=past_key_values_length)
        if attention_mask is not None:
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1])
            combined_attention_mask = (expanded_attn_mask if combined_attention_mask is None
                                       else expanded_attn_mask + combined_attention_mask)
        # [MODIFIED] add medusa mask
        if hasattr(self, "medusa_mask") and self.medusa_mask is not None:
            medusa_mask = self.medusa_mask
            medusa_len = medusa_mask.size(-1)
            combined_attention_mask[:, :, -medusa_len:, -medusa_len:][medusa_mask == 0] = combined_attention_mask.min()
        return combined_attention_mask

    def forward(self, input_ids, kv, position_ids=None):
        b, L = input_ids.shape
        past = kv["len"]
        if position_ids is None:
            position_ids = torch.arange(past, past + L)
        position_ids = position_ids.view(-1, L)
        x = self.embed_tokens(input_ids)
        attention_mask = torch.ones((b, past + L), dtype=torch.bool)
        attention_mask = self._prepare_decoder_attention_mask(attention_mask, (b, L), x, past)
        for i, (a, m) in enumerate(zip(self.attn, self.mlp)):
            x = x + a(self.norms[2 * i](x), position_ids, attention_mask, kv, i)
            x = x + m(self.norms[2 * i + 1](x))
        kv["len"] = past + L
        return self.norms[-1](x)


class ResBlock(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


VOCAB, DIM, HEADS, LAYERS, MEDUSA = 32, 32, 4, 2, 3
base = LlamaModel(VOCAB, DIM, HEADS, LAYERS)
lm_head = nn.Linear(DIM, VOCAB, bias=False)
medusa_head = nn.ModuleList([nn.Sequential(ResBlock(DIM), nn.Linear(DIM, VOCAB, bias=False)) for _ in range(MEDUSA)])


def new_kv(max_len=128):
    return {"data": torch.zeros(LAYERS, 2, 1, HEADS, max_len, DIM // HEADS), "len": 0}


def model(input_ids, kv, position_ids=None):
    h = base(input_ids, kv, position_ids)
    return torch.stack([mh(h) for mh in medusa_head], dim=0), lm_head(h)


medusa_choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]
buffers = generate_medusa_buffers(medusa_choices)


@torch.no_grad()
def medusa_generate(input_ids, max_steps=6):
    kv = new_kv()
    base.medusa_mask = None
    medusa_logits, logits = model(input_ids, kv)          # initialize_medusa
    base.medusa_mask = buffers["medusa_attn_mask"]
    accepted = []
    for _ in range(max_steps):
        # generate_candidates (greedy)
        candidates_logit = torch.argmax(logits[:, -1]).unsqueeze(0)
        candidates_medusa_logits = torch.topk(medusa_logits[:, 0, -1], TOPK, dim=-1).indices
        candidates = torch.cat([candidates_logit, candidates_medusa_logits.view(-1)], dim=-1)
        tree_candidates = candidates[buffers["tree_indices"]]
        tree_candidates_ext = torch.cat([tree_candidates, torch.zeros((1), dtype=torch.long)], dim=0)
        cart_candidates = tree_candidates_ext[buffers["retrieve_indices"]]
        tree_candidates = tree_candidates.unsqueeze(0)
        # tree_decoding
        position_ids = buffers["medusa_position_ids"] + input_ids.shape[1]
        tree_medusa_logits, tree_logits = model(tree_candidates, kv, position_ids=position_ids)
        logits = tree_logits[0, buffers["retrieve_indices"]]
        medusa_logits = tree_medusa_logits[:, 0, buffers["retrieve_indices"]]
        # evaluate_posterior (temperature 0)
        posterior_mask = (cart_candidates[:, 1:] == torch.argmax(logits[:, :-1], dim=-1)).int()
        candidates_accept_length = (torch.cumprod(posterior_mask, dim=1)).sum(dim=1)
        accept_length = candidates_accept_length.max()
        best_candidate = (torch.tensor(0) if accept_length == 0 else torch.argmax(candidates_accept_length))
        accepted.append(int(accept_length))
        # update_inference_inputs
        prev_input_len = input_ids.shape[1]
        select_indices = buffers["retrieve_indices"][best_candidate, : accept_length + 1] + prev_input_len
        input_ids = torch.cat([input_ids, cart_candidates[None, best_candidate, : accept_length + 1]], dim=-1)
        tgt = kv["data"][..., select_indices, :]
        kv["data"][..., prev_input_len: prev_input_len + tgt.shape[-2], :] = tgt
        kv["len"] = prev_input_len + tgt.shape[-2]
        logits = logits[None, best_candidate, accept_length: accept_length + 1]
        medusa_logits = medusa_logits[:, None, best_candidate, accept_length: accept_length + 1]
    base.medusa_mask = None
    return input_ids, accepted


@torch.no_grad()
def greedy(input_ids, n):
    kv = new_kv()
    _, logits = model(input_ids, kv)
    out = input_ids
    for _ in range(n):
        tok = logits[:, -1:].argmax(-1)
        out = torch.cat([out, tok], dim=1)
        _, logits = model(tok, kv)
    return out


# make medusa heads agree with the base model sometimes: tie head 0 projection to the lm_head
with torch.no_grad():
    for mh in medusa_head:
        mh[1].weight.copy_(lm_head.weight)
prompt = torch.randint(0, VOCAB, (1, 6))
out, acc = medusa_generate(prompt)
ref = greedy(prompt, out.shape[1] - prompt.shape[1])
assert torch.equal(out, ref), (out, ref)
print(f"medusa == greedy, accept lengths {acc}, tokens {out.shape[1] - prompt.shape[1]}")
