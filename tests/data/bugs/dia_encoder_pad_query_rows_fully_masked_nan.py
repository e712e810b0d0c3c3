# nari-labs/dia PR #252 (commit 998fc25) "fix: attention mask for MPS".
# create_attn_mask became p_mask_q & p_mask_k, so every padded text query row is fully masked; on the MPS path
# (custom_scaled_dot_product_attention, -inf fill + softmax) those rows turn NaN and the NaNs leak into real tokens via V.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, H, HD, V_SRC, N_LAYER = 32, 4, 8, 40, 2
USE_MPS_PATH = True  # the branch dia takes when Xq.device.type == "mps" (custom attention); reproduced on CPU


def create_attn_mask(q_padding_mask_1d, k_padding_mask_1d, device, is_causal=False):
    p_mask_q = q_padding_mask_1d.unsqueeze(2)  # [B, Tq, 1]
    p_mask_k = k_padding_mask_1d.unsqueeze(1)  # [B, 1, Tk]
    if FIXED:
        non_pad_attends_non_pad = p_mask_q & p_mask_k
        pad_attends_pad = (~p_mask_q) & (~p_mask_k)
        mask = non_pad_attends_non_pad | pad_attends_pad
    else:
        mask = p_mask_q & p_mask_k
    if is_causal:
        causal_mask_2d = torch.tril(torch.ones_like(mask[0], dtype=torch.bool, device=device))
        return (mask & causal_mask_2d).unsqueeze(1)
    return mask.unsqueeze(1)  # [B, 1, Tq, Tk]


def custom_scaled_dot_product_attention(query, key, value, attn_mask=None, scale=1.0, is_causal=False, num_gqa_groups=1):
    B, N_q, T, Hd = query.shape
    _, N_kv, S, _ = key.shape
    if num_gqa_groups > 1:
        key = key.repeat_interleave(num_gqa_groups, dim=1)
        value = value.repeat_interleave(num_gqa_groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if is_causal:
        causal_mask = torch.tril(torch.ones(T, S, dtype=torch.bool, device=query.device))
        scores = scores.masked_fill(~causal_mask, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    attn_weights = F.softmax(scores, dim=-1)
    return torch.matmul(attn_weights, value)


class RotaryEmbedding(nn.Module):
    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10000):
        super().__init__()
        half = embedding_dims // 2
        fraction = (2.0 * torch.arange(0, half)) / embedding_dims
        self.register_buffer("timescale", min_timescale * (max_timescale / min_timescale) ** fraction)

    def apply_rope(self, inputs, sin, cos):
        first_half, second_half = torch.chunk(inputs, 2, dim=-1)
        return torch.cat((first_half * cos - second_half * sin, second_half * cos + first_half * sin), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, H * HD, bias=False)
        self.k_proj = nn.Linear(D, H * HD, bias=False)
        self.v_proj = nn.Linear(D, H * HD, bias=False)
        self.o_proj = nn.Linear(H * HD, D, bias=False)
        self.rotary_emb = RotaryEmbedding(HD)
        self.num_gqa_groups = 1

    def forward(self, X, q_positions, kv_positions=None, attn_mask=None, cache=None, is_causal=False):
        B, T, _ = X.shape
        Xq = self.q_proj(X).view(B, T, H, HD)
        Xk = self.k_proj(X).view(B, T, H, HD)
        Xv = self.v_proj(X).view(B, T, H, HD)
        position = q_positions.unsqueeze(-1).unsqueeze(-1)
        sinusoid_inp = position / self.rotary_emb.timescale
        sin, cos = torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)
        Xq = self.rotary_emb.apply_rope(Xq, sin, cos).transpose(1, 2)
        attn_k = self.rotary_emb.apply_rope(Xk, sin, cos).transpose(1, 2)
        attn_v = Xv.transpose(1, 2)
        if USE_MPS_PATH:
            attn_output = custom_scaled_dot_product_attention(
                query=Xq, key=attn_k, value=attn_v, attn_mask=attn_mask if not is_causal else None,
                scale=1.0, is_causal=is_causal, num_gqa_groups=self.num_gqa_groups,
            )
        else:
            attn_output = F.scaled_dot_product_attention(
                Xq, attn_k, attn_v, attn_mask=attn_mask if not is_causal else None, scale=1.0, is_causal=is_causal
            )
        return self.o_proj(attn_output.transpose(1, 2).reshape(B, T, -1))


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_sa_norm, self.post_sa_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.self_attention = SelfAttention()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, state):
        x = x + self.self_attention(self.pre_sa_norm(x), q_positions=state.positions, kv_positions=state.positions,
                                    attn_mask=state.attn_mask)
        return x + self.mlp(self.post_sa_norm(x))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(V_SRC, D)
        self.layers = nn.ModuleList([EncoderLayer() for _ in range(N_LAYER)])
        self.norm = nn.RMSNorm(D)

    def forward(self, x_ids, state):
        x = self.embedding(x_ids)
        for layer in self.layers:
            x = layer(x, state)
        return self.norm(x)


class EncoderInferenceState:
    def __init__(self, max_position_embeddings, cond_src):
        self.positions = torch.arange(max_position_embeddings, dtype=torch.float32).unsqueeze(0)
        self.padding_mask = (cond_src.squeeze(1) != 0).repeat_interleave(2, dim=0)
        self.attn_mask = create_attn_mask(self.padding_mask, self.padding_mask, None, is_causal=False)


encoder = Encoder().eval()


@torch.no_grad()
def encode(text_tokens, text_length):
    """Dia._prepare_generation: pad text with 0, stack [uncond, cond], run the encoder."""
    B = len(text_tokens)
    src = torch.zeros((B, 1, text_length), dtype=torch.long)
    for i in range(B):
        src[i, 0, : len(text_tokens[i])] = text_tokens[i]
    text = src.squeeze(1)
    enc_input = torch.stack([torch.zeros_like(text), text], dim=1).view(2 * B, -1)
    state = EncoderInferenceState(text_length, src)
    return encoder(enc_input, state).view(B, 2, text_length, D)[:, 1]  # conditional rows


texts = [torch.randint(1, V_SRC, (6,)), torch.randint(1, V_SRC, (12,))]
batched = encode(texts, text_length=16)
nan_count, diff = 0, 0.0
for i, t in enumerate(texts):
    real = batched[i, : len(t)]
    nan_count += int(torch.isnan(real).sum())
    alone = encode([t], text_length=len(t))[0]
    diff = max(diff, (torch.nan_to_num(real, nan=1e4) - alone).abs().max().item())
print(f"NaN entries in real-token encoder outputs: {nan_count}; max |padded - unpadded| (NaN->1e4): {diff:.6f}")
