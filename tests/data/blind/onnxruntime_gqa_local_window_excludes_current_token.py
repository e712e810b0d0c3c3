# ONNX Runtime (microsoft/onnxruntime#25927): the CPU GroupQueryAttention kernel treated local_window_size as excluding
# the current token, so each query attended local_window_size + 1 keys, one more than the HF sliding window the ONNX
# model builder exports it from (the fix makes the window include the current token).
import sys
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, NUM_HEADS, KV_NUM_HEADS, LAYERS, VOCAB, SLIDING_WINDOW = 32, 4, 2, 2, 50, 4
HEAD_SIZE = HIDDEN // NUM_HEADS


def ComputeAttentionSoftmaxInplace(x):
    return torch.softmax(x, -1)


class GroupQueryAttention:
    """contrib_ops/cpu/bert/gqa_attention_base.h: ComputeAttentionProbs + ComputeVxAttentionScore (float, unpacked)."""

    def __init__(self, num_heads, kv_num_heads, local_window_size):
        self.num_heads_, self.kv_num_heads_, self.local_window_size_ = num_heads, kv_num_heads, local_window_size

    def __call__(self, Q, K, V, past_key, past_value, seqlens_k, is_prompt):
        # Q: [S, N, H], K/V: [S, N_kv, H], past: [N_kv, P, H]
        sequence_length = Q.shape[0]
        present_key = torch.cat([past_key, K.transpose(0, 1)], 1)
        present_value = torch.cat([past_value, V.transpose(0, 1)], 1)
        total_seqlen = int(seqlens_k) + 1
        past_seqlen = 0 if is_prompt else total_seqlen - sequence_length
        factor = self.num_heads_ // self.kv_num_heads_
        alpha = 1.0 / math.sqrt(HEAD_SIZE)
        out = torch.zeros(sequence_length, self.num_heads_, HEAD_SIZE)
        for i in range(self.num_heads_):
            k = present_key[i // factor]
            v = present_value[i // factor]
            output = alpha * Q[:, i] @ k[:total_seqlen].T  # S x T
            probs = torch.zeros_like(output)
            for seq in range(sequence_length):
                seq_causal_length = past_seqlen + seq + 1
                row = output[seq]
                if FIXED:
                    if self.local_window_size_ > 0 and seq_causal_length > self.local_window_size_:
                        start = seq_causal_length - self.local_window_size_
                        probs[seq, start:seq_causal_length] = ComputeAttentionSoftmaxInplace(row[start:seq_causal_length])
                    else:
                        probs[seq, :seq_causal_length] = ComputeAttentionSoftmaxInplace(row[:seq_causal_length])
                else:
                    if self.local_window_size_ > 0 and seq_causal_length > self.local_window_size_ + 1:
                        start = seq_causal_length - self.local_window_size_ - 1
                        probs[seq, start:start + self.local_window_size_ + 1] = ComputeAttentionSoftmaxInplace(
                            row[start:start + self.local_window_size_ + 1])
                    else:
                        probs[seq, :seq_causal_length] = ComputeAttentionSoftmaxInplace(row[:seq_causal_length])
                # set causal [seq_causal_length, total_seqlen) to 0.f (probs left at zero)
            out[:, i] = probs @ v[:total_seqlen]
        return out.reshape(sequence_length, HIDDEN), present_key, present_value


def rope(x, pos):  # rotate_half RoPE, x: [S, n, H]
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_SIZE, 2).float() / HEAD_SIZE))
    f = pos.float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)[:, None]
    x1, x2 = x[..., : HEAD_SIZE // 2], x[..., HEAD_SIZE // 2:]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, NUM_HEADS * HEAD_SIZE, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_NUM_HEADS * HEAD_SIZE, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_NUM_HEADS * HEAD_SIZE, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.n1, self.n2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False), nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def qkv(self, x, pos):
        h = self.n1(x)
        S = x.shape[0]
        q = rope(self.q_proj(h).view(S, NUM_HEADS, HEAD_SIZE), pos)
        k = rope(self.k_proj(h).view(S, KV_NUM_HEADS, HEAD_SIZE), pos)
        v = self.v_proj(h).view(S, KV_NUM_HEADS, HEAD_SIZE)
        return q, k, v

    def finish(self, x, attn):
        x = x + self.o_proj(attn)
        return x + self.down(F.silu(self.up(self.n2(x))))


class Model(nn.Module):  # what the ONNX model builder emits: GroupQueryAttention(local_window_size=sliding_window)
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.gqa = GroupQueryAttention(NUM_HEADS, KV_NUM_HEADS, local_window_size=SLIDING_WINDOW)

    def forward(self, ids, past, total_len, is_prompt):
        S = ids.shape[0]
        pos = torch.arange(total_len - S, total_len)
        x = self.emb(ids)
        presents = []
        for l, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, pos)
            attn, pk, pv = self.gqa(q, k, v, past[l][0], past[l][1], seqlens_k=total_len - 1, is_prompt=is_prompt)
            presents.append((pk, pv))
            x = layer.finish(x, attn)
        return self.lm_head(x), presents

    def reference(self, ids):  # HF sliding-window semantics: query i sees keys j with i - sliding_window < j <= i
        T = ids.shape[0]
        t = torch.arange(T)
        allowed = (t[None] <= t[:, None]) & (t[:, None] - t[None] < SLIDING_WINDOW)
        x = self.emb(ids)
        for layer in self.layers:
            q, k, v = layer.qkv(x, t)
            k = k.repeat_interleave(NUM_HEADS // KV_NUM_HEADS, 1)
            v = v.repeat_interleave(NUM_HEADS // KV_NUM_HEADS, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed)
            x = layer.finish(x, o.transpose(0, 1).reshape(T, HIDDEN))
        return self.lm_head(x)


model = Model().eval()
prompt = torch.randint(0, VOCAB, (9,))
with torch.no_grad():
    empty = [(torch.zeros(KV_NUM_HEADS, 0, HEAD_SIZE), torch.zeros(KV_NUM_HEADS, 0, HEAD_SIZE)) for _ in range(LAYERS)]
    logits, past = model(prompt, empty, prompt.shape[0], is_prompt=True)
    tokens, outs = prompt, [logits]
    for _ in range(5):  # onnxruntime-genai style greedy decode with past/present
        nxt = outs[-1][-1].argmax().view(1)
        tokens = torch.cat([tokens, nxt])
        logits, past = model(nxt, past, tokens.shape[0], is_prompt=False)
        outs.append(logits)
    runtime_logits = torch.cat(outs)
    ref = model.reference(tokens)
print(f"max |GQA-kernel logits (prefill + 5 decode steps) - HF sliding-window reference| = {(runtime_logits - ref).abs().max().item():.6f}")
