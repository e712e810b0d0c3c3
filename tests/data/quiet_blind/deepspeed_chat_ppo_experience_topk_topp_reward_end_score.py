"""DeepSpeed-Chat PPO generate_experience: left-padded prompts, sampled answers, actor / reward / critic forwards.

Follows microsoft/DeepSpeedExamples applications/DeepSpeed-Chat/dschat/rlhf/ppo_trainer.py
(generate_experience: attention_mask = seq.not_equal(pad_token_id), logprobs from actor logits[:, :-1],
values[:, :-1], action_mask = attention_mask[:, 1:]) and dschat/utils/model/reward_model.py (forward_value:
chosen_end_scores = value at the token before the first pad after prompt_length), on an OPT-style decoder
(learned positions from attention_mask.cumsum with offset 2; _prepare_decoder_attention_mask = causal plus
key padding as finfo.min added to q @ k^T).  Attention is causal and never sees pad keys; the left-pad query
rows have nothing to see and their outputs are never read.  The masked_fill calls in top_k / top_p filtering
and in masked_mean are over the vocabulary and the loss, not attention.  Checked: every sample run alone,
without any padding, gives the same reward, values and log-probs.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, EOS, VOCAB, D, HEADS, LAYERS, MAX_POS = 1, 2, 48, 32, 4, 2, 64


class OPTLearnedPositionalEmbedding(nn.Embedding):
    offset = 2  # OPT keeps positions 0 and 1 for its padding convention

    def forward(self, attention_mask):
        positions = (torch.cumsum(attention_mask, dim=1) * attention_mask).long() - 1
        return super().forward(positions + self.offset)


class OPTDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.embed_positions = OPTLearnedPositionalEmbedding(MAX_POS + 2, D)
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))
        self.ln = nn.ModuleList(nn.LayerNorm(D) for _ in range(LAYERS))
        self.final_layer_norm = nn.LayerNorm(D)

    @staticmethod
    def _prepare_decoder_attention_mask(attention_mask, dtype):
        bsz, tgt = attention_mask.shape
        min_value = torch.finfo(dtype).min
        causal = torch.full((tgt, tgt), min_value).triu(1)
        expanded = (1.0 - attention_mask[:, None, None, :].to(dtype)) * min_value
        return (causal[None, None] + expanded).clamp(min=min_value)

    def forward(self, input_ids, attention_mask):
        h = self.embed_tokens(input_ids) + self.embed_positions(attention_mask)
        bias = self._prepare_decoder_attention_mask(attention_mask, h.dtype)
        b, t, _ = h.shape
        for qkv, out, ln in zip(self.qkv, self.out, self.ln):
            q, k, v = qkv(ln(h)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5 + bias
            h = h + out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D))
        return self.final_layer_norm(h)


class OPTForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = OPTDecoder()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask):
        return self.lm_head(self.model(input_ids, attention_mask))


class RewardModel(nn.Module):
    def __init__(self, base, pad_token_id=PAD):
        super().__init__()
        self.rwtransformer = base
        self.v_head = nn.Linear(D, 1, bias=False)
        self.PAD_ID = pad_token_id

    def forward_value(self, input_ids, attention_mask, return_value_only=False, prompt_length=0):
        values = self.v_head(self.rwtransformer(input_ids, attention_mask)).squeeze(-1)
        if return_value_only:
            return values
        chosen_end_scores = []
        for i in range(input_ids.size(0)):
            value = values[i]
            c_inds = (input_ids[i, prompt_length:] == self.PAD_ID).nonzero()
            c_ind = c_inds[0].item() + prompt_length if len(c_inds) > 0 else input_ids.size(1)
            chosen_end_scores.append(value[c_ind - 1])
        return {"values": values, "chosen_end_scores": torch.stack(chosen_end_scores)}


def top_k_top_p_filtering(logits, top_k, top_p):
    """Vocabulary mask for sampling (not attention): drop tokens outside top-k and the top-p nucleus."""
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    remove = cum > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    return logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))


@torch.no_grad()
def generate(actor, prompts, prompt_mask, max_new_tokens, generator):
    seq, mask = prompts, prompt_mask
    finished = torch.zeros(prompts.size(0), dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = actor(seq, mask)[:, -1]
        logits[:, PAD] = float("-inf")  # never sample the pad id as content
        probs = top_k_top_p_filtering(logits, top_k=10, top_p=0.9).softmax(-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt = torch.where(finished, torch.full_like(nxt, PAD), nxt)
        finished |= nxt == EOS
        seq = torch.cat([seq, nxt[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return seq


def gather_log_probs(logits, labels):
    return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def main():
    torch.manual_seed(0)
    actor, ref = OPTForCausalLM().eval(), OPTForCausalLM().eval()
    reward_model, critic = RewardModel(OPTDecoder()).eval(), RewardModel(OPTDecoder()).eval()
    raw_prompts = [torch.randint(3, VOCAB, (n,)) for n in (5, 3, 4)]
    prompt_length = max(len(p) for p in raw_prompts)
    # DeepSpeed-Chat's prompt collator pads on the left so every prompt ends at prompt_length
    prompts = torch.stack([F.pad(p, (prompt_length - len(p), 0), value=PAD) for p in raw_prompts])
    prompt_mask = prompts.ne(PAD).long()
    seq = generate(actor, prompts, prompt_mask, max_new_tokens=6, generator=torch.Generator().manual_seed(1))
    # make sure some answers end early with EOS followed by pad (the case that matters)
    seq[0, prompt_length + 3], seq[0, prompt_length + 4:] = EOS, PAD

    with torch.no_grad():
        attention_mask = seq.not_equal(PAD).long()
        logits, logits_ref = actor(seq, attention_mask), ref(seq, attention_mask)
        reward_score = reward_model.forward_value(seq, attention_mask, prompt_length=prompt_length)["chosen_end_scores"]
        values = critic.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
        logprobs = gather_log_probs(logits[:, :-1], seq[:, 1:])
        ref_logprobs = gather_log_probs(logits_ref[:, :-1], seq[:, 1:])
        action_mask = attention_mask[:, 1:]
        kl = masked_mean((logprobs - ref_logprobs)[:, prompt_length - 1:], action_mask[:, prompt_length - 1:])

        for i in range(seq.size(0)):
            real = seq[i][attention_mask[i].bool()]  # the sample alone: no left pad, no trailing pad
            ones = torch.ones(1, len(real), dtype=torch.long)
            alone = reward_model.forward_value(real[None], ones, return_value_only=True)[0]
            torch.testing.assert_close(reward_score[i], alone[-1], rtol=1e-5, atol=1e-5)
            lp = gather_log_probs(actor(real[None], ones)[:, :-1], real[None, 1:])[0]
            # pairs of real tokens (position t predicts real token t+1 from a real token t)
            keep = attention_mask[i, :-1].bool() & action_mask[i].bool()
            torch.testing.assert_close(logprobs[i][keep], lp, rtol=1e-4, atol=1e-4)
            v = critic.forward_value(real[None], ones, return_value_only=True)[0, :-1]
            torch.testing.assert_close(values[i][keep], v, rtol=1e-4, atol=1e-4)
    print("rewards", [round(x, 4) for x in reward_score.tolist()], "kl", round(kl.item(), 4))


if __name__ == "__main__":
    main()
