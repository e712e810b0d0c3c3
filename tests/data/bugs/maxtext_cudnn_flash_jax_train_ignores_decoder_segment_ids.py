# AI-Hypercomputer/maxtext#4476: AttentionOp.cudnn_jax_flash_attention receives decoder_segment_ids, but its
# training branch calls the cuDNN dot_product_attention with mask_type=CAUSAL only, so with packing=true every
# packed segment attends to the segments packed before it in the same row. (JAX upstream; ported to torch.)
import enum
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
MODEL_MODE_TRAIN, MODEL_MODE_AUTOREGRESSIVE = "train", "autoregressive"


class MaskType(enum.Enum):
    NO_MASK = 0
    PADDING = 1
    CAUSAL = 2


def dot_product_attention(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None,
                          mask_type=MaskType.NO_MASK, scale=1.0, dropout_rate=0.0, qkv_layout="BTNH",
                          return_residual=False):
    """CPU stand-in for jax._src.cudnn.fused_attention_stablehlo.dot_product_attention (BTNH layout)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> B N T H
    T, S = q.shape[2], k.shape[2]
    allowed = torch.ones(1, 1, T, S, dtype=torch.bool)
    if mask_type == MaskType.CAUSAL:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    logits = (q @ k.transpose(-1, -2)) * scale
    lse = torch.logsumexp(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    out = out.transpose(1, 2)
    return (out, lse) if return_residual else out


class AttentionOp(nn.Module):
    def __init__(self, dropout_rate=0.0):
        super().__init__()
        self.dropout_rate = dropout_rate

    def generate_attention_mask(self, decoder_segment_ids):
        seg_kv = decoder_segment_ids
        mask = (decoder_segment_ids[:, :, None] == seg_kv[:, None, :]) & (seg_kv[:, None, :] >= 0)
        return mask[:, None, :, :]

    def cudnn_jax_flash_attention(self, query, key, value, decoder_segment_ids, model_mode=MODEL_MODE_TRAIN):
        """CUDNN Flash Attention with JAX SDPA API."""
        if model_mode == MODEL_MODE_AUTOREGRESSIVE:
            lengths = decoder_segment_ids.sum(-1)
            output, lse = dot_product_attention(query, key, value, q_seqlen=lengths, kv_seqlen=lengths,
                                                mask_type=MaskType.PADDING, scale=1.0,
                                                dropout_rate=self.dropout_rate, qkv_layout="BTNH",
                                                return_residual=True)
        elif FIXED and decoder_segment_ids is not None:
            output, lse = dot_product_attention(query, key, value,
                                                mask=self.generate_attention_mask(decoder_segment_ids),
                                                mask_type=MaskType.CAUSAL, scale=1.0,
                                                dropout_rate=self.dropout_rate, qkv_layout="BTNH",
                                                return_residual=True)
        else:
            output, lse = dot_product_attention(query, key, value, mask_type=MaskType.CAUSAL, scale=1.0,
                                                dropout_rate=self.dropout_rate, qkv_layout="BTNH",
                                                return_residual=True)
        return output, lse


class Attention(nn.Module):
    def __init__(self, emb_dim=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, emb_dim // num_heads
        self.query = nn.Linear(emb_dim, emb_dim, bias=False)
        self.key = nn.Linear(emb_dim, emb_dim, bias=False)
        self.value = nn.Linear(emb_dim, emb_dim, bias=False)
        self.out = nn.Linear(emb_dim, emb_dim, bias=False)
        self.attention_op = AttentionOp()

    def forward(self, inputs_q, decoder_segment_ids, model_mode=MODEL_MODE_TRAIN):
        b, t, _ = inputs_q.shape
        shape = (b, t, self.num_heads, self.head_dim)
        query = self.query(inputs_q).view(shape) / self.head_dim ** 0.5  # query is pre-scaled, scale=1.0 below
        key, value = self.key(inputs_q).view(shape), self.value(inputs_q).view(shape)
        out, _ = self.attention_op.cudnn_jax_flash_attention(query, key, value, decoder_segment_ids, model_mode)
        return self.out(out.reshape(b, t, -1))


class Decoder(nn.Module):
    def __init__(self, vocab=64, emb_dim=32, num_layers=2):
        super().__init__()
        self.token_embedder = nn.Embedding(vocab, emb_dim)
        self.pos_embedder = nn.Embedding(32, emb_dim)
        self.layers = nn.ModuleList(Attention(emb_dim) for _ in range(num_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(emb_dim) for _ in range(num_layers))
        self.logits_dense = nn.Linear(emb_dim, vocab, bias=False)

    def forward(self, decoder_input_tokens, decoder_segment_ids, decoder_positions):
        y = self.token_embedder(decoder_input_tokens) + self.pos_embedder(decoder_positions)
        for layer, norm in zip(self.layers, self.norms):
            y = y + layer(norm(y), decoder_segment_ids)
        return self.logits_dense(y)


model = Decoder().eval()
# packing=true: two examples share a row; inputs_segmentation / inputs_position come from the packer
seg_lens = [7, 5]
tokens = torch.randint(1, 64, (1, sum(seg_lens)))
decoder_segment_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(seg_lens)])[None]
decoder_positions = torch.cat([torch.arange(n) for n in seg_lens])[None]
with torch.no_grad():
    logits = model(tokens, decoder_segment_ids, decoder_positions)
    alone = model(tokens[:, 7:], torch.ones(1, 5, dtype=torch.long), torch.arange(5)[None])
diff = (logits[0, 7:] - alone[0]).abs().max().item()
print(f"fixed={FIXED} max |packed - alone| logits of segment 2: {diff:.4f}")
