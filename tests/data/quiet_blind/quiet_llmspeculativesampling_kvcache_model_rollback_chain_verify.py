"""Correct program (quiet batch quiet-r92a).

Citation: feifeibear/LLMSpeculativeSampling sampling/kvcache_model.py @1da8d0a0636accdd50acb06b8a2b35e2fe61ae8f
(KVCacheModel._forward_with_kvcache, _generate_with_kvcache, generate, rollback),
sampling/speculative_sampling.py @02d664be4f39a93bfaf3e80f9cb4e58499b43310 (speculative_sampling, the Google
version with the KV cache), sampling/utils.py @02d664be4f39a93bfaf3e80f9cb4e58499b43310 (norm_logits, sample, max_fn).

Chain speculative sampling, batch 1: the approx model drafts gamma tokens one at a time over its KV cache, the target
verifies them in one cached forward of every token it has not cached yet (gamma, or gamma + 1 after a full accept),
and both caches are rolled back to the accepted prefix. No attention mask is passed: the model's own causal mask
over (past + new) keys is the one in play. Ported to a tiny LlamaForCausalLM (transformers DynamicCache, so
rollback crops the cache instead of slicing a tuple of tensors). The self-check compares every probability row the
two caches kept against a full, cache-free forward of the final sequence and against a per-prefix run.
"""
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM


# ---- sampling/utils.py ----
def top_k_top_p_filter(logits, top_k=0, top_p=0.0):
    if top_k > 0:
        filter = torch.topk(logits, min(top_k, logits.size(-1)))[0]
        logits[logits < filter[:, [-1]]] = float('-inf')
    if top_p > 0.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        filter = cumulative_probs > top_p
        filter[..., 1:] = filter[..., :-1].clone()
        filter[..., 0] = 0
        indices_to_remove = filter.scatter(1, sorted_indices, filter)
        logits[indices_to_remove] = float('-inf')
    return logits


def norm_logits(logits, temperature, top_k, top_p):
    assert logits.dim() == 2
    logits = logits / temperature
    logits = top_k_top_p_filter(logits, top_k=top_k, top_p=top_p)
    probs = F.softmax(logits, dim=1)
    return probs


def sample(probs, num_samples=1, random_seed=None):
    if random_seed:
        torch.manual_seed(random_seed)
    idx_next = torch.multinomial(probs, num_samples=num_samples)
    return idx_next


def max_fn(x):
    x_max = torch.where(x > 0, x, torch.zeros_like(x))
    x_max_sum = torch.sum(x_max, dim=1, keepdim=True)
    return x_max / x_max_sum


# ---- sampling/kvcache_model.py ----
class KVCacheModel():
    def __init__(self, model, temperature=1, top_k=0, top_p=0, random_seed=None):
        self._model = model
        self._past_key_values = None
        self._prob_history = None
        self._temperature = temperature
        self._top_k = top_k
        self._top_p = top_p
        self._random_seed = random_seed

    def _forward_with_kvcache(self, input_ids):
        if self._past_key_values is None:
            assert self._prob_history is None
            # the first forward returns the prompt's logits
            outputs = self._model(input_ids)
            self._prob_history = outputs.logits
            for i in range(self._prob_history.shape[-2]):
                self._prob_history[:, i, :] = norm_logits(self._prob_history[:, i, :], self._temperature, self._top_k, self._top_p)
            self._past_key_values = outputs.past_key_values
            last_q = self._prob_history[:, -1, :]
        else:
            # return the last token's logits
            cached_len = self._past_key_values.get_seq_length()
            last_input_id = input_ids[:, cached_len:]
            if last_input_id.dim() == 1:
                last_input_id = torch.unsqueeze(last_input_id, 0)
            outputs = self._model(last_input_id, past_key_values=self._past_key_values, use_cache=True)
            not_cached_q = outputs.logits
            if not_cached_q.dim() == 2:
                not_cached_q = torch.unsqueeze(not_cached_q, 0)
            for i in range(not_cached_q.shape[-2]):
                not_cached_q[:, i, :] = norm_logits(not_cached_q[:, i, :], self._temperature, self._top_k, self._top_p)
            self._prob_history = torch.cat([self._prob_history, not_cached_q], dim=1)
            last_q = not_cached_q[:, -1, :]
            self._past_key_values = outputs.past_key_values
        return last_q

    def _generate_with_kvcache(self, prefix, gamma):
        x = prefix
        for _ in range(gamma):
            q = self._forward_with_kvcache(x)
            next_tok = sample(q, random_seed=self._random_seed)
            x = torch.cat((x, next_tok), dim=1)
        return x

    @torch.no_grad()
    def generate(self, input, gamma):
        output = self._generate_with_kvcache(input, gamma)
        return output

    @torch.no_grad()
    def rollback(self, end_pos):
        assert self._past_key_values is not None
        # k, v (batch, head, seq, hidden_dim) -> keep [:end_pos]
        to_remove = self._past_key_values.get_seq_length() - end_pos
        if to_remove > 0:
            self._past_key_values.crop(-to_remove)
        self._prob_history = self._prob_history[:, :end_pos, :]


# ---- sampling/speculative_sampling.py ----
@torch.no_grad()
def speculative_sampling(prefix, approx_model, target_model, max_len, gamma=4,
                         temperature=1, top_k=0, top_p=0, random_seed=None):
    seq_len = prefix.shape[1]
    T = seq_len + max_len
    assert prefix.shape[0] == 1, "input batch size must be 1"
    device = target_model.device

    approx_model_cache = KVCacheModel(approx_model, temperature, top_k, top_p, random_seed)
    target_model_cache = KVCacheModel(target_model, temperature, top_k, top_p, random_seed)

    torch.manual_seed(123)
    steps = []
    while prefix.shape[1] < T:
        prefix_len = prefix.shape[1]
        x = approx_model_cache.generate(prefix, gamma)
        _ = target_model_cache.generate(x, 1)

        n = prefix_len + gamma - 1
        for i in range(gamma):
            r = torch.rand(1, device=device)
            j = x[:, prefix_len + i]
            if r > (target_model_cache._prob_history[:, prefix_len + i - 1, j]) / (approx_model_cache._prob_history[:, prefix_len + i - 1, j]):
                # reject
                n = prefix_len + i - 1
                break

        assert n >= prefix_len - 1, f"n {n}, prefix_len {prefix_len}"
        prefix = x[:, :n + 1]
        approx_model_cache.rollback(n + 1)
        assert approx_model_cache._prob_history.shape[-2] <= n + 1

        if n < prefix_len + gamma - 1:
            # reject someone, sample from the pos n
            t = sample(max_fn(target_model_cache._prob_history[:, n, :] - approx_model_cache._prob_history[:, n, :]), random_seed=random_seed)
            target_model_cache.rollback(n + 1)
        else:
            # all approx model decoding accepted
            assert n == target_model_cache._prob_history.shape[1] - 1
            t = sample(target_model_cache._prob_history[:, -1, :], random_seed=random_seed)
            target_model_cache.rollback(n + 2)

        prefix = torch.cat((prefix, t), dim=1)
        steps.append(n + 1 - prefix_len)

    return prefix, approx_model_cache, target_model_cache, steps


def main():
    torch.manual_seed(0)
    vocab = 50

    def build(layers, hidden, seed):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return LlamaForCausalLM(cfg).eval()

    target = build(2, 64, 1)
    approx = build(1, 32, 2)
    temperature = 0.7

    prompt = torch.tensor([[1, 7, 19, 3, 44, 12, 8]])
    out, approx_cache, target_cache, steps = speculative_sampling(prompt, approx, target, max_len=24, gamma=4,
                                                                   temperature=temperature)
    assert out.shape[1] >= prompt.shape[1] + 24
    assert any(s < 4 for s in steps) and any(s == 4 for s in steps), steps  # both branches ran

    with torch.no_grad():
        for model, cache in ((target, target_cache), (approx, approx_cache)):
            hist = cache._prob_history
            L = hist.shape[1]
            assert L <= out.shape[1]
            # reference 1: one cache-free forward of the final sequence
            ref = F.softmax(model(out[:, :L], use_cache=False).logits / temperature, dim=-1)
            torch.testing.assert_close(hist, ref, atol=2e-5, rtol=1e-4)
            # reference 2: each row from a run of its own prefix alone
            for t in range(L):
                row = F.softmax(model(out[:, :t + 1], use_cache=False).logits[:, -1] / temperature, dim=-1)
                torch.testing.assert_close(hist[:, t], row, atol=2e-5, rtol=1e-4)
            assert cache._past_key_values.get_seq_length() <= out.shape[1]
    print("ok", out.shape[1], "tokens, accepted per step", steps)


if __name__ == "__main__":
    main()
