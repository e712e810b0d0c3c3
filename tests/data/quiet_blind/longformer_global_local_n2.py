"""Longformer QA encoder: sliding-window local attention plus global attention on the question tokens.

Follows allenai/longformer longformer/longformer.py (LongformerConfig with attention_window and
attention_mode 'n2', the dense reference mode; attention_mask values: 0 = padding, 1 = local, 2 = global)
and huggingface/transformers models/longformer/modeling_longformer.py (_compute_global_attention_mask:
global on question tokens up to the first </s>). Mask meant: a local token sees keys within
attention_window // 2 on each side (bidirectional) plus all global tokens; a global token sees every
non-padding key; padding keys are never seen. Dense q @ k.T with -10000.0 added, then softmax.
"""
import torch
from torch import nn


class LongformerConfig:
    def __init__(self, hidden_size=32, num_attention_heads=4, attention_window=6, attention_mode="n2",
                 sep_token_id=2, pad_token_id=1, vocab_size=60):
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.attention_window = attention_window
        self.attention_mode = attention_mode
        self.sep_token_id = sep_token_id
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size


def _compute_global_attention_mask(input_ids, sep_token_id):
    """Global attention on every token before the first </s> (the question, with <s>)."""
    question_end_index = (input_ids == sep_token_id).int().argmax(dim=1)
    attention_mask = torch.arange(input_ids.shape[1])[None, :] < question_end_index[:, None]
    return attention_mask.long()


class LongformerSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.one_sided_attention_window_size = config.attention_window // 2
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask):
        bsz, seq_len, _ = hidden_states.shape
        is_index_masked = attention_mask == 0
        is_index_global_attn = attention_mask == 2
        w = self.one_sided_attention_window_size
        i = torch.arange(seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        local = (j - i).abs() <= w
        allowed = local[None] | is_index_global_attn[:, None, :] | is_index_global_attn[:, :, None]
        allowed = allowed & ~is_index_masked[:, None, :]

        def heads(x):
            return x.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        q = heads(self.query(hidden_states)) / self.head_dim ** 0.5
        k, v = heads(self.key(hidden_states)), heads(self.value(hidden_states))
        attn_weights = q @ k.transpose(-1, -2)
        attn_weights = attn_weights + (~allowed[:, None]).float() * -10000.0
        attn_probs = torch.softmax(attn_weights, dim=-1)
        return (attn_probs @ v).transpose(1, 2).reshape(bsz, seq_len, -1)


def main():
    torch.manual_seed(0)
    config = LongformerConfig()
    # <s> question </s></s> context </s> <pad>...
    q1, c1, q2, c2, seq_len = 4, 20, 3, 14, 28
    input_ids = torch.full((2, seq_len), config.pad_token_id)
    for b, (q, c) in enumerate(((q1, c1), (q2, c2))):
        ids = [0] + list(range(10, 10 + q)) + [2, 2] + list(range(20, 20 + c)) + [2]
        input_ids[b, :len(ids)] = torch.tensor(ids)
    attention_mask = (input_ids != config.pad_token_id).long()
    attention_mask = attention_mask * (_compute_global_attention_mask(input_ids, config.sep_token_id) + 1)

    embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
    with torch.no_grad():
        out = LongformerSelfAttention(config)(embeddings(input_ids), attention_mask)
    print("out", tuple(out.shape), "global per row", (attention_mask == 2).sum(1).tolist())


if __name__ == "__main__":
    main()
