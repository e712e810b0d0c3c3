# huggingface/transformers#7374 (fixes #7371), Funnel Transformer, FunnelRelMultiheadAttention.forward.
# The tokenizer-style attention_mask (1 = real token, 0 = padding) was subtracted as if 1 meant "masked":
# attn_score - INF * attention_mask, so padded rows attend only to padding and real tokens are the ones masked out.
import sys

import torch
from transformers import FunnelConfig, FunnelModel
from transformers.models.funnel import modeling_funnel
from transformers.models.funnel.modeling_funnel import INF, FunnelRelMultiheadAttention

FIXED = "--fixed" in sys.argv


def forward(self, query, key, value, attention_inputs, output_attentions=False):
    # query has shape batch_size x seq_len x d_model
    # key and value have shapes batch_size x context_len x d_model
    position_embeds, token_type_mat, attention_mask, cls_mask = attention_inputs

    batch_size, seq_len, _ = query.shape
    context_len = key.shape[1]
    n_head, d_head = self.config.n_head, self.config.d_head

    # Shape batch_size x seq_len x n_head x d_head
    q_head = self.q_head(query).view(batch_size, seq_len, n_head, d_head)
    # Shapes batch_size x context_len x n_head x d_head
    k_head = self.k_head(key).view(batch_size, context_len, n_head, d_head)
    v_head = self.v_head(value).view(batch_size, context_len, n_head, d_head)

    q_head = q_head * self.scale
    # Shape n_head x d_head
    r_w_bias = self.r_w_bias * self.scale
    # Shapes batch_size x n_head x seq_len x context_len
    content_score = torch.einsum("bind,bjnd->bnij", q_head + r_w_bias, k_head)
    positional_attn = self.relative_positional_attention(position_embeds, q_head, context_len, cls_mask)
    token_type_attn = self.relative_token_type_attention(token_type_mat, q_head, cls_mask)

    # merge attention scores
    attn_score = content_score + positional_attn + token_type_attn

    # precision safe in case of mixed precision training
    dtype = attn_score.dtype
    attn_score = attn_score.float()
    # perform masking
    if attention_mask is not None:
        if FIXED:
            attn_score = attn_score - INF * (1 - attention_mask[:, None, None].float())
        else:
            attn_score = attn_score - INF * attention_mask[:, None, None].float()
    # attention probability
    attn_prob = torch.softmax(attn_score, dim=-1, dtype=dtype)
    attn_prob = self.attention_dropout(attn_prob)

    # attention output, shape batch_size x seq_len x n_head x d_head
    attn_vec = torch.einsum("bnij,bjnd->bind", attn_prob, v_head)

    # Shape shape batch_size x seq_len x d_model
    attn_out = self.post_proj(attn_vec.reshape(batch_size, seq_len, n_head * d_head))
    attn_out = self.hidden_dropout(attn_out)

    output = self.layer_norm(query + attn_out)
    return (output, attn_prob) if output_attentions else (output,)


FunnelRelMultiheadAttention.forward = forward

torch.manual_seed(0)
config = FunnelConfig(
    vocab_size=100,
    block_sizes=[1, 1],
    num_decoder_layers=1,
    d_model=32,
    n_head=4,
    d_head=8,
    d_inner=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)
model = FunnelModel(config).eval()

# a padded batch as a tokenizer gives it: row 0 has 12 real tokens + 4 pads, row 1 has 16 real tokens
lengths = [12, 16]
seq = 16
input_ids = torch.randint(5, 100, (2, seq))
input_ids[:, 0] = 2          # <cls>
attention_mask = torch.zeros(2, seq, dtype=torch.long)
for b, n in enumerate(lengths):
    attention_mask[b, :n] = 1
    input_ids[b, n:] = 0     # <pad>

with torch.no_grad():
    batched = model(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    # reference: each sequence alone, no padding (output of the first, full-length encoder block)
    worst = 0.0
    for b, n in enumerate(lengths):
        alone = model(input_ids[b : b + 1, :n], attention_mask=attention_mask[b : b + 1, :n],
                      output_hidden_states=True).hidden_states
        worst = max(worst, (batched[1][b, :n] - alone[1][0, :n]).abs().max().item())

print(f"fixed={FIXED}")
print(f"max |first-block output, padded batch - each sequence alone| over real tokens = {worst:.6f}")
