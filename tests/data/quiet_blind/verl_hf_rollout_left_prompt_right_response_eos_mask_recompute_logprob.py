"""verl GRPO/PPO: HF rollout of left-padded prompts, then log-prob recompute.

Follows volcengine/verl:
  verl/utils/model.py            compute_position_id_with_mask (cumsum(mask) - 1, clipped at 0)
  verl/workers/rollout/hf_rollout.py  HFRollout._generate_minibatch: generate from the
      left-padded prompts, then response_position_ids = position_ids[:, -1:] + arange(1..R),
      attention_mask = cat(prompt mask, get_response_mask(response, eos))
  verl/utils/torch_functional.py get_response_mask: 1 up to AND including the first eos
  verl/workers/actor/dp_actor.py  _forward_micro_batch / compute_log_prob:
      model(input_ids, attention_mask, position_ids, use_cache=False),
      logits[:, -response_length-1:-1], log_softmax gathered at the response ids.
Prompts are LEFT-padded, responses RIGHT-padded (after eos the sampler keeps emitting
pad, which the response mask removes). Position ids of response tokens continue from
the last real prompt position even though the pad columns sit in between.
Check: recomputed log-probs on response_mask == the log-probs the sampler saw during
cached decoding == each sample alone, unpadded, no cache.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
DT = torch.float64
PAD, EOS, VOCAB, RESP_LEN = 0, 2, 32, 7


def compute_position_id_with_mask(mask):
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


def get_response_mask(response_id, eos_token, dtype=torch.int64):
    eos_mask = torch.isin(response_id, torch.tensor([eos_token])).int()
    return (eos_mask.cumsum(dim=1) - eos_mask).eq(0).to(dtype)


def logprobs_from_logits(logits, labels):
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def main():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(DT).eval()
    prompts = [[1, 5, 9, 13, 7], [1, 20], [1, 4, 4, 8]]
    P = max(map(len, prompts))
    input_ids = torch.tensor([[PAD] * (P - len(s)) + s for s in prompts])
    attention_mask = (torch.arange(P)[None] >= torch.tensor([P - len(s) for s in prompts])[:, None]).long()
    position_ids = compute_position_id_with_mask(attention_mask)
    B = len(prompts)

    # ---- rollout: cached sampling loop (what generate() does), recording sampler log-probs
    g = torch.Generator().manual_seed(6)
    gen_mask, past, cur, cur_pos = attention_mask.clone(), None, input_ids, position_ids
    finished = torch.zeros(B, dtype=torch.bool)
    responses, sampler_lp = [], []
    with torch.no_grad():
        for t in range(RESP_LEN):
            out = model(input_ids=cur, attention_mask=gen_mask, position_ids=cur_pos,
                        past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[:, -1], -1)
            # draw from a tilted copy (pad never drawn, eos 6x likelier) so that rows end
            # at different steps; the recorded log-prob is the model's own
            draw = logp.exp().clone()
            draw[:, PAD] = 0
            draw[:, EOS] *= 6
            tok = torch.multinomial(draw, 1, generator=g).squeeze(-1)
            tok = torch.where(finished, torch.full_like(tok, PAD), tok)
            sampler_lp.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            responses.append(tok)
            finished |= tok == EOS
            gen_mask = torch.cat([gen_mask, torch.ones(B, 1, dtype=torch.long)], 1)
            cur, cur_pos = tok[:, None], cur_pos[:, -1:] + 1
    response = torch.stack(responses, 1)
    sampler_lp = torch.stack(sampler_lp, 1)

    # ---- HFRollout postprocessing
    delta = torch.arange(1, RESP_LEN + 1).unsqueeze(0).repeat(B, 1)
    full_pos = torch.cat([position_ids, position_ids[:, -1:] + delta], -1)
    response_mask = get_response_mask(response, EOS, attention_mask.dtype)
    full_mask = torch.cat([attention_mask, response_mask], -1)
    seq = torch.cat([input_ids, response], -1)

    # ---- dp_actor.compute_log_prob
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=full_mask, position_ids=full_pos, use_cache=False).logits
        old_log_prob = logprobs_from_logits(logits[:, -RESP_LEN - 1:-1], response)

        worst_ref = 0.0
        for b, prm in enumerate(prompts):  # each sample alone, unpadded
            n = int(response_mask[b].sum())
            ids = torch.tensor([prm + response[b, :n].tolist()])
            lg = model(input_ids=ids, use_cache=False).logits
            lp = logprobs_from_logits(lg[:, len(prm) - 1:-1], ids[:, len(prm):])[0]
            worst_ref = max(worst_ref, (lp - old_log_prob[b, :n]).abs().max().item())
    m = response_mask.bool()
    d_sampler = (old_log_prob - sampler_lp)[m].abs().max().item()
    print("responses:", response.tolist())
    print("response_mask:", response_mask.tolist())
    print(f"max|recompute-sampler|={d_sampler:.2e}  max|recompute-unpadded alone|={worst_ref:.2e}")
    assert d_sampler < 1e-10 and worst_ref < 1e-10
    print("ok")


if __name__ == "__main__":
    main()
