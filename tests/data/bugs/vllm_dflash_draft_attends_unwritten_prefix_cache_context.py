# vllm-project/vllm#47926: the DFlash drafter's attention spans the whole sequence (seq_lens =
# last_valid_pos + 1 + num_query_per_req), so on a prefix-cache hit its queries read context-KV
# slots that were never written (restored tokens never ran through the target). Fix masks them out.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, HEADS, HEAD_DIM, VOCAB = 32, 4, 8, 50
BLOCK_SIZE = 4            # num_query_per_req: one mask token block drafted in parallel
MAX_LEN = 32


class DFlashDraftAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.kv_proj = torch.nn.Linear(HIDDEN, 2 * HEADS * HEAD_DIM)
        self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, hidden, context_k, context_v, attn_mask):
        q = self.q_proj(hidden).view(-1, HEADS, HEAD_DIM).transpose(0, 1)      # H, Q, D
        k, v = self.kv_proj(hidden).view(-1, 2, HEADS, HEAD_DIM).unbind(1)
        k = torch.cat([context_k, k], 0).transpose(0, 1)                         # H, S, D
        v = torch.cat([context_v, v], 0).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o_proj(out.transpose(0, 1).reshape(-1, HEADS * HEAD_DIM))


class DFlashSpeculator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, HIDDEN)    # aux hidden states -> context
        self.attn = DFlashDraftAttention()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB)
        # per-request context KV buffer; slots are written only for tokens the target computed
        self.context_k = torch.full((MAX_LEN, HEADS, HEAD_DIM), 7.0)   # stale contents of the slots
        self.context_v = torch.full((MAX_LEN, HEADS, HEAD_DIM), -3.0)

    def precompute_and_store_context_kv(self, aux_hidden, positions):
        k, v = self.attn.kv_proj(self.fc(aux_hidden)).view(-1, 2, HEADS, HEAD_DIM).unbind(1)
        self.context_k[positions] = k
        self.context_v[positions] = v

    def propose(self, last_valid_pos, num_computed_tokens_from_cache, mask_token_id, bonus_token):
        ids = torch.tensor([bonus_token] + [mask_token_id] * (BLOCK_SIZE - 1))
        hidden = self.embed(ids)
        ctx_len = last_valid_pos + 1
        seq_len = ctx_len + BLOCK_SIZE                       # _prepare_dflash_inputs_kernel
        key_pos = torch.arange(seq_len)
        attn_mask = torch.ones(BLOCK_SIZE, seq_len, dtype=torch.bool)   # block attends bidirectionally
        if FIXED:
            # tokens restored from the prefix cache have no draft context KV: mask them out
            attn_mask &= (key_pos >= num_computed_tokens_from_cache)[None, :]
        out = self.attn(hidden, self.context_k[:ctx_len], self.context_v[:ctx_len], attn_mask)
        return self.lm_head(out).argmax(-1), self.lm_head(out)


@torch.no_grad()
def main():
    drafter = DFlashSpeculator()
    prompt_len, cached = 20, 16          # automatic prefix caching hit: 16 tokens restored
    aux_hidden = torch.randn(prompt_len, HIDDEN)   # target aux hidden states for the scheduled tokens
    # the target forward only runs the uncached suffix, so only those slots get written
    scheduled = torch.arange(cached, prompt_len)
    drafter.precompute_and_store_context_kv(aux_hidden[scheduled], scheduled)
    draft, logits = drafter.propose(prompt_len - 1, cached, mask_token_id=VOCAB - 1, bonus_token=3)

    # reference: drafter that only sees the context it actually computed
    ref = DFlashSpeculator()
    ref.load_state_dict(drafter.state_dict())
    ref.context_k, ref.context_v = drafter.context_k.clone(), drafter.context_v.clone()
    ids = torch.tensor([3] + [VOCAB - 1] * (BLOCK_SIZE - 1))
    ctx = slice(cached, prompt_len)
    out = ref.attn(ref.embed(ids), ref.context_k[ctx], ref.context_v[ctx], None)
    ref_logits = ref.lm_head(out)
    print(f"fixed={FIXED} draft={draft.tolist()} max|logits - ref| = "
          f"{(logits - ref_logits).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
