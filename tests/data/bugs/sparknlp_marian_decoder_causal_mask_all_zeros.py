# JohnSnowLabs/spark-nlp#2149: MarianTransformer fed the exported decoder a "decoder causal mask" filled with
# Float(0) at every greedy step, so decoder self-attention saw future positions; the fix puts -inf above the diagonal.
import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, H, V, PAD, EOS, START = 32, 4, 40, 0, 1, 0


def attention(q, k, v, bias):
    # the exported graph: softmax(q k^T / sqrt(d) + bias) v
    b, tq, _ = q.shape
    q = q.view(b, tq, H, -1).transpose(1, 2)
    k = k.view(b, k.shape[1], H, -1).transpose(1, 2)
    v = v.view(b, v.shape[1], H, -1).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5) + bias
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, tq, -1)


class MarianAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, kv, bias):
        return self.out_proj(attention(self.q_proj(x), self.k_proj(kv), self.v_proj(kv), bias))


class MarianDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.encoder_attn = MarianAttention(), MarianAttention()
        self.fc = nn.Sequential(nn.Linear(D, 64), nn.SiLU(), nn.Linear(64, D))
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x, causal_bias, enc, enc_bias):
        x = self.ln1(x + self.self_attn(x, x, causal_bias))
        x = self.ln2(x + self.encoder_attn(x, enc, enc_bias))
        return self.ln3(x + self.fc(x))


class MarianDecoderGraph(nn.Module):
    """Stands in for the exported TF decoder: inputs ids, encoder state, encoder mask, decoder causal mask."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.pos = nn.Embedding(64, D)
        self.layers = nn.ModuleList([MarianDecoderLayer() for _ in range(3)])
        self.lm_head = nn.Linear(D, V)

    def forward(self, decoder_input_ids, encoder_state, encoder_attention_mask, decoder_causal_mask):
        t = decoder_input_ids.shape[1]
        x = self.embed(decoder_input_ids) + self.pos(torch.arange(t))
        enc_bias = (1.0 - encoder_attention_mask[:, None, None, :].float()) * -1e9
        causal_bias = decoder_causal_mask[None, None, :, :]
        for layer in self.layers:
            x = layer(x, causal_bias, encoder_state, enc_bias)
        return self.lm_head(x)


def build_decoder_causal_mask(seq_len):
    # MarianTransformer.scala builds this matrix on the JVM side and feeds it to the graph
    if FIXED:
        mask = np.triu(np.full((seq_len, seq_len), -np.inf, dtype=np.float32), k=1)
    else:
        mask = np.full((seq_len, seq_len), 0.0, dtype=np.float32)
    return torch.from_numpy(mask)


@torch.no_grad()
def generate_no_beam_search(decoder, encoder_state, encoder_attention_mask, max_length=8):
    batch = encoder_state.shape[0]
    decoder_input_ids = torch.full((batch, 1), START, dtype=torch.long)
    step_logits = []
    for _ in range(max_length):
        decoder_causal_mask = build_decoder_causal_mask(decoder_input_ids.shape[1])
        logits = decoder(decoder_input_ids, encoder_state, encoder_attention_mask, decoder_causal_mask)
        next_token_logits = logits[:, -1, :]
        step_logits.append(logits)
        next_tokens = next_token_logits.argmax(-1, keepdim=True)
        decoder_input_ids = torch.cat([decoder_input_ids, next_tokens], dim=-1)
    return decoder_input_ids, step_logits


decoder = MarianDecoderGraph().eval()
encoder_state = torch.randn(2, 9, D)
encoder_attention_mask = torch.ones(2, 9, dtype=torch.long)
encoder_attention_mask[1, 6:] = 0

ids, step_logits = generate_no_beam_search(decoder, encoder_state, encoder_attention_mask)
# a causal decoder gives the same logits for a prefix at every later step; compare step 1 with the final step
drift = (step_logits[1][:, :2] - step_logits[-1][:, :2]).abs().max().item()
print("generated:", ids.tolist())
print(f"fixed={FIXED} prefix logits drift as the sequence grows: {drift:.3e}")
