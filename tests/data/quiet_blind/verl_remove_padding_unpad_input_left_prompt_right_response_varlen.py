"""verl actor with use_remove_padding: a left-padded prompt + right-padded response row is unpadded to varlen.

Follows volcengine/verl's dp_actor._forward_micro_batch (verl/workers/actor/dp_actor.py) with
use_remove_padding=True: `unpad_input(input_ids.unsqueeze(-1), attention_mask)` (flash_attn.bert_padding) drops
the padding on BOTH sides of each row (left of the prompt, right of the response), position_ids are gathered with
the same indices, the model runs on one (1, total_nnz) row with cu_seqlens, and `pad_input` puts log-probs back in
the padded layout before slicing the response. Here flash_attn_varlen_func(causal=True) is written as SDPA over
a block-diagonal causal mask built from cu_seqlens. Mask meant: each sample's real tokens attend causally among
themselves; no sample sees another; no padding exists after unpadding.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def unpad_input(hidden_states, attention_mask):
    """flash_attn.bert_padding.unpad_input: keep real tokens, return indices and cu_seqlens."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max())
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen


def pad_input(hidden_states, indices, batch, seqlen):
    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def varlen_causal_attention(q, k, v, cu_seqlens):
    """Stand-in for flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, ..., causal=True); q: (nnz, h, d)."""
    nnz = q.shape[0]
    seq_id = torch.searchsorted(cu_seqlens[1:], torch.arange(nnz, dtype=torch.int32), right=True)
    idx = torch.arange(nnz)
    allowed = (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed)
    return o.transpose(0, 1)


class Actor(nn.Module):
    def __init__(self, vocab=50, d=32, heads=4):
        super().__init__()
        self.h = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids_rmpad, position_ids_rmpad, cu_seqlens):
        x = self.emb(input_ids_rmpad) + self.pos(position_ids_rmpad)  # (nnz, d)
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.h, -1).unbind(1)
        o = varlen_causal_attention(q, k, v, cu_seqlens)
        return self.lm_head(x + o.reshape(x.shape[0], -1))


def main():
    # prompts left-padded to 4, responses right-padded to 4 (pad 0)
    input_ids = torch.tensor([[0, 0, 7, 8, 20, 21, 2, 0],
                              [9, 10, 11, 12, 22, 2, 0, 0],
                              [0, 13, 14, 15, 23, 24, 25, 26]])
    attention_mask = (torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0],
                                    [1, 1, 1, 1, 1, 1, 0, 0],
                                    [0, 1, 1, 1, 1, 1, 1, 1]]))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    batch, seqlen = input_ids.shape
    response_length = 4
    actor = Actor()
    with torch.no_grad():
        ids_rmpad, indices, cu_seqlens, _ = unpad_input(input_ids.unsqueeze(-1), attention_mask)
        pos_rmpad = position_ids.reshape(-1)[indices]
        logits_rmpad = actor(ids_rmpad.squeeze(-1), pos_rmpad, cu_seqlens)
        # label of token i is token i+1 of the flat row (verl rolls input_ids_rmpad by -1)
        ids_rolled = torch.roll(ids_rmpad.squeeze(-1), shifts=-1, dims=0)
        logp_rmpad = torch.log_softmax(logits_rmpad, -1).gather(-1, ids_rolled[:, None]).squeeze(-1)
        log_probs = pad_input(logp_rmpad[:, None], indices, batch, seqlen).squeeze(-1)
        log_probs = log_probs[:, -response_length - 1:-1]
    response_mask = attention_mask[:, -response_length:]
    # the label rolled across a sample boundary lands only on the last real token, which predicts nothing kept
    assert torch.isfinite(log_probs).all()
    print("response log-prob sums", [round(x, 3) for x in (log_probs * response_mask).sum(1).tolist()])


if __name__ == "__main__":
    main()
