# ExecuTorch Qualcomm llama runner (pytorch/executorch#14411, commit 5fd66ee): KVManager::update_attention_mask for the
# sliding-window mask advanced its row pointer (cur_ptr += context_len) only in SHIFT_POINTER mode, so in SMART_MASK
# mode every row's update landed on row 0 and rows 1..ar_len-1 of the next prefill chunk never saw the cached tokens.
import sys
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CONTEXT_LEN, AR_LEN, SLIDING_WINDOW = 32, 8, 12
MAX_CACHE_LEN = CONTEXT_LEN - AR_LEN
DIM, HEADS, VOCAB = 32, 4, 50
HEAD_DIM = DIM // HEADS
LAYER_TYPES = ["sliding", "full"]  # HybridCache: sliding layers read window_attention_mask


# ---- examples/qualcomm/oss_scripts/llama/runner/kv_manager.cpp (SMART_MASK), transcribed on flat uint16 buffers ----
class KVManager:
    def init_attention_mask(self, attention_mask, attention_map, ar_len, n_past, sliding_window=None):
        neg_val, pos_val = 0, 65535
        attention_mask[: ar_len * CONTEXT_LEN] = neg_val
        past_ptr, new_ptr = 0, CONTEXT_LEN - ar_len
        for i in range(ar_len):
            if attention_map[i] < 0:
                attention_mask[past_ptr:past_ptr + n_past] = pos_val
            else:
                pidx = attention_map[i]
                parent = pidx * CONTEXT_LEN
                attention_mask[past_ptr:past_ptr + CONTEXT_LEN] = attention_mask[parent:parent + CONTEXT_LEN].clone()
            attention_mask[new_ptr + i] = pos_val  # Attend to itself
            if sliding_window is not None:  # mask by limitation of sliding_window
                avalible_context_len = sliding_window - (i + 1) - n_past
                if n_past > avalible_context_len:
                    attention_mask[past_ptr:past_ptr + n_past - avalible_context_len] = neg_val
            past_ptr += CONTEXT_LEN
            new_ptr += CONTEXT_LEN

    def update_attention_mask(self, attention_mask, ar_len, n_past, n_update, sliding_window=None):
        pos_val, neg_val = 65535, 0
        cur_ptr = n_past  # SMART_MASK
        if sliding_window is None:
            for i in range(ar_len):
                attention_mask[cur_ptr:cur_ptr + n_update] = pos_val
                cur_ptr += CONTEXT_LEN
            return
        for i in range(ar_len):
            attention_mask[cur_ptr:cur_ptr + n_update] = pos_val
            avalible_cache_len = sliding_window - (i + 1)
            # kv_updater_ == SMART_MASK
            if n_past + n_update > avalible_cache_len:
                start = cur_ptr - n_past
                attention_mask[start:start + n_past + n_update - avalible_cache_len] = neg_val
            if FIXED:
                cur_ptr += CONTEXT_LEN  # moved out of the SHIFT_POINTER branch by the fix
            # (before the fix the advance sat in the SHIFT_POINTER branch only)

    def update_cache(self, k_caches, v_caches, k_out, v_out, n_past, n_update):
        for l in range(len(k_caches)):
            k_caches[l][:, n_past:n_past + n_update] = k_out[l][:, :n_update]
            v_caches[l][:, n_past:n_past + n_update] = v_out[l][:, :n_update]


# ---- static llama graph: inputs tokens, input_pos, attention_mask, window_attention_mask, k/v caches ----
def rope(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    f = pos.float()[:, None] * inv[None]
    cos, sin = f.cos(), f.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.w1, self.w2 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x, pos, k_cache, v_cache, atten_mask):
        h = self.n1(x)
        S = x.shape[0]
        q = rope(self.wq(h).view(S, HEADS, HEAD_DIM), pos[:, None]).transpose(0, 1)
        k = rope(self.wk(h).view(S, HEADS, HEAD_DIM), pos[:, None]).transpose(0, 1)
        v = self.wv(h).view(S, HEADS, HEAD_DIM).transpose(0, 1)
        kk, vv = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
        attn = q @ kk.transpose(-1, -2) / math.sqrt(HEAD_DIM) + atten_mask
        y = torch.softmax(attn, -1) @ vv
        x = x + self.wo(y.transpose(0, 1).reshape(S, DIM))
        return x + self.w2(F.silu(self.w1(self.n2(x)))), k, v


class StaticLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Layer() for _ in LAYER_TYPES])
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, input_pos, attention_mask, window_attention_mask, k_caches, v_caches):
        def dequant(m):  # uint16 mask: 65535 -> 0.0 (attend), 0 -> -65535.0 (masked)
            return m.view(AR_LEN, CONTEXT_LEN).float() - 65535.0
        full, window = dequant(attention_mask), dequant(window_attention_mask)
        x = self.emb(tokens)
        ks, vs = [], []
        for l, layer in enumerate(self.layers):
            x, k, v = layer(x, input_pos, k_caches[l], v_caches[l], window if LAYER_TYPES[l] == "sliding" else full)
            ks.append(k)
            vs.append(v)
        return self.out(x), ks, vs


model = StaticLlama().eval()
kv = KVManager()
prompt = torch.randint(0, VOCAB, (3 * AR_LEN,))

with torch.no_grad():
    # PromptProcessor::prefill (SMART_MASK, HybridCache)
    attention_mask = torch.zeros(AR_LEN * CONTEXT_LEN, dtype=torch.int32)
    window_attention_mask = torch.zeros(AR_LEN * CONTEXT_LEN, dtype=torch.int32)
    k_caches = [torch.zeros(HEADS, MAX_CACHE_LEN, HEAD_DIM) for _ in LAYER_TYPES]
    v_caches = [torch.zeros(HEADS, MAX_CACHE_LEN, HEAD_DIM) for _ in LAYER_TYPES]
    pos, n_update = 0, AR_LEN
    attention_map = list(range(-1, AR_LEN - 1))  # std::iota(..., -1)
    kv.init_attention_mask(attention_mask, attention_map, AR_LEN, pos)
    kv.init_attention_mask(window_attention_mask, attention_map, AR_LEN, pos, SLIDING_WINDOW)
    all_logits = []
    for i in range(prompt.shape[0] // AR_LEN):
        toks = prompt[i * AR_LEN:(i + 1) * AR_LEN]
        logits, ks, vs = model(toks, torch.arange(pos, pos + AR_LEN), attention_mask, window_attention_mask, k_caches, v_caches)
        all_logits.append(logits)
        kv.update_cache(k_caches, v_caches, ks, vs, pos, n_update)
        kv.update_attention_mask(attention_mask, AR_LEN, pos, n_update)
        kv.update_attention_mask(window_attention_mask, AR_LEN, pos, n_update, SLIDING_WINDOW)
        pos += AR_LEN
    runner_logits = torch.cat(all_logits)

    # reference: whole prompt in one pass, causal mask for full layers, causal + window for sliding layers
    T = prompt.shape[0]
    t = torch.arange(T)
    causal = t[None, :] <= t[:, None]
    windowed = causal & (t[:, None] - t[None, :] < SLIDING_WINDOW)
    x = model.emb(prompt)
    empty = torch.zeros(HEADS, 0, HEAD_DIM)
    for l, layer in enumerate(model.layers):
        allowed = windowed if LAYER_TYPES[l] == "sliding" else causal
        x, _, _ = layer(x, t, empty, empty, torch.zeros(T, T).masked_fill(~allowed, float("-inf")))
    ref_logits = model.out(x)

print(f"max |chunked-prefill logits (AR-{AR_LEN} x 3) - single-pass windowed reference| = {(runner_logits - ref_logits).abs().max().item():.6f}")
