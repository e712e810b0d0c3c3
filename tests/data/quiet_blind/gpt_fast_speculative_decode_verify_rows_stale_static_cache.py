# Follows pytorch-labs/gpt-fast generate.py speculative_decode / model.py Transformer.forward (mask = causal_mask[None, None, input_pos]
# over the whole static KVCache, k_out[:, :, input_pos] = k): the target verifies k drafts in one multi-row call; rejected drafts stay
# in both caches as stale entries, hidden by the causal row and overwritten later. Verified rows vs a no-cache forward of the final text.
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
vocab, NH = 24, 4


class KVCache(torch.nn.Module):
    def __init__(self, max_seq_length, hd):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, NH, max_seq_length, hd))
        self.register_buffer("v_cache", torch.zeros(1, NH, max_seq_length, hd))

    def update(self, input_pos, k_val, v_val):
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class Transformer(torch.nn.Module):
    def __init__(self, dim, n_layer, block_size=64):
        super().__init__()
        self.dim, self.hd = dim, dim // NH
        self.tok = torch.nn.Embedding(vocab, dim)
        self.wqkv = torch.nn.ModuleList([torch.nn.Linear(dim, 3 * dim, bias=False) for _ in range(n_layer)])
        self.wo = torch.nn.ModuleList([torch.nn.Linear(dim, dim, bias=False) for _ in range(n_layer)])
        self.norms = torch.nn.ModuleList([torch.nn.RMSNorm(dim) for _ in range(n_layer)])
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.pos = torch.nn.Embedding(block_size, dim)
        self.kv_caches = None
        self.causal_mask = None

    def setup_caches(self, max_seq_length):
        self.kv_caches = [KVCache(max_seq_length, self.hd) for _ in self.wqkv]
        self.causal_mask = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool))

    def forward(self, idx, input_pos=None):
        B, S = idx.shape
        x = self.tok(idx) + self.pos(input_pos if input_pos is not None else torch.arange(S))
        mask = self.causal_mask[None, None, input_pos] if input_pos is not None else None
        for li, (wqkv, wo, norm) in enumerate(zip(self.wqkv, self.wo, self.norms)):
            q, k, v = wqkv(norm(x)).view(B, S, 3, NH, self.hd).permute(2, 0, 3, 1, 4)
            if input_pos is not None:
                k, v = self.kv_caches[li].update(input_pos, k, v)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
            else:  # reference path: no cache, plain causal
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + wo(y.transpose(1, 2).reshape(B, S, self.dim))
        return self.out(x)


def logits_to_probs(logits, temperature=1.0):
    return torch.softmax(logits / max(temperature, 1e-5), dim=-1)


def multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def sample(logits):
    probs = logits_to_probs(logits[0, -1])
    return multinomial_sample_one_no_sync(probs), probs


def decode_n_tokens(model, cur_token, input_pos, num_new_tokens):
    new_tokens, new_probs = [], []
    for _ in range(num_new_tokens):
        next_token, next_prob = sample(model(cur_token, input_pos))
        input_pos += 1
        new_tokens.append(next_token.clone())
        new_probs.append(next_prob.clone())
        cur_token = next_token.view(1, -1)
    return new_tokens, new_probs


verify_log = []


def speculative_decode(model, draft_model, cur_token, input_pos, speculate_k):
    input_pos = torch.tensor([input_pos])
    draft_tokens, draft_probs = decode_n_tokens(draft_model, cur_token.view(1, -1), input_pos.clone(), speculate_k)
    draft_tokens = torch.cat(draft_tokens)
    fed = torch.cat([cur_token.view(1), draft_tokens]).view(1, -1)
    target_logits = model(fed, torch.arange(input_pos.item(), input_pos.item() + speculate_k + 1))
    verify_log.append((input_pos.item(), fed[0].clone(), target_logits[0].clone()))
    target_probs = logits_to_probs(target_logits[0])
    draft_probs = torch.stack(draft_probs)
    p = draft_probs[torch.arange(0, speculate_k), draft_tokens]
    q = target_probs[torch.arange(0, speculate_k), draft_tokens]
    accept_draft_prob = torch.minimum(torch.ones(()), q[:speculate_k] / p)
    rejected_locations = (torch.rand_like(accept_draft_prob) > accept_draft_prob).nonzero()
    if rejected_locations.shape[0] == 0:
        last_token = multinomial_sample_one_no_sync(target_probs[-1])
        draft_model(draft_tokens[-1].view(1, -1), input_pos + speculate_k)  # fill last token into draft cache
        return torch.cat([draft_tokens, last_token])
    accept_length = rejected_locations[0].item()
    new = target_probs[accept_length] - draft_probs[accept_length]
    new = torch.where(new > 0, new, 0.0)
    new = new / new.sum()
    return torch.cat([draft_tokens[:accept_length], multinomial_sample_one_no_sync(new)])


model, draft_model = Transformer(32, 2).eval(), Transformer(16, 1).eval()
prompt = torch.tensor([3, 17, 5, 9, 1], dtype=torch.int)
T, max_new_tokens, speculate_k = prompt.numel(), 14, 3
T_new = T + max_new_tokens
for m in (model, draft_model):
    m.setup_caches(T_new + speculate_k + 1)

with torch.no_grad():
    seq = torch.empty(T_new, dtype=torch.int)
    seq[:T] = prompt
    input_pos = torch.arange(0, T)
    next_token, _ = sample(model(prompt.view(1, -1), input_pos))
    draft_model(prompt.view(1, -1), input_pos)
    seq[T] = next_token.squeeze()
    input_pos = T
    accept_counts = [0] * (speculate_k + 1)
    while input_pos < T_new - 1:
        cur_token = next_token.view(())
        next_tokens = speculative_decode(model, draft_model, cur_token, input_pos, speculate_k)
        accept_counts[len(next_tokens) - 1] += 1
        num_added = min(T_new - input_pos - 1, len(next_tokens))
        seq[input_pos + 1 : input_pos + num_added + 1] = next_tokens[:num_added]
        input_pos = input_pos + num_added
        next_token = next_tokens[-1]

    full = model(seq.view(1, -1).long())[0]  # no cache, no mask tensor: causal over the final text
    worst, checked, discarded = 0.0, 0, 0
    for pos0, fed, logits in verify_log:
        for j in range(fed.numel()):
            if pos0 + j < T_new and torch.equal(fed[: j + 1], seq[pos0 : pos0 + j + 1]):
                worst = max(worst, (logits[j] - full[pos0 + j]).abs().max().item())
                checked += 1
            else:
                discarded += 1  # row computed on a rejected draft: thrown away by speculative_decode
print(f"accept_counts {accept_counts}; verified rows checked {checked}, discarded rows {discarded}")
print(f"target verify rows over stale static cache vs no-cache forward of final sequence: max diff = {worst:.3e}")
assert checked > len(verify_log) and discarded > 0
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
