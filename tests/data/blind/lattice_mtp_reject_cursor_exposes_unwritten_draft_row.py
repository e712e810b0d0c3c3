"""lattice greedy MTP speculative decoding: after a K=1 rejection the MTP cache cursor lands one row too far.

ohdearquant/lattice#1341, fixed by ohdearquant/lattice#1360 ("fix(inference): correct the MTP cache
cursor after a K=1 draft reject"); Rust/Metal (crates/inference/src/forward/metal_qwen35.rs,
generate_greedy_mtp / mtp_forward_one / verify_tokens_batched / rollback_speculative_state_to),
ported to torch from the issue and PR text. Each round `mtp_forward_one(pending_token, pos)` writes one
row of the MTP module's own KV cache at `mtp.cache.seq_len` and advances it (m -> m+1), attending rows
0..seq_len+1. `verify_tokens_batched` captures `mtp_base_seq_len` after that append (m+1). On a
rejection `rollback_speculative_state_to(pos + 1)` resolves `slot = 1` (a target-token offset) and
sets `mtp.cache.seq_len = mtp_base_seq_len + slot` = m+2, so row m+1 is never written and the next
draft attends it. Fix: the draft cursor is restored to the draft-row base (m+1) on a rejection.
The target here is a tiny transformers Qwen3 with a DynamicCache cropped on rejection.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = Qwen3Config(
    vocab_size=48,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
config._attn_implementation = "eager"
target = Qwen3ForCausalLM(config).eval()


def rope(x, pos, theta=10000.0):
    # x: (heads, 1, d); pos: absolute token position
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos * inv
    cos, sin = torch.cos(ang).repeat(2), torch.sin(ang).repeat(2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MtpCache:
    def __init__(self, n_kv, max_len, head_dim):
        self.k = torch.zeros(n_kv, max_len, head_dim)
        self.v = torch.zeros(n_kv, max_len, head_dim)
        self.seq_len = 0


class MtpModule(nn.Module):
    """Qwen3.5-style MTP head: fc(cat(norm(E(t)), norm(h))) -> one attention block -> shared lm_head."""

    def __init__(self, cfg, embed, lm_head):
        super().__init__()
        h, self.nh, self.nkv, self.hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.embed, self.lm_head = embed, lm_head
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=1e-6)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=1e-6)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = nn.RMSNorm(h, eps=1e-6)
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.norm = nn.RMSNorm(h, eps=1e-6)
        self.cache = MtpCache(self.nkv, 256, self.hd)

    @torch.no_grad()
    def mtp_forward_one(self, token, hidden, pos):
        e = self.pre_fc_norm_embedding(self.embed(torch.tensor([token])))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.view(1, -1))], dim=-1))
        r = x
        x = self.input_layernorm(x)
        q = rope(self.q_proj(x).view(self.nh, 1, self.hd), pos)
        k = rope(self.k_proj(x).view(self.nkv, 1, self.hd), pos)
        v = self.v_proj(x).view(self.nkv, 1, self.hd)
        mtp_seq_len = self.cache.seq_len          # GPU write offset, read at entry
        self.cache.k[:, mtp_seq_len] = k[:, 0]
        self.cache.v[:, mtp_seq_len] = v[:, 0]
        cur_mtp_seq = mtp_seq_len + 1             # attention window upper bound
        keys = self.cache.k[:, :cur_mtp_seq].repeat_interleave(self.nh // self.nkv, dim=0)
        vals = self.cache.v[:, :cur_mtp_seq].repeat_interleave(self.nh // self.nkv, dim=0)
        attn = F.scaled_dot_product_attention(q, keys, vals)
        x = r + self.o_proj(attn.reshape(1, -1))
        self.cache.seq_len += 1
        logits = self.lm_head(self.norm(x))
        return int(logits.argmax(-1)), logits


mtp = MtpModule(config, target.model.embed_tokens, target.lm_head).eval()


@torch.no_grad()
def target_forward(ids, cache, start):
    pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    out = target(input_ids=ids, cache=cache, position_ids=pos, use_cache=True,
                 output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0]


@torch.no_grad()
def generate_greedy_mtp(prompt, max_new_tokens):
    cache = DynamicCache()
    logits, hidden = target_forward(torch.tensor([prompt]), cache, 0)
    # MTP prefill: one row per prompt transition (h_i paired with E(t_{i+1}))
    for i in range(len(prompt) - 1):
        mtp.mtp_forward_one(prompt[i + 1], hidden[i], i)
    pending_token = int(logits[-1].argmax())
    pending_hidden = hidden[-1]
    pos = len(prompt)                               # position pending_token goes to
    out, drafts, accepted_n, draft_logits = [], [], 0, []
    while len(out) < max_new_tokens:
        draft, dl = mtp.mtp_forward_one(pending_token, pending_hidden, pos - 1)
        drafts.append(draft)
        draft_logits.append(dl)
        # verify_tokens_batched: [pending, draft] at pos, pos+1
        mtp_base_seq_len = mtp.cache.seq_len
        vlogits, vhidden = target_forward(torch.tensor([[pending_token, draft]]), cache, pos)
        choice = int(vlogits[0].argmax())
        if choice == draft:
            accepted_n += 1
            out += [pending_token, draft]
            pending_token = int(vlogits[1].argmax())
            pending_hidden = vhidden[1]
            pos += 2
        else:
            out.append(pending_token)
            # rollback_speculative_state_to(pos + 1)
            slot = 1
            cache.crop(-1)                  # drop the rejected draft row, keep pos+1 rows
            if FIXED:
                mtp.cache.seq_len = mtp_base_seq_len
            else:
                mtp.cache.seq_len = mtp_base_seq_len + slot
            pending_token = choice
            pending_hidden = vhidden[0]
            pos += 1
    return out[:max_new_tokens], drafts, accepted_n, torch.stack(draft_logits)


prompt = [3, 17, 5, 29, 11, 40, 8, 23]
tokens, drafts, accepted, dlog = generate_greedy_mtp(prompt, 24)
print("generated:", tokens)
print("drafts:", drafts)
print(f"accepted {accepted}/{len(drafts)} rounds, mtp rows {mtp.cache.seq_len}")
print("draft logits checksum: %.6f" % float(dlog.abs().sum()))
