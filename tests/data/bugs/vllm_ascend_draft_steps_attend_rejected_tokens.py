# vllm-project/vllm-ascend#14883: in ModelRunner V1 the later one-token draft decode steps reuse the
# device seq_lens of the verify step without subtracting each request's rejected-token count, so
# every draft query attends the KV of rejected draft positions. Fix: seq_lens -= num_rejected.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HEADS, HEAD_DIM, HIDDEN, VOCAB = 2, 8, 16, 40
MAX_LEN = 24
NUM_SPEC = 3                    # num_speculative_tokens


class DraftLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB)


def build_decode_mask(seq_lens):
    """AscendAttentionMetadataBuilder: one query per request sees kv slots [0, seq_len)."""
    key_pos = torch.arange(MAX_LEN)
    return (key_pos[None, :] < seq_lens[:, None])[:, None, None, :]      # [B, 1, 1, MAX_LEN]


def draft_decode_step(layer, tokens, positions, key_cache, value_cache, seq_lens):
    b = tokens.shape[0]
    q, k, v = layer.qkv(layer.embed(tokens)).view(b, 3, HEADS, HEAD_DIM).unbind(1)
    rows = torch.arange(b)
    key_cache[rows, :, positions] = k                 # slot_mapping: write this step's KV
    value_cache[rows, :, positions] = v
    attn_mask = build_decode_mask(seq_lens)
    out = F.scaled_dot_product_attention(q[:, :, None], key_cache, value_cache, attn_mask=attn_mask)
    logits = layer.lm_head(layer.o(out.reshape(b, HEADS * HEAD_DIM)))
    return logits


@torch.no_grad()
def propose(layer, key_cache, value_cache, verify_seq_lens, num_rejected, next_tokens):
    # merged step 0 already ran with the verify-step seq_lens; later steps advance by one each
    positions = verify_seq_lens - num_rejected        # next draft position (after the accepted tokens)
    seq_lens = verify_seq_lens.clone()
    if FIXED:
        seq_lens = seq_lens - num_rejected
    tokens, all_logits = next_tokens, []
    for _ in range(NUM_SPEC - 1):
        seq_lens = seq_lens + 1
        logits = draft_decode_step(layer, tokens, positions, key_cache, value_cache, seq_lens)
        all_logits.append(logits)
        tokens = logits.argmax(-1)
        positions = positions + 1
    return torch.stack(all_logits, 1)


def main():
    layer = DraftLayer()
    context_lens = torch.tensor([9, 14])
    # verify forward wrote KV for the bonus token + NUM_SPEC drafts of every request
    verify_seq_lens = context_lens + NUM_SPEC + 1
    num_rejected = torch.tensor([3, 2])
    key_cache = torch.zeros(2, HEADS, MAX_LEN, HEAD_DIM)
    value_cache = torch.zeros(2, HEADS, MAX_LEN, HEAD_DIM)
    for b in range(2):
        n = int(verify_seq_lens[b])
        key_cache[b, :, :n] = torch.randn(HEADS, n, HEAD_DIM)
        value_cache[b, :, :n] = torch.randn(HEADS, n, HEAD_DIM)
        # the rejected draft slots hold KV of tokens that are not part of the sequence
        key_cache[b, :, n - int(num_rejected[b]):n] += 3.0
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    next_tokens = torch.tensor([5, 11])
    logits = propose(layer, key_cache, value_cache, verify_seq_lens, num_rejected, next_tokens)

    # reference: only the accepted prefix is visible
    accepted_lens = verify_seq_lens - num_rejected
    ref, tokens, pos = [], next_tokens, accepted_lens.clone()
    with torch.no_grad():
        for _ in range(NUM_SPEC - 1):
            lg = draft_decode_step(layer, tokens, pos, ref_k, ref_v, pos + 1)
            ref.append(lg)
            tokens, pos = lg.argmax(-1), pos + 1
    ref = torch.stack(ref, 1)
    print(f"fixed={FIXED} drafts={logits.argmax(-1).tolist()} "
          f"max|draft logits - ref| = {(logits - ref).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
