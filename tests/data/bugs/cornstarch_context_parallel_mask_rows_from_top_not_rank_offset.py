"""cornstarch-org/Cornstarch#38 (fixes the context parallelism of #37): with Llama3-style context
parallelism each rank attended with the *top* rows of the full attention mask instead of the rows
of its own query shard, so ranks > 0 used another shard's mask rows."""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CP_SIZE = 4
SEQ_LEN = 32
NUM_HEADS = 2
HEAD_DIM = 8
HIDDEN = NUM_HEADS * HEAD_DIM


def build_multimodal_attention_mask(seq_len, image_spans, device=None):
    """Causal mask in which the tokens of each image span see each other (bidirectional block).
    True = attend. Shape [1, 1, seq_len, seq_len]."""
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    for start, end in image_spans:
        mask[start:end, start:end] = True
    return mask[None, None]


class ContextParallelAttention(torch.nn.Module):
    """Llama3-style context parallelism: keys and values are all-gathered, every rank computes
    attention for its local query states only."""

    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def shape(self, x):
        return x.view(x.shape[0], x.shape[1], NUM_HEADS, HEAD_DIM).transpose(1, 2)

    def forward(self, local_hidden_states, all_hidden_states, attention_mask, cp_rank, offsets):
        query_states = self.shape(self.q_proj(local_hidden_states))
        # all-gather of keys/values (simulated: every rank's shard, concatenated in rank order)
        key_states = self.shape(self.k_proj(all_hidden_states))
        value_states = self.shape(self.v_proj(all_hidden_states))
        local_len = query_states.shape[2]
        if FIXED:
            start = offsets[cp_rank]
            local_mask = attention_mask[:, :, start:start + local_len, :]
        else:
            local_mask = attention_mask[:, :, :local_len, :]
        out = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=local_mask)
        out = out.transpose(1, 2).reshape(local_hidden_states.shape)
        return self.o_proj(out)


def main():
    attn = ContextParallelAttention().eval()
    hidden_states = torch.randn(1, SEQ_LEN, HIDDEN)
    attention_mask = build_multimodal_attention_mask(SEQ_LEN, image_spans=[(4, 12), (20, 26)])

    shard = SEQ_LEN // CP_SIZE
    offsets = [r * shard for r in range(CP_SIZE)]
    outputs = []
    with torch.no_grad():
        for cp_rank in range(CP_SIZE):
            local = hidden_states[:, offsets[cp_rank]:offsets[cp_rank] + shard]
            outputs.append(attn(local, hidden_states, attention_mask, cp_rank, offsets))
        cp_out = torch.cat(outputs, dim=1)

        # single-device reference
        q = attn.shape(attn.q_proj(hidden_states))
        k = attn.shape(attn.k_proj(hidden_states))
        v = attn.shape(attn.v_proj(hidden_states))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        ref = attn.o_proj(ref.transpose(1, 2).reshape(hidden_states.shape))

    diff = (cp_out - ref).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: max |context-parallel - single-device| = {diff:.4e}")


if __name__ == "__main__":
    main()
