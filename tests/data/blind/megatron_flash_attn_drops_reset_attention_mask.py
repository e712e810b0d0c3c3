# bigcode-project/Megatron-LM#53 (commit 893aaa5e): with --use-flash-attn, ParallelAttention calls the causal flash
# kernel and never looks at the --reset-attention-mask document mask, so packed documents attend across <eod>.
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

EOD = 0


def validate_args(args):
    if FIXED and args.use_flash_attn:
        assert not args.reset_attention_mask, \
            "Flash Attention doesn't support arbitrary attention masks. Please turn off reset-attention-mask"
    return args


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Build masks and position id for left to right model."""
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length))).view(
        att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(data).clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= (i + 1 - prev_index)
                    prev_index = i + 1
    attention_mask = (attention_mask < 0.5)  # True = masked out
    return attention_mask, loss_mask, position_ids


class CoreAttention(nn.Module):
    def forward(self, q, k, v, attention_mask):
        scores = torch.matmul(q, k.transpose(-1, -2)) / q.size(-1) ** 0.5
        scores = scores.masked_fill(attention_mask, -10000.0)  # scale_mask_softmax
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v)


class FlashSelfAttention(nn.Module):
    """flash_attn_unpadded_func(q, k, v, cu_seqlens, ..., causal=True): one causal sequence per batch row."""
    def __init__(self, causal=True):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class ParallelAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.nh, self.use_flash_attn = args.num_attention_heads, args.use_flash_attn
        self.query_key_value = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)
        self.core_attention = CoreAttention()
        self.core_attention_flash = FlashSelfAttention(causal=True)

    def forward(self, hidden_states, attention_mask):
        b, s, h = hidden_states.shape
        q, k, v = self.query_key_value(hidden_states).view(b, s, 3, self.nh, h // self.nh).permute(2, 0, 3, 1, 4)
        if not self.use_flash_attn:
            context_layer = self.core_attention(q, k, v, attention_mask)
        else:
            context_layer = self.core_attention_flash(q, k, v)
        return self.dense(context_layer.transpose(1, 2).reshape(b, s, h))


class ParallelTransformerLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(args.hidden_size), nn.LayerNorm(args.hidden_size)
        self.self_attention = ParallelAttention(args)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, 4 * args.hidden_size), nn.GELU(),
                                 nn.Linear(4 * args.hidden_size, args.hidden_size))

    def forward(self, x, attention_mask):
        x = x + self.self_attention(self.input_layernorm(x), attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.padded_vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.layers = nn.ModuleList([ParallelTransformerLayer(args) for _ in range(args.num_layers)])
        self.final_layernorm = nn.LayerNorm(args.hidden_size)

    def forward(self, tokens, position_ids, attention_mask):
        x = self.word_embeddings(tokens) + self.position_embeddings(position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.final_layernorm(x) @ self.word_embeddings.weight.t()


args = SimpleNamespace(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64,
                       max_position_embeddings=32, use_flash_attn=True, reset_position_ids=True,
                       reset_attention_mask=True, eod_mask_loss=True)
try:
    args = validate_args(args)
except AssertionError as e:
    print("validate_args:", e, "-> training with the masked (non-flash) core attention")
    args.use_flash_attn = False

model = GPTModel(args).eval()
doc_a, doc_b = [5, 6, 7, 8, 9, 10], [21, 22, 23, 24, 25]
tokens = torch.tensor([doc_a + [EOD] + doc_b])  # a pretraining sample spanning two documents
attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
    tokens, EOD, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
with torch.no_grad():
    logits = model(tokens, position_ids, attention_mask)
    alone_ids = torch.tensor([doc_b])
    alone_mask, _, alone_pos = get_ltor_masks_and_position_ids(alone_ids, EOD, True, True, True)
    alone = model(alone_ids, alone_pos, alone_mask)
diff = (logits[0, len(doc_a) + 1:] - alone[0]).abs().max().item()
print(f"fixed={FIXED} use_flash_attn={args.use_flash_attn} doc B logits packed vs. alone: max diff {diff:.4f}")
