# mlc-llm (mlc-ai/mlc-llm#2939, "[Fix][Spec] Add the draft model PopN in chain speculative decoding"):
# after tree-draft support, BatchVerify only committed accepted nodes for the verify model and never
# called PopNFromKVCache on the draft model for chain drafts, so rejected draft tokens stayed attendable.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
VOCAB, HID, NH, HD = 50, 32, 4, 8


def rope(x, pos):  # x [H, T, D]
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Model(nn.Module):
    """A one-layer decoder with a per-sequence KV cache (stands in for the TVM-compiled model)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HID)
        self.qkv = nn.Linear(HID, 3 * HID)
        self.o = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, VOCAB)
        self.kv = {}  # internal_id -> (K [H, L, D], V [H, L, D])

    def AddNewSequence(self, sid):
        self.kv[sid] = (torch.zeros(NH, 0, HD, dtype=torch.float64), torch.zeros(NH, 0, HD, dtype=torch.float64))

    def PopNFromKVCache(self, sid, n):
        if n > 0:
            k, v = self.kv[sid]
            self.kv[sid] = (k[:, :-n], v[:, :-n])

    def forward_step(self, sid, tokens, positions, use_cache=True):
        h = self.emb(tokens)
        q, k, v = self.qkv(h).view(-1, 3, NH, HD).permute(1, 2, 0, 3)
        q, k = rope(q, positions), rope(k, positions)
        if use_cache:
            K, V = self.kv[sid]
            K, V = torch.cat([K, k], 1), torch.cat([V, v], 1)
            self.kv[sid] = (K, V)
        else:
            K, V = k, v
        n, L = q.shape[1], K.shape[1]
        mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)  # queries are the last n cached tokens
        a = F.scaled_dot_product_attention(q, K, V, attn_mask=mask).transpose(0, 1).reshape(n, HID)
        return self.head(self.o(a) + h)


draft = Model().double().eval()
verify = Model().double().eval()
sid, spec_draft_length, rounds = 0, 4, 3
prompt = torch.randint(0, VOCAB, (6,))
worst = 0.0
with torch.no_grad():
    draft.AddNewSequence(sid)
    # prefill both models with the prompt minus its last token (the engine keeps the last token pending)
    draft.forward_step(sid, prompt[:-1], torch.arange(len(prompt) - 1))
    committed = prompt.tolist()
    for r in range(rounds):
        # BatchDraft: chain drafting; feed the last committed token then each draft token but the last
        cur, draft_tokens = committed[-1], []
        for j in range(spec_draft_length):
            pos = torch.tensor([len(committed) - 1 + j])
            logits = draft.forward_step(sid, torch.tensor([cur]), pos)[-1]
            # reference: the draft model recomputed on committed + drafts so far, no cache
            seq = torch.tensor(committed + draft_tokens)
            ref = draft.forward_step(sid, seq, torch.arange(len(seq)), use_cache=False)[-1]
            worst = max(worst, (logits - ref).abs().max().item())
            cur = int(logits.argmax())
            draft_tokens.append(cur)
        # BatchVerify: the verify model scores [last committed, d1..dk] (recomputed here without cache)
        seq = torch.tensor(committed + draft_tokens)
        vlog = verify.forward_step(sid, seq, torch.arange(len(seq)), use_cache=False)[len(committed) - 1 :]
        sample_results, accept_length = [], 0
        for j in range(spec_draft_length + 1):
            tok = int(vlog[j].argmax())
            sample_results.append(tok)
            accept_length += 1
            if j == spec_draft_length or tok != draft_tokens[j]:
                break
        verify_length = spec_draft_length + 1
        rollback_length = max(verify_length - accept_length, 0)
        committed += sample_results
        if FIXED:
            if rollback_length > 0:
                # The last accepted token is not yet added into the draft model.
                draft.PopNFromKVCache(sid, rollback_length - 1)
        # (before the fix only the verify model's accepted tree nodes were committed; nothing popped the draft cache)
        if rollback_length == 0:
            draft.forward_step(sid, torch.tensor([draft_tokens[-1]]), torch.tensor([len(committed) - 2]))
        print(f"round {r}: accept_length={accept_length} draft kv len={draft.kv[sid][0].shape[1]} committed={len(committed)}")
print(f"max |draft logits (cached) - draft logits recomputed on committed tokens| = {worst:.3e}")
