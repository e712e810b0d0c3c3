"""verl multi-turn rollout: tool outputs are masked from the LOSS but stay visible to attention.

Follows volcengine/verl's SGLang multi-turn rollout (verl/workers/rollout/sglang_rollout, AsyncRolloutRequest)
and the actor's forward (verl/utils/torch_functional.py get_response_mask, verl/utils/model.py
compute_position_id_with_mask). A batch is `prompts` left-padded to `max_prompt_length` concatenated with
`responses` right-padded to `max_response_length`. The response holds assistant turns AND tool outputs; the
`response_loss_mask` (verl: `loss_mask`) is 0 on tool tokens so the policy is not trained to produce them, but the
`attention_mask` is 1 on every real token, tool output included: the assistant's next turn must read the tool
result. Mask meant: causal over real tokens (left prompt padding and right response padding hidden as keys),
position ids counted over real tokens only.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
PAD = 0


def compute_position_id_with_mask(mask):
    # verl: positions count real tokens only, so a left-padded prompt still starts at position 0
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


class TinyPolicy(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, max_pos=64):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_pos, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, position_ids):
        b, t = input_ids.shape
        h = self.tok(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        allowed = causal[None] & attention_mask.bool()[:, None, :]
        # a left-pad query row has no real key; let it see itself so softmax stays finite (its output is unused)
        allowed = allowed | torch.eye(t, dtype=torch.bool)[None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.lm_head(h + self.out(o.transpose(1, 2).reshape(b, t, -1)))


def build_batch():
    # (prompt, [(segment, is_tool)]) ; assistant turn, tool output, assistant turn
    samples = [
        ([5, 6, 7], [([10, 11], False), ([30, 31, 32], True), ([12, 2], False)]),
        ([5, 8, 9, 9, 6], [([13, 2], False)]),
        ([5, 6], [([14], False), ([33, 34], True), ([15, 16, 2], False)]),
    ]
    max_prompt_length, max_response_length = 6, 8
    prompts, responses, p_mask, r_mask, loss_mask = [], [], [], [], []
    for prompt, turns in samples:
        resp = [t for seg, _ in turns for t in seg]
        lm = [0 if tool else 1 for seg, tool in turns for _ in seg]
        lp = max_prompt_length - len(prompt)
        rp = max_response_length - len(resp)
        prompts.append([PAD] * lp + prompt)
        p_mask.append([0] * lp + [1] * len(prompt))
        responses.append(resp + [PAD] * rp)
        r_mask.append([1] * len(resp) + [0] * rp)
        loss_mask.append(lm + [0] * rp)
    t = lambda x: torch.tensor(x)
    return t(prompts), t(responses), t(p_mask), t(r_mask), t(loss_mask)


def main():
    prompts, responses, p_mask, r_mask, response_loss_mask = build_batch()
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    position_ids = compute_position_id_with_mask(attention_mask)
    model = TinyPolicy()
    logits = model(input_ids, attention_mask, position_ids)
    resp_len = responses.shape[1]
    logits = logits[:, -resp_len - 1:-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, responses[..., None]).squeeze(-1)
    # verl agg_loss "token-mean": average over trained tokens only; tool outputs do not count
    pg_loss = -(logp * response_loss_mask).sum() / response_loss_mask.sum()
    assert torch.isfinite(pg_loss)
    # tool tokens are attended (attention_mask 1) yet carry no loss
    assert ((attention_mask[:, -resp_len:] == 1) & (response_loss_mask == 0)).any()
    print(f"token-mean loss {pg_loss.item():.4f} over {int(response_loss_mask.sum())} tokens")


if __name__ == "__main__":
    main()
